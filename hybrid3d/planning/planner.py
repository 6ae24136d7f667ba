"""`python -m hybrid3d.plan`: rank (tp, pp, cp, dp, SP, ZeRO, checkpointing, micro-batch) layouts for a
model on a cluster, by the memory model (`hybrid3d.memory`) and a step-time estimate, context parallelism by
DeepSpeed-Ulysses; with --longest-sequence, the longest sequence each layout fits, context parallelism also by
ring attention (context_parallel_comm p2p, or a2a+p2p: Ulysses inside a ring), which lifts Ulysses' head limit.

Memory per GPU = peak model states (DeepSpeed's wrappers, incl. its reduce bucket; ZeRO over the d·c
ranks of DeepSpeed's data-parallel group, CP folded in) + activations of the worst pipeline rank (the
schedule's in-flight passes; `planning.activations`, with Megatron sequence parallelism (SP, Korthikanti
et al. 2022) and context parallelism (CP) by DeepSpeed-Ulysses (Jacobs et al. 2023), ring attention or both)
+ a fixed reserve (CUDA
context, NCCL, fragmentation). World = t·p·d·c; global batch = d·b·m sequences (the c ranks of a CP group share
each sequence, s/c tokens apiece).

Relative step time (lower is better), per GPU, for the same global batch: `step_time.estimate_step_time`
(its docstring has the formulas: compute / (t·p·c), the schedule's bubble, TP ring bus bytes by op, CP
all-to-alls and ring sends, DP over d·c, pipeline send/recv). The absolute numbers are rough; the ranking is what the
estimate is for.
Enumerated (`layouts.enumerate_layouts`): t | GPUs, p | GPUs/t and, with `context_parallel` (the command line's
default), c | GPUs/(t·p) with t·c <= GPUs per node (CP groups sit next to TP inside a node), where the
model splits (a % (t·c) == 0; the kv heads of a TP rank k_t and c divide one another; c | s, and
t·c | s with SP); with `sequence_parallel` SP is, for t > 1, an option of each layout like
checkpointing and the micro-batch.
Precision: ZeRO-0 plans bf16 (bf16 gradient accumulation); ZeRO-1/2 plan bf16 with fp32 gradient
accumulation (`data_types.grad_accum_dtype: fp32`), the project's default.
ZeRO-2 with p > 1 is `hybrid3d.pipeline_zero2`: a 4Ψ/Nd fp32 gradient partition instead of ZeRO-1's
full buffer, for m times the DP gradient bytes (`traffic.dp_bytes_per_step`), not overlapped.
Pipeline schedules (`schedules`, the command line's default; `schedule_options`): for p > 1 and ZeRO 0/1
each layout also tries interleaved 1F1B with v = 2 (2p | L, p | m: bubble (p-1)/(2m+p-1) for up to
1 + (p-1)/(2p) times the activations and 2x the messages) and DualPipeV (m >= 2p, L >= 2p: rank 0 holds
embedding and head); the table keeps the fastest fitting row of each schedule.

Longest sequence (`longest_sequence`, `--longest-sequence`): per layout (t, p, c, CP attention, SP, ZeRO,
checkpointing; micro-batch 1) the largest s that fits, a multiple of lcm(128, c·t with SP, else c)
(`sequence_unit`: 128-token steps that c, and with SP t, divide; 2c with a ring, whose 2c chunks must be whole),
up to the model's max_position_embeddings or `--max-seq-length`. Memory grows with s, so a binary search finds it.
Besides Ulysses (the rows `plan` has), each c > 1 also tries ring attention: "p2p", a ring over all c ranks (no
head limit, and it may cross nodes: its sends then take the inter-node link), and "a2a+p2p" with u the largest
divisor of c below c that Ulysses allows (a % (t·u), k_t and u dividing one another, t·u | GPUs per node;
`layouts.hybrid_a2a_size`). A ring rank keeps its kv heads unrepeated (`activations.cp_kv_heads`) and the
step time adds its sends (`step_time.ring_seconds`, an upper bound: not overlapped). On GPUs the trainer
runs a ring's masked blocks as explicit fp32 tiles, not a fused kernel (`parallel/attention_blocks.py`): the table
says so.

LoRA (`--lora-rank r`, `--lora-targets`; the shape's `lora_rank`, `lora_targets`): the memory model counts the
frozen base in bf16 and the adapters as the trained parameters (`memory.lora_model_states`); ZeRO-2 with p > 1
(pipeline_zero2) is not offered, as the trainer refuses it with LoRA (`config.support.check_lora`), nor is LoRA
on a mixture-of-experts model. The step-time estimate stays full fine-tuning's (6N FLOPs per token, DP traffic
of every parameter): LoRA skips the base's weight-gradient GEMMs (about 4N) and reduces only the adapters'
gradients, which `step_time`/`traffic` do not model yet, so the rel.time of LoRA rows over-weights DP.
"""

