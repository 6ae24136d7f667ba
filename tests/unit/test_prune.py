"""`keep_last` pruning (hybrid3d/checkpoint/files.py): never the tag just saved, which `latest` names."""

from hybrid3d.checkpoint.files import prune_checkpoints


def tags(root):
    return sorted(p.name for p in root.iterdir())


def test_pruning_keeps_the_newest_tags_up_to_the_saved_step(tmp_path):
    for step in (100, 200, 300):
        (tmp_path / f"global_step{step}").mkdir()
    (tmp_path / "global_step100_universal").mkdir()
    assert prune_checkpoints(tmp_path, 2, 300) == ["global_step100", "global_step100_universal"]
    assert tags(tmp_path) == ["global_step200", "global_step300"]


def test_a_run_resumed_from_an_older_tag_keeps_what_it_just_saved(tmp_path):
    """Resumed from step 100 while 200 and 300 exist (keep_last 2): the new save at 150 stays; the tags of the
    abandoned branch (200, 300) are left alone; the older tags of this branch are pruned."""
    for step in (50, 100, 150, 200, 300):
        (tmp_path / f"global_step{step}").mkdir()
    assert prune_checkpoints(tmp_path, 2, 150) == ["global_step50"]
    assert tags(tmp_path) == ["global_step100", "global_step150", "global_step200", "global_step300"]


def test_a_killed_or_stale_universal_conversion_is_not_reused(tmp_path, monkeypatch):
    """`convert_to_universal` reuses `<tag>_universal` only when its marker names the tag's contents: a folder
    left by a killed conversion (no marker) or converted from another branch's tag of the same name is redone."""
    import json

    from hybrid3d.checkpoint import universal
    from hybrid3d.checkpoint.resume import ResumePlan

    tag = tmp_path / "global_step4"
    tag.mkdir()
    (tag / "hybrid3d.json").write_text(json.dumps({"step": 4, "branch": "a"}))
    runs = []

    def fake_ds_to_universal(source, output):  # stands in for DeepSpeed's converter: writes its zero/ folder
        runs.append(str(output))
        (tmp_path / output).joinpath("zero").mkdir(parents=True)

    monkeypatch.setattr(universal, "run_ds_to_universal", fake_ds_to_universal)
    plan = ResumePlan(load_dir=tmp_path, tag="global_step4", meta={}, universal=True, module_only=False)
    killed = tmp_path / "global_step4_universal"
    (killed / "zero").mkdir(parents=True)  # what a killed run of the old code left: zero/ but no marker
    assert universal.convert_to_universal(plan) == killed and len(runs) == 1
    assert runs[0].endswith("global_step4_universal.incomplete") and not (tmp_path / runs[0]).exists()
    assert universal.convert_to_universal(plan) == killed and len(runs) == 1  # complete and current: reused
    (tag / "hybrid3d.json").write_text(json.dumps({"step": 4, "branch": "b"}))  # the tag saved again, elsewhere
    universal.convert_to_universal(plan)
    assert len(runs) == 2


def test_commit_checks_every_ranks_files_and_makes_each_step_durable(tmp_path, monkeypatch):
    """The commit refuses a tag when a file another rank wrote is missing or shorter in rank 0's view (leaving
    `latest` where it was), and fsyncs the manifest, the tag folder, the rename and `latest` in that order."""
    import os

    import pytest

    from hybrid3d.checkpoint import commit as commit_module
    from hybrid3d.checkpoint import files as files_module
    from hybrid3d.checkpoint.commit import commit, prepare_staging
    from hybrid3d.errors import CheckpointError

    (tmp_path / "latest").write_text("global_step4")
    prepare_staging(tmp_path, "global_step8", {"step": 8})
    shard = tmp_path / "global_step8.incomplete" / "mp_rank_00_model_states.pt"
    shard.write_bytes(b"x" * 10)
    with pytest.raises(CheckpointError, match="written with 12 bytes but rank 0 sees 10 bytes"):
        commit(tmp_path, "global_step8", {str(shard): 12})
    with pytest.raises(CheckpointError, match="rank 0 sees no file"):
        commit(tmp_path, "global_step8", {str(shard.with_name("other.pt")): 3})
    assert (tmp_path / "latest").read_text() == "global_step4"

    synced = []
    real_file, real_dir = commit_module.fsync_file, commit_module.fsync_dir
    for module in (commit_module, files_module):  # the manifest is written (and fsync'ed) by files.write_meta
        monkeypatch.setattr(module, "fsync_file", lambda p: synced.append(("file", os.path.basename(p))) or
                            real_file(p))
    monkeypatch.setattr(commit_module, "fsync_dir", lambda p: synced.append(("dir", os.path.basename(p))) or
                        real_dir(p))
    commit(tmp_path, "global_step8", {str(shard): 10})
    assert synced == [("file", ".hybrid3d.json.tmp"), ("dir", "global_step8.incomplete"), ("dir", tmp_path.name),
                      ("file", ".latest.tmp"), ("dir", tmp_path.name)]
    assert (tmp_path / "latest").read_text() == "global_step8"


def test_record_saves_fsyncs_and_reports_what_the_engine_writes(tmp_path):
    from types import SimpleNamespace

    from hybrid3d.ds_internals.durable_save import record_saves

    def save(state_dict, path):
        with open(path, "wb") as f:
            f.write(state_dict)

    engine = SimpleNamespace(checkpoint_engine=SimpleNamespace(save=save))
    written = {}
    with record_saves(engine, written):
        engine.checkpoint_engine.save(b"abc", tmp_path / "a.pt")
    engine.checkpoint_engine.save(b"abcd", tmp_path / "b.pt")  # outside the block: not recorded
    assert written == {str(tmp_path / "a.pt"): 3}
