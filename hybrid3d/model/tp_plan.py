"""The tensor-parallel plan of the Llama, as data: how every weight is split over the t TP ranks.

One table, read by the model's constructors (attention.py, mlp.py), the HF weight slicing and
merging (hf_weights.py), the universal-checkpoint patterns (checkpoint/universal.py) and the memory
and traffic models (planning/). Megatron-LM's layout (Shoeybi et al., 2019): q/k/v and gate/up are
column-parallel (output features split), o and down row-parallel (input features split), norms
replicated, the embedding and the untied LM head split over the (padded) vocabulary.
Qwen2's q/k/v biases follow their weights' rows (whole heads); Qwen3's q/k norm weights, (d,) and shared
by every head, are replicated, their gradients summed over TP (each rank normalises only its heads).

Key/value heads (GQA) are the one rule that depends on the sizes: split like q when t <= kv heads;
when t is a multiple of kv heads, the full k/v weights are replicated on every rank, each rank uses
the head its query heads share, and the weight gradient is summed over TP. Other combinations are
refused (`check_split`).

Mixture-of-experts blocks (Mixtral) replace the dense MLP by a router and E SwiGLU experts: each
expert is split over TP exactly like the dense MLP (gate/up column-, down row-parallel), so every TP
rank holds an f/t slice of every expert; the router (E x h) is replicated, so all TP ranks route
every token alike. A shared expert (Qwen2-MoE) is split the same way, its gate (1 x h) replicated; a MoE model's
dense blocks (`LlamaShape.dense_layers`) follow BLOCK_PLAN. Expert parallelism places whole experts per rank (parallel/expert_parallel.py): the TP split
of each expert stays this plan's. Which MoE layouts and options run is config/support.py's.

LoRA adapters (Hu et al. 2021: W x + (alpha/r)·B A x, A (r x in), B (out x r), the base W frozen) follow their
base weight's kind (`LORA_SPLITS`, one entry per kind, as Megatron-Bridge splits them): beside a column-parallel
base, A is replicated (its gradient summed over TP: every rank's B slice contributes) and B is split by output
rows like the base; beside a row-parallel base, A is split by input columns like the base (its r outputs summed
over TP) and B is replicated (its gradient summed over TP with sequence parallelism, where each rank's tokens
differ); beside a replicated k/v base (t > kv heads) both are replicated and used at the rank's head rows.
"""

from hybrid3d.errors import LayoutError
from hybrid3d.model.config import LlamaShape

VOCAB, COLUMN, ROW, REPLICATED = "vocab", "column", "row", "replicated"
KV = "kv"  # COLUMN or REPLICATED, by `kv_heads_split`

# Decoder-block weights (HF names under `model.layers.<i>.`, hybrid3d names under `<i + 1>.`).
BLOCK_PLAN = {
    "self_attn.q_proj.weight": COLUMN,
    "self_attn.q_proj.bias": COLUMN,
    "self_attn.k_proj.weight": KV,
    "self_attn.k_proj.bias": KV,
    "self_attn.v_proj.weight": KV,
    "self_attn.v_proj.bias": KV,
    "self_attn.o_proj.weight": ROW,
    "self_attn.q_norm.weight": REPLICATED,
    "self_attn.k_norm.weight": REPLICATED,
    "mlp.gate_proj.weight": COLUMN,
    "mlp.up_proj.weight": COLUMN,
    "mlp.down_proj.weight": ROW,
    "input_layernorm.weight": REPLICATED,
    "post_attention_layernorm.weight": REPLICATED,
}
EMBEDDING, FINAL_NORM, LM_HEAD = VOCAB, REPLICATED, VOCAB
DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# Present only where the family has them (LlamaShape.qkv_bias, .qk_norm).
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")

# Multi-head latent attention (model/latent_attention.py; LlamaShape.is_mla) in place of BLOCK_PLAN's attention, in
# HF order: the query and key/value expansions column-parallel by heads, o row-parallel, the latent down projections
# and their norms replicated. q_proj only without q_lora_rank, q_a_proj/q_a_layernorm/q_b_proj only with it.
MLA_PLAN = {
    "self_attn.q_proj.weight": COLUMN,
    "self_attn.q_a_proj.weight": REPLICATED,
    "self_attn.q_a_layernorm.weight": REPLICATED,
    "self_attn.q_b_proj.weight": COLUMN,
    "self_attn.kv_a_proj_with_mqa.weight": REPLICATED,
    "self_attn.kv_a_layernorm.weight": REPLICATED,
    "self_attn.kv_b_proj.weight": COLUMN,
    "self_attn.o_proj.weight": ROW,
}
Q_LORA = ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight")

