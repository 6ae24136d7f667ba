"""The process groups as the model's layers see them (no DeepSpeed import: the lowest layer)."""

from dataclasses import dataclass
from typing import Any, ClassVar, Optional


@dataclass(frozen=True)
class _RankGroup:
    """A process group plus this rank's position in it. Layers receive it instead of reading a global,
    so the model's math depends only on what it is given (a single-process model gets `single()`).
    `group` is a torch/DeepSpeed process group, or None for a group of one: every collective is a no-op."""

    group: Optional[Any]
    rank: int
    size: int
    KIND: ClassVar[str] = ""

    @classmethod
    def single(cls):
        return cls(group=None, rank=0, size=1)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"{self.KIND} rank {self.rank} is outside a group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a {self.KIND} group of size {self.size} needs a process group")


@dataclass(frozen=True)
class TensorParallelGroup(_RankGroup):
    """The TP group (the grid's slice group) as the TP layers see it.

    `sequence_parallel` (Korthikanti et al. 2022, §4.2.2): outside the TP regions activations are
    split along the sequence over the same group, (b, s/t, h); the TP layers then all-gather the
    sequence where Megatron's f copies and reduce-scatter it where g all-reduces.
    """

    sequence_parallel: bool = False
    # SUM all-reduces may take DeepSpeed's CPU shared-memory kernel: the group is the whole world, on one host
    # (ds_internals/shm_all_reduce.py)
    shm_all_reduce: bool = False
    KIND: ClassVar[str] = "tensor-parallel"

    def __post_init__(self):
        super().__post_init__()
        if self.sequence_parallel and self.size == 1:
            raise ValueError("sequence parallelism needs a tensor-parallel group of size > 1")


@dataclass(frozen=True)
class ContextParallelGroup(_RankGroup):
    """The context-parallel (DeepSpeed-Ulysses) group: the c ranks that each hold s/c of every sequence
    and exchange attention heads for sequence positions around the attention core."""

    ring: bool = False  # ring attention over the group (parallel/ring_attention.py), else DeepSpeed-Ulysses
    # a2a+p2p (USP, Fang & Zhao 2024): Ulysses over `a2a_size` consecutive ranks of the group (`a2a_group`), ring
    # attention over the size/a2a_size ranks with the same place in theirs (`ring_group`)
    a2a_size: int = 1
    a2a_group: Optional[Any] = None
    ring_group: Optional[Any] = None
    KIND: ClassVar[str] = "context-parallel"

    def ring_members(self) -> "ContextParallelGroup":
        """The ring this rank attends around: the whole group, or with a2a+p2p its ring_group."""
        if self.a2a_size == 1:
            return self
        return ContextParallelGroup(group=self.ring_group, rank=self.rank // self.a2a_size,
                                    size=self.size // self.a2a_size, ring=True)

    def a2a_members(self) -> "ContextParallelGroup":
        """The Ulysses group of a2a+p2p (the whole group without a ring)."""
        return ContextParallelGroup(group=self.a2a_group, rank=self.rank % self.a2a_size, size=self.a2a_size)


@dataclass(frozen=True)
class ExpertParallelGroup(_RankGroup):
    """The expert-parallel group (GShard, Lepikhin et al. 2021; DeepSpeed-MoE, Rajbhandari et al. 2022): the
    e data-parallel ranks that each hold E/e whole experts and exchange tokens with one another by all-to-all.
    EP rank r holds experts [r·E/e, (r+1)·E/e). `name` is DeepSpeed's group name (`ep_size_<e>`), which the
    expert parameters carry so that the engine reduces their gradients over the expert-data-parallel group."""

    name: str = ""
    KIND: ClassVar[str] = "expert-parallel"

    def local_experts(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds."""
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts cannot be split over an expert-parallel group of {self.size}")
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)
