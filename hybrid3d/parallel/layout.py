"""The layout: tensor (t), pipeline (p), data (d) and context (c) parallel sizes, and its process groups.

DeepSpeed's `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)` orders its axes
['pipe', 'data', 'model'], so  rank = pipe * d * t + data * t + model:  TP ranks are neighbours
(same node on GPU clusters), then DP, then pipeline stages.

Context parallelism is presented to DeepSpeed as part of its data axis: the topology has d·c data
ranks, data' = data * c + cp, so rank = ((pipe * d + data) * c + cp) * t + model and a CP group's c ranks
sit next to TP (Megatron-LM orders its groups tp-cp-dp-pp the same way). The c ranks of a CP group hold
the same weights and see different positions of the same sequences, which is what DeepSpeed's
engines, ZeRO stages and optimizer wrappers need to know: they partition and average over d·c ranks
(the loss carries the rest: `parallel.context_parallel.sequence_mean`). DeepSpeed's own sequence-parallel
group cannot carry CP under the pipeline: PipelineEngine and the BF16_Optimizer path reduce gradients
over `mpu.get_data_parallel_group()` only (runtime/engine.py `_reduce_non_expert_gradients`).

Expert parallelism (`ep`, e) adds no axis either: the e consecutive data ranks of one (pipe, model) pair form
an expert-parallel group, each holding E/e whole experts (parallel/expert_parallel.py), so e divides d.

Sequence parallelism (`sp`) uses the TP group and adds no axis; it is part of the layout because it
changes the shape of every activation between TP regions, (b, s/(c·t), h).
"""

from dataclasses import dataclass

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from hybrid3d.errors import LayoutError


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    dp: int
    cp: int = 1
    sp: bool = False
    ep: int = 1
    ring: bool = False  # context parallelism by ring attention (context_parallel_comm 'p2p' or 'a2a+p2p')
    cp_a2a: int = 1  # with a ring: the Ulysses ranks inside each ring member ('a2a+p2p': context_parallel_a2a_size)

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.sp and self.tp == 1:
            raise LayoutError("hybrid3d.sequence_parallel needs hybrid3d.tensor_parallel_size > 1 (it splits the "
                              "sequence over the tensor-parallel group)")
        if self.dp % self.ep:
            raise LayoutError(f"hybrid3d.expert_parallel_size ({self.ep}) must divide the data-parallel size ({self.dp})")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, sp: bool = False,
                  ep: int = 1, ring: bool = False, cp_a2a: int = 1) -> "ParallelLayout":
        """Derive dp = world / (tp * pp * cp)."""
        if tp < 1 or pp < 1 or cp < 1:
            raise LayoutError(f"hybrid3d.tensor_parallel_size ({tp}), pipeline_parallel_size ({pp}) and "
                              f"context_parallel_size ({cp}) must be >= 1")
        if world_size % (tp * pp * cp):
            names = "hybrid3d.tensor_parallel_size * hybrid3d.pipeline_parallel_size" + (
                " * hybrid3d.context_parallel_size" if cp > 1 else "")
            sizes = f"{tp} * {pp}" + (f" * {cp}" if cp > 1 else "")
            raise LayoutError(f"world size {world_size} is not divisible by {names} = {sizes} = {tp * pp * cp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp * cp), cp=cp, sp=sp, ep=ep, ring=ring and cp > 1,
                   cp_a2a=cp_a2a if ring and cp > 1 else 1)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def name(self) -> str:
        tp = f"TP{self.tp}" + ("+SP" if self.sp else "")
        cp = f"-CP{self.cp}" if self.cp > 1 else ""
        ep = f"-EP{self.ep}" if self.ep > 1 else ""
        return f"{tp}{cp}-PP{self.pp}-DP{self.dp}{ep}"

    def topology(self) -> PipeModelDataParallelTopology:
        """DeepSpeed's topology: d·c data-parallel ranks (CP folded into the data axis, module docstring)."""
        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp * self.cp)