# A mixture-of-experts block's feed-forward (hybrid3d names; `{e}` is the expert index 0..E-1), in HF order; the
# shared expert (LlamaShape.shared_expert_intermediate_size) is split like the dense MLP, its gate replicated.
MOE_PLAN = {
    "mlp.router.weight": REPLICATED,
    "mlp.router.e_score_correction_bias": REPLICATED,  # a buffer (LlamaShape.router_score_bias), not a parameter
    "mlp.experts.{e}.gate_proj.weight": COLUMN,
    "mlp.experts.{e}.up_proj.weight": COLUMN,
    "mlp.experts.{e}.down_proj.weight": ROW,
    "mlp.shared_expert.gate_proj.weight": COLUMN,
    "mlp.shared_expert.up_proj.weight": COLUMN,
    "mlp.shared_expert.down_proj.weight": ROW,
    "mlp.shared_expert_gate.weight": REPLICATED,
}
SHARED_EXPERT = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                 "mlp.shared_expert.down_proj.weight")
SHARED_EXPERT_GATE = "mlp.shared_expert_gate.weight"
ROUTER_BIAS = "mlp.router.e_score_correction_bias"
BUFFERS = (ROUTER_BIAS,)  # plan entries that are persistent buffers: loaded, saved and exported with the weights


# PEFT's LoRA `target_modules` names hybrid3d adapts (hybrid3d.lora.target_modules), and the block weight each adapts
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = {module: next(name for name in BLOCK_PLAN if name.endswith(f".{module}.weight")) for module in LORA_MODULES}
# base kind -> (A's kind, B's kind); A is (r, in) and B (out, r), so ROW splits A's dim 1 and COLUMN B's dim 0
LORA_SPLITS = {COLUMN: (REPLICATED, COLUMN), ROW: (ROW, REPLICATED), REPLICATED: (REPLICATED, REPLICATED)}


