"""The Llama as a flat sequence of layers: embedding, L decoder blocks, final norm, LM head.

The same layer classes serve the single-stage model (`LlamaSequential`) and DeepSpeed's
PipelineModule, with the same global layer indices, so parameter names agree between them.

Besides the hidden states, layers may pass (activations.py) each token's position in its document (packed
documents masked from each other: the embedding takes (ids, positions), every block's attention uses them, the
final norm drops them) and a mixture-of-experts model's routing statistics (moe.py: each block adds its own, the
final norm and head carry them to the loss).
"""

import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from hybrid3d.model.activations import join_activations, split_activations
from hybrid3d.model.attention import Attention
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.latent_attention import LatentAttention
from hybrid3d.model.mlp import SwiGLU
from hybrid3d.model.moe import MoEFeedForward
from hybrid3d.model.norm import RMSNorm
from hybrid3d.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ContextParallelGroup,
    TensorParallelGroup,
    VocabParallelEmbedding,
    padded_vocab_size,
    vocab_parallel_logits,
)
from hybrid3d.parallel.rank_groups import ExpertParallelGroup
from hybrid3d.parallel.tensor_parallel.layers import normal_init, padded_rows_init


class Embedding(VocabParallelEmbedding):
    """Token embedding: (b, s) ids -> (b, s, h); (ids, positions) -> (hidden, positions)."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None):
        super().__init__(shape.vocab_size, shape.hidden_size, tp, pad_multiple=shape.vocab_pad_multiple,
                         init_method=normal_init(shape.initializer_range), device=device, dtype=dtype)
        self.frozen_before_adapters = shape.lora_rank > 0
        self.chunked_head = shape.loss_chunk_tokens > 0  # as the tied head (`tied_lm_logits`)

    def forward(self, inputs):
        ids, positions, _ = split_activations(inputs)
        hidden = super().forward(ids)
        if self.frozen_before_adapters and torch.is_grad_enabled() and not hidden.requires_grad:
            # LoRA: the frozen embedding's output needs no gradient, but a reentrant activation checkpoint gives its
            # adapters none unless an input of the checkpointed blocks asks for one (HF's enable_input_require_grads)
            hidden.requires_grad_()
        return join_activations(hidden, positions)


class DecoderBlock(nn.Module):
    """Pre-norm block `block` (0-based): x + attn(norm(x)), then + mlp(norm(x)). (b, s, h) -> (b, s, h); each rank
    holds s/c of the sequence with context parallelism, s/(c·t) with sequence parallelism too.
    A mixture-of-experts block (`shape.is_moe_layer(block)`): x or (x, router_stats) -> (x, router_stats). A dense
    block of a MoE model (`shape.dense_layers`) passes the statistics on as it got them (none before the first
    MoE block), so a pipeline stage of dense blocks only sends (x,) or (x, router_stats) as it received them."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, cp: Optional[ContextParallelGroup] = None,
                 device=None, dtype=None, ep: Optional[ExpertParallelGroup] = None, block: int = 0):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, tp, **kw)
        self.self_attn = LatentAttention(shape, tp, **kw) if shape.is_mla else Attention(shape, tp, cp, **kw)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, tp, **kw)
        self.moe = shape.is_moe_layer(block)
        self.mlp = MoEFeedForward(shape, tp, ep, **kw) if self.moe else SwiGLU(shape, tp, **kw)

    def forward(self, inputs):
        x, positions, router_stats = split_activations(inputs)
        x = x + self.self_attn(self.input_layernorm(x), positions)
        if not self.moe:
            return join_activations(x + self.mlp(self.post_attention_layernorm(x)), positions, router_stats)
        out, router_stats = self.mlp(self.post_attention_layernorm(x), router_stats)
        return join_activations(x + out, positions, router_stats)


class FinalNorm(RMSNorm):
    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None):
        super().__init__(shape.hidden_size, shape.rms_norm_eps, tp, device=device, dtype=dtype)

    def forward(self, inputs):  # (b, s, h), or a tuple: positions end here, router statistics pass through
        hidden, _, router_stats = split_activations(inputs)
        return join_activations(super().forward(hidden), router_stats=router_stats)


