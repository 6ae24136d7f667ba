"""Asynchronous saves (`hybrid3d.checkpoint.async`, checkpoint/async_save.py): the files are DeepSpeed's, bit for
bit those of a synchronous save at the same step; a resume from them continues exactly; a process killed -9 while
the background writer runs leaves the last committed `latest`, from which the job resumes exactly."""

import shutil
from pathlib import Path

import torch

from hybrid3d.model import LlamaShape
from hybrid3d.model.presets import preset_config
from hybrid3d.planning.checkpoint_copy import rank_copy_bytes

from tests.launcher.harness import config_copy, layer_states, read_metrics, resume_copy
from tests.launcher.in_world import run_job
from tests.launcher.test_reliability import killed_in_child


def test_async_saves_write_the_synchronous_files_and_resume_exactly(uninterrupted, tmp_path):
    """The shortened demo (TP2 x PP2, saves at steps 4 and 8) with async saves: every layer and optimizer file of
    both checkpoints equals the synchronous run's, the console and metrics.jsonl report each save's copy and
    background write, and a resume from the async step-4 checkpoint ends on the uninterrupted run's losses."""
    config = config_copy(uninterrupted["config"], tmp_path / "async.json", tmp_path / "run",
                         checkpoint={"save_interval": 4, "keep_last": 0, "async": True})
    result = run_job(4, config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ours, theirs = tmp_path / "run" / "checkpoints", uninterrupted["out"] / "checkpoints"
    for tag in ("global_step4", "global_step8"):
        mine, reference = layer_states(ours / tag), layer_states(theirs / tag)
        assert mine.keys() == reference.keys() and mine
        for name in reference:
            for key, value in reference[name].items():
                assert torch.equal(mine[name][key], value), (tag, name, key)
            # byte for byte: torch.save of the host copy, later, writes what it would have written at the save
            # (the optimizer and model-state files hold the run's config, which differs: "async")
            assert (ours / tag / name).read_bytes() == (theirs / tag / name).read_bytes(), (tag, name)
        assert sorted(p.name for p in (ours / tag).iterdir()) == sorted(p.name for p in (theirs / tag).iterdir())
    assert (ours / "latest").read_text() == "global_step8"
    assert result.stdout.count("committed: the step was held") == 2
    saves = read_metrics(tmp_path / "run", "saves")
    assert [r["checkpoint"] for r in saves] == ["global_step4", "global_step8"]
    assert all(r["held_s"] > 0 and r["write_s"] > 0 for r in saves)
    # the host copy the planner counts (planning/checkpoint_copy.py) against rank 0's (stage 0, fp32, ZeRO-1 at DP1):
    # its layer files' weights and its optimizer partition (master and two moments), the RNG states left out
    predicted = rank_copy_bytes(LlamaShape.from_hf(preset_config("tiny")), 2, 2, 0, 1, 1, "fp32")
    assert all(predicted <= r["copied_bytes"] <= predicted * 1.02 for r in saves), (predicted, saves)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run", "steps")]
    assert losses == [m["loss"] for m in uninterrupted["metrics"]]

    resumed = resume_copy(4, config, tmp_path / "run", "global_step4", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    again = [m["loss"] for m in read_metrics(tmp_path / "resumed", "steps")]
    assert again == losses[-4:]


def writer_killed_after_first_file(files: dict) -> None:
    """A rank's background writer over `files` ({path: (state, zipfile)}), its process killed -9 once the first
    file is on disk (the writer fsyncs each file: the fault fires there)."""
    from hybrid3d.checkpoint import async_save

    def work(die):
        original = async_save.fsync_file

        def fsync_then_die(path):
            size = original(path)
            die(f"after {path}")
            return size

        async_save.fsync_file = fsync_then_die
        async_save.BackgroundWriter(files).wait()

    killed_in_child(work, "in the background write")


def test_kill_9_during_a_background_write_keeps_the_last_commit(uninterrupted, tmp_path):
    """The step-8 save's background writer killed -9 after its first file: `latest` still names step 4, the
    partial `global_step8.incomplete` is never loaded, and the job resumes from step 4 to the uninterrupted run's
    losses (and commits step 8 over the partial folder)."""
    source = uninterrupted["out"] / "checkpoints"
    checkpoints = tmp_path / "run" / "checkpoints"
    for name in ("global_step4", "hf"):
        shutil.copytree(source / name, checkpoints / name)
    (checkpoints / "latest").write_text("global_step4")
    staged = checkpoints / "global_step8.incomplete"
    files = {str(staged / p.relative_to(source / "global_step8")): (torch.load(p, weights_only=False), True)
             for p in sorted((source / "global_step8").rglob("*.pt"))}
    writer_killed_after_first_file(files)
    assert (checkpoints / "latest").read_text() == "global_step4"
    assert 0 < len(list(staged.rglob("*.pt"))) < len(files)  # partly written
    shutil.copy(uninterrupted["out"] / "metrics.jsonl", tmp_path / "run" / "metrics.jsonl")
    config = config_copy(uninterrupted["config"], tmp_path / "async.json", tmp_path / "run",
                         checkpoint={"save_interval": 4, "keep_last": 0, "async": True})
    resumed = run_job(4, config, "--checkpoint.load", "latest")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path / "run", "steps")]
    assert losses[-4:] == [m["loss"] for m in uninterrupted["metrics"]][-4:]
    assert (checkpoints / "latest").read_text() == "global_step8" and not staged.exists()
    assert Path(checkpoints / "global_step8").is_dir()
