"""Bytes each rank hands to collectives per training step, in the units DeepSpeed's comms logger
records (the message size passed to the op: an all-reduce's tensor, an all-gather's input).

Tensor parallelism (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §3): every decoder block does
4 all-reduces of b·s·h per micro-batch — attention and MLP each one in forward (g) and one in
backward (f). This model adds, per micro-batch: the vocab-parallel embedding's forward all-reduce of
b·s·h (first stage), the LM head's backward all-reduce of b·s·h and the cross entropy's three fp32
all-reduces of b·s (last stage), and, when t > kv heads, the backward all-reduce of the replicated
k/v weight gradients. Recomputation repeats the forward all-reduces.

Sequence parallelism (SP, Korthikanti et al. 2022, §4.2.2) replaces each all-reduce pair by its halves
over the sequence. Let x = b·(s/c)·h·(bytes per element), one rank's sequence chunk, whole hidden. Logged
per micro-batch on a TP rank (all_gather_into_tensor logs its input shard x/t, reduce_scatter_tensor
its full input x): each decoder block forward 2 all-gathers of x/t (before q/k/v and gate/up) + 2
reduce-scatters of x (after o_proj and down_proj); backward 4 all-gathers of x/t (the 2 saved shards
re-gathered for the weight gradients, the 2 row-parallel outputs' gradients) + 2 reduce-scatters of x
(the input gradients of q/k/v and gate/up) + 2 all-reduces of h (the RMSNorm weight gradients: the
weights are replicated over TP but each rank saw only its shard). Embedding (first stage): forward
reduce-scatter x, backward all-gather x/t. Last stage: the head all-gathers x/t forward and backward
and reduce-scatters x backward, the final norm's weight gradient is all-reduced, the cross entropy is
unchanged (3 fp32 all-reduces of b·s/c). Recomputation repeats the blocks' 2 all-gathers + 2
reduce-scatters. In ring bus bytes (`tp_bus_bytes`) SP's forward reduce-scatter + all-gather equal
TP's all-reduce; the backward re-gathers, 2 all-gathers of x/t per block, are the only extra.

Context parallelism (CP, DeepSpeed-Ulysses, Jacobs et al. 2023, §3; `deepspeed.sequence.layer.
DistributedAttention`, all_to_all_single over the c ranks of a CP group): per decoder block and
micro-batch, forward 4 all-to-alls — q (b·(s/c)·(a/t)·d_h), k and v (b·(s/c)·k_c·d_h each, k_c the kv
heads after repetition, `activations.cp_kv_heads`) and the attention output (as q) — and the same 4
backward; recomputation repeats the forward ones (`cp_bytes_per_step`). The loss adds one all-reduce of
2 fp32 per micro-batch (`cp_loss_bytes_per_step`). Without SP the TP all-reduces
above are over b·(s/c)·h. Ring attention (`context_parallel_comm` "p2p") replaces the all-to-alls by the ring's
point-to-point sends (`ring_bytes_per_layer`); with "a2a+p2p" the all-to-alls span the u ranks of a Ulysses
group (k_c the kv heads Ulysses over u needs, `activations.cp_kv_heads`) and the ring the c/u others.

Expert parallelism (GShard, Lepikhin et al. 2021, §2.2; DeepSpeed-MoE, Rajbhandari et al. 2022, §5;
`parallel/expert_parallel.py`, all_to_all_single over the e ranks of an EP group, logged at its input): per
MoE block and micro-batch, forward the per-expert counts (E int64) and 2 all-to-alls of token rows —
dispatch of the rank's n·k assignments (n = b·s tokens, k experts each, h wide) and combine of the r rows its
experts processed — and backward the same 2 with the roles swapped (r rows, then n·k). r depends on routing;
over an EP group Σ r = Σ n·k, so the group's mean rank logs 4·n·k·h elements a block (`ep_bytes_per_step`).
With TP each TP rank exchanges all n tokens with the ranks of its TP index. Of what is logged, a share
(e-1)/e leaves the rank when routing is even; the rest is the rank's own experts' rows. Recomputation
repeats the forward ones.

Data parallelism (Rajbhandari et al. 2020, §7): a plain all-reduce of Ψ gradients moves 2Ψ per rank
(reduce-scatter + all-gather). DeepSpeed 0.19 logs: ZeRO-0 one all-reduce of Ψ; ZeRO-1 an all-reduce
of Ψ then an all-gather of the Ψ/Nd updated partition; ZeRO-2 an all-reduce of Ψ per micro-batch
(it reduces during every backward) plus the all-gather — it all-reduces where the paper reduce-scatters.
bf16 ZeRO-0 with a pipeline (BF16_Optimizer, master sharded over DP) also all-gathers. With CP the
group is DeepSpeed's data-parallel group of d·c ranks (CP folded into it, `parallel/layout.py`): callers pass dp = d·c.

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
With SP hybrid3d turns both partitionings off (`"pipeline": {"pipe_partitioned": false, "grad_partitioned":
false}`): each TP rank already holds a (b, s/t, h) sequence shard and sends just that, b·s·h/t elements,
with no pipeline all-gather.
"""

