"""The step loop's decisions, each a small object that knows its own timing: when to evaluate,
when to save (and not twice at one step), what a non-finite loss or gradient norm does.

They hold no process groups, so each is tested alone (tests/unit/test_step_policies.py); the
loop in job.py asks them and does what they say.
"""

import math
from typing import Callable, Optional

from hybrid3d.errors import NonFiniteError


class EvalSchedule:
    """Evaluate every `interval` steps (0: never)."""

    def __init__(self, interval: int):
        self.interval = interval

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0


class SaveSchedule:
    """Save every `interval` steps (0: only at the end or on a stop), never twice at one step.

    `save(step)` writes the checkpoint and returns its path; `last_saved` is the step already on
    disk (a resumed run starts with the step it loaded)."""

    def __init__(self, interval: int, save: Callable[[int], object], path_of: Callable[[int], object],
                 last_saved: Optional[int] = None):
        self.interval = interval
        self._save = save
        self._path_of = path_of
        self.last_saved = last_saved

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def save(self, step: int):
        """Save at `step` unless that step is already saved; the checkpoint's path either way."""
        if self.last_saved == step:
            return self._path_of(step)
        path = self._save(step)
        self.last_saved = step
        return path

    def last_path(self):
        return self._path_of(self.last_saved) if self.last_saved is not None else None


class NonFinitePolicy:
    """`train.on_nonfinite`: 'stop' raises NonFiniteError naming the last checkpoint; 'skip' counts the
    step (DeepSpeed's optimizer wrappers skip the update when the gradient norm is not finite)."""

    def __init__(self, policy: str):
        if policy not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {policy!r}")
        self.policy = policy
        self.skipped = 0

    @staticmethod
    def is_nonfinite(loss: float, grad_norm: Optional[float]) -> bool:
        return not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))

    def check(self, loss: float, grad_norm: Optional[float], step: int, last_checkpoint=None) -> Optional[str]:
        """None if the step is finite; else a warning line ('skip') or NonFiniteError ('stop')."""
        if not self.is_nonfinite(loss, grad_norm):
            return None
        what = f"non-finite loss {loss} / gradient norm {grad_norm} at step {step}"
        if self.policy == "stop":
            raise NonFiniteError(f"{what}: stopping (train.on_nonfinite=stop); the last checkpoint is "
                                 f"{last_checkpoint or 'none'}")
        self.skipped += 1
        return f"warning: {what}: the update was skipped ({self.skipped} so far; train.on_nonfinite=skip)"
