"""Every tensor hybrid3d hands to a collective lives on the accelerator's device.

NCCL rejects host tensors ("No backend type associated with device type cpu"); gloo on the CPU
accepts anything, so a host-tensor collective passes every CPU test and dies at step 1 on a GPU.
Here the host is made distinguishable from the device: the ranks run with torch's default device
set to "meta", so a tensor created without `device=` is a meta tensor, and a guard around
`deepspeed.comm`'s collectives fails on any tensor that is not on the accelerator's device ("cpu").
"""

import pytest

from tests.distributed.worlds import run_world

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "send", "recv", "isend", "irecv")


def guard_collectives(expected_device: str, seen: list):
    """Wrap deepspeed.comm's tensor collectives: record each call and refuse off-device tensors."""
    import deepspeed.comm as dist
    import torch

    originals = {}
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue
        originals[name] = original

        def guarded(*args, _name=name, _original=original, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            for t in tensors:
                seen.append((_name, t.device.type))
                if t.device.type != torch.device(expected_device).type:
                    raise AssertionError(f"{_name} got a tensor on {t.device}, not the accelerator's {expected_device}")
            return _original(*args, **kwargs)

        setattr(dist, name, guarded)
    return originals


def placement_checks(rank, world_size):
    import deepspeed.comm as dist
    import torch
    from deepspeed.accelerator import get_accelerator

    from hybrid3d.checkpoint.saver import weights_are_finite
    from hybrid3d.convert.verify import broadcast_verdict
    from hybrid3d.training.signals import StopRequest

    device = get_accelerator().current_device_name()
    model = torch.nn.Linear(4, 4, device=device)
    results, seen = {}, []
    originals = guard_collectives(device, seen)
    torch.set_default_device("meta")  # host tensors made without device= now differ from the device's
    try:
        for name, check in [("stop_request", lambda: StopRequest(device=device, install=False).agreed()),
                            ("weights_are_finite", lambda: weights_are_finite(model)),
                            ("verify_verdict", lambda: broadcast_verdict(True if rank == 0 else None, 0))]:
            before = len(seen)
            try:
                results[name] = {"value": check(), "error": None}
            except AssertionError as e:
                results[name] = {"value": None, "error": str(e)}
            results[name]["collectives"] = seen[before:]
    finally:
        torch.set_default_device("cpu")
        for name, original in originals.items():
            setattr(dist, name, original)
    return results


@pytest.fixture(scope="module")
def placements(tmp_path_factory):
    return run_world(placement_checks, 2, str(tmp_path_factory.mktemp("placement")))


@pytest.mark.parametrize("name, value", [("stop_request", False), ("weights_are_finite", True),
                                         ("verify_verdict", True)])
def test_collectives_get_device_tensors(placements, name, value):
    for rank in placements:
        result = rank[name]
        assert result["error"] is None, result["error"]
        assert result["collectives"], f"{name} ran no collective: the guard saw nothing"
        assert result["value"] == value
