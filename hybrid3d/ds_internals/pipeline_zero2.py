"""ZeRO-2 (partitioned gradients) under DeepSpeed's 1F1B PipelineEngine, for DeepSpeed 0.19.8.

Why stock DeepSpeed cannot do it. ZeRO-2 reduces every micro-batch: one hook per parameter queues
the gradient in a bucket and reduces a full bucket at once, whatever the accumulation boundary
(`runtime/zero/stage_1_and_2.py:1354-1383`, `2284-2295`, `1422-1428`). After each backward it needs
`independent_gradient_partition_epilogue` (`1016-1070`): flush the last bucket, reset
`params_already_reduced`, accumulate the owned slice and free `param.grad`. The engine reaches that
epilogue only through `allreduce_gradients` (`runtime/engine.py:3072-3086`), which PipelineEngine
switches off (`enable_backward_allreduce = False`, `runtime/pipe/engine.py:80`) and calls once per
batch instead (`pipe/engine.py:278-279`, `294`). The second micro-batch then finds its parameters
"already reduced" (`stage_1_and_2.py:1436`), which is why PipelineEngine asserts ZeRO < 2 (`76-77`).

What this engine changes, all through PipelineEngine's own instruction table (`pipe/engine.py:1360`):
- BackwardPass: the stock pass, then the ZeRO-2 epilogue, so each micro-batch's buckets are
  flushed and its bookkeeping reset before the next one.
- ReduceTiedGrads: nothing. The stock version all-reduces `weight.grad` of the tied copies
  (`pipe/engine.py:281-285`), which ZeRO-2 has already reduced and freed, so the copies would drift.
- ReduceGrads: hand deferred gradients to ZeRO (see `DeferredGradients`), add the tied copies'
  reduced partitions across stages (`TiedPartitionReduction`), then
  `finalize_gradient_accumulation_boundary` (`stage_1_and_2.py:1072`), which builds the partition
  gradient the step reads without further communication.
- The ZeRO-stage assertion is bypassed for the duration of `__init__` only.

Cost: the data-parallel gradient traffic is paid once per micro-batch instead of once per step, and
it blocks inside BackwardPass, before the stage sends its gradient upstream (overlap_comm is forced
off for pipelines, `runtime/engine.py:2663-2666`). `deferred_fraction` moves part of that back to
once per step at the price of a local accumulator for the deferred parameters.
"""

import functools

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.runtime.pipe import engine as pipe_engine
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import TiedLayerSpec
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from hybrid3d.ds_internals import TIED_SUM_CHUNK_ELEMENTS, swapped

# Which collective reduces a bucket (`average_tensor`, `stage_1_and_2.py:1590-1723`): False sends each
# owner's slices with one `dist.reduce`, (d-1)/d of the bucket per rank instead of a bucket all-reduce's
# 2(d-1)/d; benchmarks/pipeline_zero2.py measures the choices.
DEFAULT_ZERO_SETTINGS = {"use_multi_rank_bucket_allreduce": False}


class _StagesBelowWeights:
    """Stands in for ZeroStageEnum in `pipe/engine.py:76-77` so that stage 2 passes `< gradients`."""

    gradients = ZeroStageEnum.weights


def initialize(deferred_fraction: float = 0.0, **kwargs):
    """`deepspeed.initialize` building a `ZeRO2PipelineEngine` for a PipelineModule.

    `deepspeed.initialize` picks the engine class by the name `PipelineEngine` in the `deepspeed`
    package (`deepspeed/__init__.py:586`); it is rebound for this call only, so every other step of
    initialize (config, optimizer flags, zero.Init context) stays DeepSpeed's own.
    """
    config = dict(kwargs.pop("config"))
    config["zero_optimization"] = {**DEFAULT_ZERO_SETTINGS, **config.get("zero_optimization", {})}
    engine_cls = functools.partial(ZeRO2PipelineEngine, deferred_fraction=deferred_fraction)
    with swapped(deepspeed, "PipelineEngine", engine_cls):
        return deepspeed.initialize(config=config, **kwargs)


def _group_index(optimizer, param) -> int:
    for index, group in enumerate(optimizer.bit16_groups):
        if any(p is param for p in group):
            return index
    raise ValueError("parameter is not trained by the ZeRO optimizer")


