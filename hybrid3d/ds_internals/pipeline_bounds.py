"""Stage bounds given to DeepSpeed's PipelineModule instead of computed by one of its partition methods.

PipelineModule cuts its layer specs in `_partition_layers(method)` (`runtime/pipe/module.py:396-447`): it sets
`self.parts` (the bounds of its `num_stages` stages) and `_set_bounds` of the rank's own stage; its methods are
"uniform", "parameters" and "type:<regex>". DualPipeVModule (2p stages) and the interleaved module (v·p stages)
multiply `num_stages` and then call it. `with_stage_bounds(cls)` is `cls` with `_PresetBounds` between it and
PipelineModule (method resolution order cls, _PresetBounds, PipelineModule), so those multiply first and the
bounds then come from the constructor's `stage_bounds(num_stages)` (`model/pipe.stage_bounds`, the project's one
owner of stage bounds).
"""

from functools import lru_cache

from deepspeed.pipe import PipelineModule


class _PresetBounds(PipelineModule):
    def __init__(self, *args, stage_bounds, **kwargs):
        self._preset_bounds = stage_bounds  # PipelineModule.__init__ partitions: set before it runs
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method="uniform"):
        stage = self._topo.get_coord(self.global_rank).pipe
        self.parts = list(self._preset_bounds(self.num_stages))
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


@lru_cache(maxsize=None)  # one class per module class: stable for isinstance checks and pickling
def with_stage_bounds(module_cls: type) -> type:
    """`module_cls` (PipelineModule, DualPipeVModule or the interleaved module) whose constructor takes
    `stage_bounds`: a function of the number of stages to their bounds, used instead of `partition_method`."""
    if module_cls is PipelineModule:
        return _PresetBounds
    cls = type(f"{module_cls.__name__}WithStageBounds", (module_cls, _PresetBounds), {})
    assert cls.__mro__.index(_PresetBounds) == cls.__mro__.index(PipelineModule) - 1
    return cls
