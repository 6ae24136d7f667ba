"""What a new user trips over (issue 22), the checks that need no process group: a model source named on the
command line, a reused output folder, a single process without the launcher, resume bounds."""

import json

from hybrid3d.config.overrides import apply_overrides
from hybrid3d.config.sections import parse_hybrid_section


def test_hf_model_override_replaces_the_json_preset_and_says_so():
    raw = {"hybrid3d": {"model": {"preset": "tiny"}}}
    log = apply_overrides(raw, [("model.hf_model", "/models/llama")])
    assert raw["hybrid3d"]["model"] == {"hf_model": "/models/llama"}
    assert log == ['hybrid3d.model.hf_model: <unset> -> "/models/llama"',
                   'hybrid3d.model.preset: "tiny" -> null (replaced by --model.hf_model from the command line)']
    parse_hybrid_section(raw)  # no longer "exclusive: set one"


def test_preset_override_replaces_the_json_hf_model():
    raw = {"hybrid3d": {"model": {"hf_model": "/models/llama", "init_from_hf": True}}}
    log = apply_overrides(raw, [("hybrid3d.model.preset", "tiny")])
    assert raw["hybrid3d"]["model"] == {"preset": "tiny"} and len(log) == 3
    parse_hybrid_section(raw)


def test_both_sources_on_the_command_line_are_still_refused():
    import pytest

    from hybrid3d.errors import ConfigError

    raw = {"hybrid3d": {"model": {}}}
    apply_overrides(raw, [("model.hf_model", "/m"), ("model.preset", "tiny")])
    with pytest.raises(ConfigError, match="are exclusive"):
        parse_hybrid_section(json.loads(json.dumps(raw)))


def _run_main(tmp_path, monkeypatch, capsys, argv, launched=True, edit=None):
    from tests.configs import write_config
    from hybrid3d.training.entry import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    if launched:
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("RANK", "0")
    config = write_config(tmp_path, edit)
    code = main(["--deepspeed_config", str(config), *argv])
    return code, capsys.readouterr().err.strip()


def _fake_previous_run(tmp_path, step=4):
    """The files a finished run leaves: metrics.jsonl, a committed tag named by `latest`."""
    out = tmp_path / "out"
    tag = out / "checkpoints" / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "hybrid3d.json").write_text(json.dumps({
        "layout": {"tp": 2, "pp": 2, "dp": 1}, "step": step, "shape": {}, "module_only": False}))
    (out / "checkpoints" / "latest").write_text(f"global_step{step}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    return out


def test_a_new_run_into_a_previous_runs_folder_is_refused(tmp_path, monkeypatch, capsys):
    out = _fake_previous_run(tmp_path)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    code, err = _run_main(tmp_path, monkeypatch, capsys, [])
    assert code == 2 and "\n" not in err, err
    assert err == (f"error: hybrid3d.train.output_dir: {out} holds a previous run ({out / 'metrics.jsonl'}): resume it "
                   "with --checkpoint.load latest, start over with --train.overwrite true, or choose another "
                   "--train.output_dir")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing touched


def test_previous_run_and_what_overwrite_removes(tmp_path):
    from hybrid3d.checkpoint.resume import ResumePlan
    from hybrid3d.training.output_folder import check_output_folder, clear_previous_run, previous_run

    out = _fake_previous_run(tmp_path)
    save = out / "checkpoints"
    assert previous_run(tmp_path / "new", tmp_path / "new" / "checkpoints") is None
    assert check_output_folder(out, save, None, overwrite=True) is True
    resuming = ResumePlan(save, "global_step4", {}, module_only=False, universal=False)
    assert check_output_folder(out, save, resuming, overwrite=False) is False  # resuming it: allowed, kept
    assert clear_previous_run(out, save) == f"metrics.jsonl and 1 checkpoint folders in {save}"
    assert previous_run(out, save) is None and sorted(p.name for p in save.iterdir()) == []


def test_steps_below_the_checkpoint_step_is_an_error(tmp_path, monkeypatch, capsys):
    out = _fake_previous_run(tmp_path, step=21)
    code, err = _run_main(tmp_path, monkeypatch, capsys, ["--checkpoint.load", "latest", "--train.steps", "10"])
    assert code == 2 and err == (
        "error: hybrid3d.train.steps (10) is not above the step of the checkpoint "
        f"{out / 'checkpoints' / 'global_step21'}"
        " (21): nothing to train (raise train.steps, or use --eval-only to evaluate it)"), err


def test_load_latest_in_a_fresh_folder_says_there_is_no_checkpoint_yet(tmp_path, monkeypatch, capsys):
    code, err = _run_main(tmp_path, monkeypatch, capsys, ["--checkpoint.load", "latest"])
    assert code == 2 and err == (f"error: hybrid3d.checkpoint.load=latest: there is no checkpoint in "
                                 f"{tmp_path / 'out' / 'checkpoints'} yet (nothing to resume: leave checkpoint.load "
                                 "unset for a new run)"), err


def test_a_single_process_needing_more_ranks_says_how_to_launch(tmp_path, monkeypatch, capsys):
    code, err = _run_main(tmp_path, monkeypatch, capsys, [], launched=False)
    assert code == 2 and err == (
        "error: hybrid3d.tensor_parallel_size 2 x pipeline_parallel_size 2 needs 4 ranks and this is a single "
        "process: launch with `deepspeed --num_gpus 4 launch/train.py --deepspeed_config ...` (a multiple of 4 adds "
        "data parallelism)"), err
    assert not (tmp_path / "out").exists()


def test_single_process_world_sets_the_launcher_variables(monkeypatch):
    from hybrid3d.parallel.standalone import LAUNCHER_VARIABLES, launched, use_single_process_world

    for name in (*LAUNCHER_VARIABLES, "LOCAL_SIZE"):  # set, then removed: monkeypatch restores the original state
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert not launched()
    use_single_process_world()
    import os

    assert all(name in os.environ for name in LAUNCHER_VARIABLES) and os.environ["WORLD_SIZE"] == "1"
    port = os.environ["MASTER_PORT"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    use_single_process_world()  # launched now: left alone
    assert os.environ["MASTER_PORT"] == port


def test_cli_descriptions_are_whole_sentences():
    from hybrid3d.convert.verify import build_parser

    description = build_parser().description
    assert description.endswith("what its Hugging Face original computes?"), description


def test_gitignore_covers_what_the_readme_commands_write():
    import re
    import subprocess

    from tests.launcher.harness import REPO

    readme = (REPO / "README.md").read_text()
    written = set(re.findall(r"--out (\S+)", readme)) | set(re.findall(r"--train\.output_dir (\S+)", readme))
    assert written, "the README's commands write no folder?"
    for path in sorted(written):
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{path}/x"], cwd=REPO).returncode == 0
        assert ignored, f"{path} (written by a README command) is not in .gitignore"