def owned_gradient_slice(optimizer, param):
    """(offset in `param`, view) of the reduced, accumulated gradient slice this DP rank owns, or None.

    The slice lives in the fp32 partition buffer when bf16 weights accumulate in fp32
    (`_get_compact_grad_partition_buffer`, `stage_1_and_2.py:1268-1310`), otherwise in the
    per-parameter `all_grad_tensors` the epilogue accumulates (`1036-1045`), which
    `finalize_gradient_accumulation_boundary` flattens; offsets as in `initialize_gradient_partition`.
    """
    group = _group_index(optimizer, param)
    partition_id = dist.get_rank(group=optimizer.real_dp_process_group[group])
    param_id = optimizer.get_param_id(param)
    if param_id not in optimizer.grad_start_offset[group][partition_id]:
        return None
    start = int(optimizer.grad_start_offset[group][partition_id][param_id])
    dest = int(optimizer.grad_partition_insertion_offset[group][partition_id][param_id])
    numel = int(min(param.numel() - start, optimizer.partition_size[group] - dest))
    if optimizer._use_compact_grad_partition_buffer(group):
        return start, optimizer._get_compact_grad_partition_buffer(group).flat_partition.narrow(0, dest, numel)
    index = next(k for k, p in enumerate(optimizer.params_in_partition[group]) if p is param)
    return start, optimizer.all_grad_tensors[group][index].view(-1).narrow(0, start, numel)


def tied_stage_groups(module) -> dict:
    """{tied key: (process group over every DP rank of every stage holding a copy, at this rank's
    tensor-parallel coordinate) or None where this rank holds no copy}.

    Every rank must call it (`dist.new_group` is collective); stages come from the layer specs the
    way PipelineModule finds them (`pipe/module.py:481-533`).
    """
    topo, grid = module._topo, module._grid
    keys = sorted({spec.key for spec in module._layer_specs if isinstance(spec, TiedLayerSpec)})
    me = topo.get_coord(grid.get_global_rank())._asdict()
    fibers = sorted({tuple((k, v) for k, v in topo.get_coord(r)._asdict().items() if k not in ("pipe", "data"))
                     for r in range(topo.world_size())})
    result = {}
    for key in keys:
        stages = sorted({module.stage_owner(i) for i, spec in enumerate(module._layer_specs)
                         if isinstance(spec, TiedLayerSpec) and spec.key == key})
        result[key] = None
        if len(stages) < 2:
            continue  # one copy: its uses already accumulate into one gradient
        for fiber in fibers:
            ranks = sorted(r for s in stages for r in topo.filter_match(pipe=s, **dict(fiber)))
            group = dist.new_group(ranks=ranks)
            if grid.get_global_rank() in ranks and all(me[k] == v for k, v in fiber):
                result[key] = group
    return result


class TiedPartitionReduction:
    """Sum the tied copies' gradients across stages after ZeRO-2 has reduced them over DP.

    Each stage reduces its copy's gradient over its own DP group like any other parameter, so
    stage s holds P_s = (1/d)·Σ_dp Σ_micro g_s, sliced over its DP ranks. The true gradient is
    P_first + P_last. The stages slice the weight differently, so each rank writes its owned slice
    into a zero tensor spanning the weight, an all-reduce runs over both stages' DP ranks, and every
    rank reads its slice back, in chunks of at most `reduce_bucket_size` and `TIED_SUM_CHUNK_ELEMENTS`
    elements. All ranks receive the same
    sum, so the copies stay bit-identical. Traffic: the tied weight once per step in the accumulation
    dtype; memory: one chunk, during the call only.
    """

    def __init__(self, module, optimizer):
        self.entries = []  # (weight, group)
        for key, group in tied_stage_groups(module).items():
            if group is None:
                continue
            for attr in module.tied_weight_attrs[key]:
                self.entries.append((module._recursive_getattr(module.tied_modules[key], attr), group))
        self.optimizer = optimizer

    def sum_across_stages(self) -> None:
        chunk = min(int(self.optimizer.reduce_bucket_size), TIED_SUM_CHUNK_ELEMENTS)
        for weight, group in self.entries:
            owned = owned_gradient_slice(self.optimizer, weight)
            start, view = owned if owned is not None else (0, weight.new_empty(0))
            end = start + view.numel()
            for lo in range(0, weight.numel(), chunk):
                hi = min(lo + chunk, weight.numel())
                buffer = torch.zeros(hi - lo, dtype=self.optimizer.gradient_accumulation_dtype, device=weight.device)
                a, b = max(lo, start), min(hi, end)
                if a < b:  # this rank owns [a, b) of the chunk
                    buffer.narrow(0, a - lo, b - a).copy_(view.narrow(0, a - start, b - a))
                dist.all_reduce(buffer, group=group)
                if a < b:
                    view.narrow(0, a - start, b - a).copy_(buffer.narrow(0, a - lo, b - a))


