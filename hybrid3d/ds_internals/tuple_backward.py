"""One backward pass per micro-batch for a pipeline stage whose output is a tuple of tensors.

DeepSpeed 0.19.8's PipelineEngine runs a non-last stage's backward for a tuple output as one `backward` per
output tensor, retaining the graph between them (`runtime/pipe/engine.py` `_exec_backward_pass`). A MoE stage
outputs (hidden, router_stats): the router statistics depend on every router's input, so the second pass
walks back through nearly the whole stage again, its all-to-alls and TP collectives included (measured:
the first stage of PP2 x EP2 logged one extra dispatch/combine backward per micro-batch, the exchanges of
every MoE block but the stage's last; tests/distributed/test_moe.py).

`OneBackwardPipelineEngine` hands DeepSpeed's method a single scalar instead, s = Σ_i <output_i, grad_i>
(the received gradient of each output): ∂s/∂output_i = grad_i exactly (the product's backward multiplies
grad_i by ones), so the parameter gradients are those of the per-tensor passes, summed once by autograd
instead of accumulated pass after pass, and DeepSpeed's own backward call (hooks, bf16 bookkeeping) runs
unchanged (the method is reached through the engine's instruction table, `_INSTRUCTION_MAP`, replaced here
with the override in it). Stages with partitioned activations are left to DeepSpeed (MoE models turn partitioning off).
"""

import deepspeed
import torch
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from hybrid3d.ds_internals import swapped


class OneBackwardPipelineEngine(PipelineEngine):
    def _exec_backward_pass(self, buffer_id):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.is_last_stage() or not isinstance(outputs, tuple) or self.is_pipe_partitioned:
            return super()._exec_backward_pass(buffer_id)
        tensors = [t for t in outputs if t.is_floating_point()]
        received = self.grad_layer
        assert len(tensors) == len(received)
        surrogate = sum(torch.sum(t * g) for t, g in zip(tensors, received) if t.requires_grad)
        self.pipe_buffers["outputs"][buffer_id] = surrogate
        self.grad_layer = torch.ones_like(surrogate)
        try:
            return super()._exec_backward_pass(buffer_id)
        finally:
            self.grad_layer = received

    # The engine dispatches instructions through this table of functions, bound when the class was defined.
    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.BackwardPass: _exec_backward_pass}


def initialize(**kwargs):
    """`deepspeed.initialize` building a OneBackwardPipelineEngine (the engine class is looked up by the name
    `PipelineEngine` in `deepspeed/__init__.py`, rebound for this call)."""
    with swapped(deepspeed, "PipelineEngine", OneBackwardPipelineEngine):
        return deepspeed.initialize(**kwargs)
