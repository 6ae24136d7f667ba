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

Pipeline (Narayanan et al. 2021, §3.2; DeepSpeed 0.19.8 `runtime/pipe/engine.py`, 1F1B `TrainSchedule`): per
micro-batch each stage boundary carries the (b, s, h) activation forward (`_exec_send_activations` ->
`_exec_recv_activations`) and its gradient backward (`_exec_send_grads` -> `_exec_recv_grads`), in the
activation dtype. With pipe/grad partitioning (`"pipeline": {"pipe_partitioned", "grad_partitioned"}`,
both true by default and active only when t > 1: `PipelineEngine.__init__` sets `is_pipe_partitioned =
is_model_parallel and ...`) each TP rank sends its 1/t slice plus a (t + 7)-element int64 meta tensor
(left out here), the scatter/gather of Narayanan et al. 2021, §4.1. The slices are re-assembled by an
all-gather over the TP group (`runtime/utils.py: PartitionedTensor.full`), the "pipeline all-gather":
  - the receiving stage gathers its input before its forward (`_exec_forward_pass`);
  - the sending stage gathers its own output back (it freed it after the send) before the backward
    (`_exec_backward_pass`; `_exec_recv_grads` when only activations are partitioned);
  - the sending stage gathers the gradient it received (`_exec_backward_pass`, grad_partitioned only).
So a stage with both neighbours logs 3 all-gathers of b·s·h/t per micro-batch, the first 2, the last 1:
as measured in benchmarks/results/2026-11-30-vm/rows.csv (S-TP2xPP2: `pp_gather` 262144 / 131072 bytes).
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
        forward += 3 * b * s * 4  # cross entropy (fp32): the max, then target logit and sum of exps in one
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


def pp_message_bytes(shape: LlamaShape, b: int, s: int, tp: int, act_bytes: int = 2,
                     partitioned: bool = True) -> int:
    """One activation or gradient message of one rank at a stage boundary: (b, s, h), or its 1/t slice
    (b·s·h/t elements, h is a multiple of t) when partitioned and t > 1."""
    elements = b * s * shape.hidden_size
    return (elements // tp if partitioned and tp > 1 else elements) * act_bytes


def _check_partitioning(pipe_partitioned: bool, grad_partitioned: bool) -> None:
    # hybrid3d's stages pass one tensor; for an unpartitioned output `_exec_recv_grads` posts one full-size
    # receive, while `_exec_send_grads` with grad_partitioned sends (meta, slice): the pair does not match.
    if grad_partitioned and not pipe_partitioned:
        raise ValueError("grad_partitioned without pipe_partitioned is not modelled (DeepSpeed 0.19.8 "
                         "partitions the gradients of partitioned activations only)")


def pipe_boundaries(pp: int, stage: int) -> int:
    """Neighbouring stages of `stage`: 0 without a pipeline, 1 for the first and last, else 2."""
    return (stage > 0) + (stage < pp - 1) if pp > 1 else 0


def pp_boundary_bytes(shape: LlamaShape, b: int, s: int, tp: int, act_bytes: int = 2,
                      pipe_partitioned: bool = True, grad_partitioned: bool = True) -> int:
    """Bytes one rank exchanges with one neighbouring stage per micro-batch: the activation one way and
    its gradient the other (one sent, one received)."""
    _check_partitioning(pipe_partitioned, grad_partitioned)
    return (pp_message_bytes(shape, b, s, tp, act_bytes, pipe_partitioned)
            + pp_message_bytes(shape, b, s, tp, act_bytes, grad_partitioned))


def pp_bytes_per_step(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int,
                      act_bytes: int = 2, pipe_partitioned: bool = True, grad_partitioned: bool = True) -> int:
    """Logged send + recv bytes of one rank per step (meta tensors left out): at each of the stage's
    boundaries, per micro-batch, the activation and its gradient, each 1/t of b·s·h when partitioned."""
    boundary = pp_boundary_bytes(shape, b, s, tp, act_bytes, pipe_partitioned, grad_partitioned)
    return gas * pipe_boundaries(pp, stage) * boundary


def pp_gather_bytes_per_step(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int,
                             act_bytes: int = 2, pipe_partitioned: bool = True,
                             grad_partitioned: bool = True) -> int:
    """Logged pipeline all-gather bytes (the input slice, b·s·h/t) of one TP rank of `stage` per step:
    the stage's input and its own output when activations are partitioned, the received gradient when
    gradients are (see the module docstring). 0 without a pipeline or without TP."""
    _check_partitioning(pipe_partitioned, grad_partitioned)
    if pp == 1 or tp == 1:
        return 0
    slice_bytes = pp_message_bytes(shape, b, s, tp, act_bytes)
    sender = stage < pp - 1
    gathers = pipe_boundaries(pp, stage) if pipe_partitioned else 0  # input (receiver), output (sender)
    gathers += 1 if grad_partitioned and sender else 0  # the gradient from the next stage
    return gas * gathers * slice_bytes