def deferred_indices(numels: list[int], fraction: float) -> list[int]:
    """The rule (the engine's and the memory model's): in order, each parameter that still fits in `fraction` of
    the stage's gradient elements is deferred: [] for 0, all for 1; the share is at most `fraction`."""
    budget, chosen = fraction * sum(numels), []
    for i, n in enumerate(numels):
        if n <= budget:
            chosen.append(i)
            budget -= n
    return chosen


def deferred_parameters(optimizer, fraction: float) -> list:
    """`deferred_indices` of the parameters in bit16 group order (the same on every DP rank of a stage)."""
    params = [p for group in optimizer.bit16_groups for p in group if p.requires_grad]
    return [params[i] for i in deferred_indices([p.numel() for p in params], fraction)]


class DeferredGradients:
    """Parameters whose gradients are accumulated locally and reduced once per step.

    ZeRO-2 skips a parameter whose `ds_grad_is_ready` is False (`stage_1_and_2.py:1431`, the flag
    Ulysses uses for tiled compute, `runtime/sequence_parallel/ulysses_sp.py:890-903`). A hook
    registered after ZeRO's (post-accumulate hooks run in order) moves the gradient into an
    accumulator of the optimizer's accumulation dtype and frees `param.grad`, so only one
    parameter's low-precision gradient exists at a time. At the boundary `release` gives the sums to
    ZeRO's own reduction path (`process_gradients`, `2284`) as if backward had produced them.
    Memory: (accumulation bytes)·Ψ_deferred; traffic: Ψ_deferred once instead of GAS times.
    """

    def __init__(self, optimizer, params: list):
        self.optimizer = optimizer
        self.entries = [(p, _group_index(optimizer, p)) for p in params]
        self.accumulators = {}
        self.hooks = []
        for p, _ in self.entries:
            p.ds_grad_is_ready = False
            self.hooks.append(p.register_post_accumulate_grad_hook(self._stash))

    def __len__(self) -> int:
        return len(self.entries)

    def _stash(self, param) -> None:
        accumulator = self.accumulators.get(id(param))
        if accumulator is None:
            self.accumulators[id(param)] = param.grad.to(self.optimizer.gradient_accumulation_dtype)
        else:
            accumulator.add_(param.grad)  # in place, upcasting without a temporary
        param.grad = None

    def release(self) -> None:
        for param, group in self.entries:
            param.grad = self.accumulators.pop(id(param)).to(param.dtype)
            param.ds_grad_is_ready = True
            self.optimizer.process_gradients(param, group)
            param.ds_grad_is_ready = False


class ZeRO2PipelineEngine(PipelineEngine):
    """PipelineEngine with DeepSpeedZeroOptimizer partitioning gradients over DP (module docstring)."""

    def __init__(self, *args, deferred_fraction: float = 0.0, **kwargs):
        with swapped(pipe_engine, "ZeroStageEnum", _StagesBelowWeights):
            super().__init__(*args, **kwargs)
        optimizer = self.optimizer
        if not (isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.partition_gradients):
            raise ValueError(f"ZeRO2PipelineEngine needs ZeRO stage 2, got {type(optimizer).__name__} at stage "
                             f"{self.zero_optimization_stage()}")
        if optimizer.cpu_offload:
            raise ValueError("ZeRO2PipelineEngine does not support optimizer offload")
        self.tied_reduction = TiedPartitionReduction(self.module, optimizer)
        self.deferred = DeferredGradients(optimizer, deferred_parameters(optimizer, deferred_fraction))

    def _exec_backward_pass(self, buffer_id):
        PipelineEngine._exec_backward_pass(self, buffer_id)
        if self.optimizer.ready_for_gradients:  # some hook ran: flush and reset for the next micro-batch
            self.optimizer.set_gradient_accumulation_boundary(False)
            self.optimizer.independent_gradient_partition_epilogue()

    def _exec_reduce_tied_grads(self):
        """Tied gradients are summed across stages in `_exec_reduce_grads`, on the reduced partitions."""

    def _exec_reduce_grads(self):
        optimizer = self.optimizer
        if len(self.deferred):
            self.deferred.release()
            optimizer.set_gradient_accumulation_boundary(False)
            optimizer.independent_gradient_partition_epilogue()
        self.tied_reduction.sum_across_stages()
        optimizer.finalize_gradient_accumulation_boundary()

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        schedule.ReduceGrads: _exec_reduce_grads,
    }
