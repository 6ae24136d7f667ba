"""ZeRO-3's partitioned parameters (DeepSpeed's `deepspeed.zero` API), in the few places hybrid3d touches them.

Under `deepspeed.zero.Init` every parameter is split over the data-parallel group as soon as its module's
constructor returns (Rajbhandari et al. 2020, §5.3, P_os+g+p): a rank keeps `p.ds_tensor`, 1/Nd of the
flattened tensor, and `p.data` is empty until DeepSpeed gathers it around the forward or backward of the module
that owns `p`. So anything that reads or writes a whole parameter outside that window goes through here:

- `partitioned_build`: the context the model is built in, partitioned over the layout's data-parallel group (its
  d·c ranks, the group the engine's ZeRO shards over) instead of `zero.Init`'s default, the whole world, which
  would mix TP shards;
- `gathered` / `written`: one parameter whole for a read or a write (HF weights in, the HF state dict out);
- `used_outside_forward`: the tied LM head reads the embedding's weight in the top module's forward;
- `held`: what a rank holds of a parameter (a check that every weight is finite reads it);
- `full_numel`: a parameter's real size whether partitioned or not;
- `track_available_parameters`: the most elements DeepSpeed's parameter coordinator holds gathered at once (its
  private count, checked against planning/zero3_fetch.py's replay).

Non-partitioned parameters (ZeRO-0/1/2, or no engine yet) pass through unchanged, so callers need not know the stage.
"""

import contextlib

import torch


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 owns `param` (`zero.Init` gave it a `ds_id`)."""
    return hasattr(param, "ds_id")


def partitioned_build(ds_config: dict, groups, enabled: bool):
    """The context a ZeRO-3 model is built in: every parameter partitioned over `groups`' data-parallel group as its
    module is made, on the device (or, with `offload_param`, the host) the config names. `groups` is the layout's
    mpu. A no-op context when not `enabled`."""
    if not enabled:
        return contextlib.nullcontext()
    import deepspeed

    check_nvme_offload(ds_config)
    return deepspeed.zero.Init(data_parallel_group=groups.get_data_parallel_group(), mpu=groups,
                               config_dict_or_path=ds_config)


def check_nvme_offload(ds_config: dict) -> None:
    """NVMe offload (`device: nvme`) swaps through DeepSpeed's async I/O op, which builds against libaio: say so in
    one line before the build instead of failing inside DeepSpeed's swapper."""
    zero = ds_config.get("zero_optimization", {})
    keys = [k for k in ("offload_optimizer", "offload_param") if (zero.get(k) or {}).get("device") == "nvme"]
    if not keys:
        return
    from deepspeed.accelerator import get_accelerator

    from hybrid3d.errors import UserError

    builder = get_accelerator().get_op_builder("AsyncIOBuilder")
    if builder is None or not builder().is_compatible(verbose=False):
        raise UserError(f"zero_optimization.{keys[0]}.device nvme needs DeepSpeed's async I/O op, which needs libaio "
                        "on this machine (Debian/Ubuntu: apt-get install libaio-dev)")


def gathered(params):
    """The whole tensors of `params` inside the block, for reading; re-partitioned after, unchanged."""
    return _gathered(params, modifier_rank=None)


def written(params):
    """The whole tensors of `params` inside the block, for writing: data-parallel rank 0's values are broadcast and
    re-partitioned on exit (with `modifier_rank=None` DeepSpeed would keep the old partitions), so every rank must
    write the same values."""
    return _gathered(params, modifier_rank=0)


def _gathered(params, modifier_rank):
    import deepspeed

    params = [p for p in params if is_partitioned(p)]
    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank) if params else contextlib.nullcontext()


def used_outside_forward(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """Have ZeRO-3 gather `param` for `module`'s forward too (a weight another module owns)."""
    if is_partitioned(param):
        import deepspeed

        deepspeed.zero.register_external_parameter(module, param)


def held(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `param`: its ZeRO-3 partition (flat, padded; on the host with offload_param), else
    the parameter itself."""
    return param.ds_tensor if is_partitioned(param) else param


def full_numel(param: torch.Tensor) -> int:
    return param.ds_numel if is_partitioned(param) else param.numel()


def partition_numels(params) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole tensors) over ZeRO-3's `params`: its partitions
    (`ds_tensor`, 1/Nd of each tensor, padded) against `ds_numel`."""
    params = [p for p in params if is_partitioned(p)]
    return sum(held(p).numel() for p in params), sum(full_numel(p) for p in params)


def offloaded(optimizer) -> dict:
    """What DeepSpeed's ZeRO optimizer wrapper keeps on the host: {"optimizer": bool, "param": bool}
    (stage 3's `offload_optimizer` / `offload_param`, stages 1-2's `cpu_offload`)."""
    return {"optimizer": bool(getattr(optimizer, "offload_optimizer", getattr(optimizer, "cpu_offload", False))),
            "param": bool(getattr(optimizer, "offload_param", False))}


class AvailablePeak:
    peak = 0


@contextlib.contextmanager
def track_available_parameters(engine):
    """Inside the block, `.peak` of the yielded object follows the largest number of elements ZeRO-3's parameter
    coordinator counts as gathered or in flight (`__n_available_params`, read after each module's fetch, where it
    peaks: releases only lower it). A ZeRO-3 engine only."""
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    fetch = coordinator.fetch_sub_module
    tracked = AvailablePeak()

    def fetch_and_count(module, forward):
        fetch(module, forward)
        tracked.peak = max(tracked.peak, coordinator._PartitionedParameterCoordinator__n_available_params)

    coordinator.fetch_sub_module = fetch_and_count
    try:
        yield tracked
    finally:
        del coordinator.fetch_sub_module  # the class's method again
