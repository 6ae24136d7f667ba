"""The machine a run plans for: a `Cluster` from what the job knows at start-up (world size, ranks per node, the
memory budget), with datasheet figures on GPUs and figures measured here on the CPU.

GPUs: the figures of the GPU's row in planning/gpus.py (its datasheet's peak bf16 rate, memory bandwidth and host
link, its intra-node link's planned bus bandwidth; a GPU the table does not know plans as an H100 SXM, the
planner's defaults: 200 GB/s inside a node, HBM3 3.35 TB/s, PCIe 5.0 x16), 25 GB/s a GPU across nodes, the
planner's 3 GB reserve (CUDA context, NCCL, fragmentation), host memory from /proc/meminfo.

CPU (gloo ranks sharing the cores): the figures `benchmarks/step_time_check.py --machine` measured on a 2-core AMD EPYC
VM (benchmarks/results/2026-12-05-vm/machine.md, at 0cdb8fc): a core's fp32 rate in hybrid3d's engine, 23.5 GFLOP/s
(bf16 at the 1.17x of fp32 plain PyTorch measured on 2026-12-04, benchmarks/results/2026-12-04-vm/step_time.md), a
rank getting its share of the cores; the framework's 2.83 ms of a core per decoder layer and micro-batch at ZeRO-0,
and what the hooks of ZeRO-1, 2 and 3 add to it: 1.08, 4.24 and 12.6 ms (17.0 at ZeRO-3 in the run before, at
e7aa32b); TP all-reduces through DeepSpeed's shared-memory kernel where the TP group is the whole world (fp32
1.51 GB/s bus bandwidth and no latency with a core a rank, 1.01 GB/s and 3.89 ms a message at 4 ranks on 2 cores,
where its ranks wait for partners the OS has descheduled) and through gloo otherwise (fp32 0.72 GB/s, 1.45 ms; bf16
0.81 GB/s, 1.44 ms: fitted over 2 of 4 ranks), gloo's latency also that of ZeRO-3's gathers and Ulysses'
all-to-alls; DP's bucket all-reduce through gloo (0.68-1.02 GB/s: 0.7); copy bandwidth 8.2 GB/s a rank with 2 ranks
copying, 5.1 with 4. No reserve: the budget caps the model states and activations the memory model counts (the
engine's tensors, as benchmarks measure them), not the process's libraries. Offload moves nothing on the CPU (the
host is the device), so CPU rows never offload.
"""

import dataclasses
import subprocess
from typing import Optional

from hybrid3d.planning.flops import peak_key
from hybrid3d.planning.gpus import GPUS, INTER_NODE_GBPS, GpuModel, gpu_for_device
from hybrid3d.planning.step_time import Cluster

DEFAULT_GPU = "h100-sxm"  # what a GPU is planned as when nothing names it (the planner's defaults)

CPU_GFLOPS_PER_CORE = {"fp32": 23.5, "bf16": 23.5 * 114.0 / 97.1}  # hybrid3d's engine on one core (docstring)
CPU_FRAMEWORK_S_PER_LAYER = 2.83e-3  # a core's seconds per decoder layer and micro-batch beyond the FLOPs
CPU_ZERO_HOOKS_S_PER_LAYER = (0.0, 3.91e-3 - 2.83e-3, 7.07e-3 - 2.83e-3, 15.43e-3 - 2.83e-3)  # what each ZeRO stage's hooks add to it
# (GB/s, µs) of a TP all-reduce over the whole world (DeepSpeed's shared-memory kernel): a core a rank, more ranks
CPU_SHM_TP = {"a core a rank": (1.51, 0.0), "cores shared": (1.01, 3890.0)}
CPU_GLOO_TP = {"fp32": (0.72, 1450.0), "bf16": (0.81, 1440.0)}  # (GB/s, µs) through gloo, a group inside the world
CPU_GLOO_DP_GBPS = 0.7  # ZeRO's bucket all-reduce through gloo
CPU_COPY_GBPS = {"a core a rank": 8.2, "cores shared": 5.1}  # memory bandwidth a rank sees while the others copy too


