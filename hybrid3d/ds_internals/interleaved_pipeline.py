"""Interleaved 1F1B (Narayanan et al. 2021, §2.2) on DeepSpeed 0.19.8's PipelineEngine.

DeepSpeed has no interleaved schedule (its issue 4035). What it has, and what this module builds on:
- `PipelineModule` cuts the layer specs into stages (`_partition_layers`, `runtime/pipe/module.py:413-469`)
  and builds one stage's layers (`_build`, 219-287) between `_local_start` and `_local_stop`;
- DualPipeVModule (`runtime/pipe/dualpipev.py:29-89`) shows that a module may build two stages and expose
  one at a time; `InterleavedPipelineModule` builds v, stages r, r+p, ..., r+(v-1)p (Megatron's
  placement), with parameter names still `<global layer index>.<name>`, so checkpoints keep DeepSpeed's
  `layer_XX` files and the universal checkpoint's names;
- PipelineEngine executes instructions through `_INSTRUCTION_MAP` (`runtime/pipe/engine.py:1360-1370`);
  `InterleavedPipelineEngine` maps the stock instructions, which carry a `chunk`, to passes on that chunk
  and to point-to-point messages that are posted in batches (CommitP2P) and waited for only where they
  are consumed. The schedule (instructions per rank) is given to it: `hybrid3d.parallel.pipeline_schedules`.

Point-to-point messages between chunks go to ranks r±1, and from the last rank to the first (chunk k's
output to chunk k+1), which DeepSpeed's p2p module accepts (`runtime/pipe/p2p.py:35-41`).
"""

import functools
from contextlib import contextmanager

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from hybrid3d.ds_internals import swapped

