"""The expert weights of an expert-parallel run in a checkpoint.

DeepSpeed 0.19.8 writes per-expert files (`layer_<l>_expert_<e>_mp_rank_XX_model_states.pt`) only for its own
MoE layer, found by class and by its parameter names (`deepspeed_moe.experts.deepspeed_experts.<e>`); for any
other model it writes the module states of data-parallel rank 0 alone (`runtime/engine.py`
`_save_moe_checkpoint`), which hold only that rank's experts. So, next to DeepSpeed's files, the ranks of
expert-data-parallel rank 0 (data rank < e) each write their experts, under their global names, to
`experts_ep_rank_<r>_mp_rank_<m>_model_states.pt`; loading takes DeepSpeed's module states without strictness
(they lack the other ranks' experts) and then this rank's expert file, every expert tensor checked by name.
The optimizer states need nothing extra: ZeRO's per-rank files hold each rank's partitions of every parameter
group, the expert groups (partitioned over expert data parallelism) included.
"""

from pathlib import Path

import torch

from hybrid3d.ds_internals.durable_save import fsync_file
from hybrid3d.errors import CheckpointError, LayoutError

EXPERT_PARAM = ".mlp.experts."  # hybrid3d's expert parameter names: `<i>.mlp.experts.<e>.<proj>.weight`


def check_expert_checkpoints(ep: int, pp: int, universal: bool = False) -> None:
    """Expert-parallel checkpoints are written and read without a pipeline, at the layout they were saved at:
    DeepSpeed's PipelineEngine takes a MoE model's checkpoint dict for its module state (`pipe/engine.py`
    `load_module_state_dict`), and `ds_to_universal` knows nothing of expert placement. The training job
    checks it at start-up (it always saves at the end), the trainer at every save and load."""
    if ep > 1 and (pp > 1 or universal):
        raise LayoutError(f"hybrid3d.expert_parallel_size ({ep}): checkpoints are supported with "
                          "pipeline_parallel_size 1 and without resharding (load_universal) only for now")


def expert_file(tag_dir, ep_rank: int, mp_rank: int) -> Path:
    return Path(tag_dir) / f"experts_ep_rank_{ep_rank:02d}_mp_rank_{mp_rank:02d}_model_states.pt"


def expert_files(tag_dir, mp_rank: int) -> list[Path]:
    """Every expert-parallel rank's expert file of TP rank `mp_rank`, in EP-rank order (none without EP)."""
    return sorted(Path(tag_dir).glob(f"experts_ep_rank_*_mp_rank_{mp_rank:02d}_model_states.pt"))


def save_experts(module, tag_dir, ep_rank: int, mp_rank: int, snapshot=None) -> dict:
    """Write (and fsync) this rank's expert file: {path: bytes}. With `snapshot` (an asynchronous save,
    checkpoint/host_copy.Snapshot) its state is copied there, to be written in the background, and nothing is
    written now ({} returned)."""
    path = expert_file(tag_dir, ep_rank, mp_rank)
    # each expert tensor a storage of its own on the host (under ZeRO they view the flat buffer of their group)
    state = {n: t.detach().to("cpu", copy=True) for n, t in module.state_dict().items() if EXPERT_PARAM in n}
    if snapshot is not None:
        snapshot.keep(path, state)
        return {}
    torch.save(state, path)
    return {str(path): fsync_file(path)}


def load_experts(module, tag_dir, ep_rank: int, mp_rank: int) -> None:
    path = expert_file(tag_dir, ep_rank, mp_rank)
    if not path.is_file():
        raise CheckpointError(f"{path}: the expert weights of expert-parallel rank {ep_rank} are missing")
    state = torch.load(path, map_location="cpu", weights_only=True)
    params = {n: p for n, p in module.named_parameters() if EXPERT_PARAM in n}
    if set(state) != set(params):
        other = sorted(set(state) ^ set(params))[0]
        raise CheckpointError(f"{path}: holds other experts than this rank's ({other})")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