from hybrid3d.model.config import LlamaShape
from hybrid3d.model.moe import expert_capacity
from hybrid3d.model.tp_plan import kv_heads_split
from hybrid3d.planning.activations import cp_kv_heads, sequence_chunk, stage_layer_count, ulysses_size
from hybrid3d.planning.memory import TORCH, UNFUSED, aligned_numel, optimizer_wrapper, stage_parameter_numels

TP_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def tp_messages(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int, act_bytes: int = 2,
                recompute: bool = False, sequence_parallel: bool = False, cp: int = 1) -> list[tuple[str, int, int]]:
    """The TP collectives one TP rank of `stage` logs per step, as (op of TP_OPS, how many, bytes each); none when
    tp == 1: the all-reduces of plain TP, or SP's all-gathers (input shard x/t), reduce-scatters (input x) and
    RMSNorm weight-gradient all-reduces (module docstring), x = b·(s/c)·h·act_bytes."""
    s_c = sequence_chunk(s, tp, sequence_parallel, cp)
    if tp == 1:
        return []
    h, d = shape.hidden_size, shape.head_dim
    x = b * s_c * h * act_bytes
    layers = stage_layer_count(shape, pp, stage)
    first, last = int(stage == 0), int(stage == pp - 1)
    # fp32 cross entropy: the max, then the target logit and the sum of exps in one message, per chunk of
    # loss_chunk_tokens of the b·s/c tokens (`tensor_parallel.chunked_vocab_parallel_loss`; 0: one chunk)
    tokens = b * s_c
    chunk = shape.loss_chunk_tokens or tokens
    messages = []
    for count, rows in ((tokens // chunk, chunk), (1 if tokens % chunk else 0, tokens % chunk)):
        messages += [("all_reduce", gas * last * count, rows * 4), ("all_reduce", gas * last * count, 2 * rows * 4)]
    if not kv_heads_split(shape.num_kv_heads, tp):  # replicated k/v (and biases): their gradients are summed over TP
        messages.append(("all_reduce", gas * layers, 2 * shape.num_kv_heads * d * (h + shape.qkv_bias) * act_bytes))
    if shape.qk_norm:  # Qwen3's q/k norm weights: each rank's gradient covers its heads, summed over TP
        messages.append(("all_reduce", gas * layers, 2 * d * act_bytes))
    if not sequence_parallel:
        forward = (2 * layers + first) * (2 if recompute else 1)
        backward = 2 * layers + last  # last: the LM head's input gradient (f)
        return messages + [("all_reduce", gas * (forward + backward), x)]
    shard = b * (s_c // tp) * h * act_bytes
    repeat = 2 if recompute else 0  # the blocks' forward all-gathers and reduce-scatters, again
    gathers = layers * (2 + 4 + repeat) + first + 2 * last
    scatters = layers * (2 + 2 + repeat) + first + last
    norms = 2 * layers + last  # RMSNorm weight gradients
    return messages + [("all_gather_into_tensor", gas * gathers, shard), ("reduce_scatter_tensor", gas * scatters, x),
                       ("all_reduce", gas * norms, h * act_bytes)]


def tp_bytes_by_op(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int, act_bytes: int = 2,
                   recompute: bool = False, sequence_parallel: bool = False, cp: int = 1) -> dict:
    """Logged TP-collective bytes of one TP rank of `stage` per step, by op (TP_OPS; all 0 when tp == 1):
    `tp_messages` summed."""
    ops = dict.fromkeys(TP_OPS, 0)
    for op, count, size in tp_messages(shape, b, s, tp, pp, stage, gas, act_bytes, recompute, sequence_parallel, cp):
        ops[op] += count * size
    return ops


def tp_bytes_per_step(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int,
                      act_bytes: int = 2, recompute: bool = False, sequence_parallel: bool = False,
                      cp: int = 1) -> int:
    """Logged TP-collective bytes of one TP rank of `stage` per step (0 when tp == 1): `tp_bytes_by_op` summed."""
    return sum(tp_bytes_by_op(shape, b, s, tp, pp, stage, gas, act_bytes, recompute, sequence_parallel, cp).values())


def tp_bus_bytes(by_op: dict, t: int) -> float:
    """Ring bus bytes per rank of logged bytes `by_op` over t ranks: an all-reduce of n moves 2n(t-1)/t, a
    reduce-scatter of input n moves n(t-1)/t, an all-gather of input shard m moves m(t-1) (`utils/
    comms_logging.py: calc_bw_log`). So SP's reduce-scatter of x + all-gather of x/t move 2x(t-1)/t, an
    all-reduce of x: SP's forward costs TP's, its backward re-gathers (2 all-gathers of x/t a block) are extra."""
    return (2 * by_op.get("all_reduce", 0) * (t - 1) / t + by_op.get("reduce_scatter_tensor", 0) * (t - 1) / t
            + by_op.get("all_gather_into_tensor", 0) * (t - 1))


def cp_bytes_per_step(shape: LlamaShape, b: int, s: int, tp: int, cp: int, pp: int, stage: int, gas: int,
                      act_bytes: int = 2, recompute: bool = False, comm: str = "a2a", a2a: int = 1) -> int:
    """Logged all_to_all_single bytes of one rank of `stage` per step (0 without Ulysses: cp == 1 or `comm`
    "p2p"): per block and micro-batch 4 forward (q, k, v, output) + 4 backward (+ 4 recomputed), q and output
    b·(s/c)·(a/t)·d_h, k and v b·(s/c)·k_c·d_h elements each (module docstring), over all c ranks or, with
    "a2a+p2p", the `a2a` ranks of a Ulysses group."""
    if ulysses_size(cp, comm, a2a) == 1:
        return 0
    s_c, d = sequence_chunk(s, tp, False, cp), shape.head_dim
    q = b * s_c * (shape.num_heads // tp) * d
    kv = b * s_c * cp_kv_heads(shape, tp, cp, comm, a2a) * d
    passes = 3 if recompute else 2
    return gas * stage_layer_count(shape, pp, stage) * passes * (2 * q + 2 * kv) * act_bytes


def cp_messages_per_step(shape: LlamaShape, cp: int, pp: int, stage: int, gas: int, recompute: bool = False,
                         comm: str = "a2a", a2a: int = 1) -> int:
    """The all-to-alls of `cp_bytes_per_step`: per block and micro-batch 4 forward + 4 backward (+ 4 recomputed)."""
    if ulysses_size(cp, comm, a2a) == 1:
        return 0
    return gas * stage_layer_count(shape, pp, stage) * (3 if recompute else 2) * 4


def ring_bytes_per_layer(shape: LlamaShape, b: int, s: int, tp: int, cp: int, a2a: int = 1, act_bytes: int = 2,
                         recompute: bool = False) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends around its ring per decoder layer and micro-batch
    (`parallel/ring_attention.py`; ring of c_r = cp/a2a members, each holding m = a2a·s/cp positions after
    Ulysses' exchange): forward passes its K/V block, 2·b·m·g·d elements with g the kv heads it attends with, on
    c_r - 1 times (2·(c_r - 1)/c_r of the sequence's K/V); backward passes K/V with their fp32 gradients c_r - 1
    times and the gradients home once; recomputation (activation checkpointing) repeats the forward."""
    ring = cp // a2a
    if ring == 1:
        return 0, 0
    g = cp_kv_heads(shape, tp, a2a) // a2a  # kv heads a rank attends with, after Ulysses' exchange if any
    block = 2 * b * (a2a * s // cp) * g * shape.head_dim  # K and V elements
    forward = (ring - 1) * block * act_bytes
    backward = (ring - 1) * block * (act_bytes + 4) + block * 4
    return forward * (2 if recompute else 1), backward


def cp_loss_bytes_per_step(cp: int, gas: int) -> int:
    """Logged all_reduce bytes of the loss over the CP group per step: the (sum, count) pair in fp32, once
    per micro-batch (`parallel.context_parallel.sequence_mean`); 0 when cp == 1."""
    return 2 * 4 * gas if cp > 1 else 0


def ep_bytes_per_step(shape: LlamaShape, b: int, s: int, ep: int, pp: int, stage: int, gas: int,
                      act_bytes: int = 2, recompute: bool = False) -> int:
    """Logged all_to_all_single bytes of the mean rank of an EP group at `stage` per step (0 when e == 1 or the
    model has no experts): per MoE block of the stage (its dense blocks exchange nothing) and micro-batch the counts (8·E bytes) and 2 row exchanges of
    n·k·h forward, 2 backward, the forward ones again with recomputation (module docstring), n = b·s.
    With an expert capacity c the rows are at most E·ceil(c·n·k/E) (`moe.capacity_keep`): an upper bound,
    reached when every expert fills its capacity."""
    if ep == 1 or not shape.is_moe:
        return 0
    assignments = b * s * shape.experts_per_token  # n·k
    if shape.expert_capacity_factor is not None:
        per_expert = expert_capacity(assignments, shape.num_experts, shape.expert_capacity_factor)
        assignments = min(assignments, shape.num_experts * per_expert)
    rows = assignments * shape.hidden_size * act_bytes  # rows of h
    forward = 8 * shape.num_experts + 2 * rows
    backward = 2 * rows
    return gas * stage_layer_count(shape, pp, stage, moe_only=True) * (forward * (2 if recompute else 1) + backward)


def dp_bytes_per_step(shape: LlamaShape, tp: int, pp: int, dp: int, stage: int, zero: int, gas: int,
                      precision: str = "bf16") -> int:
    """Logged DP-collective bytes of one rank per step. dp is the group ZeRO and the gradient reduction
    span: d, or d·c with CP (DeepSpeed's data-parallel group, CP folded in; callers pass dp = d·c). Every
    wrapper that shards the fp32 master (all but the torch optimizer and FP16_UnfusedOptimizer, see
    `memory.optimizer_wrapper`) all-gathers the updated Ψ/Nd partition. With `grad_accum_dtype` fp32
    (precision "bf16+fp32acc") the gradients are still reduced in bf16, DeepSpeed's communication dtype
    (measured: tests/distributed/test_sequence_parallel.py). DeepSpeed issues the gradient
    all-reduce also over a group of one rank (dp = 1), where it moves nothing; the all-gather it skips."""
    return group_dp_bytes(sum(stage_parameter_numels(shape, tp, pp, stage)), dp, zero, gas, precision, pp)


def group_dp_bytes(psi: int, dp: int, zero: int, gas: int, precision: str, pp: int) -> int:
    """`dp_bytes_per_step` of one parameter group of psi elements reduced over dp ranks (a mixture-of-experts
    rank reduces its dense tensors over d·c ranks and its experts over the d·c/e of their expert-data-parallel
    group)."""
    lp = 4 if precision == "fp32" else 2
    reduce = psi * lp * (gas if zero == 2 else 1)
    sharded = optimizer_wrapper(zero, precision, pp) not in (TORCH, UNFUSED)
    gather = aligned_numel(psi, dp) // dp * lp if sharded and dp > 1 else 0
    return reduce + gather


def pp_message_bytes(shape: LlamaShape, b: int, s: int, tp: int, act_bytes: int = 2,
                     partitioned: bool = True, sequence_parallel: bool = False) -> int:
    """One activation or gradient message of one rank at a stage boundary: (b, s, h), or its 1/t slice
    (b·s·h/t elements, h is a multiple of t) when partitioned and t > 1, or with SP the rank's (b, s/t, h)
    sequence shard (b·s·h/t elements; `partitioned` is then off and ignored)."""
    if sequence_parallel:
        return b * (sequence_chunk(s, tp, True) // tp) * shape.hidden_size * act_bytes
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
                      pipe_partitioned: bool = True, grad_partitioned: bool = True,
                      sequence_parallel: bool = False) -> int:
    """Bytes one rank exchanges with one neighbouring stage per micro-batch: the activation one way and
    its gradient the other (one sent, one received); with SP two (b, s/t, h) shards."""
    if sequence_parallel:
        return 2 * pp_message_bytes(shape, b, s, tp, act_bytes, sequence_parallel=True)
    _check_partitioning(pipe_partitioned, grad_partitioned)
    return (pp_message_bytes(shape, b, s, tp, act_bytes, pipe_partitioned)
            + pp_message_bytes(shape, b, s, tp, act_bytes, grad_partitioned))


def pp_bytes_per_step(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int,
                      act_bytes: int = 2, pipe_partitioned: bool = True, grad_partitioned: bool = True,
                      sequence_parallel: bool = False) -> int:
    """Logged send + recv bytes of one rank per step (meta tensors left out): at each of the stage's
    boundaries, per micro-batch, the activation and its gradient, each 1/t of b·s·h when partitioned or SP."""
    boundary = pp_boundary_bytes(shape, b, s, tp, act_bytes, pipe_partitioned, grad_partitioned, sequence_parallel)
    return gas * pipe_boundaries(pp, stage) * boundary


def pp_gathers_per_micro_batch(tp: int, pp: int, stage: int, pipe_partitioned: bool = True,
                                grad_partitioned: bool = True, sequence_parallel: bool = False) -> int:
    """Pipeline all-gathers one TP rank of `stage` runs per micro-batch: the stage's input and its own output
    when activations are partitioned, the received gradient when gradients are (see the module docstring).
    0 without a pipeline, without TP or with SP (no partitioning)."""
    if sequence_parallel:
        return 0
    _check_partitioning(pipe_partitioned, grad_partitioned)
    if pp == 1 or tp == 1:
        return 0
    sender = stage < pp - 1
    gathers = pipe_boundaries(pp, stage) if pipe_partitioned else 0  # input (receiver), output (sender)
    return gathers + (1 if grad_partitioned and sender else 0)  # the gradient from the next stage


def pp_gather_bytes_per_step(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int,
                             act_bytes: int = 2, pipe_partitioned: bool = True,
                             grad_partitioned: bool = True, sequence_parallel: bool = False) -> int:
    """Logged pipeline all-gather bytes of one TP rank of `stage` per step: `pp_gathers_per_micro_batch` of the
    input slice, b·s·h/t, each."""
    gathers = pp_gathers_per_micro_batch(tp, pp, stage, pipe_partitioned, grad_partitioned, sequence_parallel)
    return gas * gathers * pp_message_bytes(shape, b, s, tp, act_bytes) if gathers else 0