# The spec of the activations crossing stages travels once: their count, then per tensor its dtype code, ndim and
# sizes (int64). A mixture of experts' stages pass two: (hidden states, router statistics).
_SPEC_LEN = 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _encode_spec(tensor, device):
    spec = torch.zeros(_SPEC_LEN, dtype=torch.int64)
    spec[0], spec[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    spec[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
    return spec.to(device)


def _decode_spec(spec):
    values = spec.tolist()
    return tuple(values[2:2 + values[1]]), _DTYPES[values[0]]


def _tensors(value) -> tuple:
    """A stage's activations (one tensor, or a tuple of them) as a tuple."""
    return value if isinstance(value, tuple) else (value,)


def _as_passed(tensors: tuple):
    """The tuple back as a stage takes it: one tensor alone, or the tuple."""
    return tensors[0] if len(tensors) == 1 else tensors


class _PostedBatch:
    """The works of one batch_isend_irecv, waited for once (a gloo work waited for twice never returns)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()
        self.works = []

    def finished(self) -> bool:
        """True once every message has arrived or left (the batch then drops its works and their tensors)."""
        if all(work.is_completed() for work in self.works):
            self.wait()
        return not self.works


class InterleavedPipelineModule(PipelineModule):
    """A PipelineModule cut into `virtual_stages · p` stages; rank r builds stages r + k·p as chunk k.
    `activate_chunk(k)` exposes chunk k's layers through forward()."""

    def __init__(self, *args, virtual_stages: int, **kwargs):
        self.virtual_stages = virtual_stages
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method="uniform"):
        ranks = self.num_stages
        self.num_stages *= self.virtual_stages
        super()._partition_layers(method)
        stages = [self.stage_id + k * ranks for k in range(self.virtual_stages)]
        self.phase_bounds = [(self.parts[s], self.parts[s + 1]) for s in stages]  # read as by DualPipeVModule
        self.pipeline_ranks = ranks

    def stage_owner(self, layer_idx):
        return super().stage_owner(layer_idx) % self.pipeline_ranks

    def _build(self):
        self.chunk_funcs = []
        for start, stop in self.phase_bounds:
            self._set_bounds(start, stop)
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
            self.forward_funcs = []
        self.chunk_checkpointable = [[] for _ in self.phase_bounds]
        self.activate_chunk(0)

    def activate_chunk(self, chunk: int):
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self.is_checkpointable_results = self.chunk_checkpointable[chunk]
        self._local_start, self._local_stop = self.phase_bounds[chunk]

    def _precompute_checkpointable_values(self):
        for chunk in range(self.virtual_stages):
            self.activate_chunk(chunk)
            self.is_checkpointable_results_interval = None  # the parent caches per interval, not per chunk
            super()._precompute_checkpointable_values()
            self.chunk_checkpointable[chunk] = self.is_checkpointable_results
        self.activate_chunk(0)

    def _each_chunk(self, method, *args, **kwargs):
        for chunk in range(self.virtual_stages):
            self.activate_chunk(chunk)
            method(*args, **kwargs)
        self.activate_chunk(0)

    def save_state_dict(self, *args, **kwargs):
        self._each_chunk(super().save_state_dict, *args, **kwargs)

    def load_state_dir(self, *args, **kwargs):
        self._each_chunk(super().load_state_dir, *args, **kwargs)


class InterleavedPipelineEngine(PipelineEngine):
    """Runs an InterleavedPipelineModule with `schedule_cls(micro_batches, stages, stage_id, chunks,
    forward_only)`. Inside a pass on chunk k, is_first_stage/is_last_stage answer for stage r + k·p (so the
    parent's forward and backward treat the first chunk of rank 0 and the last chunk of rank p-1 as the
    first and last stage); outside a pass they answer for the rank, which holds the data iterator (ranks 0
    and p-1) and the loss (rank p-1)."""

    def __init__(self, *args, schedule_cls, **kwargs):
        self._chunk = None
        super().__init__(*args, **kwargs)
        self.schedule_cls = schedule_cls
        self.chunks = self.module.virtual_stages
        assert not (self.is_pipe_partitioned or self.is_grad_partitioned), "set pipe/grad partitioning off"
        self.pipe_buffers["grads"] = [None] * self.num_pipe_buffers
        self.pipe_buffers["losses"] = [None] * self.num_pipe_buffers
        self._queued = []  # P2POps of the current round
        self._pending = {}  # ("inputs" | "grads", buffer) -> works of the batch that receives it
        self._posted = []  # every posted batch, waited for by the end of the schedule
        # [(shape, dtype)] of the activations each chunk receives, learned from its first message: chunks may differ
        # (a MoE model's dense first layers pass the hidden states alone, its MoE layers also the router statistics)
        self._recv_spec = {}
        self._spec_sent = set()  # the chunks whose output spec went out

    # ---------------------------------------------------------------- stage identity

    def is_first_stage(self):
        return self.stage_id == 0 and self._chunk in (None, 0)

    def is_last_stage(self):
        last = self.stage_id == self.num_stages - 1
        return last and (self._chunk is None or self._chunk == self.chunks - 1)

    @contextmanager
    def _on_chunk(self, chunk):
        self._chunk = chunk
        self.module.activate_chunk(chunk)
        try:
            yield
        finally:
            self._chunk = None

    def _train_schedule(self):
        return self.schedule_cls(self.micro_batches, self.num_stages, self.stage_id, self.chunks)

    def _inference_schedule(self, micro_batches):
        return self.schedule_cls(micro_batches, self.num_stages, self.stage_id, self.chunks, forward_only=True)

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self._recv_spec = {}
        self._spec_sent = set()

    def _exec_schedule(self, pipe_schedule):
        super()._exec_schedule(pipe_schedule)
        for batch in self._posted:
            batch.wait()
        self._posted = []

    # ---------------------------------------------------------------- passes

    def _exec_load_micro_batch(self, buffer_id, chunk):
        with self._on_chunk(chunk):
            super()._exec_load_micro_batch(buffer_id)

    def _exec_forward_pass(self, buffer_id, chunk):
        self._wait("inputs", buffer_id)
        with self._on_chunk(chunk):
            super()._exec_forward_pass(buffer_id)
            if self.is_last_stage() and torch.is_grad_enabled():
                self.pipe_buffers["losses"][buffer_id] = self.loss
        if not torch.is_grad_enabled():  # no backward will free them
            self.pipe_buffers["inputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
            if chunk == self.chunks - 1 and self.stage_id == self.num_stages - 1:
                self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_backward_pass(self, buffer_id, chunk):
        self._wait("grads", buffer_id)
        with self._on_chunk(chunk):
            if self.is_last_stage():
                self.loss = self.pipe_buffers["losses"][buffer_id]
                self.pipe_buffers["losses"][buffer_id] = None
            else:
                self.grad_layer = self.pipe_buffers["grads"][buffer_id]
                self.pipe_buffers["grads"][buffer_id] = None
            first = self.is_first_stage()
            super()._exec_backward_pass(buffer_id)
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["labels"][buffer_id] = None
        if first:  # nothing is sent upstream of the first stage, which would free its inputs
            self.pipe_buffers["inputs"][buffer_id] = None

    # ---------------------------------------------------------------- messages

    def _queue(self, op, tensor, peer_stage):
        self._queued.append(dist.P2POp(op, tensor, self.grid.stage_to_global(peer_stage)))

    def _exec_send_activations(self, buffer_id, chunk, peer):
        outputs = _tensors(self.pipe_buffers["outputs"][buffer_id])
        assert all(torch.is_tensor(t) for t in outputs), "stages of an interleaved pipeline pass tensors"
        if chunk not in self._spec_sent:  # a rank sends activations to one neighbour only: one spec per chunk
            specs = torch.stack([_encode_spec(t, self.device) for t in outputs]).reshape(-1)
            dist.send(torch.tensor([len(outputs)], dtype=torch.int64, device=self.device),
                      self.grid.stage_to_global(peer))
            dist.send(specs, self.grid.stage_to_global(peer))
            self._spec_sent.add(chunk)
        for tensor in outputs:
            self._queue(dist.isend, tensor, peer)
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id, chunk, peer):
        if chunk not in self._recv_spec:  # and receives them from one neighbour only
            count = torch.zeros(1, dtype=torch.int64, device=self.device)
            dist.recv(count, self.grid.stage_to_global(peer))
            specs = torch.zeros(int(count) * _SPEC_LEN, dtype=torch.int64, device=self.device)
            dist.recv(specs, self.grid.stage_to_global(peer))
            self._recv_spec[chunk] = [_decode_spec(spec) for spec in specs.reshape(-1, _SPEC_LEN)]
        received = tuple(torch.empty(shape, dtype=dtype, device=self.device, requires_grad=dtype.is_floating_point)
                         for shape, dtype in self._recv_spec[chunk])
        for tensor in received:
            self._queue(dist.irecv, tensor, peer)
        self.pipe_buffers["inputs"][buffer_id] = _as_passed(received)
        self._pending[("inputs", buffer_id)] = self._queued

    def _exec_send_grads(self, buffer_id, chunk, peer):
        for tensor in _tensors(self.pipe_buffers["inputs"][buffer_id]):
            assert tensor.grad is not None, f"no input gradient for buffer {buffer_id}"
            self._queue(dist.isend, tensor.grad, peer)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id, chunk, peer):
        grads = tuple(torch.empty_like(t) for t in _tensors(self.pipe_buffers["outputs"][buffer_id]))
        for grad in grads:
            self._queue(dist.irecv, grad, peer)
        self.pipe_buffers["grads"][buffer_id] = _as_passed(grads)
        self._pending[("grads", buffer_id)] = self._queued

    def _exec_commit_p2p(self):
        if not self._queued:
            return
        batch = _PostedBatch(dist.batch_isend_irecv(self._queued))
        for key, ops in list(self._pending.items()):
            if ops is self._queued:
                self._pending[key] = batch
        # sent gradients would otherwise stay alive until the step ends
        self._posted = [b for b in self._posted if not b.finished()] + [batch]
        self._queued = []

    def _wait(self, kind, buffer_id):
        batch = self._pending.pop((kind, buffer_id), None)
        if batch is not None:
            batch.wait()

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: _exec_send_grads,
        schedule.RecvGrad: _exec_recv_grads,
        schedule.CommitP2P: _exec_commit_p2p,
    }


def initialize(schedule_cls, **kwargs):
    """`deepspeed.initialize` building an InterleavedPipelineEngine for an InterleavedPipelineModule
    (`deepspeed/__init__.py:586` picks the engine class by the name `PipelineEngine`, rebound for this call)."""
    engine_cls = functools.partial(InterleavedPipelineEngine, schedule_cls=schedule_cls)
    with swapped(deepspeed, "PipelineEngine", engine_cls):
        return deepspeed.initialize(**kwargs)
