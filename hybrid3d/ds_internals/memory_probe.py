"""Count the model-state bytes a live DeepSpeed engine holds, from the optimizer's own tensors.

Every tensor is attributed to one category and counted once per storage (views of one flat
buffer share a storage), with the storage's full size, so alignment padding is included:

- `params`:       the model's weights (bf16 or fp32), usually views of the wrapper's flat buffer;
- `grads`:        gradients: `param.grad`, the wrappers' gradient buffers and partitions;
- `master`:       the fp32 master-weight partitions of a mixed-precision or ZeRO wrapper;
- `optim_states`: the base optimizer's state (Adam's exp_avg, exp_avg_sq, step);
- `other`:        any further tensor reachable from the wrapper's attributes (named in `other_names`),
                  so a buffer this census does not know about shows up instead of vanishing.

Wrappers and the attributes read (DeepSpeed 0.19):
- `BF16_Optimizer` (runtime/bf16_optimizer.py): `bf16_groups_flat` (params), `fp32_groups_flat_partition`
  (master), `fp32_groups_gradients_flat` (the full-size accumulation buffer; every other gradient
  attribute is a view of it);
- `DeepSpeedZeroOptimizer` (runtime/zero/stage_1_and_2.py): `bit16_groups_flat` (params),
  `single_partition_of_fp32_groups` (master, and its `.grad` during the step), `averaged_gradients`,
  `all_grad_tensors`, `grads_in_partition`, `ipg_buckets[dtype].buffer`, `param.grad_accum`;
- no wrapper (fp32 without ZeRO): the torch optimizer's params, their `.grad` and its `state`.

`PeakProbe` snapshots when the step's gradients are complete and when the optimizer update starts;
transient buffers that live only inside a reduction call (bucket flattening) are not model states.
"""

from dataclasses import dataclass, field

import torch

CATEGORIES = ("params", "grads", "master", "optim_states", "other")

# Attribute names of the wrappers, by category (see the module docstring).
_WRAPPER_ATTRIBUTES = {
    "params": ("bf16_groups_flat", "bit16_groups_flat", "fp16_partitioned_groups_flat", "fp16_partitioned_groups",
               "param_groups_fp16_flat_cpu_memory", "param_buffer_of_bit16_for_cpu_offload_groups"),
    "master": ("fp32_groups_flat_partition", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"),
    "grads": ("fp32_groups_gradients_flat", "averaged_gradients", "all_grad_tensors", "grads_in_partition",
              "ipg_buckets", "grad_partitions_flat_buffer", "temp_grad_buffer_for_cpu_offload",
              "temp_grad_buffer_for_gpu_offload", "accumulated_grads_in_cpu"),
}
_MAX_DEPTH = 5


@dataclass
class StateBytes:
    """Bytes per category, counted once per storage."""

    by_category: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    other_names: list = field(default_factory=list)
    storages: list = field(default_factory=list)  # (category, where it was found, bytes), one per storage

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    @property
    def model_states(self) -> int:
        """params + grads + master + optim_states (what the memory model predicts)."""
        return self.total - self.by_category["other"]


def _tensors(obj, path: str, depth: int = 0):
    """Yield (path, tensor) for every tensor reachable from obj through containers and dataclass-like objects."""
    if depth > _MAX_DEPTH or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield path, obj
        if obj.is_leaf and obj.grad is not None:
            yield path + ".grad", obj.grad
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, torch.Tensor):
                yield from _tensors(key, f"{path}[key]", depth + 1)
            yield from _tensors(value, f"{path}[{key!r}]", depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for index, value in enumerate(obj):
            yield from _tensors(value, f"{path}[{index}]", depth + 1)
    elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name), f"{path}.{name}", depth + 1)


