"""A hook around DeepSpeedEngine's optimizer step (`_take_model_step`, private: deepspeed 0.19.8
runtime/engine.py), so a profiler can name the range the optimizer takes inside `engine.step()`."""

import functools
from contextlib import contextmanager

from deepspeed.runtime.engine import DeepSpeedEngine


@contextmanager
def around_model_steps(wrapper):
    """Within the block every engine's optimizer step runs inside `wrapper()` (a context manager factory)."""
    step = DeepSpeedEngine._take_model_step

    @functools.wraps(step)
    def take_model_step(self, *args, **kwargs):
        with wrapper():
            return step(self, *args, **kwargs)

    DeepSpeedEngine._take_model_step = take_model_step
    try:
        yield
    finally:
        DeepSpeedEngine._take_model_step = step
