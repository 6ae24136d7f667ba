"""When each instruction of a pipeline engine ran, how long its passes waited for messages, and the
activations it held: what benchmarks/pipeline_schedules.py measures each schedule's bubble and memory with.

PipelineEngine executes a schedule by looking every instruction up in `_INSTRUCTION_MAP`
(`runtime/pipe/engine.py:1373-1387`); `InstructionTimeline(engine)` gives the engine an instance copy of that
table whose entries time themselves, for DeepSpeed's 1F1B and DualPipeV engines and hybrid3d's interleaved
one alike. Blocking receives are instructions of their own in DeepSpeed's engines; the interleaved engine
waits for a message inside the pass that consumes it (`_wait`), so that wait is timed and subtracted.
Timestamps are `time.monotonic()` (one clock for every process of a host); on an accelerator each
instruction ends with a device synchronisation, so kernels are charged to the pass that launched them.
"""

import time
from dataclasses import dataclass, field

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe import schedule

PASSES = (schedule.ForwardPass, schedule.BackwardPass)


@dataclass
class InstructionRecord:
    name: str  # the instruction's class name
    kwargs: dict  # buffer_id, chunk / phase, peer, ...
    start: float
    end: float
    waited: float = 0.0  # seconds inside the instruction spent waiting for a message

    @property
    def busy(self) -> float:
        return self.end - self.start - self.waited


@dataclass
class InstructionTimeline:
    engine: object
    records: list = field(default_factory=list)

    def __post_init__(self):
        self._synchronize = get_accelerator().device_name() != "cpu"
        self._waited = 0.0
        table = type(self.engine)._INSTRUCTION_MAP
        self.engine._INSTRUCTION_MAP = {cls: self._timed(cls, fn) for cls, fn in table.items()}
        if hasattr(self.engine, "_wait"):
            self._wrap_wait(self.engine._wait)

    def clear(self) -> None:
        self.records = []

    def _timed(self, cls, fn):
        timeline = self

        def run(engine, **kwargs):
            timeline._waited = 0.0
            start = time.monotonic()
            result = fn(engine, **kwargs)
            if timeline._synchronize:
                get_accelerator().synchronize()
            timeline.records.append(InstructionRecord(cls.__name__, kwargs, start, time.monotonic(), timeline._waited))
            return result

        return run

    def _wrap_wait(self, wait):
        def timed_wait(*args, **kwargs):
            start = time.monotonic()
            wait(*args, **kwargs)
            self._waited += time.monotonic() - start

        self.engine._wait = timed_wait

    def passes(self) -> list[InstructionRecord]:
        return [r for r in self.records if r.name in {cls.__name__ for cls in PASSES}]


class _Held:
    """A tensor autograd saved for backward; tells the probe when the graph lets go of it."""

    __slots__ = ("tensor", "probe", "key")

    def __init__(self, tensor, probe, key):
        self.tensor, self.probe, self.key = tensor, probe, key

    def __del__(self):
        probe = getattr(self, "probe", None)  # Dynamo copies saved-tensor hook results without __init__ while tracing
        if probe is not None:
            probe._release(self.key)


class SavedActivationProbe:
    """The bytes autograd holds for backward at once (distinct storages, parameters excluded), and their peak:
    a pipeline rank's in-flight activations, measured. Use as a context manager around the steps."""

    def __init__(self, parameters):
        self._parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self._refs, self._sizes = {}, {}
        self.live = self.peak = 0

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._parameters or tensor.device.type == "meta":
            return tensor
        if key not in self._refs:
            self._refs[key], self._sizes[key] = 0, storage.nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        return _Held(tensor, self, key)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key):
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)
