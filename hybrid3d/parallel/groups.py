"""The process groups of a layout, as the `mpu` DeepSpeed expects, built on DeepSpeed's grid."""

import deepspeed.comm as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid

from hybrid3d.ds_internals import grid_topology
from hybrid3d.ds_internals.experts import create_expert_groups
from hybrid3d.ds_internals.shm_all_reduce import shm_all_reduce_spans
from hybrid3d.errors import LayoutError
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.parallel.rank_groups import ContextParallelGroup, ExpertParallelGroup, TensorParallelGroup


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
    context = (_context_group(grid_topology(grid), layout.cp, layout.ring, layout.cp_a2a) if layout.cp > 1
               else ContextParallelGroup.single())
    groups = ProcessGroups(layout, grid, context)
    if layout.ep == 1:
        return groups
    return ProcessGroups(layout, grid, context, _expert_group(groups, grid_topology(grid), layout))


def _expert_group(mpu: "ProcessGroups", topology, layout: ParallelLayout) -> ExpertParallelGroup:
    """DeepSpeed's expert groups (ds_internals/experts.py), checked against the topology: the expert-parallel
    group is the e consecutive data ranks of this rank's (pipe, model) pair, data = (data // e)·e + ep rank,
    and the expert-data-parallel group the data ranks ≡ data (mod e), which hold the same experts."""
    name, group, ep_ranks, _, edp_ranks = create_expert_groups(layout.ep, mpu)
    me = topology.get_coord(dist.get_rank())
    first = me.data - me.data % layout.ep
    expected_ep = [topology.get_rank(pipe=me.pipe, data=first + r, model=me.model) for r in range(layout.ep)]
    expected_edp = [topology.get_rank(pipe=me.pipe, data=d, model=me.model)
                    for d in range(me.data % layout.ep, layout.dp, layout.ep)]
    if ep_ranks != expected_ep or edp_ranks != expected_edp:
        raise RuntimeError(f"DeepSpeed's expert groups {ep_ranks} / {edp_ranks} are not the layout's "
                           f"{expected_ep} / {expected_edp}")
    return ExpertParallelGroup(group=group, rank=me.data % layout.ep, size=layout.ep, name=name)


def _context_group(topology, cp: int, ring: bool, a2a: int = 1) -> ContextParallelGroup:
    """Create every CP group, the c ranks of one (pipe, model) pair whose data' = data·c + r differ in r only
    (a collective: all ranks create all groups in the same order), and return this rank's. With a2a+p2p (`a2a` >
    1) also each group's Ulysses groups (a2a consecutive ranks) and rings (the ranks at one place in those)."""
    mine = None
    for pipe in range(topology.get_dim("pipe")):
        for model in range(topology.get_dim("model")):
            for data in range(0, topology.get_dim("data"), cp):
                ranks = [topology.get_rank(pipe=pipe, data=data + r, model=model) for r in range(cp)]
                group = dist.new_group(ranks=ranks)
                a2a_groups = ring_groups = [None] * cp
                if a2a > 1:
                    a2a_groups = [dist.new_group(ranks=ranks[k:k + a2a]) for k in range(0, cp, a2a)]
                    ring_groups = [dist.new_group(ranks=ranks[k::a2a]) for k in range(a2a)]
                if dist.get_rank() in ranks:
                    r = ranks.index(dist.get_rank())
                    mine = ContextParallelGroup(group=group, rank=r, size=cp, ring=ring, a2a_size=a2a,
                                                a2a_group=a2a_groups[r // a2a] if a2a > 1 else None,
                                                ring_group=ring_groups[r % a2a] if a2a > 1 else None)
    return mine


class ProcessGroups:
    """The `mpu` object DeepSpeed (engine, ZeRO, checkpointing, activation checkpointing) expects.

    It adapts DeepSpeed's `PipelineParallelGrid`, whose TP group is the *slice* group, and adds
    the Megatron names DeepSpeed's `bwc` helpers look for (`get_tensor_model_parallel_group`).
    "Model parallel" in DeepSpeed's sense is pipe x TP (all ranks holding one model replica);
    DeepSpeed uses it for checkpoint numbering and gradient-norm reductions.
    """

    def __init__(self, layout: ParallelLayout, grid: PipelineParallelGrid,
                 context: ContextParallelGroup = ContextParallelGroup.single(),
                 expert: ExpertParallelGroup = ExpertParallelGroup.single()):
        self.layout = layout
        self.grid = grid
        self._context = context
        self._expert = expert

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

    # Data parallel as DeepSpeed sees it: the d·c ranks holding one model slice (CP folded in, layout.py).
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
        group = self.get_tensor_model_parallel_group() if size > 1 else None
        return TensorParallelGroup(group=group, rank=self.get_tensor_model_parallel_rank(), size=size,
                                   sequence_parallel=self.layout.sp,
                                   shm_all_reduce=size > 1 and shm_all_reduce_spans(group))

    def context_parallel(self) -> ContextParallelGroup:
        """What attention and the loss need for context parallelism (a group of one without it)."""
        return self._context

    def expert_parallel(self) -> ExpertParallelGroup:
        """The expert-parallel group the MoE blocks dispatch over (a group of one without expert parallelism)."""
        return self._expert

    def data_shard(self) -> tuple[int, int]:
        """(rank, size) of this rank's data shard: the d replicas that read different sequences; the c CP
        ranks inside one DeepSpeed data-parallel block read the same ones."""
        return self.get_data_parallel_rank() // self.layout.cp, self.layout.dp