def _storage(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


# Engine attributes holding a tensor outside the model states: the last gradient norm, a 0-d tensor (a census
# reports it among the "other" names)
ENGINE_SCALARS = frozenset({"_global_grad_norm"})


def base_optimizer(optimizer):
    """The torch optimizer a wrapper steps (the optimizer itself when there is no wrapper)."""
    return getattr(optimizer, "optimizer", optimizer)


def census(module: torch.nn.Module, optimizer, extra_grads=()) -> StateBytes:
    """Model-state bytes of `module` trained by `optimizer` (an engine's `.optimizer`); `extra_grads`:
    gradient tensors held outside the optimizer (the deferred accumulators of ds_internals/pipeline_zero2.py)."""
    seen = {}
    result = StateBytes()

    def claim(category, tensors, name):
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            ptr, nbytes = _storage(t)
            if nbytes == 0 or ptr in seen:
                continue
            seen[ptr] = category
            result.by_category[category] += nbytes
            result.storages.append((category, name, nbytes))
            if category == "other":
                result.other_names.append(name)

    base = base_optimizer(optimizer)
    params = [p for p in module.parameters()]
    claim("params", params, "module.parameters")
    for category, names in _WRAPPER_ATTRIBUTES.items():
        for name in names:
            if optimizer is not base and hasattr(optimizer, name):
                found = list(_tensors(getattr(optimizer, name), name))
                claim(category, [t for path, t in found if not (category == "master" and _is_grad_path(path))], name)
                if category == "master":  # the master partition's gradient (ZeRO-3 offload holds it between steps)
                    claim("grads", [t for path, t in found if _is_grad_path(path)], name + ".grad")
    # ZeRO-3's partitions: the trainable ones are views of the wrapper's flat buffer (claimed above), a frozen
    # parameter's (LoRA's base) is its own tensor
    claim("params", [p.ds_tensor for p in params if hasattr(p, "ds_tensor")], "param.ds_tensor")
    claim("grads", [p.grad for p in params], "param.grad")
    claim("grads", [getattr(p, "grad_accum", None) for p in params], "param.grad_accum")
    claim("grads", list(extra_grads), "extra_grads")
    for group in base.param_groups:  # the fp32 master partitions' gradients, or the plain params'
        claim("grads", [p.grad for p in group["params"]], "master.grad")
        claim("params" if optimizer is base else "master", group["params"], "optimizer.param_groups")
    claim("optim_states", [t for state in base.state.values() for t in state.values() if isinstance(t, torch.Tensor)],
          "optimizer.state")
    if optimizer is not base:
        for name, value in vars(optimizer).items():
            if name in ("optimizer", "module"):
                continue
            for path, t in _tensors(value, name):
                claim("other", [t], path)
    return result


def _is_grad_path(path: str) -> bool:
    return path.endswith(".grad")


class PeakProbe:
    """Snapshot `census` at the two moments when model states peak, during one enabled step.

    - `boundary`: entry of the engine's `allreduce_gradients` (PipelineEngine with BF16_Optimizer:
      `_bf16_reduce_grads`) at the gradient-accumulation boundary,
      i.e. after the last micro-batch's backward and before the data-parallel reduction of
      ZeRO-0/1 (ZeRO-2 has reduced all but its last bucket); for ds_internals/pipeline_zero2.py, the
      largest of the snapshots at its bucket reductions and epilogues;
    - `step`: entry of the base optimizer's `step()`, when the wrapper has built the fp32 gradient
      of its partition.

    Both methods are wrapped on the instance (engines and wrappers call them through `self`).
    Enable the probe for a step after the first: Adam's moments are created lazily by the first.
    """

    LABELS = ("boundary", "step")

    def __init__(self, engine):
        from hybrid3d.ds_internals.pipeline_zero2 import ZeRO2PipelineEngine

        self.engine = engine
        self.enabled = False
        self.snapshots: dict[str, StateBytes] = {}
        base = base_optimizer(engine.optimizer)
        for name in ("allreduce_gradients", "_bf16_reduce_grads"):  # the latter: PipelineEngine + BF16_Optimizer
            if hasattr(engine, name):
                setattr(engine, name, self._wrap(getattr(engine, name), "boundary",
                                                 engine.is_gradient_accumulation_boundary))
        base.step = self._wrap(base.step, "step", lambda: True, keep_larger=True)
        if isinstance(engine, ZeRO2PipelineEngine):
            # It reduces during every backward: `boundary` is the largest snapshot taken at a bucket
            # reduction or a ZeRO-2 epilogue (what `memory.model_states_from_numels` predicts for it).
            for name in ("reduce_ipg_grads", "independent_gradient_partition_epilogue"):
                setattr(engine.optimizer, name, self._wrap(getattr(engine.optimizer, name), "boundary",
                                                           lambda: True, keep_larger=True))

    def _wrap(self, method, label, when, keep_larger=False):
        def wrapped(*args, **kwargs):
            if self.enabled and when():
                deferred = getattr(self.engine, "deferred", None)
                snapshot = census(self.engine.module, self.engine.optimizer,
                                  deferred.accumulators.values() if deferred is not None else ())
                previous = self.snapshots.get(label)
                if not (keep_larger and previous is not None and previous.model_states >= snapshot.model_states):
                    self.snapshots[label] = snapshot
            return method(*args, **kwargs)

        return wrapped

    def peak(self) -> StateBytes:
        """The snapshot with the larger model-state total."""
        missing = [label for label in self.LABELS if label not in self.snapshots]
        if missing:
            raise RuntimeError(f"no {'/'.join(missing)} snapshot: enable the probe around a whole training step")
        return max(self.snapshots.values(), key=lambda s: s.model_states)

