"""Aux-loss-free load balancing (DeepSeek-V3 report, arXiv 2412.19437, §2.1.2; Wang et al. 2024, arXiv 2408.15664):
instead of a load-balancing loss, each router's per-expert score correction bias b (`e_score_correction_bias`, used
only to choose experts, not to weigh them) moves once per optimizer step by

    b_e += rate · sign(mean(c) − c_e),

c_e the tokens routed to expert e in that step's global batch: an overloaded expert becomes less likely to be chosen,
an underloaded one more. As Megatron-core (`moe_utils.get_updated_expert_bias`), the counts are summed over the ranks
that route different tokens — the data-parallel group (its expert-parallel ranks included, and the context-parallel
ranks DeepSpeed folds in); the tensor-parallel ranks route the same tokens and are not summed. The bias is a
persistent fp32 buffer: DeepSpeed saves and restores it with the module, and the HF export writes it.
"""

import deepspeed.comm as dist
import torch
from torch import nn

from hybrid3d.model.moe import Router


def biased_routers(module: nn.Module) -> list[Router]:
    """The routers with a score correction bias, in module order (the same on every rank of a stage)."""
    return [m for m in module.modules() if isinstance(m, Router) and m.e_score_correction_bias is not None]


def start_counting(module: nn.Module) -> None:
    """Make the biased routers count their training assignments (`Router.token_counts`)."""
    for router in biased_routers(module):
        router.count_tokens = True


@torch.no_grad()
def update_expert_biases(module: nn.Module, rate: float, data_parallel_group, data_parallel_size: int) -> None:
    """One balancing update of every biased router of `module`, from the counts since the last (one all-reduce of
    all of them over the data-parallel group)."""
    routers = biased_routers(module)
    if not routers:
        return
    counts = torch.stack([router.take_token_counts() for router in routers])  # (layers, E)
    if data_parallel_size > 1:
        dist.all_reduce(counts, group=data_parallel_group)
    for router, layer_counts in zip(routers, counts):
        router.e_score_correction_bias += rate * torch.sign(layer_counts.mean() - layer_counts)