@dataclass(frozen=True)
class HeadInput:
    """What the head hands the loss when it runs chunked (`LlamaShape.loss_chunk_tokens`): its input and its
    vocab-sharded weight, for `LanguageModelLoss` to apply chunk by chunk (the last stage's output goes straight
    to the loss, never to another stage)."""

    hidden: torch.Tensor  # (b, s, h), or (b, s/t, h) with SP
    weight: torch.Tensor  # (V_padded/t, h)
    router_stats: Optional[torch.Tensor] = None


class LMHead(ColumnParallelLinear):
    """Untied output projection: (b, s, h) -> (b, s, V_padded/t) vocab-sharded logits; a `HeadInput` when the
    loss applies it in chunks."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None):
        padded = padded_vocab_size(shape.vocab_size, tp.size, shape.vocab_pad_multiple)
        init = padded_rows_init(normal_init(shape.initializer_range), shape.vocab_size)  # padding rows zero
        super().__init__(shape.hidden_size, padded, tp, init_method=init, device=device, dtype=dtype)
        self.chunked = shape.loss_chunk_tokens > 0

    def forward(self, inputs):  # (b, s, h), or (hidden, router_stats): the statistics pass through
        hidden, _, router_stats = split_activations(inputs)
        if self.chunked:
            return HeadInput(hidden, self.weight, router_stats)
        return join_activations(super().forward(hidden), router_stats=router_stats)


def tied_lm_logits(embedding: Embedding, inputs):
    """Tied head: logits from the embedding's vocab-sharded weight. (b, s, h) -> (b, s, V_padded/t);
    (hidden, router_stats) -> (logits, router_stats); a `HeadInput` when the loss applies it in chunks."""
    hidden, _, router_stats = split_activations(inputs)
    if embedding.chunked_head:
        return HeadInput(hidden, embedding.weight, router_stats)
    return join_activations(vocab_parallel_logits(hidden, embedding.weight, embedding.tp), router_stats=router_stats)


def layer_classes(shape: LlamaShape) -> list[type]:
    """[Embedding, DecoderBlock x L, FinalNorm, LMHead (untied only)], by global layer index."""
    classes = [Embedding] + [DecoderBlock] * shape.num_layers + [FinalNorm]
    return classes if shape.tie_word_embeddings else classes + [LMHead]


def layer_kwargs(cls: type, index: int, cp: Optional[ContextParallelGroup],
                 ep: Optional[ExpertParallelGroup] = None) -> dict:
    """Constructor arguments beyond (shape, tp) of layer spec `index`: a decoder block's index among the blocks, the
    context-parallel group, which only attention uses, and the expert-parallel group, which only a MoE block's
    experts use."""
    if cls is not DecoderBlock:
        return {}
    return {"block": index - 1, **({"cp": cp} if cp is not None else {}), **({"ep": ep} if ep is not None else {})}


def seed_layer(seed: int) -> None:
    """Seed what draws a layer's initial weights: Python's and numpy's generators (as DeepSpeed's
    `set_random_seed`, which PipelineModule's `seed_layers` calls) and torch's host generator, where layers are
    built; the accelerator's generators only where one is present. `torch.manual_seed` on a machine without CUDA
    queues a lazy CUDA, XPU and MTIA seeding, each with a formatted stack (~6 ms per layer, kept for the life of
    the process)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def build_layers(shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None,
                 seed: Optional[int] = None, cp: Optional[ContextParallelGroup] = None,
                 ep: Optional[ExpertParallelGroup] = None) -> list[nn.Module]:
    """Instantiate `layer_classes(shape)`. With `seed`, layer i is drawn after seeding `seed + i`,
    exactly as PipelineModule(seed_layers=True, base_seed=seed) does, so a single-stage model and
    any pipeline partitioning start from the same weights."""
    layers = []
    for index, cls in enumerate(layer_classes(shape)):
        if seed is not None:
            seed_layer(seed + index)
        layers.append(cls(shape, tp, device=device, dtype=dtype, **layer_kwargs(cls, index, cp, ep)))
    return layers
