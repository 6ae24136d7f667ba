"""The machine a run plans for: a `Cluster` from what the job knows at start-up (world size, ranks per node, the
memory budget), with datasheet figures on GPUs and figures measured here on the CPU.

GPUs: the peak bf16 rate of the device table (`flops.peak_tflops`, or `train.peak_tflops`) and the Cluster's
datasheet defaults (NVLink-class 200 GB/s inside a node, 25 GB/s a GPU across nodes, HBM3 3.35 TB/s, PCIe 5.0
x16 to the host), the planner's 3 GB reserve (CUDA context, NCCL, fragmentation), host memory from /proc/meminfo.

CPU (gloo ranks sharing the cores): the figures `benchmarks/step_time_check.py` measured on a 2-core AMD EPYC VM
(benchmarks/results/2026-12-04-vm/step_time.md): the compute rate of plain PyTorch on all cores (fp32 97.1, bf16
114.0 GFLOP/s, 48.6 and 57.0 a core), a rank getting its share of the cores; TP all-reduces through DeepSpeed's
shared-memory kernel where the TP group is the whole world (fp32 5.79 GB/s bus bandwidth, 0.01 ms a message) and
through gloo otherwise (1.03 GB/s, 1.55 ms; bf16 0.87 GB/s, 1.02 ms: fitted over 2 of 4 ranks); DP's bucket
all-reduce through gloo (0.92-1.23 GB/s: 1.0); copy bandwidth 13.0-14.1 GB/s a rank. The shared-memory figures were
measured with no more ranks than cores; with more, its ranks wait for partners the OS has descheduled (TP4 on 2
cores measured 0.68-1.9 s a step against 0.56 for DP4: benchmarks/auto_layout.py), so there gloo's figures are used. No reserve: the budget caps
the model states and activations the memory model counts (the engine's tensors, as benchmarks measure them), not
the process's libraries. Offload moves nothing on the CPU (the host is the device), so CPU rows never offload.
"""

from typing import Optional

from hybrid3d.planning.step_time import Cluster

CPU_GFLOPS_PER_CORE = {"fp32": 97.1 / 2, "bf16": 114.0 / 2}  # plain PyTorch, 2 cores (module docstring)
CPU_SHM_TP = (5.79, 10.0)  # (GB/s, µs) of a TP all-reduce over the whole world (DeepSpeed's shared-memory kernel)
CPU_GLOO_TP = {"fp32": (1.03, 1550.0), "bf16": (0.87, 1020.0)}  # (GB/s, µs) through gloo, a group inside the world
CPU_GLOO_DP_GBPS = 1.0  # ZeRO's bucket all-reduce through gloo
CPU_COPY_GBPS = 13.0  # memory bandwidth a rank sees while the others copy too


def cpu_cluster(world: int, budget_gb: float, cores: int, precision: str) -> Cluster:
    """`world` CPU ranks on `cores` cores of one host, each held to `budget_gb` (module docstring)."""
    lp = "fp32" if precision == "fp32" else "bf16"
    gbps, latency = CPU_GLOO_TP[lp]
    rank_gflops = CPU_GFLOPS_PER_CORE[lp] * cores / world  # each rank gets its share of the cores
    return Cluster(gpus=world, gpu_memory_gb=budget_gb, gpus_per_node=world, reserve_gb=0.0,
                   peak_tflops=rank_gflops / 1e3, efficiency=1.0, intra_node_gbps=gbps, inter_node_gbps=gbps,
                   memory_gbps=CPU_COPY_GBPS, latency_us=latency, dp_gbps=CPU_GLOO_DP_GBPS,
                   shared_cores=cores, whole_world_tp=CPU_SHM_TP if world <= cores else None)


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


def gpu_cluster(world: int, budget_gb: float, gpus_per_node: int, peak_tflops: float,
                host_gb: Optional[float]) -> Cluster:
    """`world` GPUs, `gpus_per_node` a node, each held to `budget_gb` with the planner's reserve (module docstring)."""
    return Cluster(gpus=world, gpu_memory_gb=budget_gb, gpus_per_node=gpus_per_node, peak_tflops=peak_tflops,
                   host_memory_gb=host_gb)