from dataclasses import dataclass
from typing import Callable, Optional

from hybrid3d.model.config import LlamaShape
from hybrid3d.planning.activations import uses_ring
from hybrid3d.planning.checkpoint_copy import async_copy_bytes
from hybrid3d.planning.hints import gb
from hybrid3d.planning.layouts import (  # noqa: F401 (re-exported: the planner's public names)
    Candidate,
    cp_label,
    divisors,
    enumerate_layouts,
    expert_parallel_options,
    layout_refusal,
    sequence_unit,
)
from hybrid3d.planning.lora_plan import lora_line, lora_targets, non_negative_int, with_lora  # noqa: F401
from hybrid3d.planning.memory import DEFAULT_REDUCE_BUCKET, GB, worst_rank_bytes
from hybrid3d.planning.offload_plan import NO_OFFLOAD, offload_options, worst_rank_placed, zero3_allowed
from hybrid3d.planning.zero3_fetch import Zero3Knobs
from hybrid3d.planning.plan_format import format_longest, format_plan  # noqa: F401 (the command line prints them)
from hybrid3d.planning.step_time import Cluster, StepTime, bubble_fraction, estimate_step_time, pipe_seconds  # noqa

SCHEDULE_LABELS = {"1f1b": "1f1b", "interleaved": "int-v{v}", "dualpipev": "dpv"}  # the table's `sched` column


@dataclass(frozen=True)
class Choice:
    tp: int
    pp: int
    dp: int
    zero: int
    checkpointing: bool
    micro_batch: int
    gas: int
    states_gb: float
    activations_gb: float
    memory_gb: float
    step_seconds: float
    bubble: float
    pipe_seconds: float  # pipeline send/recv and all-gathers within step_seconds
    sp: bool = False  # Megatron sequence parallelism over the TP group
    cp: int = 1  # context-parallel degree (world = tp·pp·cp·dp)
    schedule: str = "1f1b"  # hybrid3d.pipeline_schedule
    virtual: int = 1  # hybrid3d.virtual_pipeline_size: v chunks per rank when interleaved
    comm: str = "a2a"  # hybrid3d.context_parallel_comm: "a2a" Ulysses, "p2p" ring attention, "a2a+p2p" both
    cp_a2a: int = 1  # hybrid3d.context_parallel_a2a_size: the Ulysses ranks inside each ring member with "a2a+p2p"
    offload: str = NO_OFFLOAD  # zero3_memory.OFFLOAD_CHOICES: what DeepSpeed keeps in host memory
    host_gb: float = 0.0  # host memory per GPU for the offloaded states
    run_precision: Optional[str] = None  # a run's own precision (memory.PRECISIONS); None: the planner's convention
    ep: int = 1  # hybrid3d.expert_parallel_size: ranks of the data-parallel group a MoE block's experts spread over

    @property
    def precision(self) -> str:
        return self.run_precision or planned_precision(self.zero, self.offload)

    @property
    def ring(self) -> bool:
        return uses_ring(self.cp, self.comm)

    @property
    def cp_label(self) -> str:
        return cp_label(self.cp, self.comm, self.cp_a2a)

    @property
    def schedule_label(self) -> str:
        return "-" if self.pp == 1 else SCHEDULE_LABELS[self.schedule].format(v=self.virtual)


def planned_precision(zero: int, offload: str = NO_OFFLOAD) -> str:
    """bf16 gradient accumulation at ZeRO-0 and with offload (offload_plan's docstring), else fp32."""
    return "bf16" if zero == 0 or offload != NO_OFFLOAD else "bf16+fp32acc"


