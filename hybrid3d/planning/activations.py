"""Analytic activation memory per rank: what autograd keeps for backward, per micro-batch.

Letters: b micro-batch, s sequence, h hidden, a heads, f intermediate (SwiGLU), V vocabulary (V_p padded to
t·128), L layers, t tensor-parallel degree, p pipeline stages, m micro-batches per step (GAS), c
context-parallel degree, s_c = s/c, d_h head dim, k_c kv heads a rank hands to the CP exchange.

The count starts from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", §4, Eq. 1-2: sbh(34 + 5as/h) per GPT layer, sbh(10 + 24/t + 5as/(ht)) with TP) and is fitted,
term by term, to the tensors this Llama saves, as counted by saved-tensor hooks in bf16
(tests/distributed/test_sequence_parallel.py; the model and the count agree to the byte, up to
scalars). Per decoder block, bf16 (2 bytes) unless marked fp32 (an fp32 run keeps the same tensors at 4 bytes: `lp`;
each RMSNorm's upcast is then the input itself, still 4 bytes):

- each of the two RMSNorms: its fp32 upcast of the input (4·s_c·b·h), its fp32 1/rms (4·s_c·b), the bf16
  normalised tensor the weight multiplies (2·s_c·b·h) and its output, which the next GEMM saves as its input
  (2·s_c·b·h): 16·s_c·b·h + 8·s_c·b for both, divided by t with sequence parallelism (SP), where norms
  run on (b, s/(c·t), h) shards and the column-parallel GEMMs save the shard and gather it again in backward;
- attention: Q 2·s_c·b·a·d_h/t, K and V 2·2·s_c·b·k_c·d_h, the fused SDPA kernel's output 2·s_c·b·a·d_h/t
  (also the o_proj input without CP; with CP o_proj saves the exchange's output, a second copy) and fp32
  log-sum-exp 4·a·s·b/(t·c) (Korthikanti's "selective recomputation", §4.2: no s² scores), or an unfused
  softmax 2·a·s²·b/(t·c) (not measured here); RoPE's cos and sin: the (s, d_h) tables 2·2·s·d_h, shared by every
  layer and micro-batch of a rank (`model/rope.py`), so counted once per rank; with documents each block gathers
  its tokens' rows instead, 2·2·b·s·d_h per block;
- SwiGLU: gate, up, silu(gate) and the down_proj input, 4·2·s_c·b·f/t.

Context parallelism (CP; DeepSpeed-Ulysses, Jacobs et al. 2023, §3) gives every per-token term s -> s_c;
the core runs on the whole sequence with a/(t·c) heads, so its terms are divided by c through the heads
(4·a·s·b/(t·c); s², not s_c², unfused). K and V: the exchange needs whole kv heads on each of the c
ranks, so a rank's k_t heads are repeated up to k_c = c when c is a multiple of k_t (k_c = k_t when c
divides k_t), and attention keeps s·(k_c/c)·d_h = s_c·k_c·d_h per tensor.

Ring attention (`context_parallel_comm` "p2p", `parallel/ring_attention.py`; "a2a+p2p": Ulysses over u
consecutive CP ranks around a ring over the c/u others) keeps the same tensors (measured: benchmarks/results/
2026-12-04-vm/ring_vs_ulysses.md): its autograd function saves q, k, v of the rank's positions, its output and
the fp32 log-sum-exp of a/(t·u) heads over u·s/c positions, 4·a·s·b/(t·c) as above. RoPE: each block gathers the
shared tables' rows at its u·s/c positions (times b with documents), 2·2·(u·s/c)·d_h, and keeps those only. Only the kv heads differ: the ring sends them as they are, so p2p keeps k_c = k_t and a2a+p2p repeats
them only as Ulysses over u needs; in every case k_c = `cp_kv_heads`, the kv heads of Ulysses over u =
`ulysses_size` ranks (u = c for a2a, 1 for p2p). Its blocks always run the fused kernel, build their masks per
block (no shared mask is kept, K and V are never repeated to the query heads) and are not saved; each block saves
the int64 table of its ring's positions, (c/u)·(u·s/c)·8 = 8·s bytes; a mask's (b, s) document ids, kept per
layer outside autograd, are left out (8·b·s bytes).

Masked attention (`masks.attention_bias`: a sliding window shorter than s, or packed documents masked from each
other): SDPA takes an additive mask in the compute dtype, which every layer of a rank shares, so it is counted
once, not per layer: 2·s² for a window (one per shape, whatever the micro-batch), 2·b·s² for documents (one per
micro-batch in flight; with checkpointing only the layer being recomputed holds one: the mask lives while a saved
graph holds it). The core runs on the whole
sequence under CP, so s², not s_c². K and V are repeated to the query heads before SDPA (the fused kernels refuse
`enable_gqa` with a mask), so each keeps 2·s_c·b·a·d_h/t, as Q does, instead of 2·s_c·b·k_c·d_h.

The first stage adds the token ids (int64, 8·s_c·b; + a bool mask s_c·b with t > 1); the last the final
norm (8·s_c·b·h + 4·s_c·b, /t with SP) and the cross entropy: without TP torch's log-softmax over V
(fp32, 4·s_c·b·V), with TP the fp32 softmax of the vocab-parallel loss (4·s_c·b·V_p/t) and its masks, plus
the int64 targets 8·s_c·b. The bf16 logits themselves are not kept. With full checkpointing a layer keeps
only its input 2·s_c·b·h (/t with SP or `partition_activations`; the config refuses both) and one layer
is recomputed at a time.

Pipeline schedules (`parallel.pipeline_schedules`; S stages, rank r holds stage r (1F1B), stages r + k·p,
k < v (interleaved, S = v·p), or stages r and 2p-1-r (DualPipeV, S = 2p)). Stage σ keeps per micro-batch
    a_σ = L_σ·(a_layer, or 2·s_c·b·h [/t] with checkpointing) + [σ = 0]·a_in + [σ = S-1]·a_out,
L_σ its decoder blocks (`stage_bounds(L, S)`), a_in/a_out the first and last stage's extras above. Rank r
holds at most
    A_r = max over the prefixes of its pass order of Σ_{(i, σ) forward run, backward not yet} a_σ
(`peak_in_flight`), + a_layer with checkpointing (one layer recomputed at a time). 1F1B keeps
min(p - r, m) micro-batches in flight: A_r = min(p - r, m)·a_r (Narayanan et al. 2021, §2.2). Interleaved
1F1B runs 2(p-1-r) + (v-1)·p warm-up forwards, so rank 0 peaks at v·p + p - 1 chunks of L/(v·p) layers:
L·(1 + (p-1)/(p·v)) layers' worth, 1 + (p-1)/(p·v) times 1F1B's L (Narayanan et al. 2021, §2.2, when
v·m >= v·p + p - 1; Korthikanti et al. 2022 state the same factor).
"""

