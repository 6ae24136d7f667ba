"""What the parts of a decoder block that differ between families keep for backward, per micro-batch: the
mixture-of-experts feed-forward (`model/moe.py`), multi-head latent attention (`model/latent_attention.py`) and
Qwen3's q/k norms. `activations.activation_bytes_per_layer` adds them to the parts every block shares (its two
RMSNorms, the GEMM inputs after them, RoPE's tables); the module docstring there has the letters.

Counted, term by term, from the tensors hybrid3d's blocks keep for backward (saved-tensor hooks, the storages still
alive after the forward; TP 1, bf16 and fp32: tests/unit/test_block_activations.py, equal to the byte), n = b·s_c
tokens of the micro-batch, lp the compute dtype's bytes:

- a MoE block's router, softmax (Mixtral, Qwen): its fp32 probabilities 4·n·E, the int64 top-k indices 8·n·k and,
  renormalised, the fp32 sum and top-k weights 4·n + 4·n·k. Sigmoid (DeepSeek-V3): the fp32 scores 4·n·E and the
  top-k indices 8·n·k; below fp32 the fp32 copies of the input 4·n·h and of the (E, h) weight 4·E·h (at fp32 both
  are the tensors themselves); renormalised 4·n + 4·n·k. What the group-limited choice saves (n_group > 1) is freed
  with it during the forward: no gradient flows through the indices it picks.
- the routed experts: each of the n·k assignments is a row of its expert: its int64 place in the sort by expert and
  its token 16, its input lp·h, its fp32 routing weight 4, the expert's output and its weighted copy 2·lp·h, and
  what the kernel keeps (model/expert_kernels.py): grouped GEMMs gate and up 2·lp·f_e/t, the loop of GEMMs also
  silu(gate) and the down projection's input, 4·lp·f_e/t: n·k·(20 + lp·(3h + 2·f_e/t)) or n·k·(20 + lp·(3h + 4·f_e/t)). The per-expert row counts depend on the
  routing, their sum does not. With expert
  parallelism a rank's experts run on the rows the all-to-all brings, n·k on average when routing is even (the
  count used here); the all-to-all's own buffers are not counted.
- a shared expert (Qwen2-MoE, DeepSeek-V3) of width f_s: 4·lp·n·f_s/t, as a dense SwiGLU; with Qwen2-MoE's gate also
  its sigmoid output lp·n and the shared output it scales lp·n·h.
- multi-head latent attention, a_t = a/t heads, instead of grouped-query attention's Q, K, V, output and core: the
  q latent's norm (4 + 2·lp)·n·r_q + 4·n with `q_lora_rank` r_q (its upcast, 1/rms, normalised tensor and the q_b
  GEMM's input), the kv latent's (4 + 2·lp)·n·r_kv + 4·n (at fp32 the upcast is the whole kv_a output, 4·n·d_r
  more), the o_proj input lp·n·a_t·d_v and the core. The core runs unfused where the kernel refuses a value width
  different from the query's (this CPU: torch's math path, which keeps fp32 copies of q, k, v and the fp32
  probabilities whatever the compute dtype: 4·n·a_t·(2·d_qk + d_v) + 4·b·a_t·s²), else fused (q, k, v and the
  output in lp and the fp32 log-sum-exp: lp·n·a_t·(2·d_qk + 2·d_v) + 4·n·a_t; not measured on this machine).
  Expert models run without SP and CP (config/support.py), so s_c = s here.
- Qwen3's q/k norms on the a_t query and k_t kv heads of d_h: each keeps its fp32 upcast, its normalised tensor
  and its fp32 1/rms per head: (4 + lp)·n·(a_t + k_t)·d_h + 4·n·(a_t + k_t).
"""

from hybrid3d.model.config import LlamaShape
from hybrid3d.model.expert_kernels import choose_kernel
from hybrid3d.model.tp_plan import kv_heads_per_rank


def router_bytes(shape: LlamaShape, n: int, lp: int) -> float:
    """A MoE block's router (module docstring)."""
    e, h, k = shape.num_experts, shape.hidden_size, shape.experts_per_token
    kept = 4 * n * e + 8 * n * k + (4 * n + 4 * n * k if shape.router_renormalize else 0)
    if shape.router_scoring != "sigmoid":
        return kept
    return kept + (4 * n * h + 4 * e * h if lp < 4 else 0)  # the fp32 upcasts of the input and the weight


def routed_expert_bytes(shape: LlamaShape, n: int, t: int, lp: int) -> float:
    """The n·k rows of the routed experts (module docstring)."""
    h, f = shape.hidden_size, shape.expert_intermediate_size
    kept = 2 if choose_kernel(shape.expert_kernel, h, f // t, lp)[0] == "grouped_mm" else 4  # f/t-wide per row
    return n * shape.experts_per_token * (20 + lp * (3 * h + kept * f / t))


def shared_expert_bytes(shape: LlamaShape, n: int, t: int, lp: int) -> float:
    """The shared expert, with Qwen2-MoE's gate (module docstring); 0 without one."""
    width = shape.shared_expert_intermediate_size
    if not width:
        return 0.0
    gate = lp * n + lp * n * shape.hidden_size if shape.shared_expert_gate else 0
    return 4 * lp * n * width / t + gate


def moe_feed_forward_bytes(shape: LlamaShape, n: int, t: int, lp: int) -> float:
    """A MoE block's feed-forward after its norm's output: router, routed rows, shared expert."""
    return router_bytes(shape, n, lp) + routed_expert_bytes(shape, n, t, lp) + shared_expert_bytes(shape, n, t, lp)


def latent_attention_bytes(shape: LlamaShape, b: int, s: int, t: int, fused: bool, lp: int) -> float:
    """Multi-head latent attention after the block's input norm (module docstring)."""
    n, heads = b * s, shape.num_heads // t
    qk, v, rope = shape.qk_head_dim, shape.value_head_dim, shape.head_dim
    q_latent = (4 + 2 * lp) * n * shape.q_lora_rank + 4 * n if shape.q_lora_rank else 0
    kv_latent = (4 + 2 * lp) * n * shape.kv_lora_rank + 4 * n + (4 * n * rope if lp == 4 else 0)
    if fused:
        core = lp * n * heads * (2 * qk + 2 * v) + 4 * n * heads
    else:
        core = 4 * n * heads * (2 * qk + v) + 4 * b * heads * s * s
    return q_latent + kv_latent + core + lp * n * heads * v


def qk_norm_bytes(shape: LlamaShape, n: int, t: int, lp: int) -> float:
    """Qwen3's q/k norms (module docstring); 0 without them."""
    if not shape.qk_norm:
        return 0.0
    heads = shape.num_heads // t + kv_heads_per_rank(shape.num_kv_heads, t)
    return (4 + lp) * n * heads * shape.head_dim + 4 * n * heads
