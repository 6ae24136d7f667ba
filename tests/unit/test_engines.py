"""The engine table (training/engines.py) against the support table (config/support.py): every combination the
configuration accepts has exactly one engine, and every combination without one is refused first."""

import itertools

import pytest

from hybrid3d.errors import UnsupportedConfigError
from hybrid3d.training.engines import engine_for

ROWS = {(False, "1f1b", False, False): "DeepSpeedEngine", (False, "1f1b", False, True): "DeepSpeedEngine",
        (True, "1f1b", False, False): "PipelineEngine", (True, "dualpipev", False, False): "DualPipeVEngine",
        (True, "interleaved", False, False): "InterleavedPipelineEngine",
        (True, "1f1b", True, False): "ZeRO2PipelineEngine", (True, "1f1b", False, True): "OneBackwardPipelineEngine",
        (True, "dualpipev", False, True): "DualPipeVEngine", (True, "interleaved", False, True): "InterleavedPipelineEngine"}


@pytest.mark.parametrize("pipeline, schedule, zero2, experts",
                         [k for k in itertools.product((True,), ("1f1b", "dualpipev", "interleaved"), (False, True),
                                                       (False, True))] + [(False, "1f1b", False, False),
                                                                          (False, "1f1b", False, True)])
def test_each_combination_has_one_engine_or_a_refusal_before_it(pipeline, schedule, zero2, experts):
    from hybrid3d.config.sections import parse_hybrid_section
    from hybrid3d.config.support import check_moe_options, check_schedule_with_pipeline_zero2
    from hybrid3d.errors import ConfigError

    expected = ROWS.get((pipeline, schedule, zero2, experts))
    if expected is not None:
        assert engine_for(pipeline, schedule, zero2, experts).name == expected
        return
    with pytest.raises(UnsupportedConfigError):
        engine_for(pipeline, schedule, zero2, experts)
    hybrid = parse_hybrid_section({"hybrid3d": {"pipeline_parallel_size": 2, "pipeline_schedule": schedule,
                                                "pipeline_zero2": zero2}})
    with pytest.raises(ConfigError):  # the support table refuses it first, in one line
        check_schedule_with_pipeline_zero2(hybrid)
        check_moe_options(experts, 2, schedule=schedule, pipeline_zero2=zero2)
