"""DeepSpeed's PipelineModule broadcasts each tied weight from its first stage (`_synchronize_tied_weights`,
deepspeed 0.19.8 runtime/pipe/module.py:472) when it is built and after every module load, outside `torch.no_grad`.
The weight stays a leaf and its gradient is unaffected (the tied runs of tests/distributed/test_engine.py match
HF either way), but autograd's fallback for operators without an autograd
kernel warns at each process's first backward through it: "c10d::broadcast_: an autograd kernel was not
registered ... silently incorrect behavior" (torch 2.13), once per rank of every run with tied embeddings over
stages. Run the broadcast under `torch.no_grad`, as a copy of weights should be (test_engine: no run warns)."""

from contextlib import contextmanager

import torch
from deepspeed.runtime.pipe.module import PipelineModule

from hybrid3d.ds_internals import swapped


@contextmanager
def tied_weights_synchronised_without_grad():
    """Within the block, PipelineModule (and its subclasses) broadcast tied weights under torch.no_grad."""
    synchronise = PipelineModule._synchronize_tied_weights

    def without_grad(self):
        with torch.no_grad():
            synchronise(self)

    with swapped(PipelineModule, "_synchronize_tied_weights", without_grad):
        yield


def skip_frozen_tied_gradients(module: PipelineModule) -> None:
    """A PipelineModule whose tied weights are all frozen (LoRA's base) skips their gradient all-reduce between
    stages: DeepSpeed's `allreduce_tied_weight_gradients` (module.py:457) all-reduces `weight.grad`, None there."""
    tied = [module._recursive_getattr(module.tied_modules[key], attr)
            for key, comm in module.tied_comms.items() for attr in comm["weight_attr"]]
    if tied and not any(weight.requires_grad for weight in tied):
        module.allreduce_tied_weight_gradients = lambda: None