def cpu_cluster(world: int, budget_gb: float, cores: int, precision: str) -> Cluster:
    """`world` CPU ranks on `cores` cores of one host, each held to `budget_gb` (module docstring)."""
    lp = "fp32" if precision == "fp32" else "bf16"
    gbps, latency = CPU_GLOO_TP[lp]
    rank_gflops = CPU_GFLOPS_PER_CORE[lp] * cores / world  # each rank gets its share of the cores
    sharing = "cores shared" if world > cores else "a core a rank"
    return Cluster(gpus=world, gpu_memory_gb=budget_gb, gpus_per_node=world, reserve_gb=0.0,
                   peak_tflops=rank_gflops / 1e3, efficiency=1.0, intra_node_gbps=gbps, inter_node_gbps=gbps,
                   memory_gbps=CPU_COPY_GBPS[sharing], latency_us=latency, dp_gbps=CPU_GLOO_DP_GBPS,
                   shared_cores=cores, whole_world_tp=CPU_SHM_TP[sharing],
                   framework_s_per_layer=CPU_FRAMEWORK_S_PER_LAYER,
                   zero_hooks_s_per_layer=CPU_ZERO_HOOKS_S_PER_LAYER)


def host_memory_gb() -> Optional[float]:
    """This node's memory (MemTotal of /proc/meminfo) in GB, None where there is no /proc."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None


def gpu_cluster(world: int, budget_gb: float, gpus_per_node: int, gpu: GpuModel, host_gb: Optional[float],
                peak_tflops: Optional[float] = None, intra_node_gbps: Optional[float] = None,
                inter_node_gbps: Optional[float] = None, **more) -> Cluster:
    """`world` GPUs of model `gpu` (planning/gpus.py: its datasheet's peak, memory bandwidth, host link and the
    intra-node link's planned bus bandwidth), `gpus_per_node` a node, each held to `budget_gb` with the planner's
    reserve; a figure given here beats the table's; `more`: other Cluster fields (the reserve, the host's Adam)."""
    return Cluster(gpus=world, gpu_memory_gb=budget_gb, gpus_per_node=gpus_per_node,
                   peak_tflops=peak_tflops or gpu.peak_tflops, memory_gbps=gpu.memory_gbps, pcie_gbps=gpu.pcie_gbps,
                   intra_node_gbps=intra_node_gbps or gpu.intra_node_gbps,
                   inter_node_gbps=inter_node_gbps or INTER_NODE_GBPS, host_memory_gb=host_gb, **more)


def nvlink_count() -> Optional[int]:
    """NVLinks active on GPU 0 as the driver reports them (NVML through pynvml if installed, else `nvidia-smi
    nvlink --status`), None where neither answers (no NVIDIA driver, an AMD GPU)."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            active = 0
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    active += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:  # a link this GPU does not have
                    break
            return active
        except pynvml.NVMLError:
            return None
    try:
        out = subprocess.run(["nvidia-smi", "nvlink", "--status", "-i", "0"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return sum("GB/s" in line and "inactive" not in line.lower() for line in out.stdout.splitlines())


def device_gpu(device_name: str, links: Optional[int]) -> tuple[GpuModel, str]:
    """The table's row for this job's GPU and where its figures come from, in words. A GPU the table does not know
    is planned as an H100 SXM (the planner's defaults); one whose row has NVLink but whose driver reports none
    active (a PCIe card named like its SXM sibling, links down) is planned over its PCIe host link."""
    name = gpu_for_device(device_name)
    if name is None:  # its peak, where the table of peaks knows it
        key = peak_key(device_name)
        gpu = GPUS[DEFAULT_GPU] if key is None else dataclasses.replace(GPUS[DEFAULT_GPU], peak_key=key)
        return gpu, (f"{device_name!r} is not in the GPU table: an H100 SXM's datasheet figures"
                     + ("" if key is None else f" with the {key}'s peak"))
    gpu = GPUS[name]
    if links == 0 and gpu.link.startswith(("NVLink", "Infinity")):
        pcie = f"PCIe {gpu.pcie_gen}.0 x16"
        gpu = dataclasses.replace(gpu, link=pcie + " (no NVLink active)", link_gbps=gpu.pcie_gbps)
        return gpu, f"{gpu.label} datasheet figures (the driver reports no NVLink: {pcie})"
    return gpu, f"{gpu.label} datasheet figures" + ("" if links is None else f", {links} NVLinks active")
