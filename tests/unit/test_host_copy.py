"""checkpoint/host_copy.py: `torch.save` of an asynchronous save's host copy, written after training has changed
the states (by checkpoint/async_save.py's background writer), is the file `torch.save` would have written at the
save, byte for byte."""

import os
import sys
import threading

import torch

from hybrid3d.checkpoint.async_save import BackgroundWriter, lower_to_idle_priority
from hybrid3d.checkpoint.host_copy import HostBuffers, Snapshot


def optimizer_like_state():
    """What DeepSpeed hands torch.save, in small: a module state dict (an OrderedDict with `_metadata`), tensors
    that view one flat buffer (ZeRO's partitions), a Parameter with an attribute, fp32 that requires grad, bf16,
    a transposed view, scalars, a param_groups list and a tuple."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    flat = torch.randn(40)
    master = torch.randn(6, requires_grad=True)
    parameter = torch.nn.Parameter(torch.randn(3))
    parameter.partition_id = 1
    state = {
        "module": module.state_dict(),
        "partitions": [flat[2:8], flat[5:25].view(4, 5), flat[30:].view(2, 5).t()],
        "master": master,
        "parameter": parameter,
        "bf16": torch.randn(5).to(torch.bfloat16),
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1]}],
        "rng": (torch.get_rng_state(), None),
        "global_steps": 4,
    }
    return state, (module, flat, master, parameter)


def train_on(state, tensors):
    """What the next steps do to the states the save copied."""
    module, flat, master, parameter = tensors
    with torch.no_grad():
        module.weight.add_(1)
        flat.mul_(2)
        master.add_(1)
        parameter.sub_(1)
    state["param_groups"][0]["lr"] = 5e-4
    state["global_steps"] = 5


def idle_policy_allowed() -> bool:
    """Whether a thread here may take SCHED_IDLE: the writer's own call, made on a throw-away thread."""
    allowed = []
    thread = threading.Thread(target=lambda: allowed.append(lower_to_idle_priority()))
    thread.start()
    thread.join()
    return allowed[0]


def test_the_copy_written_later_is_the_file_of_the_save(tmp_path):
    state, tensors = optimizer_like_state()
    (tmp_path / "sync").mkdir()
    torch.save(state, tmp_path / "sync" / "states.pt")
    snapshot = Snapshot(HostBuffers())
    snapshot.add(tmp_path / "async" / "states.pt", state)
    snapshot.wait_for_copies()
    train_on(state, tensors)
    policy = os.sched_getscheduler(0) if sys.platform == "linux" else None
    writer = BackgroundWriter(snapshot.files)
    assert writer.wait() == {str(tmp_path / "async" / "states.pt"): (tmp_path / "sync" / "states.pt").stat().st_size}
    assert (tmp_path / "async" / "states.pt").read_bytes() == (tmp_path / "sync" / "states.pt").read_bytes()
    # the writer's thread ran at the idle policy wherever a thread may take it (Linux; a sandbox may refuse it, and
    # then the writer keeps its priority: the kernel's own policy read back decides, lower_to_idle_priority); the
    # thread that started it kept its own
    assert writer.at_idle_priority == idle_policy_allowed()
    if policy is not None:
        assert os.sched_getscheduler(0) == policy != os.SCHED_IDLE
    # each storage once (the flat buffer whole, as torch.save writes it), scalars and containers not counted
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in (*state["module"].values(), *state["partitions"], state["master"], state["parameter"],
                          state["bf16"], state["rng"][0])}
    assert snapshot.copied_bytes == sum(storages.values())
    loaded = torch.load(tmp_path / "async" / "states.pt", weights_only=False)
    assert loaded["partitions"][0].untyped_storage().data_ptr() == loaded["partitions"][1].untyped_storage().data_ptr()
    assert type(loaded["parameter"]) is torch.nn.Parameter and loaded["parameter"].partition_id == 1
    assert loaded["master"].requires_grad and loaded["param_groups"][0]["lr"] == 1e-3


def test_later_saves_reuse_the_buffers(tmp_path):
    """The next save copies into the same host memory (pinning is slow to allocate); a storage whose size changed
    gets a new buffer."""
    buffers = HostBuffers()
    state, tensors = optimizer_like_state()
    first = Snapshot(buffers)
    first.add(tmp_path / "global_step4" / "states.pt", state)
    train_on(state, tensors)
    second = Snapshot(buffers)
    second.add(tmp_path / "global_step8" / "states.pt", state)
    [(one, _)] = first.files.values()
    [(two, _)] = second.files.values()
    assert one["master"].data_ptr() == two["master"].data_ptr()
    assert torch.equal(two["master"], state["master"].detach())
    state["master"] = torch.randn(7)
    third = Snapshot(buffers)
    third.add(tmp_path / "global_step12" / "states.pt", state)
    [(three, _)] = third.files.values()
    assert three["master"].data_ptr() != two["master"].data_ptr() and torch.equal(three["master"], state["master"])
