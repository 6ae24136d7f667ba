"""The 3D layout: tensor (t), pipeline (p) and data (d) parallel sizes, and its process groups.

DeepSpeed's `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)` orders its axes
['pipe', 'data', 'model'], so  rank = pipe * d * t + data * t + model:  TP ranks are neighbours
(same node on GPU clusters), then DP, then pipeline stages.
"""

from dataclasses import dataclass
from typing import Any, Optional

import deepspeed.comm as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid


@dataclass(frozen=True)
class TensorParallelGroup:
    """A process group plus this rank's position in it, as the TP layers see it.

    Layers receive it instead of reading a global, so the model's math depends only on what it
    is given (a single-process model gets `TensorParallelGroup.single()`).
    `group` is a torch/DeepSpeed process group (the grid's slice group), or None when
    the model is not tensor-parallel (size 1): then every collective is a no-op.
    """

    group: Optional[Any]
    rank: int
    size: int

    @classmethod
    def single(cls) -> "TensorParallelGroup":
        return cls(group=None, rank=0, size=1)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a tensor-parallel group of size {self.size} needs a process group")


class LayoutError(ValueError):
    """A layout that cannot work for this world size or model; the message names the numbers."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    dp: int

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> "ParallelLayout":
        """Derive dp = world / (tp * pp)."""
        if tp < 1 or pp < 1:
            raise LayoutError(f"tensor_parallel_size ({tp}) and pipeline_parallel_size ({pp}) must be >= 1")
        if world_size % (tp * pp):
            raise LayoutError(
                f"world size {world_size} is not divisible by tensor_parallel_size * pipeline_parallel_size "
                f"= {tp} * {pp} = {tp * pp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        return f"TP{self.tp}-PP{self.pp}-DP{self.dp}"

    def check_model(self, shape) -> None:
        """Raise LayoutError if this layout cannot split `shape` (a `LlamaShape`) exactly."""
        t = self.tp
        if shape.num_heads % t:
            raise LayoutError(f"num_attention_heads ({shape.num_heads}) is not divisible by tensor_parallel_size ({t})")
        kv = shape.num_kv_heads
        if kv % t and t % kv:
            raise LayoutError(
                f"num_key_value_heads ({kv}) and tensor_parallel_size ({t}) must divide one another "
                f"(kv heads are split when tp <= {kv}, replicated when tp is a multiple of {kv})")
        if shape.intermediate_size % t:
            raise LayoutError(
                f"intermediate_size ({shape.intermediate_size}) is not divisible by tensor_parallel_size ({t})")
        if shape.num_layers < self.pp:
            raise LayoutError(
                f"pipeline_parallel_size ({self.pp}) exceeds num_hidden_layers ({shape.num_layers}): "
                "every stage needs at least one decoder block")

    def topology(self) -> PipeModelDataParallelTopology:
        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)

    def build_groups(self) -> "ProcessGroups":
        """Create the process groups (a collective call: every rank must call it, in the same order)."""
        if not dist.is_initialized():
            raise RuntimeError("initialise the process group first (deepspeed.init_distributed)")
        world = dist.get_world_size()
        if world != self.world_size:
            raise LayoutError(
                f"layout {self.name} needs {self.world_size} ranks (tp*pp*dp = {self.tp}*{self.pp}*{self.dp}) "
                f"but the world has {world}")
        return ProcessGroups(self, PipelineParallelGrid(topology=self.topology()))


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
