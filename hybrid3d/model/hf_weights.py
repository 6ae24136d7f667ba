"""How each Hugging Face tensor (Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE) maps onto hybrid3d's layers and
TP shards.

One table (`param_specs`, built from the TP plan in tp_plan.py) drives loading an HF state dict into any TP size and merging TP shards
back, so the model, the converter and the universal-checkpoint patterns agree on q/k/v layout.
Shard kinds:
- vocab:      padded to the model's padded vocabulary, then split along dim 0 (embedding, untied head);
- column:     split along dim 0 (q/k/v and Qwen2's q/k/v biases, gate/up);
- row:        split along dim 1 (o, down);
- replicated: identical on every TP rank (norms, Qwen3's q/k norms; k/v and their biases when tp > kv heads).
HF's q/k/v rows are already grouped by head in RoPE's half-split order, so contiguous row blocks
are whole heads and no permutation is needed.

Mixtral's experts use the names of its checkpoint files (the Hub's and `save_pretrained`'s):
`block_sparse_moe.gate.weight` (the router) and `block_sparse_moe.experts.<e>.w1/w3/w2.weight`
(gate/up/down), each a plain copy of one hybrid3d expert weight. transformers >= 5 renames and fuses
them in memory; `unfuse_hf_experts` reads a module's `state_dict()` under the file names. Qwen2-MoE's and
Qwen3-MoE's files name them `mlp.gate.weight` and `mlp.experts.<e>.gate_proj/up_proj/down_proj.weight`
(`MOE_FILE_NAMES`); Qwen2-MoE's shared expert and its gate keep hybrid3d's names (`mlp.shared_expert.*`,
`mlp.shared_expert_gate.weight`).
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass

import deepspeed.comm as dist
import torch
import torch.nn.functional as F

from hybrid3d.ds_internals.zero3 import gathered, is_partitioned, written
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.tp_plan import (
    BUFFERS,
    EMBEDDING,
    ROUTER_BIAS,
    FINAL_NORM,
    LM_HEAD,
    REPLICATED,
    ROW,
    VOCAB,
    block_kind,
    block_weights,
    lora_kinds,
    lora_weights,
)
from hybrid3d.parallel.tensor_parallel import padded_vocab_size
from hybrid3d.parallel.rank_groups import TensorParallelGroup
from hybrid3d.parallel.tensor_parallel.lora import LORA_PARAMETER

MIXTRAL_EXPERT_WEIGHTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # hybrid3d -> HF
# model_type -> (the router's file name, an expert weight's, from its index e and hybrid3d's projection name)
MOE_FILE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight",
                lambda e, proj: f"block_sparse_moe.experts.{e}.{MIXTRAL_EXPERT_WEIGHTS[proj]}.weight"),
    "qwen2_moe": ("mlp.gate.weight", lambda e, proj: f"mlp.experts.{e}.{proj}.weight"),
    "qwen3_moe": ("mlp.gate.weight", lambda e, proj: f"mlp.experts.{e}.{proj}.weight"),
    "deepseek_v3": ("mlp.gate.weight", lambda e, proj: f"mlp.experts.{e}.{proj}.weight"),
}
# model_type -> the prefix its files give hybrid3d's `mlp.shared_expert.` (DeepSeek-V3's shared experts, one SwiGLU)
SHARED_EXPERT_FILE_PREFIX = {"deepseek_v3": "mlp.shared_experts."}
# transformers >= 5 in memory: `mlp.gate.weight` (E, h), `mlp.experts.gate_up_proj` (E, 2f, h) holding
# [w1; w3] of each expert, `mlp.experts.down_proj` (E, h, f) holding w2.
_FUSED_MOE = re.compile(r"^(.*\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")

@dataclass(frozen=True)
class ParamSpec:
    hf_name: str
    local_name: str  # `<global layer index>.<name>`, as in LlamaSequential and PipelineModule
    kind: str


TIED_KEY = "embed"  # the TiedLayerSpec key of the embedding / LM head


def is_adapter(spec: ParamSpec) -> bool:
    """A LoRA factor (trained, saved and exported apart from the frozen base)."""
    return LORA_PARAMETER in spec.local_name


def param_specs(shape: LlamaShape, tp_size: int) -> list[ParamSpec]:
    """Every tensor of the model, in HF order, then its LoRA adapters' (`is_adapter`) if it has any.

    A tied embedding is named `tied_modules.embed.weight` (PipelineModule's name for a
    TiedLayerSpec, used by LlamaSequential too); otherwise layer 0 holds it."""
    embed_name = f"tied_modules.{TIED_KEY}.weight" if shape.tie_word_embeddings else "0.weight"
    specs = [ParamSpec("model.embed_tokens.weight", embed_name, EMBEDDING)]
    for i in range(shape.num_layers):
        specs += [ParamSpec(f"model.layers.{i}.{hf_block_name(name, shape.model_type)}", f"{i + 1}.{name}",
                            block_kind(template, shape, tp_size))
                  for name, template in block_weights(shape, i)]
    if shape.lora_rank:  # adapters after the base weights, under PEFT's names (less its `base_model.model.`)
        for i in range(shape.num_layers):
            for a_name, b_name, base in lora_weights(shape, shape.lora_targets):
                a_kind, b_kind = lora_kinds(base, shape, tp_size)
                specs += [ParamSpec(f"model.layers.{i}.{a_name}", f"{i + 1}.{a_name}", a_kind),
                          ParamSpec(f"model.layers.{i}.{b_name}", f"{i + 1}.{b_name}", b_kind)]
    specs.append(ParamSpec("model.norm.weight", f"{shape.num_layers + 1}.weight", FINAL_NORM))
    if not shape.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", f"{shape.num_layers + 2}.weight", LM_HEAD))
    return specs


def plan_buffers(model: torch.nn.Module) -> dict:
    """The model's buffers that the TP plan lists as tensors of the checkpoint (`tp_plan.BUFFERS`), by local name."""
    return {name: b for name, b in model.named_buffers() if name.split(".", 1)[-1] in BUFFERS}


