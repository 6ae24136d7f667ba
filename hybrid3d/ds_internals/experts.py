"""hybrid3d's mixture-of-experts blocks as DeepSpeed 0.19.8's engine and ZeRO see expert parallelism.

What DeepSpeed provides and hybrid3d uses as it is:
- the process groups: `deepspeed.utils.groups._create_expert_data_and_model_parallel(e, mpu)` builds, from the
  mpu's topology (rank = pipe·D·T + data·T + model), the expert-parallel groups (e consecutive data-parallel
  ranks of one pipe stage and TP index) and the expert-data-parallel groups (the ranks of one data-parallel
  group holding the same experts), registered under the name `ep_size_<e>`;
- the parameter marks of its own MoE layer, `param.allreduce = False` and `param.group_name = 'ep_size_<e>'`
  (`deepspeed.moe.utils.is_moe_param`), set by the model (model/moe.py `Experts`);
- the optimizer parameter groups: `split_params_into_different_moe_groups_for_optimizer` puts the expert
  parameters in groups marked `moe`, which ZeRO-1/2 partition over the expert-data-parallel group
  (`stage_1_and_2.py` `_configure_moe_settings`);
- gradient reduction: with `engine.has_moe_layers` ZeRO-1/2 (`average_tensor`; the engine's own ZeRO-0 path
  `_reduce_expert_gradients` likewise) sum expert gradients over the expert-data-parallel group and divide by the whole
  data-parallel size, which is the data-parallel mean of the loss: each expert's local gradient already sums
  the contributions of the e ranks of its expert-parallel group, brought back by the combine's backward.
  ZeRO's gradient norm (`get_grad_norm_direct` over the data-parallel group, `_average_expert_grad_norms`)
  then counts every expert once.

Where it does not fit, and what is done instead:
- `engine.has_moe_layers` is set only for instances of `deepspeed.moe.layer.MoE` (or AutoEP's layer) found
  in `_configure_distributed_model` (`runtime/engine.py:2100-2107`); hybrid3d's block cannot be one (model/moe.py
  says why). `engine_sees_experts` makes the engine's name `MoE` match hybrid3d's class as well, for the
  duration of `deepspeed.initialize` only: everything else of its MoE set-up then runs as DeepSpeed wrote it.
  Outside that call (checkpoint save and load, which look for DeepSpeed's own `deepspeed_moe.experts` names)
  the engine does not recognise the block: hybrid3d writes the experts itself (checkpoint/experts.py), and
  refuses expert-parallel checkpoints under a pipeline, where PipelineEngine's `load_module_state_dict` takes
  a MoE model's whole checkpoint dict for its module state.
- `_create_expert_data_and_model_parallel` skips creation when a group of that name exists, and DeepSpeed keeps
  the groups in module globals: a second layout in the same process (the tests run several per world) would
  get the first one's groups. `create_expert_groups` drops the stale entries first.
- The fp32 ZeRO-0 path clips with `runtime/utils.py: clip_grad_norm_`, which averages per-rank norms over data
  parallelism instead of summing the experts' squares: expert parallelism is refused with ZeRO stage 0.
"""

from contextlib import contextmanager

import deepspeed.comm as dist

from hybrid3d.ds_internals import swapped


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups of size e (`groups.py`: f"ep_size_{e}")."""
    return f"ep_size_{ep_size}"


def create_expert_groups(ep_size: int, mpu) -> tuple:
    """Create the expert-parallel and expert-data-parallel groups of size e over `mpu`'s topology (a collective:
    every rank calls it). Returns (name, ep group, ep ranks, edp group, edp ranks) of this rank."""
    from deepspeed.utils import groups

    name = expert_group_name(ep_size)
    for registry in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                     groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        registry.pop(name, None)  # another layout's groups of the same size (module docstring)
    # It reads the data-parallel size through `groups.mpu`, which the engine sets to the same mpu later.
    with swapped(groups, "mpu", mpu):
        groups._create_expert_data_and_model_parallel(ep_size, mpu=mpu)
    ep_ranks = [int(r) for r in groups._get_expert_parallel_group_ranks(name)]
    edp_ranks = [int(r) for r in groups._get_expert_data_parallel_group_ranks(name)]
    if dist.get_rank() not in ep_ranks or dist.get_rank() not in edp_ranks:
        raise RuntimeError(f"DeepSpeed's expert groups {name} do not hold rank {dist.get_rank()}")
    return (name, groups._get_expert_parallel_group(name), ep_ranks,
            groups._get_expert_data_parallel_group(name), edp_ranks)


@contextmanager
def engine_sees_experts(moe_cls):
    """Inside the block, `DeepSpeedEngine` counts modules of `moe_cls` (which carry `num_experts`) as MoE layers
    (`has_moe_layers`), so its optimizer, ZeRO and gradient reduction treat marked parameters as experts."""
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime import engine

    with swapped(engine, "MoE", (MoE, moe_cls)):
        yield