def lora_weights(shape: LlamaShape, targets) -> list[tuple[str, str, str]]:
    """(A's name, B's name, base name) under `<i + 1>.` of every adapter pair of a decoder block, in HF order:
    `self_attn.q_proj.lora_A.weight`, `self_attn.q_proj.lora_B.weight`, ... (PEFT's names under
    `model.layers.<i>.`)."""
    out = []
    for module, base in LORA_TARGETS.items():
        if module in targets:
            prefix = base[:-len(".weight")]
            out.append((f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight", base))
    return out


def lora_kinds(base: str, shape: LlamaShape, t: int) -> tuple[str, str]:
    """(A's kind, B's kind) of the adapter pair beside block weight `base` at TP size t."""
    return LORA_SPLITS[block_kind(base, shape, t)]


def lora_factor_shapes(base: str, shape: LlamaShape, t: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(A's, B's) shape on one TP rank, for the adapter pair beside block weight `base`, rank r."""
    h, f, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    out_in = {"self_attn.q_proj.weight": (shape.num_heads * d, h), "self_attn.k_proj.weight": (shape.num_kv_heads * d, h),
              "self_attn.v_proj.weight": (shape.num_kv_heads * d, h), "self_attn.o_proj.weight": (h, shape.num_heads * d),
              "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    out, inp = out_in[base]
    a_kind, b_kind = lora_kinds(base, shape, t)
    return (rank, inp // t if a_kind == ROW else inp), (out // t if b_kind == COLUMN else out, rank)


def block_weights(shape: LlamaShape, block: int) -> list[tuple[str, str]]:
    """(name under `<block + 1>.`, BLOCK_PLAN/MOE_PLAN template) of every weight of decoder block `block` (0-based),
    in HF order: BLOCK_PLAN for a dense block (biases and q/k norms only where the family has them); for a MoE block
    (`shape.is_moe_layer`) its MLP entries replaced by MOE_PLAN's, experts expanded, the shared expert and its gate
    only where the model has them."""
    out = []
    for name in BLOCK_PLAN:
        if (name in QKV_BIASES and not shape.qkv_bias) or (name in QK_NORMS and not shape.qk_norm):
            continue
        if shape.is_mla and name.startswith("self_attn."):
            if name == "self_attn.q_proj.weight":  # the whole latent attention in its place
                queries = Q_LORA if shape.q_lora_rank else ("self_attn.q_proj.weight",)
                out += [(n, n) for n in MLA_PLAN if n in queries or n not in (*Q_LORA, "self_attn.q_proj.weight")]
            continue
        if not (shape.is_moe_layer(block) and name in DENSE_MLP):
            out.append((name, name))
        elif name == DENSE_MLP[0]:
            out.append(("mlp.router.weight", "mlp.router.weight"))
            if shape.router_score_bias:
                out.append((ROUTER_BIAS, ROUTER_BIAS))
            out += [(template.format(e=e), template) for e in range(shape.num_experts)
                    for template in MOE_PLAN if "{e}" in template]
            if shape.shared_expert_intermediate_size:
                out += [(name, name) for name in SHARED_EXPERT]
            if shape.shared_expert_gate:
                out.append((SHARED_EXPERT_GATE, SHARED_EXPERT_GATE))
    return out


def feed_forward_widths(shape: LlamaShape) -> dict[str, int]:
    """The width of every SwiGLU the model builds, by what holds it: the dense MLP (a dense model's, or a MoE
    model's dense blocks'), each routed expert, the shared expert. TP splits each of them (`check_split`)."""
    widths = {}
    if not shape.is_moe or shape.dense_layers:
        widths["intermediate_size"] = shape.intermediate_size
    if shape.is_moe:
        widths["moe_intermediate_size" if shape.moe_intermediate_size else "intermediate_size"] = \
            shape.expert_intermediate_size
    if shape.shared_expert_intermediate_size:
        widths["shared_expert_intermediate_size"] = shape.shared_expert_intermediate_size
    return widths


def kv_heads_split(num_kv_heads: int, t: int) -> bool:
    """True: k/v heads are split over TP (t <= kv); False: replicated on every rank (t > kv)."""
    return t <= num_kv_heads


def kv_heads_per_rank(num_kv_heads: int, t: int) -> int:
    """kv heads a TP rank computes with: kv/t, or 1 when they are replicated."""
    return num_kv_heads // t if kv_heads_split(num_kv_heads, t) else 1


def kv_rows_per_rank(shape: LlamaShape, t: int) -> int:
    """Rows of k_proj (and v_proj) a TP rank stores: kv/t heads, or all kv heads when replicated."""
    heads = shape.num_kv_heads // t if kv_heads_split(shape.num_kv_heads, t) else shape.num_kv_heads
    return heads * shape.head_dim


def context_kv_heads(kv_per_rank: int, c: int) -> int:
    """kv heads a TP rank hands to the context-parallel exchange: its own when c divides them, else
    each repeated c/kv times (c a multiple of them), so each of the c ranks receives whole kv heads."""
    return kv_per_rank if kv_per_rank % c == 0 else c


def block_kind(name: str, shape: LlamaShape, t: int) -> str:
    """The split of decoder-block weight `name` (a BLOCK_PLAN or MOE_PLAN key) at TP size t."""
    kind = MLA_PLAN[name] if shape.is_mla and name in MLA_PLAN else BLOCK_PLAN.get(name) or MOE_PLAN[name]
    if kind == KV:
        return COLUMN if kv_heads_split(shape.num_kv_heads, t) else REPLICATED
    return kind


def check_split(shape: LlamaShape, t: int, pp: int = 1, cp: int = 1, ep: int = 1, ring: bool = False,
                cp_a2a: int = 1) -> None:
    """Raise LayoutError if TP size t, pp stages, context-parallel size cp and expert-parallel size ep cannot
    split `shape` exactly. Ring attention (`ring`) splits no heads over its ring: only Ulysses (all of cp, or the
    `cp_a2a` ranks inside each ring member) needs to divide them."""
    if shape.num_heads % t:
        raise LayoutError(f"num_attention_heads ({shape.num_heads}) is not divisible by tensor_parallel_size ({t})")
    kv = shape.num_kv_heads
    if kv % t and t % kv:
        raise LayoutError(
            f"num_key_value_heads ({kv}) and tensor_parallel_size ({t}) must divide one another "
            f"(kv heads are split when tp <= {kv}, replicated when tp is a multiple of {kv})")
    cp_heads = cp_a2a if ring else cp  # the CP ranks that split a TP rank's heads (Ulysses')
    if shape.num_heads % (t * cp_heads):
        raise LayoutError(f"num_attention_heads ({shape.num_heads}) is not divisible by tensor_parallel_size * "
                          f"context_parallel_size ({t} * {cp_heads}): each context-parallel rank attends with whole heads")
    kv_t = kv_heads_per_rank(kv, t)
    if kv_t % cp_heads and cp_heads % kv_t:
        raise LayoutError(
            f"the {kv_t} kv heads of a tensor-parallel rank (num_key_value_heads {kv} / tensor_parallel_size {t}) "
            f"and context_parallel_size ({cp_heads}) must divide one another")
    for field, width in feed_forward_widths(shape).items():
        if width % t:
            raise LayoutError(f"{field} ({width}) is not divisible by tensor_parallel_size ({t})")
    if ep > 1 and not shape.num_experts:
        raise LayoutError(f"expert_parallel_size ({ep}) needs a mixture-of-experts model (num_local_experts > 0)")
    if shape.num_experts % ep:
        raise LayoutError(f"num_local_experts ({shape.num_experts}) is not divisible by expert_parallel_size ({ep})")
    if shape.num_layers < pp:
        raise LayoutError(
            f"pipeline_parallel_size ({pp}) exceeds num_hidden_layers ({shape.num_layers}): "
            "every stage needs at least one decoder block")
