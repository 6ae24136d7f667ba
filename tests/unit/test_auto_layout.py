""""auto" in a config (config/auto_values.py, planning/auto_layout.py, training/auto_start.py): which keys are open,
what the given ones constrain, the decision and its tie rule, the written-out config the one validation pass accepts,
the refusals, and `python -m hybrid3d.plan --write-config`."""

import json

import pytest

from hybrid3d.config.run_config import parse_config
from hybrid3d.config.sections import parse_hybrid_section
from hybrid3d.errors import ConfigError
from hybrid3d.model import LlamaShape
from hybrid3d.model.presets import preset_config
from hybrid3d.config.auto_values import auto_keys, placeholder_config, read_request
from hybrid3d.planning.auto_layout import (ENOUGH_HEADROOM, HEADROOM_GRAIN, TIE_BAND, apply_choice, choose, decide,
                                           report_lines)
from hybrid3d.planning.machines import cpu_cluster
from hybrid3d.planning.plan_cli import main as plan_main
from hybrid3d.planning.planner import Choice, Cluster
from hybrid3d.training.entry import parse_args, prepare
from hybrid3d.config.validation import validate_run

BUCKET = 100_000  # elements: the tiny model's reduce bucket (DeepSpeed's default would be 2 GB in fp32)


@pytest.fixture(scope="module")
def tiny():
    return LlamaShape.from_hf(preset_config("tiny"))


def config(**section) -> dict:
    return {"train_batch_size": 16, "zero_optimization": {"reduce_bucket_size": BUCKET},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "hybrid3d": {"model": {"preset": "tiny"}, "data": {"seq_length": 128}, **section}}


def decided(shape, raw, world=4, budget=0.5):
    keys = auto_keys(raw)
    request = read_request(raw, keys)
    decision = decide(shape, cpu_cluster(world, budget, 2, request.precision), request, offload=False)
    return decision, apply_choice(raw, decision.chosen, keys)


def test_layout_auto_opens_every_key_the_config_leaves_out():
    keys = auto_keys(config(layout="auto", tensor_parallel_size=2))
    assert "hybrid3d.tensor_parallel_size" not in keys  # given: a constraint
    assert {"hybrid3d.pipeline_parallel_size", "hybrid3d.activation_checkpointing", "zero_optimization.stage",
            "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"} <= set(keys)
    assert auto_keys(config(tensor_parallel_size=2)) == []
    assert auto_keys(config(pipeline_parallel_size="auto")) == ["hybrid3d.pipeline_parallel_size"]
    with pytest.raises(ConfigError, match="hybrid3d.layout must be \"auto\""):
        auto_keys(config(layout="fast"))
    # the placeholder parses (the model is read from it), the real section refuses "auto" below the entry
    parse_hybrid_section(placeholder_config(config(layout="auto", pipeline_parallel_size="auto")))
    with pytest.raises(ConfigError, match="pipeline_parallel_size is \"auto\": only launch/train.py"):
        parse_hybrid_section(config(pipeline_parallel_size="auto"))


def test_given_keys_constrain_and_the_result_validates(tiny):
    raw = config(layout="auto", tensor_parallel_size=2)
    raw["zero_optimization"]["stage"] = 1
    decision, resolved = decided(tiny, raw)
    assert all(r.tp == 2 and r.zero == 1 for r in decision.ranked)
    assert decision.chosen.memory_gb <= 0.5
    run = validate_run(resolved, 4, tiny, on_cpu=True)  # the one validation pass takes it as written
    c = decision.chosen
    assert (run.layout.tp, run.layout.pp, run.layout.cp, run.layout.dp) == (c.tp, c.pp, c.cp, c.dp)
    assert (run.config.zero_stage, run.config.micro_batch_size, run.config.gradient_accumulation_steps) == (
        1, c.micro_batch, c.gas)
    assert run.config.checkpoint_interval == (1 if c.checkpointing else 0)
    assert "layout" not in resolved["hybrid3d"]
    # the same inputs give the same decision (every rank computes it alone)
    assert decided(tiny, raw)[1] == resolved


def test_open_micro_batch_keeps_the_given_accumulation(tiny):
    raw = config(tensor_parallel_size=1, pipeline_parallel_size=1)
    raw.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=2)
    decision, resolved = decided(tiny, raw)
    assert resolved["gradient_accumulation_steps"] == 2 and resolved["train_micro_batch_size_per_gpu"] == 2  # 16/4/2


def test_tie_band_prefers_headroom():
    def row(seconds, memory):
        return Choice(1, 1, 4, 0, False, 1, 4, memory, 0.0, memory, seconds, 0.0, 0.0)

    fastest, roomy, slow_roomiest = row(1.0, 9.5), row(1.0 + TIE_BAND / 2, 8.0), row(1.0 + 2 * TIE_BAND, 1.0)
    assert choose([fastest, roomy, slow_roomiest], 10.0) is roomy
    assert choose([fastest, slow_roomiest], 10.0) is fastest
    assert choose([fastest, row(1.0, 9.5)], 10.0) is fastest  # equal headroom: the first
    # beyond ENOUGH_HEADROOM of the budget more room buys nothing: the faster estimate wins
    safe, safer = row(1.0, 10.0 * (1 - ENOUGH_HEADROOM)), row(1.0 + TIE_BAND / 2, 5.0)
    assert choose([safe, safer], 10.0) is safe
    assert choose([row(1.0, 9.5), row(1.0 + TIE_BAND / 2, 9.2)], 10.0).memory_gb == 9.2  # both short: more room
    # less than HEADROOM_GRAIN of the budget apart: as safe as each other, the faster estimate wins
    assert choose([row(1.0, 9.5), row(1.0 + TIE_BAND / 2, 9.5 - HEADROOM_GRAIN * 10.0 / 2)], 10.0).memory_gb == 9.5


