"""Bytes each rank hands to collectives per training step, in the units DeepSpeed's comms logger
records (the message size passed to the op: an all-reduce's tensor, an all-gather's input).

Tensor parallelism (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §3): every decoder block does
4 all-reduces of b·s·h per micro-batch — attention and MLP each one in forward (g) and one in
backward (f). This model adds, per micro-batch: the vocab-parallel embedding's forward all-reduce of
b·s·h (first stage), the LM head's backward all-reduce of b·s·h and the cross entropy's three fp32
all-reduces of b·s (last stage), and, when t > kv heads, the backward all-reduce of the replicated
k/v weight gradients. Recomputation repeats the forward all-reduces.

Data parallelism (Rajbhandari et al. 2020, §7): a plain all-reduce of Ψ gradients moves 2Ψ per rank
(reduce-scatter + all-gather). DeepSpeed 0.19 logs: ZeRO-0 one all-reduce of Ψ; ZeRO-1 an all-reduce
of Ψ then an all-gather of the Ψ/Nd updated partition; ZeRO-2 an all-reduce of Ψ per micro-batch
(it reduces during every backward) plus the all-gather — it all-reduces where the paper reduce-scatters.
bf16 ZeRO-0 with a pipeline (BF16_Optimizer, master sharded over DP) also all-gathers.

Pipeline (Narayanan et al. 2021): each stage boundary carries b·s·h activations forward and their
gradients backward per micro-batch, split over the t ranks of a TP group (DeepSpeed's partitioned sends).
"""

from hybrid3d.model.config import LlamaShape
from hybrid3d.model.tp_plan import kv_heads_split
from hybrid3d.planning.memory import (
    TORCH,
    UNFUSED,
    aligned_numel,
    optimizer_wrapper,
    stage_layer_count,
    stage_parameter_numels,
)


def tp_bytes_per_step(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int,
                      act_bytes: int = 2, recompute: bool = False) -> int:
    """Logged all-reduce bytes of one TP rank of `stage` per step (0 when tp == 1)."""
    if tp == 1:
        return 0
    h = shape.hidden_size
    bsh = b * s * h * act_bytes
    layers = stage_layer_count(shape, pp, stage)
    forward = 2 * layers * bsh + (bsh if stage == 0 else 0)
    backward = 2 * layers * bsh
    if stage == pp - 1:
        backward += bsh  # LM head input gradient (f)
        forward += 3 * b * s * 4  # cross entropy: max, target logit, sum of exps (fp32)
    if not kv_heads_split(shape.num_kv_heads, tp):  # replicated k/v: their weight gradients are summed
        backward += layers * 2 * shape.num_kv_heads * shape.head_dim * h * act_bytes
    per_micro = forward * (2 if recompute else 1) + backward
    return gas * per_micro


def dp_bytes_per_step(shape: LlamaShape, tp: int, pp: int, dp: int, stage: int, zero: int, gas: int,
                      precision: str = "bf16") -> int:
    """Logged DP-collective bytes of one rank per step. Every wrapper that shards the fp32 master
    (all but the torch optimizer and FP16_UnfusedOptimizer, see `memory.optimizer_wrapper`) all-gathers
    the updated Ψ/Nd partition. DeepSpeed issues the gradient all-reduce also over a group of one
    rank (dp = 1), where it moves nothing; the all-gather it skips."""
    psi = sum(stage_parameter_numels(shape, tp, pp, stage))
    lp = 4 if precision == "fp32" else 2
    reduce = psi * lp * (gas if zero == 2 else 1)
    sharded = optimizer_wrapper(zero, precision, pp) not in (TORCH, UNFUSED)
    gather = aligned_numel(psi, dp) // dp * lp if sharded and dp > 1 else 0
    return reduce + gather


def pp_bytes_per_step(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int,
                      act_bytes: int = 2) -> int:
    """Logged send + recv bytes of one rank per step: activations out and gradients back at each of
    the stage's boundaries, 1/t of b·s·h per TP rank."""
    if pp == 1:
        return 0
    boundaries = (stage > 0) + (stage < pp - 1)
    return gas * boundaries * 2 * b * s * shape.hidden_size * act_bytes // tp
