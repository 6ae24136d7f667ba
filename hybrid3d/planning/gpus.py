"""The GPUs the planner knows by name (`python -m hybrid3d.plan --gpu MODEL`, and a GPU job's "auto" from the
device name): each one's memory, memory bandwidth, host link and intra-node link from its vendor's datasheet, and
its dense bf16 peak from `flops.PEAK_BF16_TFLOPS` (one table of peaks for MFU and planning alike).

The step-time model (`step_time.Cluster`) wants the bus bandwidth a TP, CP or in-node DP collective reaches, not a
link's datasheet rate. The planner's default for an NVLink-4 node has been 200 GB/s, against NVLink 4's 450 GB/s per
direction: `BUS_SHARE` = 200/450 of a link's per-direction datasheet rate is therefore what every link is planned
at, so an H100 SXM plans exactly as before and other links scale by their datasheet rates. Without peer-to-peer
(GeForce cards: the driver refuses it between them) NCCL stages every transfer through host memory, so each byte
crosses the PCIe link twice: half again. These are a model of the links, not measurements of them; measure a box
(NCCL's all_reduce_perf) and give `--intra-node-gbps` where it matters. Across nodes every GPU plans the
`INTER_NODE_GBPS` of one 200 Gb/s NIC a GPU unless `--inter-node-gbps` says otherwise.
"""

import re
from dataclasses import dataclass
from typing import Optional

from hybrid3d.errors import ConfigError
from hybrid3d.planning.flops import PEAK_BF16_TFLOPS

BUS_SHARE = 200.0 / 450.0  # of a link's per-direction datasheet rate (module docstring)
INTER_NODE_GBPS = 25.0  # one 200 Gb/s NIC (InfiniBand HDR / 200 GbE) a GPU
# GB/s per direction of a x16 host link, by PCIe generation (PCI-SIG: 16, 32, 64 GT/s a lane)
PCIE_X16_GBPS = {3: 16.0, 4: 32.0, 5: 64.0}


@dataclass(frozen=True)
class GpuModel:
    """One GPU as its datasheet gives it. `link_gbps`: GB/s per direction of the link its TP/CP collectives use
    inside a node (NVLink or Infinity Fabric through a switch or mesh; PCIe where there is none for all 8)."""

    label: str
    memory_gb: float
    memory_gbps: float
    peak_key: str  # its row of flops.PEAK_BF16_TFLOPS
    pcie_gen: int  # the host link, x16
    link: str  # what the link is, in words
    link_gbps: float
    peer_to_peer: bool = True  # False: NCCL stages through host memory

    @property
    def peak_tflops(self) -> float:
        return PEAK_BF16_TFLOPS[self.peak_key]

    @property
    def pcie_gbps(self) -> float:
        return PCIE_X16_GBPS[self.pcie_gen]

    @property
    def intra_node_gbps(self) -> float:
        """The bus bandwidth planned for collectives inside a node (module docstring)."""
        return self.link_gbps * BUS_SHARE / (1 if self.peer_to_peer else 2)


GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s (both directions),
    # PCIe Gen5
    "h100-sxm": GpuModel("H100 SXM", 80, 3350, "H100", 5, "NVLink 4 (NVSwitch)", 450),
    # same datasheet (PCIe card): 80 GB HBM2e at 2.0 TB/s; its NVLink bridge joins pairs only, so a node's
    # collectives run over PCIe Gen5
    "h100-pcie": GpuModel("H100 PCIe", 80, 2000, "H100 PCIe", 5, "PCIe 5.0 x16", 64),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, NVLink 4 900 GB/s, PCIe Gen5
    "h200": GpuModel("H200 SXM", 141, 4800, "H200", 5, "NVLink 4 (NVSwitch)", 450),
    # NVIDIA HGX B200 datasheet: 180 GB HBM3e a GPU (1.4 TB for 8) at 8 TB/s, NVLink 5 1.8 TB/s, PCIe Gen5
    # (Gen6 on the host side of some boards)
    "b200": GpuModel("B200 SXM", 180, 8000, "B200", 5, "NVLink 5 (NVSwitch)", 900),
    # NVIDIA A100 Tensor Core GPU datasheet: SXM4 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s, NVLink 3
    # 600 GB/s, PCIe Gen4
    "a100-sxm-40": GpuModel("A100 SXM 40GB", 40, 1555, "A100", 4, "NVLink 3 (NVSwitch)", 300),
    "a100-sxm-80": GpuModel("A100 SXM 80GB", 80, 2039, "A100", 4, "NVLink 3 (NVSwitch)", 300),
    # same datasheet (PCIe card, 80 GB HBM2e at 1,935 GB/s): an NVLink bridge joins pairs only
    "a100-pcie": GpuModel("A100 PCIe 80GB", 80, 1935, "A100", 4, "PCIe 4.0 x16", 32),
    # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16, no NVLink
    "l40s": GpuModel("L40S", 48, 864, "L40S", 4, "PCIe 4.0 x16", 32),
    # NVIDIA L4 datasheet: 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16, no NVLink
    "l4": GpuModel("L4", 24, 300, "L4", 4, "PCIe 4.0 x16", 32),
    # NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090): 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4 x16, no
    # NVLink; the driver refuses peer-to-peer between GeForce cards
    "rtx4090": GpuModel("RTX 4090", 24, 1008, "RTX 4090", 4, "PCIe 4.0 x16", 32, peer_to_peer=False),
    # NVIDIA Ampere GA102 GPU architecture whitepaper (GeForce RTX 3090): 24 GB GDDR6X at 936 GB/s, PCIe Gen4 x16;
    # its NVLink bridge joins pairs only, and peer-to-peer over PCIe is refused between GeForce cards
    "rtx3090": GpuModel("RTX 3090", 24, 936, "RTX 3090", 4, "PCIe 4.0 x16", 32, peer_to_peer=False),
    # NVIDIA A10 datasheet: 24 GB GDDR6 at 600 GB/s, PCIe Gen4 x16, no NVLink
    "a10": GpuModel("A10", 24, 600, "A10", 4, "PCIe 4.0 x16", 32),
    # AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, Infinity Fabric 896 GB/s peak (both directions, 7
    # links to the other GPUs of the platform), PCIe Gen5
    "mi300x": GpuModel("MI300X", 192, 5300, "MI300X", 5, "Infinity Fabric (7 links)", 448),
}

# The current device's name as the driver gives it (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3", "NVIDIA
# A100-SXM4-40GB", "NVIDIA GeForce RTX 4090") -> its row: the first pattern found wins
DEVICE_NAMES = ((r"\bH100\b.*PCIE", "h100-pcie"), (r"\bH100\b", "h100-sxm"), (r"\bH200\b", "h200"),
                (r"\bB200\b", "b200"), (r"\bA100\b.*PCIE", "a100-pcie"), (r"\bA100\b.*40GB", "a100-sxm-40"),
                (r"\bA100\b", "a100-sxm-80"), (r"\bL40S\b", "l40s"), (r"\bL4\b", "l4"),
                (r"\bRTX 4090\b", "rtx4090"), (r"\bRTX 3090\b", "rtx3090"), (r"\bA10\b", "a10"),
                (r"\bMI300X\b", "mi300x"))


def gpu_model(name: str, key: str = "--gpu") -> GpuModel:
    """The table's row for `name`; an unknown name is refused in one line listing the known ones."""
    if name not in GPUS:
        raise ConfigError(f"{key}: unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return GPUS[name]


def gpu_for_device(device_name: str) -> Optional[str]:
    """The table's name for a device as the driver names it ("NVIDIA GeForce RTX 4090"), None if unknown."""
    upper = device_name.upper()
    return next((row for pattern, row in DEVICE_NAMES if re.search(pattern, upper)), None)


def machine_line(gpu: GpuModel, intra_gbps: float, inter_gbps: float, peak: float, given: set) -> str:
    """The figures a plan used, in words; `given`: the ones the command line overrode."""
    mark = {name: " (given)" if name in given else "" for name in ("intra", "inter", "peak")}
    link = f"{gpu.link}" + ("" if gpu.peer_to_peer else ", no peer-to-peer")
    return (f"machine: {gpu.label}: {peak:g} TFLOP/s bf16{mark['peak']}, {gpu.memory_gbps:g} GB/s memory; "
            f"in a node {intra_gbps:.3g} GB/s{mark['intra']} ({link}), across nodes {inter_gbps:g} GB/s"
            f"{mark['inter']}, host PCIe {gpu.pcie_gen}.0 x16 {gpu.pcie_gbps:g} GB/s")
