"""Crashes, hangs, corrupted checkpoints and numerical faults lose no completed step.

Faults come from outside the product: kill -9 and SIGSTOP from the test, and
tests/faults/sitecustomize.py loaded into the ranks through PYTHONPATH.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hybrid3d.checkpoint.resume import ResumePlan
from hybrid3d.checkpoint.universal import scratch_folder
from hybrid3d.training.entry import main
from tests.launcher.harness import (deepspeed_command, demo_config, launch_env, layer_states, rank_process,
                                    read_metrics, wait_for)
from tests.launcher.in_world import run_job

def copy_checkpoint(uninterrupted, tmp_path) -> Path:
    target = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted["out"] / "checkpoints", target, ignore=shutil.ignore_patterns("*_universal"))
    (target / "latest_universal").unlink(missing_ok=True)
    return target


@pytest.mark.parametrize("damage, needle", [
    (lambda p: p.unlink(), "is missing (the checkpoint is incomplete)"),
    (lambda p: p.write_bytes(p.read_bytes()[:100]), "bytes, the manifest says"),
], ids=["missing", "truncated"])
def test_damaged_checkpoint_is_refused_naming_the_file(uninterrupted, tmp_path, monkeypatch, capsys, damage, needle):
    checkpoints = copy_checkpoint(uninterrupted, tmp_path)
    victim = checkpoints / "global_step8" / "layer_03-model_01-model_states.pt"
    damage(victim)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    code = main(["--deepspeed_config", str(uninterrupted["config"]), "--checkpoint.load", str(checkpoints),
                 "--train.output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and str(victim) in err and needle in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_another_models_checkpoint_is_refused(uninterrupted, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    code = main(["--deepspeed_config", str(uninterrupted["config"]), "--checkpoint.load",
                 str(uninterrupted["out"] / "checkpoints"), "--model.config_overrides", '{"intermediate_size": 256}',
                 "--train.output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "holds another model (intermediate_size=352, this run has 256)" in err, err


def test_corrupted_shard_is_named_before_loading(uninterrupted, tmp_path):
    checkpoints = copy_checkpoint(uninterrupted, tmp_path)
    victim = checkpoints / "global_step8" / "zero_pp_rank_0_mp_rank_02_optim_states.pt"
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)  # same size, damaged bytes
    victim.write_bytes(bytes(data))
    result = run_job(4, uninterrupted["config"], "--checkpoint.load", str(checkpoints), "--eval-only")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() + result.stdout.splitlines() if "error: " in line]
    assert len(errors) == 1 and str(victim) in errors[0] and "corrupted checkpoint file" in errors[0], errors


def test_a_rank_that_stops_answering_ends_the_job(tmp_path):
    """A rank stopped (SIGSTOP) mid-run: the other rank's watchdog ends it within timeout_seconds plus a bound,
    with a line naming the rank that saw it and the step. Two ranks (TP2): the watchdog, not the layout, is the subject.

    Once the healthy rank has ended on its own, the test kills the stopped one: DeepSpeed's launcher would do the
    same after its 30 s grace (`terminate_process_tree`: SIGTERM, which a stopped process cannot act on, then
    SIGKILL), time that tests nothing of ours."""
    timeout_s = 6  # the demo's steps take < 1 s, its step-4 save and evaluation ~2 s on 2 cores
    config = demo_config(tmp_path, timeout_seconds=timeout_s)
    proc = subprocess.Popen(deepspeed_command(2, config, "--pipeline_parallel_size", "1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=launch_env())
    metrics = tmp_path / "run" / "metrics.jsonl"
    stopped = None
    try:
        assert wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, proc)
        healthy, stopped = rank_process(proc, 0), rank_process(proc, 1)
        stopped.suspend()  # SIGSTOP: alive, holding its sockets, answering nothing
        suspended_at = time.time()
        healthy.wait(timeout=timeout_s + 60)  # psutil.TimeoutExpired fails the test: the watchdog did not end it
        ended_after = time.time() - suspended_at
    finally:
        if stopped is not None and stopped.is_running():
            stopped.kill()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert ended_after < timeout_s + 60, ended_after
    hang = re.search(r"error: rank (\d): no progress for \d+ s in (step \d+|the evaluation at step \d+)", output)
    assert hang and hang.group(1) == "0", output[-3000:]


def nan_run(tmp_path, policy: str):
    """NaN loss in step 3 (the 9th loss call on the last stage: GAS 4); the job in the pooled world of 4 (the
    policy, not the process, is the subject)."""
    config = demo_config(tmp_path)
    raw = json.loads(config.read_text())
    raw["hybrid3d"]["train"].update(on_nonfinite=policy, steps=5, eval_interval=0)
    raw["hybrid3d"]["checkpoint"] = {"save_interval": 1}
    config.write_text(json.dumps(raw))
    return run_job(4, config, nan_loss_call=9)


def test_nan_with_skip_policy_skips_the_update(tmp_path):
    result = nan_run(tmp_path, "skip")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "warning: non-finite loss nan / gradient norm" in result.stdout and "at step 3: the update was skipped" \
        in result.stdout
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert math.isnan(losses[2]) and all(math.isfinite(x) for i, x in enumerate(losses) if i != 2)
    checkpoints = tmp_path / "run" / "checkpoints"
    before, after = layer_states(checkpoints / "global_step2"), layer_states(checkpoints / "global_step3")
    assert all(torch.equal(before[f][k], after[f][k]) for f in before for k in before[f])  # no update applied
    final = layer_states(checkpoints / "global_step5")
    assert all(torch.isfinite(t).all() for layer in final.values() for t in layer.values())


def test_nan_with_stop_policy_stops_without_saving_it(tmp_path):
    result = nan_run(tmp_path, "stop")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "non-finite loss nan" in errors[0] and "at step 3: stopping" in errors[0], errors
    assert "global_step2" in errors[0]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step2" and not (checkpoints / "global_step3").exists()


def killed_in_child(work, what: str) -> None:
    """`work(die)` in a forked child of this process, `die(reason)` killing the child -9 where a fault fires (the
    faults of tests/launcher/faults): the state a process killed there leaves, with no test code run after it."""
    pid = os.fork()
    if pid == 0:
        # The child has only the forking thread: a parallel region would wait for OpenMP workers that were not
        # copied (libgomp hangs: seen in ds_to_universal's first tensor clone). One thread runs none.
        torch.set_num_threads(1)
        try:
            work(lambda reason: os.kill(os.getpid(), signal.SIGKILL))
        finally:
            os._exit(3)  # reached only if the fault never fired
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the fault {what} never fired"


def commit_killed_at(phase: str, save_dir: Path, tag: str, keep_last: int, step: int) -> None:
    """What rank 0 does after every rank saved (checkpoint/saver.py: the commit of `tag`, then the pruning), killed
    -9 at `phase`."""
    from hybrid3d.checkpoint import commit, files
    from tests.launcher.faults.fault_patches import patch_commit, patch_prune

    def work(die):
        patch_prune(files, die) if phase == "prune" else patch_commit(commit, phase, tag, die)
        commit.commit(save_dir, tag)
        files.prune_checkpoints(save_dir, keep_last, step)

    killed_in_child(work, f"at {phase}")


@pytest.mark.parametrize("phase, latest", [("manifest", "global_step4"), ("rename", "global_step4"),
                                           ("latest", "global_step4"), ("prune", "global_step8")],
                         ids=["before-manifest", "before-rename", "before-latest", "during-pruning"])
def test_kill_9_at_every_phase_of_a_commit_loses_nothing(uninterrupted, tmp_path, phase, latest):
    """The committing process killed -9 at each phase of committing step 8 (keep_last 1, so the commit prunes step
    4): `latest` names a complete tag, and the job resumes from it to the uninterrupted run's losses (from step 4)
    or evaluates to its last eval loss (from step 8, with step 4 left half-deleted by the pruning).

    The commit runs in a forked child of this process over the uninterrupted run's files, staged as the ranks
    leave them (`global_step8.incomplete`, `latest` at step 4); ranks killed -9 inside a launched job (a whole node,
    one of them in the save of step 8) are test_multinode.py's."""
    from hybrid3d.checkpoint.files import read_meta, write_meta
    from hybrid3d.checkpoint.schema import MANIFEST_KEY

    config = demo_config(tmp_path)
    raw = json.loads(config.read_text())
    raw["hybrid3d"]["checkpoint"]["keep_last"] = 1
    config.write_text(json.dumps(raw))
    checkpoints = tmp_path / "run" / "checkpoints"
    source = uninterrupted["out"] / "checkpoints"
    for name in ("global_step4", "hf"):
        shutil.copytree(source / name, checkpoints / name)
    staged = checkpoints / "global_step8.incomplete"
    shutil.copytree(source / "global_step8", staged)
    meta = read_meta(staged)
    del meta[MANIFEST_KEY]  # written by the commit
    write_meta(staged, meta)
    (checkpoints / "latest").write_text("global_step4")
    shutil.copy(uninterrupted["out"] / "metrics.jsonl", tmp_path / "run" / "metrics.jsonl")

    commit_killed_at(phase, checkpoints, "global_step8", keep_last=1, step=8)
    assert (checkpoints / "latest").read_text() == latest
    if latest == "global_step4":
        resumed = run_job(4, config, "--checkpoint.load", "latest")
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
        assert losses[-4:] == [m["loss"] for m in uninterrupted["metrics"]][-4:]
        assert (checkpoints / "latest").read_text() == "global_step8" and not (checkpoints / "global_step4").exists()
        return
    assert (checkpoints / "global_step4").exists() and len(list((checkpoints / "global_step4").iterdir())) < len(
        list((source / "global_step4").iterdir()))  # half-deleted
    evaluated = run_job(4, config, "--checkpoint.load", "latest", "--eval-only")
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    eval_loss = float(re.search(r"eval_loss (\S+) perplexity", evaluated.stdout).group(1))
    assert math.isclose(eval_loss, uninterrupted["metrics"][-1]["eval_loss"], rel_tol=1e-5)