def test_report_names_the_choice_the_next_rows_and_the_refusals(tiny):
    decision, _ = decided(tiny, config(layout="auto"), budget=0.02)
    lines = report_lines(decision, "CPU rates measured by benchmarks/step_time_check.py")
    assert lines[0].startswith("auto: TP") and "of 0.02 GB per device" in lines[1]
    assert sum("auto:   next:" in line for line in lines) == 2
    assert "refused:" in lines[-1] and "over 0.02 GB" in lines[-1]


def test_refusals_are_one_line(tiny):
    with pytest.raises(ConfigError, match="needs train_batch_size"):
        read_request({"hybrid3d": {"layout": "auto"}}, ["hybrid3d.tensor_parallel_size"])
    fp16 = config(layout="auto")
    fp16["fp16"] = {"enabled": True}
    with pytest.raises(ConfigError, match="fp16.enabled is not modelled"):
        read_request(fp16, auto_keys(fp16))
    ring = config(layout="auto", context_parallel_comm="p2p")
    with pytest.raises(ConfigError, match="context_parallel_comm 'p2p'"):
        read_request(ring, auto_keys(ring))
    both = config(activation_checkpointing="auto")
    both["pipeline"] = {"activation_checkpoint_interval": 1}
    with pytest.raises(ConfigError, match="activation_checkpoint_interval both set"):
        read_request(both, auto_keys(both))
    with pytest.raises(ConfigError) as nothing_fits:
        decided(tiny, config(layout="auto"), budget=0.001)
    message = str(nothing_fits.value)
    assert "\n" not in message and "no layout fits 0.001 GB per device" in message
    assert "the least memory any option needs" in message
    # a job's hints name its config keys, and only changes that would fit: no planner flag, no empty list
    assert "what would fit: hybrid3d.device_memory_gb >= " in message and "--" not in message and ":;" not in message
    # SP needs TP > 1, which a world of 1 cannot give: contradicts the support table
    with pytest.raises(ConfigError, match="no layout of 1 ranks has the values given"):
        decided(tiny, config(layout="auto", sequence_parallel=True), world=1)


def test_activation_checkpointing_key():
    raw = config(activation_checkpointing=True)
    raw["train_micro_batch_size_per_gpu"] = 4
    assert parse_config(raw, 4).checkpoint_interval == 1
    raw["pipeline"] = {"activation_checkpoint_interval": 0}
    with pytest.raises(ConfigError, match="activation_checkpointing is true but pipeline.activation_checkpoint_"):
        parse_config(raw, 4)


def test_entry_decides_before_validation(tmp_path):
    """The job's entry: "auto" decided from the budget, the config as given kept apart; on the CPU the budget is
    required; nothing is written before the job starts."""
    raw = config(layout="auto", train={"output_dir": str(tmp_path / "out")})
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="hybrid3d.device_memory_gb"):
        prepare(*parse_args(["--deepspeed_config", str(path)]), world_size=2)
    job = prepare(*parse_args(["--deepspeed_config", str(path), "--device_memory_gb", "0.5"]), world_size=2)
    assert job.given["hybrid3d"]["layout"] == "auto" and "layout" not in job.raw["hybrid3d"]
    assert job.layout.tp * job.layout.pp * job.layout.cp * job.layout.dp == 2
    assert job.auto_lines[0].startswith("auto: ")
    assert not (tmp_path / "out").exists()


def test_plan_writes_the_chosen_row_as_a_config(tmp_path, capsys):
    out = tmp_path / "planned.json"
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                "hybrid3d": {"train": {"steps": 7}}}))
    argv = ["--model", "tiny", "--gpus", "4", "--gpu-memory", "80", "--seq-length", "128", "--global-batch", "16",
            "--write-config", str(out), "--from", str(base)]
    assert plan_main(argv) == 0
    written = json.loads(out.read_text())
    assert written["hybrid3d"]["train"]["steps"] == 7 and written["optimizer"]["params"]["lr"] == 1e-4
    assert written["train_batch_size"] == 16 and written["bf16"]["enabled"]
    shape = LlamaShape.from_hf(preset_config("tiny"))
    run = validate_run(written, 4, shape, on_cpu=False)
    assert f"wrote {out}: TP{run.layout.tp} PP{run.layout.pp}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exists:
        plan_main(argv)
    assert exists.value.code == 2 and "exists (not overwritten)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(["--model", "tiny", "--gpus", "4", "--gpu-memory", "80", "--from", str(base)])
    assert "--from needs --write-config" in capsys.readouterr().err


def test_gpu_cluster_keeps_the_planner_defaults():
    """An H100 SXM (and a GPU the table does not know) plans with the planner's defaults: today's rankings."""
    from hybrid3d.planning.gpus import GPUS
    from hybrid3d.planning.machines import device_gpu, gpu_cluster

    cluster = gpu_cluster(8, 80.0, 8, GPUS["h100-sxm"], 2000.0)
    assert cluster == Cluster(gpus=8, gpu_memory_gb=80.0, host_memory_gb=2000.0)
    unknown, source = device_gpu("Some Accelerator 9000", links=None)
    assert unknown == GPUS["h100-sxm"] and "not in the GPU table" in source
