"""The single-stage tensor-parallel Llama (pp = 1) and its loss.

Parameters are named `<global layer index>.<name>`, exactly as DeepSpeed's PipelineModule
names them, so checkpoints and weight maps are shared between the two forms.
"""

from typing import Callable, Optional

import torch
from torch import nn

from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_weights import TIED_KEY
from hybrid3d.model.layers import HeadInput, build_layers, tied_lm_logits
from hybrid3d.model.activations import split_activations
from hybrid3d.model.moe import load_balancing_loss, router_tally
from hybrid3d.parallel.context_parallel import sequence_mean
from hybrid3d.parallel.tensor_parallel import (IGNORE_INDEX, chunked_vocab_parallel_loss, gather_from_tp_region,
                                               token_loss_sum)
from hybrid3d.parallel.rank_groups import ContextParallelGroup, ExpertParallelGroup, TensorParallelGroup


class LanguageModelLoss:
    """Next-token cross entropy over vocab-sharded logits; DeepSpeed's `loss_fn(outputs, labels)`.

    `labels` is the targets (b, s), IGNORE_INDEX where no loss is taken: the loss is then the micro-batch's mean
    over its counted tokens. Or (targets, weight): the loss is the sum over counted tokens times `weight`, a ()
    tensor the data path sets to (micro-batches in the global batch) / (counted tokens in the global batch), so
    that after DeepSpeed averages over micro-batches and data-parallel ranks the step's loss is the token-level
    mean over the whole global batch (`data.packing.micro_batches` says why).
    With context parallelism the logits and targets are this rank's s/c positions (`sequence_mean`).
    A MoE model's outputs are (logits, router_stats): the loss is then, as HF Mixtral's with
    `output_router_logits`, cross entropy + router_aux_loss_coef · load-balancing loss (moe.py)."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, ignore_index: int = IGNORE_INDEX,
                 cp: Optional[ContextParallelGroup] = None):
        self.vocab_size = shape.vocab_size
        self.tp = tp
        self.cp = cp or ContextParallelGroup.single()
        self.ignore_index = ignore_index
        self.num_experts = shape.num_experts
        self.router_aux_loss_coef = shape.router_aux_loss_coef
        self.chunk_tokens = shape.loss_chunk_tokens
        self._router_tally = None  # training calls' `moe.router_tally` sums since the last `take_router_tally`

    def __call__(self, outputs, labels):  # (b, s/c, V_padded/t) or (that, (2E + 1,)), (b, s/c) or that + () -> ()
        targets, weight = labels if isinstance(labels, (tuple, list)) else (labels, None)
        if isinstance(outputs, HeadInput):  # the head applied here, chunk by chunk (loss_chunk_tokens)
            router_stats = outputs.router_stats
            total = chunked_vocab_parallel_loss(outputs.hidden, outputs.weight, targets, self.tp, self.vocab_size,
                                                self.ignore_index, self.chunk_tokens).sum()
            count = (targets != self.ignore_index).sum()
        else:
            logits, _, router_stats = split_activations(outputs)
            total, count = token_loss_sum(logits, targets, self.tp, self.vocab_size, self.ignore_index)
        loss = sequence_mean(total, count, self.cp, weight)
        if router_stats is not None:
            aux = load_balancing_loss(router_stats, self.num_experts)
            loss = loss + self.router_aux_loss_coef * aux
            if torch.is_grad_enabled():  # training micro-batches only: evaluation runs without gradients
                tally = router_tally(aux, router_stats, self.num_experts)
                self._router_tally = tally if self._router_tally is None else self._router_tally + tally
        return loss

    def take_router_tally(self) -> Optional[torch.Tensor]:
        """The summed tallies of the training calls since the last take (None if none ran here), and reset."""
        tally, self._router_tally = self._router_tally, None
        return tally


class LlamaSequential(nn.Module):
    """[Embedding, DecoderBlock x L, FinalNorm, LMHead?]: ids (b, s) -> logits (b, s, V_padded/t);
    with experts -> (logits, router_stats (2E + 1,)), the input of `loss_fn`.

    Layer i is registered as child `str(i)`, except a tied embedding, which lives in
    `tied_modules.embed` as in PipelineModule: parameter names are identical in both forms.

    Activation checkpointing mirrors PipelineModule's: runs of `checkpoint_interval` decoder
    blocks go through `checkpoint_fn` (DeepSpeed's `checkpointing.checkpoint` or
    `non_reentrant_checkpoint`), which honours `deepspeed.checkpointing.configure()`.
    """

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None,
                 seed: Optional[int] = None, checkpoint_interval: int = 0, checkpoint_fn: Optional[Callable] = None,
                 cp: Optional[ContextParallelGroup] = None, ep: Optional[ExpertParallelGroup] = None):
        super().__init__()
        layers = build_layers(shape, tp, device=device, dtype=dtype, seed=seed, cp=cp, ep=ep)
        if shape.tie_word_embeddings:
            self.tied_modules = nn.ModuleDict({TIED_KEY: layers[0]})
        else:
            self.add_module("0", layers[0])
        for index, layer in enumerate(layers[1:], start=1):
            self.add_module(str(index), layer)
        self.layers = layers  # forward order; a plain list, so nothing is registered twice
        self.shape = shape
        self.tp = tp
        self.loss_fn = LanguageModelLoss(shape, tp, cp=cp)
        if checkpoint_interval and checkpoint_fn is None:
            raise ValueError("checkpoint_interval > 0 needs a checkpoint_fn")
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_fn = checkpoint_fn

    def forward(self, ids):  # (b, s) ids, or (ids, positions) for packed documents masked from each other
        layers = self.layers
        blocks_end = 1 + self.shape.num_layers
        hidden = layers[0](ids)
        step = self.checkpoint_interval or self.shape.num_layers
        for start in range(1, blocks_end, step):
            run = _run_layers(layers[start:min(start + step, blocks_end)])
            args = hidden if isinstance(hidden, tuple) else (hidden,)  # MoE: (hidden, router_stats)
            hidden = self.checkpoint_fn(run, *args) if self.checkpoint_interval else run(*args)
        for layer in layers[blocks_end:]:
            hidden = layer(hidden)
        return tied_lm_logits(layers[0], hidden) if self.shape.tie_word_embeddings else hidden

    def loss(self, ids, targets):
        return self.loss_fn(self(ids), targets)


def _run_layers(layers):
    def run(*inputs):  # one tensor, or a tuple's tensors as checkpoint functions pass them (as PipelineModule's)
        hidden = inputs[0] if len(inputs) == 1 else inputs
        for layer in layers:
            hidden = layer(hidden)
        return hidden

    return run


def gather_vocab_logits(logits, tp: TensorParallelGroup, vocab_size: int):
    """All-gather vocab-sharded logits and strip padding: (b, s, V_padded/t) -> (b, s, V)."""
    return gather_from_tp_region(logits, tp)[..., :vocab_size]