def hf_block_name(name: str, model_type: str = "mixtral") -> str:
    """The HF file name of decoder-block weight `name` (hybrid3d's, under `<i + 1>.`), under `model.layers.<i>.`;
    `model_type` names the experts' family (MOE_FILE_NAMES)."""
    if name == "mlp.router.weight":
        return MOE_FILE_NAMES[model_type][0]
    if name == ROUTER_BIAS:  # beside the router's weight: mlp.gate.e_score_correction_bias
        return MOE_FILE_NAMES[model_type][0].removesuffix("weight") + "e_score_correction_bias"
    if name.startswith("mlp.shared_expert.") and model_type in SHARED_EXPERT_FILE_PREFIX:
        return SHARED_EXPERT_FILE_PREFIX[model_type] + name.removeprefix("mlp.shared_expert.")
    if name.startswith("mlp.experts."):
        _, _, expert, proj, _ = name.split(".")  # mlp.experts.<e>.<proj>.weight
        return MOE_FILE_NAMES[model_type][1](expert, proj)
    return name  # attention, norms and the dense MLP share HF's names


def unfuse_hf_experts(hf_state_dict: Mapping, model_type: str = "mixtral") -> Mapping:
    """`hf_state_dict` under the file names `param_specs` uses: a transformers >= 5 MoE module's fused experts
    split into per-expert views (no copies), its router renamed (`model_type`: MOE_FILE_NAMES). Anything else,
    e.g. a lazy `HFSource`, is returned as it is, without reading a tensor."""
    if not any(_FUSED_MOE.match(name) for name in hf_state_dict):
        return hf_state_dict
    out = {}
    for name, tensor in hf_state_dict.items():
        match = _FUSED_MOE.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        router, expert = MOE_FILE_NAMES[model_type]
        if kind == "gate.weight":
            out[f"{prefix}.{router}"] = tensor  # (E, h)
        elif kind == "experts.down_proj":
            out.update({f"{prefix}.{expert(e, 'down_proj')}": down for e, down in enumerate(tensor)})  # (h, f) each
        else:
            for e, gate_up in enumerate(tensor):  # (2f, h): gate rows first, then up
                out[f"{prefix}.{expert(e, 'gate_proj')}"], out[f"{prefix}.{expert(e, 'up_proj')}"] = gate_up.chunk(2)
    return out


def shard_hf_tensor(spec: ParamSpec, tensor: torch.Tensor, shape: LlamaShape, tp_rank: int, tp_size: int):
    """This TP rank's slice of a full HF tensor."""
    if spec.kind == REPLICATED:
        return tensor
    if spec.kind == VOCAB:
        # Rows [r*V_padded/t, (r+1)*V_padded/t) of the vocabulary padded with zero rows; only this
        # rank's rows are padded, so a converter never copies the whole (largest) tensor.
        rows = padded_vocab_size(shape.vocab_size, tp_size, shape.vocab_pad_multiple) // tp_size
        own = tensor[tp_rank * rows:(tp_rank + 1) * rows]
        return F.pad(own, (0, 0, 0, rows - own.shape[0]))
    dim = 1 if spec.kind == ROW else 0
    return tensor.chunk(tp_size, dim=dim)[tp_rank]


