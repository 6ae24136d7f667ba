"""The process groups of a layout, as the `mpu` DeepSpeed expects, built on DeepSpeed's grid."""

import deepspeed.comm as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid

from hybrid3d.errors import LayoutError
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.parallel.tensor_parallel.group import TensorParallelGroup


def build_groups(layout: ParallelLayout) -> "ProcessGroups":
    """Create the process groups (a collective call: every rank must call it, in the same order)."""
    if not dist.is_initialized():
        raise RuntimeError("initialise the process group first (deepspeed.init_distributed)")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(
            f"layout {layout.name} needs {layout.world_size} ranks (tp*pp*dp = {layout.tp}*{layout.pp}*{layout.dp}) "
            f"but the world has {world}")
    return ProcessGroups(layout, PipelineParallelGrid(topology=layout.topology()))




class ProcessGroups:
    """The `mpu` object DeepSpeed (engine, ZeRO, checkpointing, activation checkpointing) expects.

    It adapts DeepSpeed's `PipelineParallelGrid`, whose TP group is the *slice* group, and adds
    the Megatron names DeepSpeed's `bwc` helpers look for (`get_tensor_model_parallel_group`).
    "Model parallel" in DeepSpeed's sense is pipe x TP (all ranks holding one model replica);
    DeepSpeed uses it for checkpoint numbering and gradient-norm reductions.
    """

    def __init__(self, layout: ParallelLayout, grid: PipelineParallelGrid):
        self.layout = layout
        self.grid = grid

    # Tensor parallel: the grid's slice group.
    def get_tensor_model_parallel_group(self):
        return self.grid.get_slice_parallel_group()

    def get_tensor_model_parallel_rank(self) -> int:
        return self.grid.get_slice_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.grid.get_slice_parallel_world_size()

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group."""
        return dist.get_rank() - self.get_tensor_model_parallel_rank()

    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    # Model parallel (pipe x TP).
    def get_model_parallel_group(self):
        return self.grid.get_model_parallel_group()

    def get_model_parallel_rank(self) -> int:
        return self.grid.get_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.grid.get_model_parallel_world_size()

    # Data parallel.
    def get_data_parallel_group(self):
        return self.grid.get_data_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return self.grid.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.grid.get_data_parallel_world_size()

    def get_data_parallel_group_ranks(self):
        return self.grid.get_data_parallel_group_ranks()

    # Pipeline.
    def get_pipe_parallel_group(self):
        return self.grid.get_pipe_parallel_group()

    def get_pipe_parallel_rank(self) -> int:
        return self.grid.get_pipe_parallel_rank()

    def get_pipe_parallel_world_size(self) -> int:
        return self.grid.get_pipe_parallel_world_size()

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    @property
    def stage_id(self) -> int:
        return self.grid.get_stage_id()

    def tensor_parallel(self) -> TensorParallelGroup:
        """What the TP layers need: the slice group and this rank's place in it."""
        size = self.get_tensor_model_parallel_world_size()
        return TensorParallelGroup(group=self.get_tensor_model_parallel_group() if size > 1 else None,
                                   rank=self.get_tensor_model_parallel_rank(), size=size)