def _worst_rank(shape: LlamaShape, tp: int, pp: int, dp: int, zero: int, checkpointing: bool, micro_batch: int,
                seq: int, gas: int, bucket: int, sp: bool, cp: int, schedule: str = "1f1b", v: int = 1,
                comm: str = "a2a", cp_a2a: int = 1, offload: str = NO_OFFLOAD,
                precision: Optional[str] = None, zero3: Zero3Knobs = Zero3Knobs(),
                ep: int = 1) -> tuple[float, float, float]:
    """(device model states, activations, host bytes) of the worst rank at `precision` (None: the planned one), ZeRO
    over the d·c ranks: `worst_rank_bytes` (ZeRO-2 with p > 1 pipeline_zero2; E/`ep` experts per MoE block), or for
    ZeRO-3 and offload `offload_plan.worst_rank_placed`."""
    precision = precision or planned_precision(zero, offload)
    if zero == 3 or offload != NO_OFFLOAD:
        return worst_rank_placed(shape, tp, pp, dp * cp, zero, precision, offload, checkpointing, micro_batch, seq,
                                 gas, bucket, sp, cp, schedule, v, comm, cp_a2a, zero3)
    return (*worst_rank_bytes(shape, tp, pp, dp * cp, zero, precision, checkpointing, micro_batch, seq, gas, bucket,
                              sp, cp, zero == 2 and pp > 1, schedule, v, comm, cp_a2a, ep), 0.0)


def schedule_options(shape: LlamaShape, pp: int, gas: int, zero: int, others: bool = True) -> list[tuple[str, int]]:
    """(schedule, v) the config accepts for p = pp, m = gas: 1F1B; with `others`, p > 1 and ZeRO < 2
    (pipeline_zero2 runs 1F1B only) interleaved with v = 2 when 2p divides L and p divides m, DualPipeV when
    m >= 2p and L >= 2p."""
    options = [("1f1b", 1)]
    if others and pp > 1 and zero < 2:
        options += [("interleaved", 2)] if shape.num_layers % (2 * pp) == 0 and gas % pp == 0 else []
        options += [("dualpipev", 1)] if gas >= 2 * pp and shape.num_layers >= 2 * pp else []
    return options


def evaluate(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, zero: int, checkpointing: bool,
             micro_batch: int, seq: int, global_batch: int, bucket: int, sp: bool = False, cp: int = 1,
             schedule: str = "1f1b", virtual: int = 1, comm: str = "a2a", cp_a2a: int = 1,
             offload: str = NO_OFFLOAD, precision: Optional[str] = None, async_checkpoint: bool = False,
             zero3: Zero3Knobs = Zero3Knobs(), ep: int = 1) -> Choice:
    """One option's memory and step time; `precision`: a run's own (None: `planned_precision`); `ep`: expert
    parallelism of a mixture of experts;
    `async_checkpoint`: the host copy of an asynchronous save counts in `host_gb` (planning/checkpoint_copy.py);
    `zero3`: DeepSpeed's stage3_* knobs a ZeRO-3 row runs with (planning/zero3_fetch.py)."""
    dp = cluster.gpus // (tp * pp * cp)
    gas = global_batch // (dp * micro_batch)
    run_precision, precision = precision, precision or planned_precision(zero, offload)
    states, acts, host = _worst_rank(shape, tp, pp, dp, zero, checkpointing, micro_batch, seq, gas, bucket, sp, cp,
                                     schedule, virtual, comm, cp_a2a, offload, precision, zero3, ep)
    step = estimate_step_time(shape, cluster, tp, pp, dp, zero, micro_batch, gas, seq, precision, checkpointing,
                              sequence_parallel=sp, cp=cp, schedule=schedule, virtual=virtual, comm=comm,
                              cp_a2a=cp_a2a, offload=offload, zero3=zero3, ep=ep)
    memory = states + acts + cluster.reserve_gb * GB
    if async_checkpoint:
        host += async_copy_bytes(shape, tp, pp, dp * cp, zero, precision, schedule, virtual)
    return Choice(tp, pp, dp, zero, checkpointing, micro_batch, gas, states / GB, acts / GB, memory / GB,
                  step.seconds, bubble_fraction(schedule, pp, gas, virtual), step.pipe, sp, cp, schedule, virtual,
                  comm, cp_a2a, offload, host / GB, run_precision, ep)


def _zero_stages(shape: LlamaShape, pp: int, dp: int) -> tuple:
    # ZeRO-2 with pp > 1: pipeline_zero2, which LoRA does not run with (config.support.check_lora); ZeRO-3: no
    # pipeline (offload_plan.zero3_allowed)
    stages = (0, 1, 2) if pp == 1 or (dp > 1 and not shape.lora_rank) else (0, 1)
    return stages + ((3,) if zero3_allowed(shape, pp) else ())


