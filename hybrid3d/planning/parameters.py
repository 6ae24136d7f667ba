"""Parameter counts the memory model and the planner read: every layer's tensors on one TP rank, what a pipeline
rank holds, the whole model's, and the LoRA adapters' (from the TP plan: `model/tp_plan.py`)."""

from hybrid3d.model.config import LlamaShape
from hybrid3d.model.flop_counts import latent_attention_shapes
from hybrid3d.model.pipe import stage_bounds
from hybrid3d.model.tp_plan import kv_rows_per_rank, lora_factor_shapes, lora_weights
from hybrid3d.parallel.pipeline_schedules import num_stages
from hybrid3d.parallel.tensor_parallel.layers import padded_vocab_size
from hybrid3d.planning.activations import rank_stages


def layer_parameter_numels(shape: LlamaShape, t: int, ep: int = 1) -> list[tuple[str, list[int]]]:
    """(layer type, tensor sizes on one TP rank in registration order) for every pipeline layer spec.

    Mirrors `hybrid3d.model.layers` (and the TP plan's per-family biases and q/k norms):
    [Embedding, DecoderBlock x L, FinalNorm, LMHead (untied)] and,
    when tied, the head is a second copy of the embedding (a TiedLayerSpec on the last stage). A
    mixture-of-experts block (`model/moe.py`) holds the replicated router (E, h) and, with expert
    parallelism e, E/e experts, each split over TP like the dense MLP, then the shared expert (split alike) and its
    replicated gate (1, h); a MoE model's dense blocks (`shape.dense_layers`) the dense MLP."""
    h, d = shape.hidden_size, shape.head_dim
    vocab_rows = padded_vocab_size(shape.vocab_size, t, shape.vocab_pad_multiple) // t
    q = shape.num_heads * d // t

    def swiglu(f: int) -> list[int]:
        return [f // t * h, f // t * h, h * (f // t)]  # gate, up, down

    moe = [shape.num_experts * h] + swiglu(shape.expert_intermediate_size) * (shape.num_experts // ep)
    if shape.shared_expert_intermediate_size:
        moe += swiglu(shape.shared_expert_intermediate_size) + [h] * shape.shared_expert_gate
    kv = kv_rows_per_rank(shape, t)
    bias = shape.qkv_bias  # Qwen2: each projection's bias follows its weight's rows
    attention = ([q * h] + [q] * bias + [kv * h] + [kv] * bias + [kv * h] + [kv] * bias + [h * q]
                 + [d, d] * shape.qk_norm)
    if shape.is_mla:  # q_a, q_a_layernorm, q_b (or q), kv_a, kv_a_layernorm, kv_b, o: heads split over TP
        *queries, kv_a, kv_b, o = latent_attention_shapes(shape)  # (out, in) each, unsplit
        attention = ([queries[0][0] * h, shape.q_lora_rank, queries[1][0] // t * queries[1][1]] if shape.q_lora_rank
                     else [queries[0][0] // t * h])
        attention += [kv_a[0] * kv_a[1], shape.kv_lora_rank, kv_b[0] // t * kv_b[1], h * (o[1] // t)]
    blocks = [[h] + attention + [h] + (moe if shape.is_moe_layer(i) else swiglu(shape.intermediate_size))
              for i in range(shape.num_layers)]  # input norm, q/k/v/o (+ Qwen3's q/k norms), post-attention norm, MLP
    specs = [("Embedding", [vocab_rows * h])] + [("DecoderBlock", block) for block in blocks] + [("FinalNorm", [h])]
    specs.append(("TiedEmbedding" if shape.tie_word_embeddings else "LMHead", [vocab_rows * h]))
    return specs


def stage_parameter_numels(shape: LlamaShape, t: int, pp: int, stage: int) -> list[int]:
    """Sizes of the parameters one TP rank of 1F1B `stage` holds, in `module.parameters()` order."""
    return rank_parameter_numels(shape, t, pp, stage)


def rank_parameter_numels(shape: LlamaShape, t: int, pp: int, rank: int, schedule: str = "1f1b",
                          v: int = 1, ep: int = 1) -> list[int]:
    """Sizes of the parameters one TP rank of pipeline rank `rank` holds under `schedule`, in
    `module.parameters()` order: the layers of its stages (`rank_stages`; v·p stages when interleaved,
    2p for DualPipeV, so DualPipeV's rank 0 holds the embedding and the head) in the order it builds them.

    A tied embedding lives in `tied_modules` (registered before the layers) on the rank of the first stage
    and, as the head's copy, on that of the last; a rank holding both (p = 1, DualPipeV's rank 0) shares
    one module. `ep`: expert parallelism, E/e experts per MoE block."""
    local = _rank_specs(layer_parameter_numels(shape, t, ep), shape, pp, rank, schedule, v)
    tied = shape.tie_word_embeddings
    first = [n for kind, sizes in local if tied and kind in ("Embedding", "TiedEmbedding") for n in sizes][:1]
    rest = [n for kind, sizes in local if not (tied and kind in ("Embedding", "TiedEmbedding")) for n in sizes]
    return first + rest


def _rank_specs(specs: list, shape: LlamaShape, pp: int, rank: int, schedule: str, v: int) -> list:
    """The entries of `specs` (one per pipeline layer spec) that pipeline rank `rank` builds, in its order."""
    bounds = stage_bounds(shape, num_stages(schedule, pp, v))
    return [spec for stage in rank_stages(schedule, pp, rank, v) for spec in specs[bounds[stage]:bounds[stage + 1]]]


def rank_expert_numels(shape: LlamaShape, t: int, pp: int, rank: int, schedule: str = "1f1b", v: int = 1,
                       ep: int = 1) -> list[int]:
    """Sizes of the routed experts' tensors among `rank_parameter_numels` (gate, up, down of each of the E/e experts
    of each MoE block the rank holds): DeepSpeed's expert parameter group, which ZeRO partitions over the
    expert-data-parallel group instead of the data-parallel one (`training/trainer.py`). Empty for a dense model."""
    if not shape.is_moe:
        return []
    f, h = shape.expert_intermediate_size // t, shape.hidden_size
    bounds = stage_bounds(shape, num_stages(schedule, pp, v))
    blocks = sum(1 for stage in rank_stages(schedule, pp, rank, v) for i in range(bounds[stage], bounds[stage + 1])
                 if 1 <= i <= shape.num_layers and shape.is_moe_layer(i - 1))
    return [f * h, f * h, h * f] * (shape.num_experts // ep) * blocks


def block_adapter_numels(shape: LlamaShape, t: int) -> list[int]:
    """Sizes of the LoRA adapter factors of one decoder block on one TP rank, in `module.parameters()` order
    (A, B of each of `shape.lora_targets`, in HF order): the TP plan's `lora_factor_shapes`. Empty without LoRA."""
    if not shape.lora_rank:
        return []
    return [rows * cols for _, _, base in lora_weights(shape, shape.lora_targets)
            for rows, cols in lora_factor_shapes(base, shape, t, shape.lora_rank)]


def rank_adapter_numels(shape: LlamaShape, t: int, pp: int, rank: int, schedule: str = "1f1b",
                        v: int = 1) -> list[int]:
    """Sizes of the trainable LoRA adapter parameters one TP rank of pipeline rank `rank` holds, in order (those of
    the decoder blocks of its stages, as `rank_parameter_numels` places the blocks). Empty without LoRA."""
    block = block_adapter_numels(shape, t)
    specs = [(kind, block if kind == "DecoderBlock" else []) for kind, _ in layer_parameter_numels(shape, t)]
    return [n for _, sizes in _rank_specs(specs, shape, pp, rank, schedule, v) for n in sizes]


def adapter_parameters(shape: LlamaShape) -> int:
    """LoRA adapter parameters of the unsharded model (0 without LoRA)."""
    return shape.num_layers * sum(block_adapter_numels(shape, 1))


def model_parameters(shape: LlamaShape) -> int:
    """Parameters of the unsharded model: unpadded vocabulary, a tied embedding counted once."""
    blocks = sum(sum(sizes) for kind, sizes in layer_parameter_numels(shape, 1) if kind == "DecoderBlock")
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return embeddings + blocks + shape.hidden_size


# ---------------------------------------------------------------- model states
