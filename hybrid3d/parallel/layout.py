"""The 3D layout: tensor (t), pipeline (p) and data (d) parallel sizes, and its process groups.

DeepSpeed's `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)` orders its axes
['pipe', 'data', 'model'], so  rank = pipe * d * t + data * t + model:  TP ranks are neighbours
(same node on GPU clusters), then DP, then pipeline stages.
"""

from dataclasses import dataclass

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from hybrid3d.errors import LayoutError


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

    def topology(self) -> PipeModelDataParallelTopology:
        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)