def layout_rows(shape: LlamaShape, tp: int, pp: int, cp: int, dp: int,
                untested_experts: bool = False) -> list[tuple]:
    """(ep, ZeRO stage) of the row groups of a layout: each `_zero_stages` stage; for a mixture of experts no
    pipeline_zero2 (`config.support.check_moe_options`)
    and each further `expert_parallel_options` e > 1 as `config.ds_checks.check_expert_parallel` allows it: ZeRO-1,
    or ZeRO-2 without a pipeline. `untested_experts`: every e the arithmetic allows, as a question of memory only."""
    stages = [z for z in _zero_stages(shape, pp, dp * cp) if not (shape.is_moe and z == 2 and pp > 1)]
    return [(ep, zero) for ep in expert_parallel_options(shape, tp, pp, cp, dp, untested_experts)
            for zero in stages if ep == 1 or zero in (1, 2)]


def host_fits(choice: Choice, cluster: Cluster) -> bool:
    """The offloaded states of a node's GPUs fit its host memory (`Cluster.host_memory_gb`; None: not checked)."""
    if cluster.host_memory_gb is None:
        return True
    return choice.host_gb * min(cluster.gpus, cluster.gpus_per_node) <= cluster.host_memory_gb


def _too_big(name: str, least: Choice, cluster: Cluster, what: str) -> str:
    return (f"{name}: needs >= {gb(least.memory_gb)} GB per GPU ({gb(least.states_gb)} model states + "
            f"{gb(least.activations_gb)} activations + {cluster.reserve_gb:g} reserve {what}) > "
            f"{cluster.gpu_memory_gb:g} GB")


