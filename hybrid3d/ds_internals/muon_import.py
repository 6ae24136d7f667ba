"""DeepSpeed's Muon module imported without importing TorchInductor on the way.

DeepSpeed 0.19.8 imports `deepspeed.runtime.zero.muon.muon_optimizer` in every ZeRO initialisation
(`runtime/zero/utils.py:is_zero_supported_optimizer`), in `BF16_Optimizer.__init__` and in ZeRO's step, whatever
the optimizer is. Its `original_muon.py` decorates three functions with `@compiler.compile()`, i.e. `torch.compile`
at import time, and `torch.compile` imports TorchDynamo and TorchInductor to build its backend: 1.7 s per process on
an idle core (measured on this repository's 2-core CI machine), paid by every rank of every job, which then never
calls those functions unless the optimizer is Muon. DeepSpeed's own comment there says the import was moved out of
module level because it is slow.

`import_muon_lazily` imports the same module with `torch.compile` replaced, for the import only, by a wrapper that
calls the real `torch.compile` on the first call of the decorated function, with the same arguments. Nothing else
changes: `torch.compile` compiles on first call anyway; only the import of the compiler moves there. (Declining the
import instead breaks `BF16_Optimizer`, which imports Muon without a guard.)
"""

import functools
import importlib
import sys

import torch

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _compile_on_first_call(model=None, **options):
    """`torch.compile(model, **options)`, made when the result is first called (also as `@torch.compile(...)`)."""
    if model is None:
        return lambda fn: _compile_on_first_call(fn, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(model, **options)
        return compiled(*args, **kwargs)

    return call


def import_muon_lazily() -> None:
    """Import DeepSpeed's Muon module (once per process) with its `torch.compile` calls deferred to first use."""
    if MUON_MODULE in sys.modules:
        return
    real_compile = torch.compile
    torch.compile = _compile_on_first_call
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        torch.compile = real_compile
