"""The planner's step-time estimate: seconds of one training step of a layout, by part (not overlapped).

Per GPU, for the same global batch (d·b·m sequences; t·p·d·c GPUs):
    compute  = tokens/GPU · (6N + 12·L·h·s) / (t·p·c) · (4/3 with full recomputation) / (peak · efficiency)
    bubble   = compute · (p - 1)/m        (1F1B: the bubble fraction (p-1)/(m+p-1) of the total step)
    tp comm  = ring bus bytes of the logged TP collectives / intra-node bandwidth (not overlapped):
               all-reduce n -> 2n(t-1)/t, reduce-scatter n -> n(t-1)/t, all-gather of shard m -> m(t-1)
               (`traffic.tp_bus_bytes`; with SP the reduce-scatters and all-gathers of `tp_bytes_by_op`)
    cp comm  = logged all-to-all bytes · (c-1)/c / intra-node bandwidth (`traffic.cp_bytes_per_step`)
    dp comm  = logged DP bytes · 2(n-1)/n / inter-node bandwidth (or intra-node when one node holds it),
               n = d·c: ZeRO and the gradient reduction span DeepSpeed's data-parallel group (CP folded in)
    pp comm  = (m + p - 1) · max over stages of one micro-batch's
               [send/recv bytes / link bandwidth + pipeline all-gather bytes · (t - 1) / intra-node bandwidth]
CP places its groups inside a node next to TP (rank = ((pipe·d + data)·c + cp)·t + model, `parallel/
layout.py`), so a CP all-to-all runs at the intra-node bandwidth; the planner refuses t·c > GPUs per
node. Compute: with CP each rank computes s/c of every sequence's tokens and a/(t·c) heads of attention
over all s, so the FLOPs are divided by c like the tokens.
pp comm: DeepSpeed's TrainSchedule runs 2(m + p - 1) lock-step slots (`runtime/pipe/schedule.py:
TrainSchedule.steps`) whose sends and receives block (`runtime/pipe/p2p.py: send/recv`), so a stage's
transfers lengthen each of the m + p - 1 forward-backward slots of the slowest stage; the bytes are
`traffic.pp_boundary_bytes` (activation and gradient, 1/t each when partitioned or with SP) and
`traffic.pp_gather_bytes_per_step` (an all-gather of input M moves (t - 1)·M per rank, the bus bytes of
`utils/comms_logging.py: calc_bw_log`; none with SP), and a stage boundary uses the inter-node link when
it crosses nodes (`Cluster.pipe_link_gbps`). These paths are DeepSpeed 0.19.8's.
The absolute numbers are rough; the ranking is what the estimate is for.
"""

from dataclasses import dataclass

from hybrid3d.model.config import LlamaShape
from hybrid3d.planning.flops import training_flops_per_token
from hybrid3d.planning.memory import GB
from hybrid3d.planning.traffic import (
    cp_bytes_per_step,
    dp_bytes_per_step,
    pp_boundary_bytes,
    pp_gather_bytes_per_step,
    tp_bus_bytes,
    tp_bytes_by_op,
)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gb: float
    gpus_per_node: int = 8
    reserve_gb: float = 3.0
    peak_tflops: float = 989.4
    efficiency: float = 0.5
    intra_node_gbps: float = 200.0  # GB/s per GPU of all-reduce bus bandwidth inside a node
    inter_node_gbps: float = 25.0  # GB/s per GPU across nodes

    def pipe_link_gbps(self, stage: int, tp: int, dp: int) -> float:
        """Bandwidth between `stage` and `stage + 1`. DeepSpeed numbers ranks pipe·d·t + data·t + model
        (`runtime/pipe/topology.py: PipeModelDataParallelTopology`) and its launcher fills each node with
        consecutive ranks (`launcher/launch.py: main`), so rank r of `stage` sends to r + d·t; the
        boundary is inter-node when any such pair sits on two nodes (the slowest pair sets the pace)."""
        width = tp * dp
        first = stage * width
        crosses = any(r // self.gpus_per_node != (r + width) // self.gpus_per_node
                      for r in range(first, first + width))
        return self.inter_node_gbps if crosses else self.intra_node_gbps


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step by part; the parts are not overlapped, `seconds` is their sum."""

    compute: float  # one GPU's forward + backward (+ recomputation) FLOPs at peak · efficiency
    bubble: float  # 1F1B fill and drain: compute · (p - 1)/m
    tp: float  # TP all-reduces (with SP: reduce-scatters, all-gathers and the norms' all-reduces)
    dp: float  # gradient reduction and ZeRO's all-gather
    pipe: float  # pipeline send/recv and the all-gathers re-assembling partitioned messages
    cp: float = 0.0  # Ulysses all-to-alls

    @property
    def seconds(self) -> float:
        return self.compute + self.bubble + self.tp + self.dp + self.pipe + self.cp


def pipe_seconds(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, dp: int, micro_batch: int, gas: int,
                 seq: int, act_bytes: int = 2, pipe_partitioned: bool = True, grad_partitioned: bool = True,
                 sequence_parallel: bool = False) -> float:
    """(m + p - 1) · the slowest stage's pipeline traffic per micro-batch (module docstring, pp comm)."""
    if pp == 1:
        return 0.0
    boundary = pp_boundary_bytes(shape, micro_batch, seq, tp, act_bytes, pipe_partitioned, grad_partitioned,
                                 sequence_parallel)
    links = [cluster.pipe_link_gbps(st, tp, dp) * GB for st in range(pp - 1)]  # links[i]: stage i -> i + 1
    slowest = 0.0
    for st in range(pp):
        p2p = sum(boundary / links[i] for i in (st - 1, st) if 0 <= i < pp - 1)
        gathers = pp_gather_bytes_per_step(shape, micro_batch, seq, tp, pp, st, 1, act_bytes, pipe_partitioned,
                                           grad_partitioned, sequence_parallel)
        gather = gathers * (tp - 1) / (cluster.intra_node_gbps * GB)
        slowest = max(slowest, p2p + gather)
    return (gas + pp - 1) * slowest


