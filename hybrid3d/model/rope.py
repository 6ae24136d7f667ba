"""Rotary position embeddings (Su et al. 2021, RoFormer) in HF's half-split convention.

The head dimension is split in halves (x1, x2), rotated as (x1 cos - x2 sin, x2 cos + x1 sin),
with frequency theta^(-2i/d) for pair i. `llama3` scaling (Meta, Llama 3.1 release) divides
low frequencies by `factor`, keeps high ones, and interpolates smoothly in between.

`yarn` scaling (Peng et al. 2023, YaRN, arXiv 2309.00071, §3.2-3.4): pair i of the d/2 turns r_i = L/λ_i times
over the original context L (λ_i its wavelength). Pairs that turn more than beta_fast times keep their frequency
(extrapolation), pairs that turn fewer than beta_slow times are divided by `factor` (interpolation, as Position
Interpolation), and a linear ramp over the pair index joins the two; the pair index where r_i = r is
d·ln(L / (2π·r)) / (2·ln θ), rounded outwards unless `truncate` is false. cos and sin are then scaled by the
attention factor 0.1·ln(factor) + 1 (§3.4; with `mscale` and `mscale_all_dim`, DeepSeek's ratio of two such
factors; or the config's `attention_factor`), which scales every attention logit by its square.
"""

import functools
import json
import math

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies, optionally llama3- or yarn-scaled."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`; short ones are unchanged.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies (module docstring): (d/2,) fp32."""
    context = scaling["original_max_position_embeddings"]

    def pair_turning(rotations: float) -> float:  # the (fractional) pair index that turns `rotations` times
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(scaling["beta_fast"]), pair_turning(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: divide
    extrapolated = 1 - ramp
    positions = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # θ^(2i/d)
    return (1.0 / (scaling["factor"] * positions)) * (1 - extrapolated) + (1.0 / positions) * extrapolated


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term, 0.1·mscale·ln(factor) + 1 (1 without extension, factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: yarn's attention factor (module docstring), 1.0 for the other types."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(scaling["factor"], scaling["mscale"]) / yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
    return yarn_mscale(scaling["factor"])


class RotaryFrequencies(nn.Module):
    """The inverse frequencies as a non-persistent buffer: it moves with the module (`.to(device)`),
    so no layer copies it to the device in every forward, but it stays fp32 under `.bfloat16()` /
    `.to(dtype)`, which would round the frequencies (DeepSpeed casts the whole module for bf16).

    `cos_sin` hands every layer of the process the same tables for the same (frequencies, sequence length,
    device, dtype) (`_shared_cos_sin`): they are computed once, not per forward, and a rank holds one copy,
    not one per layer (at s = 1M, d_h = 128 in bf16 a copy is 0.5 GB)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)
        self.scale = attention_factor(scaling)
        # what the frequencies are a function of, hashable: the shared tables' key
        self._spec = (head_dim, float(theta), json.dumps(scaling, sort_keys=True) if scaling else None)

    def _apply(self, fn, recurse=True):
        fp32 = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = fp32.to(self.inv_freq.device)  # the new device, the old (fp32) values
        return self

    def cos_sin(self, seq_len: int, device, dtype):
        """`rope_cos_sin` of this module's frequencies, (s, head_dim) each, shared with every layer asking for the
        same key. Callers must not modify them in place. Inside a compiled block they are computed in the graph
        (Dynamo cannot trace the memo, and a graph break there would split every block in two)."""
        if torch.compiler.is_compiling():
            return rope_cos_sin(self.inv_freq, seq_len, device, dtype, self.scale)
        return _shared_cos_sin(self._spec, seq_len, torch.device(device), dtype)


@functools.lru_cache(maxsize=4)  # a memo of a pure function: the training and evaluation lengths of a run
def _shared_cos_sin(spec: tuple, seq_len: int, device: torch.device, dtype: torch.dtype):
    head_dim, theta, scaling = spec
    scaling = json.loads(scaling) if scaling else None
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
    return rope_cos_sin(inv_freq, seq_len, device, dtype, attention_factor(scaling))


def rope_cos_sin(inv_freq: torch.Tensor, seq_len: int, device, dtype, scale: float = 1.0):
    """cos, sin of shape (s, head_dim) for positions 0..s-1, computed in fp32, times `scale` (yarn's
    `attention_factor`)."""
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # (s, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (s, d)
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x: (b, heads, s, d); cos/sin: (s, d), or (b, 1, s, d) for per-row positions."""
    return x * cos + _rotate_half(x) * sin
