"""The step loop's policies alone: when to evaluate and save, what a non-finite step does, how a
stop request is agreed."""

import math
import os
import signal

import pytest

from hybrid3d.errors import NonFiniteError
from hybrid3d.training.signals import StopRequest
from hybrid3d.training.step_policies import EvalSchedule, NonFinitePolicy, SaveSchedule


def test_eval_schedule():
    assert [s for s in range(1, 13) if EvalSchedule(4).due(s)] == [4, 8, 12]
    assert not any(EvalSchedule(0).due(s) for s in range(1, 13))


def test_save_schedule_saves_each_step_once():
    written = []
    saves = SaveSchedule(3, save=lambda s: written.append(s) or f"tag{s}", path_of=lambda s: f"tag{s}")
    assert saves.last_path() is None
    for step in range(1, 7):
        if saves.due(step):
            saves.save(step)
    assert written == [3, 6]
    assert saves.save(6) == "tag6" and written == [3, 6]  # the end of the run at a saved step: no second save
    assert saves.save(7) == "tag7" and written == [3, 6, 7] and saves.last_path() == "tag7"
    assert not any(SaveSchedule(0, save=None, path_of=None).due(s) for s in range(1, 10))


def test_save_schedule_after_resume_does_not_rewrite_the_loaded_step():
    written = []
    saves = SaveSchedule(0, save=written.append, path_of=lambda s: f"tag{s}", last_saved=8)
    assert saves.save(8) == "tag8" and written == []
    assert saves.last_path() == "tag8"


def test_nonfinite_stop_names_the_last_checkpoint():
    policy = NonFinitePolicy("stop")
    assert policy.check(2.5, 1.0, step=3) is None
    assert policy.check(2.5, None, step=3) is None  # no norm reported (no clipping): the loss decides
    with pytest.raises(NonFiniteError, match=r"non-finite loss nan / gradient norm 1.0 at step 4: stopping .* the "
                                             r"last checkpoint is ckpt/global_step2"):
        policy.check(math.nan, 1.0, step=4, last_checkpoint="ckpt/global_step2")
    with pytest.raises(NonFiniteError, match="gradient norm inf at step 5.*checkpoint is none"):
        policy.check(2.5, math.inf, step=5)


def test_nonfinite_skip_counts():
    policy = NonFinitePolicy("skip")
    assert policy.check(math.nan, None, step=3) == ("warning: non-finite loss nan / gradient norm None at step 3: "
                                                    "the update was skipped (1 so far; train.on_nonfinite=skip)")
    assert policy.check(1.0, math.inf, step=4).endswith("(2 so far; train.on_nonfinite=skip)")
    assert policy.check(1.0, 1.0, step=5) is None and policy.skipped == 2
    with pytest.raises(ValueError):
        NonFinitePolicy("ignore")


def test_stop_request_is_agreed_when_any_rank_got_a_signal():
    other_ranks = {"flag": 0}  # what the other ranks contribute to the all-reduce (max)
    request = StopRequest(all_reduce_max=lambda mine: max(mine, other_ranks["flag"]), install=False)
    assert not request.agreed()
    other_ranks["flag"] = 1  # another rank got SIGTERM: this one stops too
    assert request.agreed()


def test_stop_request_handles_sigterm():
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        request = StopRequest(all_reduce_max=lambda mine: mine)
        assert not request.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert request.signal_name == "SIGTERM" and request.agreed()
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