def estimate_step_time(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, dp: int, zero: int,
                       micro_batch: int, gas: int, seq: int, precision: str = "bf16+fp32acc",
                       checkpointing: bool = False, pipe_partitioned: bool = True,
                       grad_partitioned: bool = True, sequence_parallel: bool = False, cp: int = 1) -> StepTime:
    """Estimated seconds of one training step (the planner's model, module docstring) of `shape` on
    `cluster` (peak, efficiency, intra/inter-node bandwidth, GPUs per node) with layout tp x pp x dp x cp,
    ZeRO stage `zero`, `micro_batch` sequences of `seq` tokens per micro-batch, `gas` micro-batches per
    step (global batch = dp · micro_batch · gas; dp excludes cp), `precision` one of memory.PRECISIONS
    (activations and messages are 4 bytes for "fp32", else 2), full activation `checkpointing`,
    DeepSpeed's `"pipeline": {"pipe_partitioned", "grad_partitioned"}` (both on by default; they act only
    when tp > 1 and are off with SP), Megatron `sequence_parallel` and Ulysses context parallelism `cp`.
    `.seconds` is the total; it is meant for comparing with measured step times."""
    act_bytes = 4 if precision == "fp32" else 2
    sp = sequence_parallel
    compute = micro_batch * gas * seq * training_flops_per_token(shape, seq) / (tp * pp * cp)  # tokens/GPU · FLOPs
    compute *= 4 / 3 if checkpointing else 1
    compute /= cluster.peak_tflops * 1e12 * cluster.efficiency
    intra = cluster.intra_node_gbps * GB
    tp_seconds = max(tp_bus_bytes(tp_bytes_by_op(shape, micro_batch, seq, tp, pp, st, gas, act_bytes, checkpointing,
                                                 sp, cp), tp) for st in range(pp)) / intra
    cp_seconds = max(cp_bytes_per_step(shape, micro_batch, seq, tp, cp, pp, st, gas, act_bytes, checkpointing)
                     for st in range(pp)) * (cp - 1) / cp / intra
    zero_group = dp * cp
    dp_bandwidth = cluster.intra_node_gbps if tp * pp * zero_group <= cluster.gpus_per_node else cluster.inter_node_gbps
    dp_seconds = max(dp_bytes_per_step(shape, tp, pp, zero_group, st, zero, gas, precision) for st in range(pp)) \
        * 2 * (zero_group - 1) / zero_group / (dp_bandwidth * GB)
    pipe = pipe_seconds(shape, cluster, tp, pp, dp, micro_batch, gas, seq, act_bytes, pipe_partitioned,
                        grad_partitioned, sp)
    return StepTime(compute, compute * (pp - 1) / gas, tp_seconds, dp_seconds, pipe, cp_seconds)
