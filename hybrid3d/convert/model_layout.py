"""Names, shapes and order of the tensors each side expects, read off models built on the meta device.

Building the real modules (hybrid3d's TP layers, HF's LlamaForCausalLM) on the meta device costs
no memory and keeps the converter from restating what the models define: the key order DeepSpeed
writes, each TP shard's shape, and the full tensor shapes an HF checkpoint must have.
"""

from collections import OrderedDict

import torch
from transformers import AutoModelForCausalLM

from hybrid3d.convert.ds_files import TIED_PREFIX
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_weights import unfuse_hf_experts

from hybrid3d.model.llama import LlamaSequential
from hybrid3d.model.pipe import stage_bounds
from hybrid3d.parallel.rank_groups import TensorParallelGroup

# No collective runs while modules are built on the meta device, so a TP rank's layers can be
# described without a process group.
_NO_PROCESS_GROUP = "meta-device placeholder"


def meta_model(shape: LlamaShape, tp_rank: int, tp_size: int) -> LlamaSequential:
    """TP rank `tp_rank`'s full layer stack on the meta device (shapes and names only)."""
    group = _NO_PROCESS_GROUP if tp_size > 1 else None
    return LlamaSequential(shape, TensorParallelGroup(group, tp_rank, tp_size), device="meta")


def hf_parameter_shapes(config) -> dict[str, torch.Size]:
    """Every tensor the HF model class of `config` (LlamaForCausalLM, MixtralForCausalLM) expects, without tied
    duplicates, in order, under its checkpoint-file names (a transformers >= 5 Mixtral fuses its experts in
    memory; its files keep one tensor per expert, `hf_weights.unfuse_hf_experts`)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = OrderedDict((name, p) for name, p in model.named_parameters())
    saved = set(model.state_dict())  # and the persistent buffers the files carry (DeepSeek's router bias)
    parameters.update((name, b) for name, b in model.named_buffers() if name in saved)
    return OrderedDict((name, p.shape) for name, p in unfuse_hf_experts(parameters, config.model_type).items())


def pipeline_stages(shape: LlamaShape, pp: int) -> list[range]:
    """Global layer indices on each stage, as the default method cuts them (`cost`: the layers' training
    FLOPs balanced, the embedding with the first stage, the norm and head with the last). A tied head
    is one more layer spec at the end of the list."""
    bounds = stage_bounds(shape, pp)
    return [range(bounds[s], bounds[s + 1]) for s in range(pp)]


def stage_param_shapes(model: LlamaSequential, layers: range) -> "OrderedDict[str, torch.Size]":
    """`param_shapes` of a stage holding global `layers`: the tied embedding first (PipelineModule
    and LlamaSequential register `tied_modules` before the layers), then layer by layer."""
    shape = model.shape
    tied_head = len(model.layers)  # the spec index of a tied LM head
    params = OrderedDict()
    if shape.tie_word_embeddings and (0 in layers or tied_head in layers):
        params[TIED_PREFIX + "weight"] = model.layers[0].weight.shape
    for index in layers:
        if index >= len(model.layers) or (index == 0 and shape.tie_word_embeddings):
            continue
        for name, param in model.layers[index].named_parameters():
            params[f"{index}.{name}"] = param.shape
    return params


def buffer_names(module: torch.nn.Module) -> list[str]:
    """Persistent buffers, which DeepSpeed lists in `buffer_names` (none in this model today)."""
    params = {name for name, _ in module.named_parameters()}
    return [name for name in module.state_dict(keep_vars=True) if name not in params]