from functools import lru_cache
from typing import Optional

from hybrid3d.config.sections import CONTEXT_PARALLEL_COMMS
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.pipe import check_schedule_stages, stage_bounds
from hybrid3d.model.tp_plan import context_kv_heads, kv_heads_per_rank
from hybrid3d.planning.block_activations import latent_attention_bytes, moe_feed_forward_bytes, qk_norm_bytes
from hybrid3d.parallel.pipeline_schedules import num_stages, weighted_peak_in_flight
from hybrid3d.parallel.tensor_parallel.layers import padded_vocab_size


def sequence_chunk(s: int, t: int, sequence_parallel: bool = False, cp: int = 1) -> int:
    """s_c = s/c, the tokens of a micro-batch's sequence one CP rank reads; ValueError unless c divides s
    and, with SP, t divides s_c (and t > 1: SP splits over the TP group)."""
    if cp < 1 or s % cp:
        raise ValueError(f"sequence length {s} is not divisible by context_parallel_size {cp}")
    if sequence_parallel and t == 1:
        raise ValueError("sequence parallelism needs tensor-parallel size t > 1")
    if sequence_parallel and (s // cp) % t:
        raise ValueError(f"sequence chunk s/c = {s // cp} is not divisible by tensor-parallel size {t} "
                         "(sequence parallelism splits it over TP)")
    return s // cp


def ulysses_size(cp: int, comm: str = "a2a", cp_a2a: int = 1) -> int:
    """u: the CP ranks one Ulysses all-to-all spans (`context_parallel_comm` `comm`): all c with "a2a", none (1) with
    "p2p" (a ring over all c), `cp_a2a` (context_parallel_a2a_size, 1 < u < c dividing c) with "a2a+p2p"; a ring spans
    the other c/u."""
    if comm not in CONTEXT_PARALLEL_COMMS:
        raise ValueError(f"context_parallel_comm must be one of {', '.join(CONTEXT_PARALLEL_COMMS)}, got {comm!r}")
    if comm == "a2a+p2p" and (not 1 < cp_a2a < cp or cp % cp_a2a):
        raise ValueError(f"context_parallel_a2a_size {cp_a2a} must divide context_parallel_size {cp} and lie "
                         "strictly between 1 and it")
    return {"a2a": cp, "p2p": 1, "a2a+p2p": cp_a2a}[comm]


def uses_ring(cp: int, comm: str = "a2a") -> bool:
    """Whether attention runs around a ring (p2p or a2a+p2p over c > 1 ranks), as `ParallelLayout.ring`."""
    return cp > 1 and comm != "a2a"


def cp_kv_heads(shape: LlamaShape, t: int, cp: int = 1, comm: str = "a2a", cp_a2a: int = 1) -> int:
    """k_c: kv heads a TP rank hands to the Ulysses exchange over u = `ulysses_size` ranks and keeps, per position,
    for attention (`tp_plan.context_kv_heads`): its k_t own heads when u divides them, else u (each repeated u/k_t
    times, so every Ulysses rank gets one); k_t with a ring alone (u = 1: sent as they are). ValueError unless k_t
    and u divide one another."""
    u = ulysses_size(cp, comm, cp_a2a)
    kv_t = kv_heads_per_rank(shape.num_kv_heads, t)
    if kv_t % u and u % kv_t:
        size = "context_parallel_size" if comm == "a2a" else "context_parallel_a2a_size"
        raise ValueError(f"the {kv_t} kv heads of a TP rank and {size} {u} must divide one another")
    return context_kv_heads(kv_t, u)


def attention_mask_kind(shape: LlamaShape, s: int, document_mask: bool) -> Optional[str]:
    """The explicit mask SDPA gets (`masks.attention_bias`): "documents", "window" (shorter than s) or None."""
    if document_mask:
        return "documents"
    return "window" if shape.sliding_window is not None and shape.sliding_window < s else None


def activation_bytes_per_layer(shape: LlamaShape, b: int, s: int, t: int, flash_attention: bool = True,
                               sequence_parallel: bool = False, cp: int = 1, mask: Optional[str] = None,
                               comm: str = "a2a", cp_a2a: int = 1, lp: int = 2, block: Optional[int] = None) -> float:
    """Bytes one decoder block keeps for backward per micro-batch (module docstring), s_c = s/c:
    norms (16·s_c·b·h + 8·s_c·b)/(t with SP) + Q 2·s_c·b·a·d_h/t + K, V 4·s_c·b·k_c·d_h + attention output
    2·s_c·b·a·d_h/t (twice with CP) + SwiGLU 8·s_c·b·f/t + core 4·a·s·b/(t·c) fused or 2·a·s²·b/(t·c)
    unfused + the RoPE rows it gathers (`gathered_rope_bytes`; the shared tables are counted once per rank by
    `activation_bytes`). K and V count the heads a rank computes with (`kv_heads_per_rank`):
    with t > kv heads the weights are replicated, but each rank keeps only the one head it uses. With a `mask`
    (`attention_mask_kind`) they are repeated to the query heads (2 x Q's bytes), and with documents RoPE's
    rows are gathered per token, (b, s, d_h) each. The shared mask itself is counted by `activation_bytes`.
    `comm`, `cp_a2a`: context_parallel_comm and context_parallel_a2a_size; a ring (`uses_ring`) keeps k_c =
    `cp_kv_heads` heads with or without a mask and always runs the fused kernel (module docstring). `lp`: bytes of
    the compute dtype (2 bf16, 4 fp32: module docstring). `block` (0-based): which decoder block, for a model whose
    blocks differ (a MoE model's dense and expert blocks); None: a MoE block if the model has one. The mixture of
    experts, latent attention and q/k norms: `block_activations`."""
    h, a, d = shape.hidden_size, shape.num_heads, shape.head_dim
    s_c = sequence_chunk(s, t, sequence_parallel, cp)
    n = s_c * b
    moe_block = shape.is_moe if block is None else shape.is_moe_layer(block)
    ring = uses_ring(cp, comm)
    norms = (2 * (4 + 2 * lp) * s_c * b * h + 8 * s_c * b) / (t if sequence_parallel else 1)
    q = lp * s_c * b * a * d / t
    kv = 2 * q if mask and not ring else 2 * lp * s_c * b * cp_kv_heads(shape, t, cp, comm, cp_a2a) * d
    out = q * (2 if cp > 1 else 1)
    feed_forward = moe_feed_forward_bytes(shape, n, t, lp) if moe_block else 4 * lp * n * shape.intermediate_size / t
    fused = flash_attention or ring  # the ring's blocks: torch's fused kernel, which returns the log-sum-exp
    if shape.is_mla:  # expert models run without SP, CP, documents and windows (config/support.py)
        return norms + latent_attention_bytes(shape, b, s, t, fused, lp) + feed_forward
    core = 4 * a * s * b / (t * cp) if fused else 2 * a * s * s * b / (t * cp)
    table = 8 * s if ring else 0  # the ring's int64 (c/u, u·s/c) table of every member's positions, per block
    return (norms + q + kv + out + qk_norm_bytes(shape, n, t, lp) + feed_forward + core + table
            + gathered_rope_bytes(shape, b, s, cp, mask, comm, cp_a2a, lp))


def gathered_rope_bytes(shape: LlamaShape, b: int, s: int, cp: int = 1, mask: Optional[str] = None,
                        comm: str = "a2a", cp_a2a: int = 1, lp: int = 2) -> float:
    """RoPE's cos and sin a block keeps of its own, 2·2·n·d_h for the n rows it gathers from the shared tables:
    each token's position in its document (n = b·s), a ring rank's positions (n = u·s/c, times b with documents),
    none otherwise (the block keeps the shared tables themselves: `shared_rope_bytes`)."""
    rows = b if mask == "documents" else 0
    if uses_ring(cp, comm):
        rows = max(rows, 1) * ulysses_size(cp, comm, cp_a2a) * s // cp
    else:
        rows *= s
    return 2 * lp * rows * shape.head_dim


def shared_rope_bytes(shape: LlamaShape, s: int, cp: int = 1, mask: Optional[str] = None, comm: str = "a2a",
                      lp: int = 2) -> float:
    """RoPE's (s, d_h) cos and sin tables, 2·2·s·d_h once per rank (`model/rope.RotaryFrequencies`: every layer
    and micro-batch shares them), as the blocks that multiply by them whole keep them; blocks gathering rows
    (`gathered_rope_bytes`) keep only those."""
    return 0 if mask == "documents" or uses_ring(cp, comm) else 2 * lp * s * shape.head_dim


def input_layer_activation_bytes(shape: LlamaShape, b: int, s: int, t: int, cp: int = 1) -> float:
    """First stage, per micro-batch: the int64 token ids (8·s_c·b) and, with TP, the vocabulary-range mask."""
    s_c = s // cp
    return 8 * s_c * b + (s_c * b if t > 1 else 0)


def output_layer_activation_bytes(shape: LlamaShape, b: int, s: int, t: int, sequence_parallel: bool = False,
                                  cp: int = 1, lp: int = 2) -> float:
    """Last stage, per micro-batch: the final norm ((8·s_c·b·h + 4·s_c·b), /t with SP; its output is the
    head's saved input), the cross entropy's fp32 probabilities (4·s_c·b·V without TP, 4·s_c·b·V_p/t with
    TP, plus 2 bool masks) and the int64 targets 8·s_c·b. With the head and cross entropy in chunks
    (`shape.loss_chunk_tokens`) each token's fp32 log-sum-exp, 4·s_c·b, instead of its probabilities."""
    s_c = sequence_chunk(s, t, sequence_parallel, cp)
    norm = ((4 + 2 * lp) * s_c * b * shape.hidden_size + 4 * s_c * b) / (t if sequence_parallel else 1)
    if shape.loss_chunk_tokens:
        loss = 4 * s_c * b
    elif t == 1:
        loss = 4 * s_c * b * shape.vocab_size
    else:
        loss = 4 * s_c * b * padded_vocab_size(shape.vocab_size, t, shape.vocab_pad_multiple) / t + 2 * s_c * b
    return norm + loss + 8 * s_c * b


def in_flight_micro_batches(pp: int, stage: int, gas: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at once: min(p - stage, m)."""
    return min(pp - stage, gas) if pp > 1 else 1


def rank_stages(schedule: str, p: int, rank: int, v: int = 1) -> list[int]:
    """The stages pipeline rank r holds, in the order it builds them: [r] (1F1B), [r, r + p, ..., r + (v-1)·p]
    (interleaved, Megatron's placement), [r, 2p-1-r] (DualPipeV, DeepSpeed's DualPipeVModule)."""
    if schedule == "dualpipev":
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(v if schedule == "interleaved" else 1)]


@lru_cache(maxsize=4096)  # the planner's searches ask for the same stages thousands of times
def stage_layer_count(shape: LlamaShape, pp: int, stage: int, moe_only: bool = False) -> int:
    """Decoder blocks of `stage` when the model is cut into `pp` stages (S stages for S = v·p or 2p); `moe_only`:
    its mixture-of-experts blocks only."""
    bounds = stage_bounds(shape, pp)
    return sum(1 for i in range(bounds[stage], bounds[stage + 1])
               if 1 <= i <= shape.num_layers and (not moe_only or shape.is_moe_layer(i - 1)))


def activation_bytes(shape: LlamaShape, b: int, s: int, tp: int, pp: int, stage: int, gas: int,
                     checkpointing: bool = False, partition_activations: bool = False,
                     flash_attention: bool = True, sequence_parallel: bool = False, cp: int = 1,
                     schedule: str = "1f1b", virtual: int = 1, document_mask: bool = False, comm: str = "a2a",
                     cp_a2a: int = 1, lp: int = 2) -> float:
    """Activation bytes of one rank: A_r of the module docstring. With the 1F1B `schedule` `stage` is the
    rank's stage, and A_r = in-flight micro-batches x (its layers' activations, or with checkpointing their
    inputs 2·s_c·b·h, /t with SP or partition_activations) + with checkpointing one layer being recomputed.
    With "interleaved" (`virtual` = v chunks per rank) or "dualpipev" `stage` is the pipeline rank r, and
    the rank's pass order weighs each of its stages σ by a_σ. `document_mask` (and a window shorter than s in
    `shape`): the shared attention masks of the module docstring, which a ring (`comm` "p2p" or "a2a+p2p",
    `cp_a2a` = u) does not keep. `lp`: bytes of the compute dtype, 2 (bf16) or 4 (fp32)."""
    if sequence_parallel and partition_activations:
        raise ValueError("sequence_parallel and partition_activations exclude each other")
    mask = attention_mask_kind(shape, s, document_mask)
    def block_bytes(block: Optional[int]) -> float:
        return activation_bytes_per_layer(shape, b, s, tp, flash_attention, sequence_parallel, cp, mask, comm,
                                          cp_a2a, lp, block)

    # a MoE model's expert blocks and its dense ones (`shape.dense_layers`) keep different amounts
    per_moe = block_bytes(None)
    per_dense = block_bytes(shape.dense_layers[0]) if shape.dense_layers else per_moe
    per_layer = max(per_moe, per_dense)  # the layer being recomputed under checkpointing: the larger kind
    shared = not uses_ring(cp, comm)  # a ring builds each block's mask when it runs it
    # once per rank: the (s, s) bf16 window mask and RoPE's shared tables
    per_rank = (lp * s * s if mask == "window" and shared else 0) + shared_rope_bytes(shape, s, cp, mask, comm, lp)
    document_masks = lp * b * s * s if mask == "documents" and shared else 0  # one per micro-batch: (b, 1, s, s)
    kept_moe, kept_dense, recompute = per_moe, per_dense, 0  # what a block keeps per micro-batch; the recomputed one
    if checkpointing:
        kept_moe = kept_dense = lp * (s // cp) * b * shape.hidden_size / (
            tp if partition_activations or sequence_parallel else 1)
        recompute = per_layer + document_masks  # the recomputed layer builds its micro-batch's mask again
    shared_per_micro_batch = 0 if checkpointing else document_masks

    def stage_bytes(sigma: int, stages: int) -> float:  # a_σ: what stage σ of `stages` keeps per micro-batch
        extra = output_layer_activation_bytes(shape, b, s, tp, sequence_parallel, cp, lp) if sigma == stages - 1 else 0.0
        if sigma == 0:
            extra += input_layer_activation_bytes(shape, b, s, tp, cp)
        layers = stage_layer_count(shape, stages, sigma)
        moe = stage_layer_count(shape, stages, sigma, moe_only=True)
        return moe * kept_moe + (layers - moe) * kept_dense + (shared_per_micro_batch if layers else 0) + extra

    if schedule == "1f1b":
        return in_flight_micro_batches(pp, stage, gas) * stage_bytes(stage, pp) + recompute + per_rank
    check_schedule_stages(shape, pp, schedule, virtual)
    stages = num_stages(schedule, pp, virtual)
    weights = {sigma: stage_bytes(sigma, stages) for sigma in rank_stages(schedule, pp, stage, virtual)}
    return weighted_peak_in_flight(schedule, pp, gas, virtual, stage, weights) + recompute + per_rank