def merge_tp_shards(spec: ParamSpec, shards: list[torch.Tensor], shape: LlamaShape) -> torch.Tensor:
    """The full HF tensor from all TP ranks' slices (in TP-rank order); strips vocab padding.

    Replicated tensors must agree on every rank: a difference means TP ranks drifted apart."""
    if spec.kind == REPLICATED:
        if any(not torch.equal(shard, shards[0]) for shard in shards[1:]):
            raise ValueError(f"replicated '{spec.local_name}' differs between tensor-parallel ranks")
        return shards[0]
    full = torch.cat(shards, dim=1 if spec.kind == ROW else 0)
    return full[:shape.vocab_size] if spec.kind == VOCAB else full


def load_hf_state_dict(model: torch.nn.Module, hf_state_dict: dict, shape: LlamaShape,
                       tp: TensorParallelGroup, adapters: bool = False) -> None:
    """Copy HF `LlamaForCausalLM` (or `MixtralForCausalLM`) weights into a TP model's parameters, slicing for this TP rank.

    Works for a LlamaSequential (all layers) or a pipeline stage holding some of them: a parameter
    whose local name the model lacks is skipped, but every model parameter must be filled.
    Mixtral weights may come under the file names or as a transformers >= 5 module's `state_dict()`.
    `adapters`: fill the LoRA factors instead (PEFT's tensors under `param_specs`' names), and only them; otherwise
    the factors are left as they are (drawn, or loaded apart).
    """
    hf_state_dict = unfuse_hf_experts(hf_state_dict, shape.model_type)
    params = {name: p for name, p in model.named_parameters() if (LORA_PARAMETER in name) == adapters}
    if not adapters:  # the persistent buffers the plan names (DeepSeek's router bias) load like weights
        params.update(plan_buffers(model))
    filled = set()
    for spec in param_specs(shape, tp.size):
        if spec.local_name not in params:
            continue
        if spec.hf_name not in hf_state_dict:
            raise KeyError(f"HF state dict lacks '{spec.hf_name}'")
        shard = shard_hf_tensor(spec, hf_state_dict[spec.hf_name], shape, tp.rank, tp.size)
        param = params[spec.local_name]
        with written([param]), torch.no_grad():  # ZeRO-3: this one parameter whole, then partitioned again
            if param.shape != shard.shape:
                raise ValueError(f"'{spec.hf_name}' gives shape {tuple(shard.shape)} for TP rank {tp.rank}, "
                                 f"but '{spec.local_name}' has {tuple(param.shape)}")
            param.copy_(shard)
        filled.add(spec.local_name)
    unfilled = sorted(set(params) - filled)
    if unfilled:
        raise KeyError(f"no HF weight maps to {', '.join(unfilled)}")


def gather_hf_state_dict(model: torch.nn.Module, shape: LlamaShape, tp: TensorParallelGroup,
                         grads: bool = False) -> dict:
    """Full HF-named tensors (or their gradients) of the layers this model holds, gathered over TP.

    A collective over the TP group: every TP rank must call it; each gets the full tensors. Under ZeRO-3 also over
    the data-parallel group, one parameter at a time (its gradients are partitioned: `grads` is refused).
    """
    params = dict(model.named_parameters())
    if not grads:
        params.update(plan_buffers(model))
    out = {}
    for spec in param_specs(shape, tp.size):
        if spec.local_name not in params:
            continue
        param = params[spec.local_name]
        if grads and is_partitioned(param):
            raise ValueError(f"'{spec.local_name}' is partitioned by ZeRO-3: its gradient is not held whole")
        with gathered([param]):
            local = param.grad if grads else param.detach()
            if local is None:
                raise ValueError(f"'{spec.local_name}' has no gradient")
            local = local.clone() if is_partitioned(param) else local.contiguous()
        shards = [local]
        if tp.size > 1:
            shards = [torch.empty_like(local) for _ in range(tp.size)]
            dist.all_gather(shards, local, group=tp.group)
        out[spec.hf_name] = merge_tp_shards(spec, shards, shape)
    return out
