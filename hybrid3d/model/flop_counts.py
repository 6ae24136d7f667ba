"""The weights each layer multiplies per token: the one count behind the FLOPs per token (planning/flops.py) and
the cost of each pipeline layer spec (model/pipe.layer_costs).

A decoder block multiplies its q, k, v, o and gate, up, down weights (in a mixture-of-experts block only the k
experts a token is routed to, after the router's h -> E, and the shared expert with its gate); the LM head multiplies V·h, also when tied to the
embedding; the embedding lookup and the RMSNorm weights are not matmuls.
"""

from hybrid3d.model.config import LlamaShape


def block_matmul_parameters(shape: LlamaShape, block: int) -> int:
    """Weights decoder block `block` (0-based) multiplies per token."""
    h, d = shape.hidden_size, shape.head_dim
    attention = h * shape.num_heads * d * 2 + h * shape.num_kv_heads * d * 2  # q, o and k, v
    if shape.is_mla:
        attention = sum(out * inp for out, inp in latent_attention_shapes(shape))
    if not shape.is_moe_layer(block):
        return attention + 3 * h * shape.intermediate_size  # gate, up, down
    # each token passes through k of the E experts, after the router's (h -> E) matmul, and the shared expert
    mlp = shape.experts_per_token * 3 * h * shape.expert_intermediate_size + shape.num_experts * h
    mlp += 3 * h * shape.shared_expert_intermediate_size + (h if shape.shared_expert_gate else 0)
    return attention + mlp


def latent_attention_shapes(shape: LlamaShape) -> list[tuple[int, int]]:
    """(out, in) of each matrix of a latent attention block, unsplit, in registration order (latent_attention.py):
    q_a, q_b (or q), kv_a, kv_b, o."""
    h, a, r_q, r_kv = shape.hidden_size, shape.num_heads, shape.q_lora_rank, shape.kv_lora_rank
    qk, v = shape.qk_head_dim, shape.v_head_dim
    queries = [(r_q, h), (a * qk, r_q)] if r_q else [(a * qk, h)]
    return queries + [(r_kv + shape.head_dim, h), (a * (shape.qk_nope_head_dim + v), r_kv), (h, a * v)]


def blocks_matmul_parameters(shape: LlamaShape) -> int:
    """Weights all L decoder blocks multiply per token."""
    return sum(block_matmul_parameters(shape, block) for block in range(shape.num_layers))


def head_matmul_parameters(shape: LlamaShape) -> int:
    """Weights the LM head multiplies per token: V·h."""
    return shape.vocab_size * shape.hidden_size