def conversion_killed(plan, into: Path) -> None:
    """rank 0's universal conversion of `plan` into `into` (checkpoint/universal.py), killed -9 after DeepSpeed's
    converter ran and before the result is marked complete."""
    from hybrid3d.checkpoint import universal
    from tests.launcher.faults.fault_patches import patch_universal

    def work(die):
        patch_universal(universal, die)
        universal.convert_to_universal(plan, into=into)

    killed_in_child(work, "in the conversion")


def test_kill_9_during_the_universal_conversion_is_redone(uninterrupted, tmp_path):
    """The converting process killed -9 after DeepSpeed's converter ran but before the result was marked complete:
    the next evaluation at the other layout converts again and evaluates to the uninterrupted run's last eval loss.
    The conversion runs in a forked child of this process (ranks killed -9 inside a launched job: test_multinode.py)."""
    checkpoints = copy_checkpoint(uninterrupted, tmp_path)
    args = ("--tensor_parallel_size", "1", "--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "2",
            "--checkpoint.load", str(checkpoints), "--eval-only")
    # an evaluation converts into a scratch folder of its own, never into the checkpoint folder
    plan = ResumePlan(checkpoints, "global_step8", {}, module_only=False, universal=True)
    scratch = scratch_folder(plan)
    conversion_killed(plan, scratch)
    assert list(scratch.glob("global_step8_universal.incomplete-*"))
    assert not (scratch / "global_step8_universal").exists()
    result = run_job(4, uninterrupted["config"], *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    eval_loss = float(re.search(r"eval_loss (\S+) perplexity", result.stdout).group(1))
    assert math.isclose(eval_loss, uninterrupted["metrics"][-1]["eval_loss"], rel_tol=1e-5)
    assert not scratch.exists()  # removed after the evaluation
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step4", "global_step8", "hf", "latest",
                                                              "zero_to_fp32.py", "zero_to_torch.py"]
