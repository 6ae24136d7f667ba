"""The Llama shape hybrid3d builds, read from a `transformers.LlamaConfig` (the source of truth), or
a `MixtralConfig`: a Llama whose feed-forward is a mixture of experts (Jiang et al. 2024, Mixtral), or a
`Qwen3MoeConfig`: Qwen3's attention with Mixtral's feed-forward, its top-k weights renormalised only with
`norm_topk_prob` (Qwen team 2025, Qwen3 technical report), or a `Qwen2MoeConfig`: the same router beside a shared
expert every token passes through, scaled per token by a sigmoid gate, and q/k/v biases (Qwen team 2024,
Qwen1.5-MoE / Qwen2 technical report). The Qwen families interleave dense layers (`dense_layers`: HF's
`mlp_only_layers` and `decoder_sparse_step`) with the mixture-of-experts ones.

The dense families that differ from Llama only in attention are the same decoder with switches set
from their configs (`FAMILY_SWITCHES`): Qwen2/Qwen2.5 add biases to q/k/v (Bai et al. 2023), Qwen3
RMS-normalises each query and key head before RoPE (Qwen team 2025), Mistral attends over a sliding
window of the last `sliding_window` positions (Jiang et al. 2023).

Only what the model can represent exactly is accepted; anything else is refused with a message
naming the config field, so a converted model never silently differs from its HF original.
"""

from dataclasses import dataclass, field
from typing import Optional

from hybrid3d.errors import UnsupportedConfigError

EXPERT_KERNELS = (None, "grouped_mm", "loop")  # LlamaShape.expert_kernel, hybrid3d.expert_kernel (None: choose)

SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# model_type -> the HF class an export names in config.json's `architectures` (AutoModelForCausalLM loads it)
HF_CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                        "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                        "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                        "deepseek_v3": "DeepseekV3ForCausalLM"}
# model_type -> (q/k/v biases, q/k RMSNorm, sliding window read from the config); Qwen2-MoE's biases are its
# config's `qkv_bias` (`_qwen_moe_fields`)
FAMILY_SWITCHES = {"llama": (False, False, False), "mistral": (False, False, True), "qwen2": (True, False, True),
                   "qwen3": (False, True, True), "mixtral": (False, False, False),
                   "qwen2_moe": (True, False, True), "qwen3_moe": (False, True, True),
                   "deepseek_v3": (False, False, False)}


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int  # h
    intermediate_size: int
    num_layers: int  # L
    num_heads: int  # a
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    vocab_pad_multiple: int = 128
    # Mixture of experts (Mixtral): E experts of `moe_intermediate_size` each (0: `intermediate_size`, Mixtral's),
    # top-k routing; 0 experts = dense SwiGLU.
    num_experts: int = 0  # E
    experts_per_token: int = 2  # k
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss added to the LM loss
    router_renormalize: bool = True  # the k weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    moe_intermediate_size: int = 0  # f_e, each expert's width (0: intermediate_size)
    # The decoder blocks (0-based) of a MoE model whose feed-forward is the dense SwiGLU of `intermediate_size`
    # (Qwen's mlp_only_layers and decoder_sparse_step); every other block's is a mixture of experts.
    dense_layers: tuple = ()
    # A shared expert beside the routed ones in every MoE block (0: none), a SwiGLU of this width every token
    # passes through; with `shared_expert_gate` its output is scaled per token by sigmoid(x·w_g) (Qwen2-MoE).
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # DeepSeek-V3's router (`moe.Router`): "sigmoid" scores chosen on scores + e_score_correction_bias
    # (`router_score_bias`), among the `router_topk_groups` best of `router_groups` groups, the weights times
    # `routed_scaling_factor`; "softmax" is Mixtral's and Qwen's.
    router_scoring: str = "softmax"
    router_score_bias: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek-V2/V3, `latent_attention.py`) when kv_lora_rank > 0: queries through a
    # rank-`q_lora_rank` bottleneck (0: a plain q_proj), keys and values from one rank-`kv_lora_rank` latent, each
    # head's query and key of qk_nope_head_dim + head_dim (the rotary part, one key shared by every head), its value
    # of v_head_dim; the rotary pairs interleaved with `rope_interleave`.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Expert capacity (GShard/Switch): None drops nothing (HF Mixtral); a factor c caps each expert at
    # ceil(c·n·k/E) of a rank's n tokens' assignments (`moe.capacity_keep`). Set from hybrid3d.expert_capacity_factor.
    expert_capacity_factor: Optional[float] = None
    # How a rank's experts run (`model/expert_kernels.py`): "grouped_mm" (grouped GEMMs), "loop" (one GEMM per expert)
    # or None (the loop). Set from hybrid3d.expert_kernel.
    expert_kernel: Optional[str] = None
    # Per-family attention switches (FAMILY_SWITCHES); `model_type` names the HF class an export writes.
    model_type: str = "llama"
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim of every query and key head, before RoPE (Qwen3)
    sliding_window: Optional[int] = None  # key j visible to query i iff i - window < j <= i (Mistral)
    # The LM head and the cross entropy `loss_chunk_tokens` tokens at a time, keeping no logits (0: all at once;
    # hybrid3d.loss_chunk_tokens, `tensor_parallel.chunked_vocab_parallel_loss`).
    loss_chunk_tokens: int = 0
    # LoRA adapters (hybrid3d.lora in the JSON; Hu et al. 2021): rank r (0: none) beside the `lora_targets` modules
    # (PEFT's names, tp_plan.LORA_TARGETS), scaled by alpha / r, dropout on their input; the base then frozen.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: tuple = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise UnsupportedConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.num_experts < 0:
            raise UnsupportedConfigError(f"num_local_experts must be >= 0, got {self.num_experts}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise UnsupportedConfigError(f"num_experts_per_tok ({self.experts_per_token}) must be between 1 and "
                                         f"num_local_experts ({self.num_experts})")
        if self.expert_capacity_factor is not None and not self.expert_capacity_factor > 0:
            raise UnsupportedConfigError(f"expert_capacity_factor must be > 0, got {self.expert_capacity_factor}")
        if self.expert_kernel not in EXPERT_KERNELS:
            raise UnsupportedConfigError(f"expert_kernel must be null, 'grouped_mm' or 'loop', "
                                         f"got {self.expert_kernel!r}")
        if self.router_aux_loss_coef < 0:
            raise UnsupportedConfigError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.moe_intermediate_size < 0 or self.shared_expert_intermediate_size < 0:
            raise UnsupportedConfigError("moe_intermediate_size and shared_expert_intermediate_size must be >= 0")
        if (self.moe_intermediate_size or self.dense_layers or self.shared_expert_intermediate_size) \
                and not self.num_experts:
            raise UnsupportedConfigError("moe_intermediate_size, dense_layers and shared experts need num_experts > 0")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers) or list(self.dense_layers) != sorted(
                set(self.dense_layers)):
            raise UnsupportedConfigError(f"dense_layers {list(self.dense_layers)} must be distinct, ascending block "
                                         f"indices below num_hidden_layers ({self.num_layers})")
        if self.num_experts and len(self.dense_layers) == self.num_layers:
            raise UnsupportedConfigError(f"every one of the {self.num_layers} layers is dense (mlp_only_layers, "
                                         "decoder_sparse_step): a mixture-of-experts model needs one sparse layer")
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise UnsupportedConfigError(f"router scoring {self.router_scoring!r} is not supported (softmax, sigmoid)")
        groups, per_group = self.router_groups, self.num_experts // self.router_groups
        if self.num_experts and (self.num_experts % groups or (groups > 1 and per_group < 2)
                                 or not 1 <= self.router_topk_groups <= groups):
            raise UnsupportedConfigError(f"n_group ({groups}) must divide n_routed_experts ({self.num_experts}) "
                                         f"into groups of >= 2 (each scored by its top 2), topk_group "
                                         f"({self.router_topk_groups}) between 1 and n_group")
        if self.num_experts and groups > 1 and self.router_topk_groups * per_group < self.experts_per_token:
            raise UnsupportedConfigError(f"topk_group ({self.router_topk_groups}) groups of "
                                         f"{self.num_experts // self.router_groups} experts cannot hold "
                                         f"num_experts_per_tok ({self.experts_per_token})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedConfigError(f"sliding_window must be >= 1 or null, got {self.sliding_window}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, block: int) -> bool:
        """Whether decoder block `block` (0-based) is a mixture of experts (else the dense SwiGLU)."""
        return self.is_moe and block not in self.dense_layers

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek) instead of grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key width: head_dim, or with MLA the non-rotary part plus the rotary head_dim."""
        return self.qk_nope_head_dim + self.head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def moe_layers(self) -> int:
        """How many decoder blocks are mixtures of experts."""
        return self.num_layers - len(self.dense_layers) if self.is_moe else 0

    @property
    def expert_intermediate_size(self) -> int:
        """f_e: each routed expert's width."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @classmethod
    def from_hf(cls, config, vocab_pad_multiple: int = 128) -> "LlamaShape":
        """Read a `transformers.LlamaConfig` or `MixtralConfig` (transformers 4.x `rope_scaling`/`rope_theta`
        or 5.x `rope_parameters`)."""
        model_type = getattr(config, "model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"model_type '{model_type}' is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                raise UnsupportedConfigError(f"{flag}=true is not supported (only Qwen2's q/k/v biases are)")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedConfigError(f"hidden_act '{act}' is not supported (only 'silu')")
        moe = (_mixtral_fields(config) if model_type == "mixtral" else
               _qwen_moe_fields(config) if model_type in ("qwen2_moe", "qwen3_moe") else
               _deepseek_fields(config) if model_type == "deepseek_v3" else {})
        qkv_bias, qk_norm, windowed = FAMILY_SWITCHES[model_type]
        if model_type == "llama" and getattr(config, "sliding_window", None):
            raise UnsupportedConfigError("sliding_window is not supported for model_type 'llama'")
        sliding_window = _sliding_window(config) if windowed else None
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            raise UnsupportedConfigError(f"pretraining_tp={config.pretraining_tp} is not supported (only 1)")

        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_theta = rope.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedConfigError(
                f"rope_scaling.rope_type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        rope_scaling = None
        if rope_type == "llama3":
            missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings") if k not in rope]
            if missing:
                raise UnsupportedConfigError(f"rope_scaling (llama3) lacks {', '.join(missing)}")
            rope_scaling = {"rope_type": "llama3", **{k: rope[k] for k in (
                "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
        if rope_type == "yarn":
            rope_scaling = _yarn_scaling(rope, config.max_position_embeddings)

        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(**{**dict(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            initializer_range=getattr(config, "initializer_range", 0.02),
            attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
            vocab_pad_multiple=vocab_pad_multiple,
            model_type=model_type,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            sliding_window=sliding_window,
        ), **moe})


def _yarn_scaling(rope: dict, max_position_embeddings: int) -> dict:
    """YaRN's settings as `model/rope.py` reads them, with HF's defaults filled in (`_compute_yarn_parameters`:
    beta_fast 32, beta_slow 1, truncate true, a null factor = max_position_embeddings / the original context)."""
    if "original_max_position_embeddings" not in rope:
        raise UnsupportedConfigError("rope_scaling (yarn) lacks original_max_position_embeddings")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(f"rope_scaling.partial_rotary_factor={rope['partial_rotary_factor']} is not "
                                     "supported (only 1.0: every pair of the head rotated)")
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / original
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
            "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
            "truncate": bool(rope.get("truncate", True)), "attention_factor": rope.get("attention_factor"),
            "mscale": rope.get("mscale"), "mscale_all_dim": rope.get("mscale_all_dim")}


def _deepseek_fields(config) -> dict:
    """DeepSeek-V3's fields (`DeepseekV3Config`): multi-head latent attention, the sigmoid router with its score
    correction bias and group-limited choice, shared experts without a gate (one SwiGLU of
    n_shared_experts x moe_intermediate_size), the first `first_k_dense_replace` layers dense. Its
    multi-token-prediction layers are not part of the causal LM (HF skips them on load: `hf_source`)."""
    if config.q_lora_rank is not None and config.q_lora_rank < 1:
        raise UnsupportedConfigError(f"q_lora_rank={config.q_lora_rank} must be >= 1 or null")
    if config.num_key_value_heads != config.num_attention_heads:
        raise UnsupportedConfigError(f"num_key_value_heads={config.num_key_value_heads} is not supported for "
                                     f"deepseek_v3 (only num_attention_heads, {config.num_attention_heads}: "
                                     "latent attention expands a key and a value per head)")
    first_dense = config.first_k_dense_replace
    if not 0 <= first_dense < config.num_hidden_layers:
        raise UnsupportedConfigError(f"first_k_dense_replace={first_dense} leaves no mixture-of-experts layer "
                                     f"(num_hidden_layers {config.num_hidden_layers})")
    return dict(num_experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok,
                router_aux_loss_coef=0.0,  # DeepseekV3ForCausalLM adds no load-balancing loss
                router_renormalize=bool(config.norm_topk_prob), moe_intermediate_size=config.moe_intermediate_size,
                dense_layers=tuple(range(first_dense)),
                shared_expert_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                router_scoring="sigmoid", router_score_bias=True, router_groups=config.n_group,
                router_topk_groups=config.topk_group, routed_scaling_factor=float(config.routed_scaling_factor),
                q_lora_rank=config.q_lora_rank or 0, kv_lora_rank=config.kv_lora_rank,
                qk_nope_head_dim=config.qk_nope_head_dim, v_head_dim=config.v_head_dim,
                head_dim=config.qk_rope_head_dim, rope_interleave=bool(config.rope_interleave))


def _sliding_window(config) -> Optional[int]:
    """The one window every layer attends with, or None for full causal attention. Mistral windows every
    layer; Qwen2/Qwen3 only with use_sliding_window, per `layer_types` (layers >= max_window_layers).
    A model whose layers differ is refused: the decoder blocks are built alike."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type != "mistral" and layer_types:
        kinds = set(layer_types)
        if len(kinds) > 1:
            raise UnsupportedConfigError(
                f"layer_types mixes {' and '.join(sorted(kinds))} (use_sliding_window with max_window_layers "
                f"{getattr(config, 'max_window_layers', None)} < num_hidden_layers {config.num_hidden_layers}) "
                "is not supported: only the same attention in every layer")
        if kinds != {"sliding_attention"}:
            return None
    return window


def _mixtral_fields(config) -> dict:
    """The expert fields of a MixtralConfig; refuses what the model would compute differently."""
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        # A window at least as long as any sequence masks nothing beyond the causal mask.
        raise UnsupportedConfigError(
            f"sliding_window={window} is not supported: only full causal attention (sliding_window null or "
            f">= max_position_embeddings {config.max_position_embeddings})")
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        raise UnsupportedConfigError(f"router_jitter_noise={jitter} is not supported (only 0)")
    return dict(num_experts=config.num_local_experts, experts_per_token=config.num_experts_per_tok,
                router_aux_loss_coef=float(config.router_aux_loss_coef))


def _qwen_moe_fields(config) -> dict:
    """The expert fields of a Qwen3MoeConfig or Qwen2MoeConfig: experts of `moe_intermediate_size`; the blocks
    HF builds dense (`Qwen3MoeDecoderLayer`: index in mlp_only_layers, or (index + 1) not a multiple of
    decoder_sparse_step) with the SwiGLU of `intermediate_size`; Qwen2-MoE's gated shared expert and q/k/v biases."""
    attention = {"qkv_bias": bool(config.qkv_bias)} if config.model_type == "qwen2_moe" else {}
    if not config.num_experts:
        return attention
    step = getattr(config, "decoder_sparse_step", 1)
    if step < 1:
        raise UnsupportedConfigError(f"decoder_sparse_step={step} must be >= 1")
    only_dense = set(getattr(config, "mlp_only_layers", None) or ())
    outside = sorted(i for i in only_dense if not 0 <= i < config.num_hidden_layers)
    if outside:
        raise UnsupportedConfigError(f"mlp_only_layers names layers {outside} the model lacks "
                                     f"(num_hidden_layers {config.num_hidden_layers})")
    dense = tuple(i for i in range(config.num_hidden_layers) if i in only_dense or (i + 1) % step)
    fields = dict(attention, num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                  router_aux_loss_coef=float(config.router_aux_loss_coef),
                  router_renormalize=bool(config.norm_topk_prob), moe_intermediate_size=config.moe_intermediate_size,
                  dense_layers=dense)
    if config.model_type == "qwen2_moe":
        if not config.shared_expert_intermediate_size:
            raise UnsupportedConfigError("shared_expert_intermediate_size=0 is not supported: Qwen2-MoE's blocks "
                                         "always hold a shared expert")
        fields.update(shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                      shared_expert_gate=True)
    return fields
