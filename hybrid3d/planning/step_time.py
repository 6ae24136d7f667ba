"""The planner's step-time estimate: seconds of one training step of a layout, by part (not overlapped).

Per GPU, for the same global batch (d·b·m sequences; t·p·d·c GPUs):
    compute  = tokens/GPU · (6N + 12·L·h·s) / (t·p·c) · (4/3 with full recomputation) / (peak · efficiency)
    bubble   = compute · (slots - m)/m = compute · f/(1 - f), f the schedule's ideal bubble fraction of the
               step (`pipeline_schedules.ideal_bubble`), slots = m/(1 - f) the step's length in micro-batch
               slots (`pipeline_slots`): 1F1B f = (p-1)/(m+p-1), slots m + p - 1, bubble compute·(p-1)/m;
               interleaved 1F1B f = (p-1)/(v·m+p-1), slots m + (p-1)/v, bubble compute·(p-1)/(v·m)
               (Narayanan et al. 2021, §2.2.2); DualPipeV f from a timed run of its orders. CPU ranks sharing
               C cores (`Cluster.shared_cores`, w > C ranks): a waiting rank gives its core to the others, so a
               step takes the longer of the work of all ranks over the cores (compute) and the schedule's
               critical path at one core a rank (slots · compute/m · C/w): the bubble is what the second exceeds
               the first by (`shared_core_bubble`), none where each stage's ranks can fill the cores
    framework = m · the busiest rank's decoder layers · (Python, autograd and DeepSpeed's per-module hooks per layer
               and micro-batch: `Cluster.framework_s_per_layer`, + `Cluster.zero_hooks_s_per_layer` of the
               ZeRO stage)
               · w/C where w ranks share C cores (4/3 with recomputation): seconds a micro-batch costs whatever its
               size, which FLOPs leave out. benchmarks/step_time_check.py measures them on one core (its
               `framework_line`); 0 on GPUs, where the host issues kernels ahead of the device
    tp comm  = ring bus bytes of the logged TP collectives / intra-node bandwidth (not overlapped):
               all-reduce n -> 2n(t-1)/t, reduce-scatter n -> n(t-1)/t, all-gather of shard m -> m(t-1)
               (`traffic.tp_bus_bytes`; with SP the reduce-scatters and all-gathers of `tp_bytes_by_op`)
               + the messages (`traffic.tp_messages`) · the latency of one collective (`Cluster.latency_us`,
               Hockney's α: 0 by default, as NCCL's tens of µs are small against messages of MBs; gloo's on a
               CPU shared by its ranks are milliseconds, benchmarks/step_time_check.py measures them; on the CPU a
               TP group that is the whole world takes the shared-memory kernel's for its all-reduces,
               `Cluster.whole_world_tp`, and gloo's for SP's all-gathers and reduce-scatters)
    cp comm  = logged all-to-all bytes · (u-1)/u / intra-node bandwidth (`traffic.cp_bytes_per_step`), over the
               u ranks of Ulysses (u = c with `context_parallel_comm` "a2a", none with "p2p"), + its all-to-alls
               (`traffic.cp_messages_per_step`) · the latency of one collective (`Cluster.latency_us`)
               + with a ring ("p2p", "a2a+p2p"): ring bytes per layer (`traffic.ring_bytes_per_layer`: forward
               + backward, the forward again with checkpointing) · the busiest rank's layers · m / the ring's
               link (`Cluster.ring_gbps`: intra-node when a CP group fits a node, else inter-node)
    dp comm  = logged DP bytes · 2(n-1)/n / inter-node bandwidth (or intra-node when one node holds it; on the
               CPU gloo's bucket bandwidth, `Cluster.dp_gbps`),
               n = d·c: ZeRO and the gradient reduction span DeepSpeed's data-parallel group (CP folded in)
    ep comm  = logged all-to-all bytes of the experts' dispatch and combine (`traffic.ep_bytes_per_step`) · (e-1)/e
               / the intra-node bandwidth where an EP group's t·c·e ranks divide a node, else the inter-node one
               (no rate of its own measured yet); with e > 1 the dp comm term reduces the experts over the d·c/e
               ranks of their expert-data-parallel group and the dense tensors over d·c
    pp comm  = slots · max over pipeline ranks of one micro-batch's
               [send/recv bytes / link bandwidth + pipeline all-gather bytes · (t - 1) / intra-node bandwidth
                + its sends, receives and all-gathers · the latency of one]
    optimizer = the parameters a rank steps (its stages' Ψ, / d·c when ZeRO shards the master) · the bytes Adam
               reads and writes per parameter (`OPTIMIZER_BYTES`) / memory bandwidth: the step is memory-bound
               (a handful of FLOPs per 28-36 bytes moved): about 1% of a 7B step on H100s, several percent on CPUs.
    ZeRO-3 (p = 1): dp comm = (all-gathered partitions · (n-1) + m · lp·Ψ · (n-1)/n) / bandwidth instead:
               what DeepSpeed's parameter coordinator all-gathers per micro-batch, replayed with its stage3_*
               knobs (`zero3_fetch.zero3_step_traffic`: between 1x and 2x the weights, as many layers stay
               gathered from their forward to their backward; Rajbhandari et al. 2020, §7.2.1 count 2x), the
               persistent parameters' gather after the step and every micro-batch's gradient reduce-scatter,
               counted as not overlapped, though DeepSpeed prefetches; + its all-gathers and one reduce-scatter
               per micro-batch · the latency of one collective (`Cluster.latency_us`).
    offload  = with offload_optimizer the step runs on the host: its partition (Ψ/n elements) / the host's Adam
               rate (`Cluster.host_adam_gelems`) + the partition's lp gradients down and lp weights up the host
               link (2·lp·Ψ/n / `Cluster.pcie_gbps`); with offload_param each micro-batch's forward and backward
               also fetch the lp partition from the host (+ 2m·lp·Ψ/n) (Ren et al. 2021, ZeRO-Offload).
TP, CP and DP bytes are those of the busiest pipeline rank, summed over its stages (one with 1F1B; v with
the interleaved schedule; DualPipeV's rank 0 adds the head's collectives to the embedding's). DP sums the
stages' Ψ, so a tied embedding DualPipeV's rank 0 holds once is counted twice (an over-estimate).
CP places its groups inside a node next to TP (rank = ((pipe·d + data)·c + cp)·t + model, `parallel/
layout.py`), so a CP all-to-all runs at the intra-node bandwidth; the planner refuses t·u > GPUs per
node. A ring's sends may cross nodes. Compute: with CP each rank computes s/c of every sequence's tokens and
a/(t·c) heads of attention over all s (a ring: its queries against every key block, causal pairs balanced by
the 2c chunks), so the FLOPs are divided by c like the tokens. The ring term is not overlapped, like every other
term here, while `parallel/ring_attention.py` overlaps each send with the attention of the block in hand: an
upper bound.
pp comm: DeepSpeed's TrainSchedule runs 2(m + p - 1) lock-step slots (`runtime/pipe/schedule.py:
TrainSchedule.steps`) whose sends and receives block (`runtime/pipe/p2p.py: send/recv`), so a stage's
transfers lengthen each of the m + p - 1 forward-backward slots of the slowest stage (slots for the other
schedules likewise); the bytes are
`traffic.pp_boundary_bytes` (activation and gradient, 1/t each when partitioned or with SP) and
`traffic.pp_gather_bytes_per_step` (an all-gather of input M moves (t - 1)·M per rank, the bus bytes of
`utils/comms_logging.py: calc_bw_log`; none with SP), and a stage boundary uses the inter-node link when
it crosses nodes (`Cluster.pipe_link_gbps`). These paths are DeepSpeed 0.19.8's.
Other schedules: a rank sends and receives at every boundary of its stages whose neighbour stage sits on
another rank, so a micro-batch crosses S - 1 boundaries (1F1B p - 1, interleaved v·p - 1 with the last
rank's chunk k handing over to rank 0's chunk k + 1) except DualPipeV's turn-around from stage p-1 to p,
which stays on rank p-1 (2p - 2 messages each way); a middle rank handles 2 (1F1B), 2v (interleaved) or 4
(DualPipeV) of them per micro-batch. Both schedules send whole activations, DeepSpeed's pipe/grad
partitioning off (`config.ds_checks.check_pipeline_schedule`): no pipeline all-gathers.
The absolute numbers are rough; the ranking is what the estimate is for.
"""

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from hybrid3d.model.config import LlamaShape
from hybrid3d.parallel.pipeline_schedules import ideal_bubble, num_stages
from hybrid3d.planning.activations import rank_stages, stage_layer_count, ulysses_size, uses_ring
from hybrid3d.planning.flops import training_flops_per_token
from hybrid3d.planning.memory import GB, TORCH, UNFUSED, optimizer_wrapper, stage_parameter_numels
from hybrid3d.planning.parameters import rank_expert_numels, rank_parameter_numels
from hybrid3d.planning.zero3_fetch import Zero3Knobs, zero3_step_traffic
from hybrid3d.planning.traffic import (
    cp_bytes_per_step,
    cp_messages_per_step,
    dp_bytes_per_step,
    ep_bytes_per_step,
    group_dp_bytes,
    pp_boundary_bytes,
    pp_gather_bytes_per_step,
    pp_gathers_per_micro_batch,
    ring_bytes_per_layer,
    tp_bus_bytes,
    tp_messages,
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
    memory_gbps: float = 3350.0  # GB/s of device memory: the H100 SXM's HBM3 datasheet figure, as peak_tflops is
    latency_us: float = 0.0  # µs of one TP collective beyond its bytes / bandwidth (module docstring)
    pcie_gbps: float = 64.0  # GB/s per direction of a GPU's host link: PCIe 5.0 x16's datasheet figure (H100 SXM)
    # G elements/s of DeepSpeedCPUAdam per GPU: measured with 2 threads on a 2-core AMD EPYC VM (AVX2), 2026-12-05
    # (0.45 with one thread); a host with more cores per GPU steps faster (--host-adam-rate)
    host_adam_gelems: float = 0.76
    host_memory_gb: Optional[float] = None  # GB of host memory per node for offloaded states (None: not checked)
    # GB/s of DP's bucket all-reduce where it differs from the link's: on the CPU ZeRO reduces through gloo while the
    # TP layers take DeepSpeed's shared-memory kernel (planning/machines.py); None: the link's
    dp_gbps: Optional[float] = None
    # Cores the ranks share (CPU ranks, more ranks than cores): a pipeline bubble's idle ranks lend theirs to the busy
    # ones (`shared_core_bubble`); None: a device per rank
    shared_cores: Optional[int] = None
    # (GB/s, µs) of a TP all-reduce whose group is the whole world where it differs from the link's: on the CPU
    # DeepSpeed's shared-memory kernel serves that group only (ds_internals/shm_all_reduce.py); None: the link's
    whole_world_tp: Optional[tuple] = None
    # Seconds of one core a decoder layer's forward + backward costs a micro-batch beyond its FLOPs (Python, autograd,
    # DeepSpeed's hooks) at ZeRO-0, and what the hooks of ZeRO stages 0-3 add to it: measured on the CPU
    # (planning/machines.py); 0 on GPUs, where they overlap the device's work (module docstring, framework)
    framework_s_per_layer: float = 0.0
    zero_hooks_s_per_layer: tuple = (0.0, 0.0, 0.0, 0.0)

    def ring_gbps(self, tp: int, cp: int) -> float:
        """Bandwidth of a CP ring's neighbour sends. A CP group is t·c consecutive ranks from a multiple of t·c
        (`parallel/layout.py`), so all groups lie in one node each iff t·c divides the GPUs per node; otherwise a
        group spans a node boundary, which falls between two ring members (t·u divides the node), and that pair
        sets the pace."""
        return self.intra_node_gbps if self.gpus_per_node % (tp * cp) == 0 else self.inter_node_gbps

    def pipe_link_gbps(self, stage: int, tp: int, dp: int) -> float:
        """Bandwidth between `stage` and `stage + 1`. DeepSpeed numbers ranks pipe·d·t + data·t + model
        (`runtime/pipe/topology.py: PipeModelDataParallelTopology`) and its launcher fills each node with
        consecutive ranks (`launcher/launch.py: main`), so rank r of `stage` sends to r + d·t; the
        boundary is inter-node when any such pair sits on two nodes (the slowest pair sets the pace)."""
        return self.pipe_pair_gbps(stage, stage + 1, tp, dp)

    def pipe_pair_gbps(self, rank: int, other: int, tp: int, dp: int) -> float:
        """Bandwidth between pipeline ranks `rank` and `other` (as `pipe_link_gbps`: GPU r of one talks to
        r + (other - rank)·d·t of the other; interleaved 1F1B also links rank p-1 to rank 0)."""
        width = tp * dp
        first, offset = rank * width, (other - rank) * width
        crosses = any(r // self.gpus_per_node != (r + offset) // self.gpus_per_node
                      for r in range(first, first + width))
        return self.inter_node_gbps if crosses else self.intra_node_gbps


def shared_core_bubble(world: int, cores: Optional[int], slots: float, gas: int) -> float:
    """The bubble as a fraction of a rank's per-micro-batch work summed over the step (module docstring, bubble):
    (slots - m)/m with a device a rank; with `world` ranks on `cores` cores (w > C) a waiting rank's core runs the
    others, and the step is the longer of all ranks' work over the cores and the critical path at one core a rank,
    slots · C/w of the per-micro-batch work, so the bubble is max(0, slots/m · C/w - 1)."""
    share = min(1.0, cores / world) if cores else 1.0
    return max(0.0, slots / gas * share - 1.0)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step by part; the parts are not overlapped, `seconds` is their sum."""

    compute: float  # one GPU's forward + backward (+ recomputation) FLOPs at peak · efficiency
    bubble: float  # pipeline fill and drain: compute · (slots - m)/m (1F1B: compute · (p - 1)/m)
    tp: float  # TP all-reduces (with SP: reduce-scatters, all-gathers and the norms' all-reduces)
    dp: float  # gradient reduction and ZeRO's all-gather
    pipe: float  # pipeline send/recv and the all-gathers re-assembling partitioned messages
    cp: float = 0.0  # Ulysses all-to-alls and the ring's sends
    optimizer: float = 0.0  # the optimizer step's memory traffic
    framework: float = 0.0  # per-micro-batch work beyond the FLOPs (Python, autograd, hooks)
    ep: float = 0.0  # the experts' dispatch and combine all-to-alls

    @property
    def seconds(self) -> float:
        return (self.compute + self.bubble + self.tp + self.dp + self.pipe + self.cp + self.optimizer + self.framework
                + self.ep)


@lru_cache(maxsize=256)
def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """f, `ideal_bubble` cached: DualPipeV's comes from a timed run of its orders (up to a second at m = 512),
    and the planner asks for the same (p, m) in many rows."""
    return ideal_bubble(schedule, p, m, v)


def pipeline_slots(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The step's length in micro-batch slots (one micro-batch's forward and backward on one rank):
    m/(1 - f) for the schedule's ideal bubble fraction f. The closed forms for 1F1B, m + p - 1, and for
    interleaved 1F1B, m + (p - 1)/v (v·m + p - 1 chunk slots of 1/v each), are that identity exactly."""
    if schedule == "1f1b":
        return m + p - 1
    if schedule == "interleaved":
        return m + (p - 1) / v
    return m / (1 - bubble_fraction(schedule, p, m, v))


def _worst_rank(per_stage, schedule: str, pp: int, v: int = 1) -> float:
    """max over the p pipeline ranks of per_stage(S, σ) summed over the rank's stages σ (S stages in all)."""
    stages = num_stages(schedule, pp, v)
    return max(sum(per_stage(stages, sigma) for sigma in rank_stages(schedule, pp, r, v)) for r in range(pp))


def pipe_seconds(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, dp: int, micro_batch: int, gas: int,
                 seq: int, act_bytes: int = 2, pipe_partitioned: bool = True, grad_partitioned: bool = True,
                 sequence_parallel: bool = False, schedule: str = "1f1b", virtual: int = 1) -> float:
    """slots · the slowest pipeline rank's traffic per micro-batch (module docstring, pp comm): at each boundary
    of its stages whose neighbour stage is on another rank, the activation and its gradient, plus (1F1B) the
    pipeline all-gathers, each message also costing `Cluster.latency_us`. The interleaved and DualPipeV schedules
    send whole activations (partitioning off)."""
    if pp == 1:
        return 0.0
    if schedule != "1f1b":
        pipe_partitioned = grad_partitioned = False
    boundary = pp_boundary_bytes(shape, micro_batch, seq, tp, act_bytes, pipe_partitioned, grad_partitioned,
                                 sequence_parallel)
    stages = num_stages(schedule, pp, virtual)
    owner = {sigma: r for r in range(pp) for sigma in rank_stages(schedule, pp, r, virtual)}
    slowest = 0.0
    for r in range(pp):
        neighbours = [owner[n] for sigma in rank_stages(schedule, pp, r, virtual) for n in (sigma - 1, sigma + 1)
                      if 0 <= n < stages and owner[n] != r]
        p2p = sum(boundary / (cluster.pipe_pair_gbps(min(r, o), max(r, o), tp, dp) * GB) for o in neighbours)
        gathers = pp_gather_bytes_per_step(shape, micro_batch, seq, tp, pp, r, 1, act_bytes, pipe_partitioned,
                                           grad_partitioned, sequence_parallel)
        gather = gathers * (tp - 1) / (cluster.intra_node_gbps * GB)
        messages = 2 * len(neighbours) + pp_gathers_per_micro_batch(tp, pp, r, pipe_partitioned, grad_partitioned,
                                                                    sequence_parallel)
        slowest = max(slowest, p2p + gather + messages * cluster.latency_us * 1e-6)
    return pipeline_slots(schedule, pp, gas, virtual) * slowest


def ring_seconds(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, cp: int, micro_batch: int, gas: int,
                 seq: int, act_bytes: int = 2, checkpointing: bool = False, comm: str = "a2a", cp_a2a: int = 1,
                 schedule: str = "1f1b", virtual: int = 1) -> float:
    """The ring's part of cp comm (module docstring): (forward + backward) ring bytes per layer · the layers of the
    busiest pipeline rank · m micro-batches / the ring's link; 0 without a ring."""
    if not uses_ring(cp, comm):
        return 0.0
    forward, backward = ring_bytes_per_layer(shape, micro_batch, seq, tp, cp, ulysses_size(cp, comm, cp_a2a),
                                             act_bytes, checkpointing)
    layers = _worst_rank(lambda S, st: stage_layer_count(shape, S, st), schedule, pp, virtual)
    return (forward + backward) * layers * gas / (cluster.ring_gbps(tp, cp) * GB)


# Bytes Adam moves per parameter it steps: reads of the fp32 parameter (master), gradient and both moments, writes
# of the parameter and moments (7 x 4); with bf16 weights also the bf16 gradient read into fp32 and the updated
# master written back to the bf16 weight (+ 2 + 4 + 2). DeepSpeed's ZeRO wrappers and torch's AdamW alike.
OPTIMIZER_BYTES = {"fp32": 28, "bf16": 36, "bf16+fp32acc": 36}


def optimizer_seconds(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, zero_group: int, zero: int,
                      precision: str, schedule: str = "1f1b", virtual: int = 1, offload: str = "none",
                      gas: int = 1, ep: int = 1) -> float:
    """The busiest rank's optimizer step: its stages' parameters (1/zero_group of them where the wrapper shards
    the master, `memory.optimizer_wrapper`; ZeRO-3 does; a mixture of experts' E/e experts per block 1/(zero_group/e)
    of them) · OPTIMIZER_BYTES / memory bandwidth, or with `offload` on the host, with the transfers over the host
    link (module docstring)."""
    sharded = zero == 3 or optimizer_wrapper(zero, precision, pp) not in (TORCH, UNFUSED)
    share = zero_group if sharded else 1

    def stepped(stages: int, stage: int) -> float:
        dense, experts = expert_split(shape, tp, stages, stage, ep)
        return dense / share + experts / max(1, share // ep)

    numel = _worst_rank(stepped, schedule, pp, virtual)
    if offload == "none":
        return numel * OPTIMIZER_BYTES[precision] / (cluster.memory_gbps * GB)
    lp = 4 if precision == "fp32" else 2
    transfers = 2 * lp * numel * (1 + (gas if offload == "optimizer+params" else 0))
    return numel / (cluster.host_adam_gelems * 1e9) + transfers / (cluster.pcie_gbps * GB)


@lru_cache(maxsize=4096)
def expert_split(shape: LlamaShape, tp: int, stages: int, stage: int, ep: int = 1) -> tuple[int, int]:
    """(dense, routed-expert) parameter elements of one TP rank of `stage` of `stages` with E/e experts per MoE
    block: DeepSpeed's two parameter groups (`memory.moe_model_states`); (all, 0) for a dense model."""
    everything = sum(rank_parameter_numels(shape, tp, stages, stage, ep=ep))
    experts = sum(rank_expert_numels(shape, tp, stages, stage, ep=ep))
    return everything - experts, experts


def estimate_step_time(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, dp: int, zero: int,
                       micro_batch: int, gas: int, seq: int, precision: str = "bf16+fp32acc",
                       checkpointing: bool = False, pipe_partitioned: bool = True,
                       grad_partitioned: bool = True, sequence_parallel: bool = False, cp: int = 1,
                       schedule: str = "1f1b", virtual: int = 1, comm: str = "a2a", cp_a2a: int = 1,
                       offload: str = "none", zero3: Zero3Knobs = Zero3Knobs(), ep: int = 1) -> StepTime:
    """Estimated seconds of one training step (the planner's model, module docstring) of `shape` on
    `cluster` (peak, efficiency, intra/inter-node bandwidth, GPUs per node) with layout tp x pp x dp x cp,
    ZeRO stage `zero`, `micro_batch` sequences of `seq` tokens per micro-batch, `gas` micro-batches per
    step (global batch = dp · micro_batch · gas; dp excludes cp), `precision` one of memory.PRECISIONS
    (activations and messages are 4 bytes for "fp32", else 2), full activation `checkpointing`,
    DeepSpeed's `"pipeline": {"pipe_partitioned", "grad_partitioned"}` (both on by default; they act only
    when tp > 1 and are off with SP and with the interleaved and DualPipeV schedules), Megatron
    `sequence_parallel`, context parallelism `cp` by `comm` (context_parallel_comm: "a2a" Ulysses, "p2p" ring
    attention, "a2a+p2p" Ulysses over `cp_a2a` ranks around a ring) and the pipeline `schedule` ("1f1b",
    "interleaved" with `virtual` = v chunks per rank, "dualpipev"); ZeRO-3 (`zero` 3, p = 1, its stage3_* knobs
    `zero3`) and `offload` (one of "none", "optimizer", "optimizer+params") as the module docstring says; `ep`
    expert-parallel ranks of a mixture of experts (its all-to-alls, and its experts reduced over d·c/e ranks).
    `.seconds` is the total; it is meant for comparing with measured step times."""
    act_bytes = 4 if precision == "fp32" else 2
    sp, v = sequence_parallel, virtual
    compute = micro_batch * gas * seq * training_flops_per_token(shape, seq) / (tp * pp * cp)  # tokens/GPU · FLOPs
    compute *= 4 / 3 if checkpointing else 1
    compute /= cluster.peak_tflops * 1e12 * cluster.efficiency
    intra = cluster.intra_node_gbps * GB
    link = (cluster.intra_node_gbps, cluster.latency_us)
    # the all-reduces' (GB/s, µs): on the CPU a TP group that is the whole world takes the shared-memory kernel, which
    # serves all-reduces only; SP's all-gathers and reduce-scatters keep the link's
    all_reduce = cluster.whole_world_tp if cluster.whole_world_tp and tp == cluster.gpus else link

    def tp_stage_seconds(stages: int, stage: int) -> float:
        seconds = 0.0
        for op, count, size in tp_messages(shape, micro_batch, seq, tp, stages, stage, gas, act_bytes, checkpointing,
                                           sp, cp):
            gbps, latency_us = all_reduce if op == "all_reduce" else link
            seconds += count * (tp_bus_bytes({op: size}, tp) / (gbps * GB) + latency_us * 1e-6)
        return seconds

    tp_seconds = _worst_rank(tp_stage_seconds, schedule, pp, v)
    u = ulysses_size(cp, comm, cp_a2a)  # the ranks of one all-to-all (c with Ulysses alone)
    cp_seconds = _worst_rank(lambda S, st: cp_bytes_per_step(shape, micro_batch, seq, tp, cp, S, st, gas, act_bytes,
                                                            checkpointing, comm, cp_a2a),
                             schedule, pp, v) * (u - 1) / u / intra
    cp_seconds += _worst_rank(lambda S, st: cp_messages_per_step(shape, cp, S, st, gas, checkpointing, comm, cp_a2a),
                              schedule, pp, v) * cluster.latency_us * 1e-6
    cp_seconds += ring_seconds(shape, cluster, tp, pp, cp, micro_batch, gas, seq, act_bytes, checkpointing, comm,
                               cp_a2a, schedule, v)
    zero_group = dp * cp
    dp_bandwidth = cluster.intra_node_gbps if tp * pp * zero_group <= cluster.gpus_per_node else cluster.inter_node_gbps
    dp_bandwidth = cluster.dp_gbps or dp_bandwidth
    if zero == 3:
        traffic = zero3_step_traffic(shape, tp, zero_group, gas, act_bytes, zero3)
        # an all-gather of m elements a rank moves m·(n-1) to each rank, a reduce-scatter of M moves M·(n-1)/n
        moved = (traffic.gather_bytes * (zero_group - 1)
                 + traffic.reduce_scatter_bytes * (zero_group - 1) / zero_group)
        dp_seconds = moved / (dp_bandwidth * GB)
        dp_seconds += (traffic.gather_calls + gas) * cluster.latency_us * 1e-6 if zero_group > 1 else 0.0
    elif shape.is_moe:  # two groups: the dense tensors over the d·c ranks, the experts over d·c/e of them
        expert_group = zero_group // ep

        def moe_dp(stages: int, stage: int) -> float:
            dense, experts = expert_split(shape, tp, stages, stage, ep)
            return sum(group_dp_bytes(numel, n, zero, gas, precision, stages) * 2 * (n - 1) / n
                       for numel, n in ((dense, zero_group), (experts, expert_group)) if numel)

        dp_seconds = _worst_rank(moe_dp, schedule, pp, v) / (dp_bandwidth * GB)
    else:
        dp_seconds = _worst_rank(lambda S, st: dp_bytes_per_step(shape, tp, S, zero_group, st, zero, gas, precision),
                                schedule, pp, v) * 2 * (zero_group - 1) / zero_group / (dp_bandwidth * GB)
    # an EP group is e consecutive data ranks, t·c global ranks apart (parallel/layout.py): inside a node iff its
    # t·c·e ranks divide one
    ep_gbps = cluster.intra_node_gbps if cluster.gpus_per_node % (tp * cp * ep) == 0 else cluster.inter_node_gbps
    ep_seconds = _worst_rank(lambda S, st: ep_bytes_per_step(shape, micro_batch, seq // cp, ep, S, st, gas, act_bytes,
                                                            checkpointing), schedule, pp, v) * (ep - 1) / ep
    ep_seconds /= ep_gbps * GB
    pipe = pipe_seconds(shape, cluster, tp, pp, dp, micro_batch, gas, seq, act_bytes, pipe_partitioned,
                        grad_partitioned, sp, schedule, v)
    layers = _worst_rank(lambda S, st: stage_layer_count(shape, S, st), schedule, pp, v)
    per_layer = cluster.framework_s_per_layer + cluster.zero_hooks_s_per_layer[zero]
    stretch = max(1.0, cluster.gpus / cluster.shared_cores) if cluster.shared_cores else 1.0
    framework = gas * layers * per_layer * stretch * (4 / 3 if checkpointing else 1)
    bubble = (compute + framework) * shared_core_bubble(cluster.gpus, cluster.shared_cores,
                                                        pipeline_slots(schedule, pp, gas, v), gas)
    optimizer = optimizer_seconds(shape, cluster, tp, pp, zero_group, zero, precision, schedule, v, offload, gas, ep)
    return StepTime(compute, bubble, tp_seconds, dp_seconds, pipe, cp_seconds, optimizer, framework, ep_seconds)
