"""Torch function modes that count what code does: normal draws (a model's initial weights) and host reads
(each a device sync on a GPU)."""

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = {"tolist", "item", "bincount", "nonzero", "__bool__", "__int__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts the torch calls that need a tensor's values on the host (a device sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                  and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            self.calls.append(name)
        return func(*args, **kwargs)


class DrawCounter(TorchFunctionMode):
    """Counts the elements every normal draw fills (tests/distributed/engine_worker.py counts a trainer's build
    with it: HF weights follow, so it must draw none)."""

    def __init__(self):
        super().__init__()
        self.drawn = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.normal_, torch.nn.init.normal_):  # the init hands its call to the mode whole
            kwargs = kwargs or {}
            self.drawn += (args[0] if args else kwargs["tensor"]).numel()
        return func(*args, **(kwargs or {}))


def host_allocations(fn) -> tuple[int, int, object]:
    """(the most bytes torch's CPU allocator held at once while `fn()` ran, over what it held when `fn` began; the
    largest net allocation one operator made; fn's result), counted from the allocations and frees the profiler
    records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = largest = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage  # + allocations inside the op, - frees (`[memory]` events)
        peak = max(peak, live)
        largest = max(largest, event.self_cpu_memory_usage)
    return peak, largest, result