def plan(shape: LlamaShape, cluster: Cluster, seq: int, global_batch: int, bucket: int = DEFAULT_REDUCE_BUCKET,
         sequence_parallel: bool = False, context_parallel: bool = False,
         schedules: bool = False, least: Optional[list] = None, precision: Optional[str] = None,
         accept: Optional[Callable[[Choice], bool]] = None, offload: bool = True,
         async_checkpoint: bool = False, zero3: Zero3Knobs = Zero3Knobs(),
         untested_experts: bool = False) -> tuple[list[Choice], list[str]]:
    """(feasible choices best first: per (tp, pp, cp, zero[, schedule]) the fastest that fits; one refusal line
    per (tp, pp, cp[, zero]) that has no feasible option). `sequence_parallel`: also try SP for t > 1;
    `context_parallel`: also enumerate c > 1; `schedules`: also the interleaved and DualPipeV schedules
    (`schedule_options`) for p > 1 (the command line does all three; off by default, so a plain call plans
    the 1F1B 3D layouts it always did). `least`: receives the least-memory option refused for memory.
    A run's "auto" (`planning.auto_layout`): `precision`, its own for every row (None: `planned_precision`);
    `accept`, the options its given keys allow (the others are neither rows nor refusals); `offload`, False where
    offload cannot help (the CPU). `async_checkpoint`: asynchronous saves' host copy counts as host memory.
    `zero3`: the stage3_* knobs of the ZeRO-3 rows (DeepSpeed's defaults unless given). `untested_experts`: a mixture
    of experts also at the (t, p, e) the support table does not run yet (`layout_rows`): what its memory would be,
    not a layout a run accepts."""
    feasible, refused = [], []
    for tp, pp, cp, dp, _, _, name, reason in enumerate_layouts(shape, cluster, global_batch, context_parallel,
                                                                untested_experts=untested_experts):
        if reason is None and seq % cp:
            reason = f"seq {seq} is not divisible by cp={cp}"
        if reason:
            refused.append(f"{name}: {reason}")
            continue
        moe = shape.is_moe  # no SP or pipeline_zero2 with experts (config.support.check_moe_options)
        sps = (False, True) if sequence_parallel and tp > 1 and seq % (cp * tp) == 0 and not moe else (False,)
        for ep, zero in layout_rows(shape, tp, pp, cp, dp, untested_experts):
            offloads = offload_options(shape, pp, zero) if offload and ep == 1 else (NO_OFFLOAD,)
            options = [evaluate(shape, cluster, tp, pp, zero, ckpt, mb, seq, global_batch, bucket, sp, cp, *sched,
                                offload=kind, precision=precision, async_checkpoint=async_checkpoint, zero3=zero3,
                                ep=ep)
                       for sp in sps for ckpt in (False, True) for mb in divisors(global_batch // dp) if mb <= 16
                       for sched in schedule_options(shape, pp, global_batch // (dp * mb), zero, schedules)
                       for kind in offloads]
            options = [c for c in options if accept is None or accept(c)]
            if not options:
                continue
            fits = [c for c in options if c.memory_gb <= cluster.gpu_memory_gb and host_fits(c, cluster)]
            for kind in dict.fromkeys((c.schedule, c.offload) for c in fits):  # the fastest row of each
                feasible.append(min((c for c in fits if (c.schedule, c.offload) == kind),
                                    key=lambda c: (c.step_seconds, c.checkpointing, c.sp, -c.micro_batch)))
            if not fits:
                smallest = min(options, key=lambda c: c.memory_gb)
                how = f"at micro-batch {smallest.micro_batch}, checkpointing" + (", SP" if smallest.sp else "")
                experts = f" EP{ep}" if ep > 1 else ""
                refused.append(_too_big(f"{name}{experts} ZeRO-{zero}", smallest, cluster, how))
                if least is not None and (not least or smallest.memory_gb < least[0].memory_gb):
                    least[:] = [smallest]
    feasible.sort(key=lambda c: c.step_seconds)
    return feasible, refused


def _largest_fit(fits, unit: int, cap: int) -> int:
    """The largest multiple of `unit` <= cap for which fits(seq) holds, 0 if none (fits is monotone in seq)."""
    lo, hi = 0, cap // unit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * unit) else (lo, mid - 1)
    return lo * unit


def _longest_rows(shape: LlamaShape, cluster: Cluster, layout: Candidate, global_batch: int, cap: int, bucket: int,
                  schedules: bool) -> tuple[list[tuple[Choice, int]], Optional[str]]:
    """([(choice, longest seq)] of one layout's (SP, ZeRO, checkpointing[, schedule]) options at micro-batch 1 that fit
    some sequence; the refusal line when none does)."""
    tp, pp, cp, dp, comm, a2a = layout[:6]
    gas, rows, least = global_batch // dp, [], None  # least: the option needing the least memory
    for sp, zero, ckpt, sched in [(sp, z, ck, sched) for sp in ((False, True) if tp > 1 else (False,))
                                  for z in _zero_stages(shape, pp, dp * cp) for ck in (False, True)
                                  for sched in schedule_options(shape, pp, gas, z, schedules)]:
        unit = sequence_unit(tp, cp, sp, uses_ring(cp, comm))

        def fits(seq: int) -> bool:
            memory = sum(_worst_rank(shape, tp, pp, dp, zero, ckpt, 1, seq, gas, bucket, sp, cp, *sched, comm,
                                     a2a)[:2])
            return (memory + cluster.reserve_gb * GB) / GB <= cluster.gpu_memory_gb

        def choice(seq: int) -> Choice:
            return evaluate(shape, cluster, tp, pp, zero, ckpt, 1, seq, global_batch, bucket, sp, cp, *sched, comm, a2a)

        seq = _largest_fit(fits, unit, cap)
        if seq:
            rows.append((choice(seq), seq))
        elif unit <= cap:
            c = choice(unit)
            least = (c, unit) if least is None or c.memory_gb < least[0].memory_gb else least
    if rows:
        return rows, None
    unit = sequence_unit(tp, cp, False, uses_ring(cp, comm))
    return [], (_too_big(layout.name, least[0], cluster, f"for {least[1]} tokens at micro-batch 1") if least
                else f"{layout.name}: no {unit}-token step fits under {cap}")


def longest_sequence(shape: LlamaShape, cluster: Cluster, global_batch: int, max_seq: Optional[int] = None,
                     bucket: int = DEFAULT_REDUCE_BUCKET, schedules: bool = False,
                     rings: bool = True) -> tuple[list[tuple[Choice, int]], list[str]]:
    """([(choice, longest seq)] of every (tp, pp, cp, CP attention, SP, ZeRO, checkpointing[, schedule]) layout at
    micro-batch 1 that fits some sequence, longest first then fastest; refusal lines). seq is the largest multiple of
    `sequence_unit` <= max_seq (default: max_position_embeddings) whose peak memory fits the GPU.
    `schedules`: as for `plan`; `rings`: also ring attention, "p2p" and "a2a+p2p" (`layouts.ring_options`), at each
    c > 1 (False: Ulysses only, as `plan`)."""
    cap = max_seq or shape.max_position_embeddings
    rows, refused = [], []
    for layout in enumerate_layouts(shape, cluster, global_batch, rings=rings):
        if layout.reason:
            refused.append(f"{layout.name}: {layout.reason}")
            continue
        found, reason = _longest_rows(shape, cluster, layout, global_batch, cap, bucket, schedules)
        rows += found
        refused += [reason] if reason else []
    rows.sort(key=lambda r: (-r[1], r[0].step_seconds))
    return rows, refused
