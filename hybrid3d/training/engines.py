"""Which DeepSpeed engine serves a run: one table, keyed by the validated config.

    pipeline  schedule     pipeline_zero2  experts  engine (how it is built)
    no        -            -               any      DeepSpeedEngine (deepspeed.initialize)
    yes       1f1b         no              no       PipelineEngine (deepspeed.initialize)
    yes       dualpipev    no              no       DualPipeVEngine (deepspeed.initialize, for the DualPipeVModule)
    yes       interleaved  no              no       InterleavedPipelineEngine (ds_internals/interleaved_pipeline.py)
    yes       1f1b         yes             no       ZeRO2PipelineEngine (ds_internals/pipeline_zero2.py)
    yes       1f1b         no              yes      OneBackwardPipelineEngine (ds_internals/tuple_backward.py)
    yes       dualpipev    no              yes      DualPipeVEngine (its own backward of the stage's tuple)
    yes       interleaved  no              yes      InterleavedPipelineEngine (the tuple between chunks)

Every other combination is refused before anything is built (config/support.py: the support table); `engine_for`
raises for one that got here anyway, instead of letting one rule silently win over another.
"""

import functools
from dataclasses import dataclass
from typing import Callable

import deepspeed

from hybrid3d.ds_internals import interleaved_pipeline, pipeline_zero2, tuple_backward
from hybrid3d.errors import UnsupportedConfigError
from hybrid3d.parallel.pipeline_schedules import InterleavedSchedule


@dataclass(frozen=True)
class EngineChoice:
    name: str
    initialize: Callable  # deepspeed.initialize's signature


def engine_for(pipeline: bool, schedule: str, pipeline_zero2_on: bool, experts: bool,
               deferred_fraction: float = 0.0) -> EngineChoice:
    """The row of the module's table for this combination."""
    if not pipeline:
        return EngineChoice("DeepSpeedEngine", deepspeed.initialize)
    table = {
        ("1f1b", False, False): EngineChoice("PipelineEngine", deepspeed.initialize),
        ("dualpipev", False, False): EngineChoice("DualPipeVEngine", deepspeed.initialize),
        ("interleaved", False, False): EngineChoice(
            "InterleavedPipelineEngine",
            functools.partial(interleaved_pipeline.initialize, schedule_cls=InterleavedSchedule)),
        ("1f1b", True, False): EngineChoice(
            "ZeRO2PipelineEngine", functools.partial(pipeline_zero2.initialize, deferred_fraction=deferred_fraction)),
        ("1f1b", False, True): EngineChoice("OneBackwardPipelineEngine", tuple_backward.initialize),
    }
    table[("dualpipev", False, True)] = table[("dualpipev", False, False)]  # MoE: one per tuple tensor, DeepSpeed's
    table[("interleaved", False, True)] = table[("interleaved", False, False)]  # MoE: a tuple between stages
    key = (schedule, pipeline_zero2_on, experts)
    if key not in table:
        raise UnsupportedConfigError(f"no engine serves pipeline_schedule {schedule!r} with pipeline_zero2="
                                     f"{pipeline_zero2_on} and {'a' if experts else 'no'} mixture of experts "
                                     "(config/support.py should have refused it)")
    return table[key]
