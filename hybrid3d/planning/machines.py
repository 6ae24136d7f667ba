"""The machine a run plans for: a `Cluster` from what the job knows at start-up (world size, ranks per node, the
memory budget), with datasheet figures on GPUs and figures measured here on the CPU.

GPUs: the peak bf16 rate of the device table (`flops.peak_tflops`, or `train.peak_tflops`) and the Cluster's
datasheet defaults (NVLink-class 200 GB/s inside a node, 25 GB/s a GPU across nodes, HBM3 3.35 TB/s, PCIe 5.0
x16 to the host), the planner's 3 GB reserve (CUDA context, NCCL, fragmentation), host memory from /proc/meminfo.

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

from typing import Optional

from hybrid3d.planning.step_time import Cluster

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


def gpu_cluster(world: int, budget_gb: float, gpus_per_node: int, peak_tflops: float,
                host_gb: Optional[float]) -> Cluster:
    """`world` GPUs, `gpus_per_node` a node, each held to `budget_gb` with the planner's reserve (module docstring)."""
    return Cluster(gpus=world, gpu_memory_gb=budget_gb, gpus_per_node=gpus_per_node, peak_tflops=peak_tflops,
                   host_memory_gb=host_gb)
