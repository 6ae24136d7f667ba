"""The weights each layer multiplies per token: the one count behind the FLOPs per token (planning/flops.py) and
the cost of each pipeline layer spec (model/pipe.layer_costs).

A decoder block multiplies its q, k, v, o and gate, up, down weights (in a mixture-of-experts block only the k
experts a token is routed to, after the router's h -> E); the LM head multiplies V·h, also when tied to the
embedding; the embedding lookup and the RMSNorm weights are not matmuls.
"""

from hybrid3d.model.config import LlamaShape


def block_matmul_parameters(shape: LlamaShape) -> int:
    """Weights one decoder block multiplies per token."""
    h, f, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    attention = h * shape.num_heads * d * 2 + h * shape.num_kv_heads * d * 2  # q, o and k, v
    mlp = 3 * h * f  # gate, up, down
    if shape.is_moe:  # each token passes through k of the E experts, after the router's (h -> E) matmul
        mlp = shape.experts_per_token * mlp + shape.num_experts * h
    return attention + mlp


def head_matmul_parameters(shape: LlamaShape) -> int:
    """Weights the LM head multiplies per token: V·h."""
    return shape.vocab_size * shape.hidden_size
