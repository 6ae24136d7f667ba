"""Llama built from tensor-parallel layers."""

from hybrid3d.errors import UnsupportedConfigError
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_weights import load_hf_state_dict, merge_tp_shards, param_specs, shard_hf_tensor
from hybrid3d.model.llama import LanguageModelLoss, LlamaSequential, gather_vocab_logits

__all__ = [
    "LanguageModelLoss", "LlamaSequential", "LlamaShape", "UnsupportedConfigError", "gather_vocab_logits",
    "load_hf_state_dict", "merge_tp_shards", "param_specs", "shard_hf_tensor",
]
