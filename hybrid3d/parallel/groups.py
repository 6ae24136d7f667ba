"""The process groups of a layout, as the `mpu` DeepSpeed expects, built on DeepSpeed's grid."""

import deepspeed.comm as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid

from hybrid3d.errors import LayoutError
from hybrid3d.parallel.layout import CONTEXT_AXIS, ParallelLayout
from hybrid3d.parallel.tensor_parallel.group import ContextParallelGroup, TensorParallelGroup


def build_groups(layout: ParallelLayout) -> "ProcessGroups":
    """Create the process groups (a collective call: every rank must call it, in the same order)."""
    if not dist.is_initialized():
        raise RuntimeError("initialise the process group first (deepspeed.init_distributed)")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(
            f"layout {layout.name} needs {layout.world_size} ranks (tp*pp*dp*cp = {layout.tp}*{layout.pp}*{layout.dp}"
            f"*{layout.cp}) but the world has {world}")
    grid = PipelineParallelGrid(topology=layout.topology())
    context = _context_groups(grid._topo) if layout.cp > 1 else None
    return ProcessGroups(layout, grid, context)


class _Group:
    """One rank's group of a family of disjoint groups: the process group and the member ranks."""

    def __init__(self, ranks: list[int], group):
        self.ranks, self.group = ranks, group

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank())

    @property
    def size(self) -> int:
        return len(self.ranks)


def _family(topology, vary: tuple[str, ...]) -> _Group:
    """Create every group of ranks that differ only along the axes `vary` (a collective: all ranks create
    all groups in the same order) and return this rank's."""
    fixed = [a for a in topology.get_axis_names() if a not in vary]
    mine = None
    seen = set()
    for rank in range(topology.world_size()):
        coord = topology.get_coord(rank)
        key = tuple(getattr(coord, a) for a in fixed)
        if key in seen:
            continue
        seen.add(key)
        ranks = sorted(topology.filter_match(**dict(zip(fixed, key))))
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = _Group(ranks, group)
    return mine


def _context_groups(topology) -> dict:
    """The groups DeepSpeed's grid lacks for context parallelism: the CP group (its Ulysses all-to-alls),
    the sequence-data-parallel group d·c (gradient reduction and ZeRO partitions: DeepSpeed's
    `seq_data_parallel_group`) and the model-parallel group pipe x TP without the CP ranks (gradient-norm
    reductions and checkpoint file numbering: CP ranks hold the same weights)."""
    return {"context": _family(topology, (CONTEXT_AXIS,)),
            "sequence_data": _family(topology, ("data", CONTEXT_AXIS)),
            "model": _family(topology, ("pipe", "model"))}




class ProcessGroups:
    """The `mpu` object DeepSpeed (engine, ZeRO, checkpointing, activation checkpointing) expects.

    It adapts DeepSpeed's `PipelineParallelGrid`, whose TP group is the *slice* group, and adds
    the Megatron names DeepSpeed's `bwc` helpers look for (`get_tensor_model_parallel_group`).
    "Model parallel" in DeepSpeed's sense is pipe x TP (all ranks holding one model replica);
    DeepSpeed uses it for checkpoint numbering and gradient-norm reductions.
    """

    def __init__(self, layout: ParallelLayout, grid: PipelineParallelGrid, context: dict | None = None):
        self.layout = layout
        self.grid = grid
        self._context = context  # the groups of `_context_groups` when cp > 1

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

    # Model parallel (pipe x TP; the grid's also spans the CP ranks, so with cp > 1 it is replaced).
    def get_model_parallel_group(self):
        return self._context["model"].group if self._context else self.grid.get_model_parallel_group()

    def get_model_parallel_rank(self) -> int:
        return self._context["model"].rank if self._context else self.grid.get_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self._context["model"].size if self._context else self.grid.get_model_parallel_world_size()

    # Context parallel, under the names DeepSpeed's `utils/groups.py` asks an mpu for. Without CP the
    # sequence-parallel size is 1 (DeepSpeed then never asks for its group) and the sequence-data-parallel
    # group is DP.
    def get_sequence_parallel_group(self):
        return self._context["context"].group if self._context else None

    def get_sequence_parallel_rank(self) -> int:
        return self._context["context"].rank if self._context else 0

    def get_sequence_parallel_world_size(self) -> int:
        return self._context["context"].size if self._context else 1

    def get_sequence_data_parallel_group(self):
        return self._context["sequence_data"].group if self._context else self.get_data_parallel_group()

    def get_sequence_data_parallel_rank(self) -> int:
        return self._context["sequence_data"].rank if self._context else self.get_data_parallel_rank()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._context["sequence_data"].size if self._context else self.get_data_parallel_world_size()

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
        """What the TP layers need: the slice group, this rank's place in it, and whether activations
        between TP regions are split along the sequence."""
        size = self.get_tensor_model_parallel_world_size()
        return TensorParallelGroup(group=self.get_tensor_model_parallel_group() if size > 1 else None,
                                   rank=self.get_tensor_model_parallel_rank(), size=size,
                                   sequence_parallel=self.layout.sp)

    def context_parallel(self) -> ContextParallelGroup:
        """What attention and the loss need for context parallelism (a group of one without it)."""
        if not self._context:
            return ContextParallelGroup.single()
        context = self._context["context"]
        return ContextParallelGroup(group=context.group, rank=context.rank, size=context.size)
