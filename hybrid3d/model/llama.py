"""The single-stage tensor-parallel Llama (pp = 1) and its loss.

Parameters are named `<global layer index>.<name>`, exactly as DeepSpeed's PipelineModule
names them, so checkpoints and weight maps are shared between the two forms.
"""

from torch import nn

from hybrid3d.layout import TensorParallelGroup
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.layers import build_layers, tied_lm_logits
from hybrid3d.tensor_parallel import IGNORE_INDEX, gather_from_tp_region, mean_token_loss


class LanguageModelLoss:
    """Mean next-token cross entropy over vocab-sharded logits; DeepSpeed's `loss_fn(outputs, labels)`."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, ignore_index: int = IGNORE_INDEX):
        self.vocab_size = shape.vocab_size
        self.tp = tp
        self.ignore_index = ignore_index

    def __call__(self, logits, targets):  # (b, s, V_padded/t), (b, s) -> scalar
        return mean_token_loss(logits, targets, self.tp, self.vocab_size, self.ignore_index)


class LlamaSequential(nn.Sequential):
    """[Embedding, DecoderBlock x L, FinalNorm, LMHead?]: ids (b, s) -> logits (b, s, V_padded/t)."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None):
        super().__init__(*build_layers(shape, tp, device=device, dtype=dtype))
        self.shape = shape
        self.tp = tp
        self.loss_fn = LanguageModelLoss(shape, tp)

    def forward(self, ids):
        hidden = ids
        for layer in self:
            hidden = layer(hidden)
        return tied_lm_logits(self[0], hidden) if self.shape.tie_word_embeddings else hidden

    def loss(self, ids, targets):
        return self.loss_fn(self(ids), targets)


def gather_vocab_logits(logits, tp: TensorParallelGroup, vocab_size: int):
    """All-gather vocab-sharded logits and strip padding: (b, s, V_padded/t) -> (b, s, V)."""
    return gather_from_tp_region(logits, tp)[..., :vocab_size]
