"""The planner's GPU table (planning/gpus.py): every row sourced, `--gpu` and its overrides, the device name a job
reports, and what a PCIe workstation's links change in the ranking."""

import ast
import re

import pytest

from hybrid3d.planning import gpus
from hybrid3d.planning.gpus import GPUS, gpu_for_device
from hybrid3d.planning.machines import device_gpu, gpu_cluster
from hybrid3d.planning.plan_cli import main as plan_main


def test_every_row_names_its_source():
    """Each row of GPUS follows a comment naming the datasheet or whitepaper its figures come from (rows of one
    product share the comment above the first of them)."""
    lines = open(gpus.__file__).read().splitlines()
    table = next(node for node in ast.parse("\n".join(lines)).body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "GPUS")
    assert [key.value for key in table.value.keys] == list(GPUS)
    for key in table.value.keys:
        above = key.lineno - 2  # the line before the row (0-based)
        while re.match(r'\s*"[a-z0-9-]+": GpuModel', lines[above]):  # the row before it shares its comment
            above -= 1
        comment = []
        while lines[above].strip().startswith("#"):
            comment.insert(0, lines[above])
            above -= 1
        assert re.search(r"datasheet|whitepaper", " ".join(comment)), (key.value, comment)


def test_the_driver_names_map_to_rows():
    names = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H200": "h200",
             "NVIDIA A100-SXM4-40GB": "a100-sxm-40", "NVIDIA A100-SXM4-80GB": "a100-sxm-80",
             "NVIDIA A100 80GB PCIe": "a100-pcie", "NVIDIA GeForce RTX 4090": "rtx4090",
             "NVIDIA GeForce RTX 3090": "rtx3090", "NVIDIA L40S": "l40s", "NVIDIA L4": "l4", "NVIDIA A10": "a10",
             "AMD Instinct MI300X": "mi300x", "NVIDIA B200": "b200", "NVIDIA L40": None}
    assert {name: gpu_for_device(name) for name in names} == names
    pcie, source = device_gpu("NVIDIA H100 80GB HBM3", links=0)  # NVLinks down: planned over its PCIe link
    assert pcie.intra_node_gbps == pytest.approx(64 * gpus.BUS_SHARE) and "no NVLink" in source
    nvlink, source = device_gpu("NVIDIA H100 80GB HBM3", links=18)
    assert nvlink == GPUS["h100-sxm"] and "18 NVLinks active" in source


def test_an_unknown_gpu_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--model", "llama3-8b", "--gpus", "8", "--gpu", "rtx9090"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1
    assert "--gpu: unknown GPU 'rtx9090'" in err[-1] and all(name in err[-1] for name in GPUS)


def _first_rows(capsys, *argv) -> tuple[str, list[list[str]]]:
    assert plan_main(["--model", "llama3-8b", "--gpus", "8", "--top", "40", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    header = out.index(next(line for line in out if line.lstrip().startswith("tp ")))
    rows = [line.split() for line in out[header + 1:] if line.strip() and line.split()[0].isdigit()]
    return next(line for line in out if line.startswith("machine: ")), rows


def test_a_pcie_workstation_plans_without_tensor_parallelism_first(capsys):
    """On 8 RTX 4090s (PCIe 4.0, no peer-to-peer: 7.1 GB/s planned) the first rows split no layer over TP, and the
    line above the table names the link; on H100 SXMs (200 GB/s) a TP2 row comes first, as it did before the table
    (8 x 24 GB); an override of the link beats the table and brings TP2 back on the 4090s."""
    machine, rows = _first_rows(capsys, "--gpu", "rtx4090")
    assert "RTX 4090" in machine and "in a node 7.11 GB/s (PCIe 4.0 x16, no peer-to-peer)" in machine
    assert rows[0][0] == "1" and rows[0][2] == "1"  # tp 1, cp 1
    first_tp = next(i for i, row in enumerate(rows) if int(row[0]) > 1)
    assert first_tp > 5
    machine, rows = _first_rows(capsys, "--gpu", "h100-sxm", "--gpu-memory", "24")
    assert "in a node 200 GB/s" in machine and rows[0][:3] == ["2", "2", "2"]
    machine, rows = _first_rows(capsys, "--gpu", "rtx4090", "--intra-node-gbps", "200", "--peak-tflops", "989.4")
    assert "in a node 200 GB/s (given)" in machine and "989.4 TFLOP/s bf16 (given)" in machine
    assert rows[0][:3] == ["2", "2", "2"]  # the H100's figures at 24 GB: the same first row


def test_overrides_beat_the_table():
    cluster = gpu_cluster(16, 24, 8, GPUS["rtx4090"], None, intra_node_gbps=20.0, inter_node_gbps=5.0)
    assert (cluster.intra_node_gbps, cluster.inter_node_gbps) == (20.0, 5.0)
    assert (cluster.peak_tflops, cluster.memory_gbps, cluster.pcie_gbps) == (165.2, 1008, 32.0)
    table = gpu_cluster(16, 24, 8, GPUS["rtx4090"], None)
    assert table.intra_node_gbps == pytest.approx(32 * gpus.BUS_SHARE / 2) and table.inter_node_gbps == 25.0
