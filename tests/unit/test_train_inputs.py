"""Bad input to the training entry point: one line naming the key or file, exit code 2, nothing
written. These run `hybrid3d.train.main` in-process (the checks precede any process group); the
same through the real launcher: tests/launcher/test_train_errors.py."""

import json

import pytest

from hybrid3d.config.overrides import apply_overrides

from hybrid3d.errors import LayoutError
from hybrid3d.model import LlamaShape
from hybrid3d.model.presets import preset_config
from hybrid3d.config.request import request_from
from hybrid3d.training.auto_start import resolve_auto
from hybrid3d.training.entry import main
from hybrid3d.config.validation import validate_run
from tests.configs import h, write_config
from tests.launcher.harness import REPO
from hybrid3d.model.tp_plan import check_split

# (case id, edit of the demo config or raw text, extra argv, WORLD_SIZE, text the message must contain)
BAD_INPUTS = [
    ("invalid-json", None, "{not json", [], 4, "invalid JSON at line 1"),
    ("unknown-section-key", lambda c: h(c).update(tensor_paralel_size=2), None, [], 4,
     "hybrid3d.tensor_paralel_size is not a known key"),
    ("unknown-nested-key", lambda c: h(c)["train"].update(stepz=3), None, [], 4, "hybrid3d.train.stepz is not a known key"),
    ("wrong-type", lambda c: h(c)["train"].update(steps="ten"), None, [], 4, "hybrid3d.train.steps must be an integer"),
    ("negative", lambda c: h(c)["data"].update(seq_length=-1), None, [], 4, "hybrid3d.data.seq_length must be >= 1"),
    ("bool-type", lambda c: h(c)["data"].update(shuffle="yes"), None, [], 4, "hybrid3d.data.shuffle must be true or false"),
    ("unknown-preset", lambda c: h(c)["model"].update(preset="llama9"), None, [], 4, "preset 'llama9'"),
    ("no-model", lambda c: h(c).update(model={}), None, [], 4, "hybrid3d.model: set preset"),
    ("both-models", lambda c: h(c)["model"].update(hf_model="x"), None, [], 4, "are exclusive"),
    ("hf-model-missing", lambda c: h(c).update(model={"hf_model": "/nonexistent/llama"}), None, [], 4,
     "hybrid3d.model.hf_model: /nonexistent/llama is not a folder"),
    ("bad-override-field", lambda c: h(c)["model"].update(config_overrides={"hidden_sise": 8}), None, [], 4,
     "hybrid3d.model.config_overrides.hidden_sise is not a field of the model's HF config"),
    ("data-missing", lambda c: h(c)["data"].update(path="/nonexistent/data.jsonl"), None, [], 4,
     "hybrid3d.data.path: /nonexistent/data.jsonl does not exist"),
    ("tokenizer-missing", lambda c: h(c)["data"].update(tokenizer="/nonexistent/tok"), None, [], 4,
     "hybrid3d.data.tokenizer: /nonexistent/tok is not a folder"),
    ("seq-too-long", lambda c: h(c)["data"].update(seq_length=4096), None, [], 4,
     "hybrid3d.data.seq_length (4096) exceeds the model's max_position_embeddings (512)"),
    ("zero2-pipeline", lambda c: c["zero_optimization"].update(stage=2), None, [], 4,
     "zero_optimization.stage=2 cannot run with hybrid3d.pipeline_parallel_size=2"),
    ("world-not-divisible", None, None, [], 6, "world size 6 is not divisible by hybrid3d.tensor_parallel_size"),
    ("batch-arithmetic", lambda c: c.update(train_batch_size=7), None, [], 4, "train_batch_size (7) !="),
    ("heads-not-divisible", lambda c: h(c).update(tensor_parallel_size=3, pipeline_parallel_size=1), None, [], 3,
     "num_attention_heads (4) is not divisible by tensor_parallel_size (3)"),
    ("too-many-stages", lambda c: h(c).update(tensor_parallel_size=1, pipeline_parallel_size=8), None, [], 8,
     "pipeline_parallel_size (8) exceeds num_hidden_layers (4)"),
    ("checkpoint-missing", lambda c: h(c)["checkpoint"].update(load="/nonexistent/ckpt"), None, [], 4,
     "hybrid3d.checkpoint.load: /nonexistent/ckpt is not a folder"),
    ("eval-without-data", lambda c: h(c)["data"].update(eval_fraction=0.0), None, [], 4,
     "hybrid3d.train.eval_interval needs hybrid3d.data.eval_path"),
    ("eval-only-without-load", None, None, ["--eval-only"], 4, "--eval-only needs hybrid3d.checkpoint.load"),
    ("override-without-value", None, None, ["--train.steps"], 4, "override --train.steps has no value"),
    ("positional-argument", None, None, ["stray"], 4, "unexpected argument 'stray'"),
    ("not-a-tokenizer", lambda c: h(c)["data"].update(tokenizer="."), None, [], 4,
     "hybrid3d.data.tokenizer: cannot load a tokenizer from ."),
    ("bad-nonfinite-policy", lambda c: h(c)["train"].update(on_nonfinite="ignore"), None, [], 4,
     "hybrid3d.train.on_nonfinite must be 'skip' or 'stop'"),
    ("skip-without-wrapper", lambda c: (h(c)["train"].update(on_nonfinite="skip"), c["zero_optimization"].update(stage=0)),
     None, [], 4, "hybrid3d.train.on_nonfinite='skip' needs zero_optimization.stage >= 1 or bf16"),
    ("skip-without-overflow-check", lambda c: (h(c)["train"].update(on_nonfinite="skip"),
                                               c.update(bf16={"enabled": True, "check_grad_overflow": False})),
     None, [], 4, "hybrid3d.train.on_nonfinite='skip' needs bf16.check_grad_overflow true"),
    ("async-checkpoint-writer", lambda c: c.update(checkpoint={"writer": {"type": "fast"}}), None, [], 4,
     "checkpoint.writer (DeepSpeed's fast/decoupled checkpoint writers) is not supported"),
    ("datastates-checkpoints", lambda c: c.update(datastates_ckpt={"enabled": True}), None, [], 4,
     "datastates_ckpt.enabled (asynchronous DataStates checkpoints) is not supported"),
    ("cpu-checkpointing", lambda c: c.update(activation_checkpointing={"cpu_checkpointing": True}), None, [], 4,
     "activation_checkpointing.cpu_checkpointing needs activation_checkpointing.partition_activations"),
    # DeepSpeed keys checked against those DeepSpeed 0.19.8 reads (DeepSpeed itself ignores unknown ones).
    ("ds-top-level-typo", lambda c: c.update(gradient_accumulation_step=2), None, [], 4,
     "gradient_accumulation_step is neither a DeepSpeed 0.19.8 key nor a hybrid3d key; did you mean "
     "gradient_accumulation_steps?"),
    ("ds-nested-typo", lambda c: c["zero_optimization"].update(stag=2), None, [], 4,
     "zero_optimization.stag is not a key DeepSpeed 0.19.8 reads; did you mean stage?"),
    ("ds-offload-typo", lambda c: c["zero_optimization"].update(offload_optimizer={"devic": "cpu"}), None, [], 4,
     "zero_optimization.offload_optimizer.devic is not a key DeepSpeed 0.19.8 reads; did you mean device?"),
    ("hybrid-key-at-top-level", lambda c: c.update(pipeline_parallel_size=2), None, [], 4,
     'pipeline_parallel_size is a hybrid3d key: put it in the "hybrid3d" section'),
    ("override-section-typo", None, None, ["--trian.steps", "5"], 4,
     "override --trian.steps: trian is neither a DeepSpeed 0.19.8 key nor a hybrid3d key; did you mean train?"),
    ("override-ds-typo", None, None, ["--zero_optimisation.stage", "2"], 4,
     "override --zero_optimisation.stage: zero_optimisation is neither a DeepSpeed 0.19.8 key nor a hybrid3d key; "
     "did you mean zero_optimization?"),
    ("launcher-flag-after-script", None, None, ["--num_gpus", "2"], 4,
     "--num_gpus is a flag of the deepspeed launcher, which passes it on to the script when it comes after it: put "
     "it before the script (deepspeed --num_gpus 2 launch/train.py ...)"),
    ("launcher-switch-after-script", None, None, ["--train.steps", "3", "--no_ssh"], 4,
     "--no_ssh is a flag of the deepspeed launcher"),
    # Sequence and context parallelism: the combinations that cannot work.
    ("sp-without-tp", lambda c: h(c).update(tensor_parallel_size=1, sequence_parallel=True), None, [], 2,
     "hybrid3d.sequence_parallel needs hybrid3d.tensor_parallel_size > 1"),
    ("sp-partition-activations", lambda c: (h(c).update(sequence_parallel=True),
                                            c.update(activation_checkpointing={"partition_activations": True})),
     None, [], 4, "activation_checkpointing.partition_activations cannot be combined with hybrid3d.sequence_parallel"),
    ("sp-pipe-partitioned", lambda c: (h(c).update(sequence_parallel=True), c.update(pipeline={"pipe_partitioned": True})),
     None, [], 4, "pipeline.pipe_partitioned=true cannot be combined with hybrid3d.sequence_parallel"),
    ("cp-world-not-divisible", lambda c: h(c).update(context_parallel_size=2, pipeline_parallel_size=1), None, [], 6,
     "world size 6 is not divisible by hybrid3d.tensor_parallel_size * hybrid3d.pipeline_parallel_size * "
     "hybrid3d.context_parallel_size = 2 * 1 * 2"),
    ("seq-not-divisible-by-cp-tp", lambda c: (h(c).update(context_parallel_size=2, pipeline_parallel_size=1,
                                                          sequence_parallel=True), h(c)["data"].update(seq_length=130)),
     None, [], 4, "hybrid3d.data.seq_length (130) is not divisible by context_parallel_size (2) * "
                  "tensor_parallel_size (2, sequence_parallel)"),
    ("heads-not-divisible-by-tp-cp", lambda c: h(c).update(context_parallel_size=4, pipeline_parallel_size=1), None, [],
     8, "num_attention_heads (4) is not divisible by tensor_parallel_size * context_parallel_size (2 * 4)"),
    ("cp-zero-value", lambda c: h(c).update(context_parallel_size=0), None, [], 4,
     "hybrid3d.context_parallel_size must be >= 1, got 0"),
    # Pipeline schedules.
    ("unknown-schedule", lambda c: h(c).update(pipeline_schedule="gpipe"), None, [], 4,
     "hybrid3d.pipeline_schedule must be one of '1f1b', 'interleaved', 'dualpipev', got 'gpipe'"),
    ("interleaved-one-chunk", lambda c: h(c).update(pipeline_schedule="interleaved"), None, [], 4,
     "hybrid3d.pipeline_schedule='interleaved' needs hybrid3d.virtual_pipeline_size >= 2 (model chunks per rank), got 1"),
    ("virtual-size-without-interleaved", lambda c: h(c).update(virtual_pipeline_size=2), None, [], 4,
     "hybrid3d.virtual_pipeline_size=2 applies to hybrid3d.pipeline_schedule='interleaved' only, not '1f1b'"),
    ("interleaved-without-pipeline", lambda c: h(c).update(pipeline_schedule="interleaved", virtual_pipeline_size=2,
                                                           pipeline_parallel_size=1),
     None, [], 4, "hybrid3d.pipeline_schedule='interleaved' needs hybrid3d.pipeline_parallel_size > 1"),
    ("interleaved-gas", lambda c: (h(c).update(pipeline_schedule="interleaved", virtual_pipeline_size=2),
                                   c.update(gradient_accumulation_steps=3)),
     None, [], 4, "hybrid3d.pipeline_schedule='interleaved' needs gradient_accumulation_steps (3) divisible by "
                  "pipeline_parallel_size (2)"),
    ("interleaved-layers", lambda c: h(c).update(pipeline_schedule="interleaved", virtual_pipeline_size=4), None, [],
     4, "virtual_pipeline_size 4 must divide the 4/2 decoder layers of each pipeline stage"),
    ("interleaved-pipeline-zero2", lambda c: (h(c).update(pipeline_schedule="interleaved", virtual_pipeline_size=2,
                                                          pipeline_zero2=True), c["zero_optimization"].update(stage=2)),
     None, [], 4, "hybrid3d.pipeline_zero2 cannot run with hybrid3d.pipeline_schedule='interleaved'"),
    ("interleaved-partitioned", lambda c: (h(c).update(pipeline_schedule="interleaved", virtual_pipeline_size=2),
                                           c.update(pipeline={"pipe_partitioned": True})),
     None, [], 4, "pipeline.pipe_partitioned=true cannot be combined with hybrid3d.pipeline_schedule='interleaved'"),
    ("dualpipev-gas", lambda c: (h(c).update(pipeline_schedule="dualpipev"), c.update(gradient_accumulation_steps=2)),
     None, [], 4, "hybrid3d.pipeline_schedule='dualpipev' needs gradient_accumulation_steps >= 2 * "
                  "pipeline_parallel_size = 4, got 2"),
    ("dualpipev-without-pipeline", lambda c: h(c).update(pipeline_schedule="dualpipev", pipeline_parallel_size=1),
     None, [], 4, "hybrid3d.pipeline_schedule='dualpipev' needs hybrid3d.pipeline_parallel_size > 1"),
    ("dualpipev-pipeline-zero2", lambda c: (h(c).update(pipeline_schedule="dualpipev", pipeline_zero2=True),
                                           c["zero_optimization"].update(stage=2)),
     None, [], 4, "hybrid3d.pipeline_zero2 cannot run with hybrid3d.pipeline_schedule='dualpipev'"),
    ("dualpipev-partitioned", lambda c: (h(c).update(pipeline_schedule="dualpipev"),
                                        c.update(pipeline={"grad_partitioned": True})),
     None, [], 4, "pipeline.grad_partitioned=true cannot be combined with hybrid3d.pipeline_schedule='dualpipev'"),
    ("dualpipev-too-few-layers", lambda c: (h(c).update(pipeline_schedule="dualpipev", tensor_parallel_size=1,
                                                        pipeline_parallel_size=4),
                                            c.update(gradient_accumulation_steps=8)), None, [], 4,
     "pipeline_schedule 'dualpipev' cuts the model into 2 * pipeline_parallel_size = 8 stages, more than "
     "num_hidden_layers (4)"),
]


@pytest.mark.parametrize("case, edit, text, argv, world, needle", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys, case, edit, text, argv, world, needle):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    config = write_config(tmp_path, edit, text)
    assert main(["--deepspeed_config", str(config), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and needle in err, err
    assert not (tmp_path / "out").exists()


def test_other_ranks_leave_the_error_line_to_rank_0(tmp_path, monkeypatch, capsys):
    """DeepSpeed's launcher ends every rank when one exits non-zero, so a rank other than 0 waits for rank 0 to print
    the one line (and is ended meanwhile); one still there after the grace period says it itself."""
    from hybrid3d.training import entry

    waits = []
    monkeypatch.setattr(entry, "wait_for_rank0_to_report", lambda: waits.append(True))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    config = write_config(tmp_path, lambda c: h(c)["train"].update(stepz=3))
    assert main(["--deepspeed_config", str(config)]) == 2
    assert waits == [True]
    err = capsys.readouterr().err.strip()
    assert err.startswith("error (rank 1): hybrid3d.train.stepz is not a known key") and "\n" not in err, err


def test_kv_heads_and_context_parallel_size_must_divide_one_another():
    from transformers import LlamaConfig

    shape = LlamaShape.from_hf(LlamaConfig(hidden_size=96, num_attention_heads=12, num_key_value_heads=3,
                                           intermediate_size=48, num_hidden_layers=2, vocab_size=64))
    check_split(shape, 1, 1, cp=3)  # 3 kv heads over 3 ranks
    check_split(shape, 3, 1, cp=2)  # 1 kv head per TP rank, repeated for 2 CP ranks
    with pytest.raises(LayoutError) as err:
        check_split(shape, 1, 1, cp=2)
    assert str(err.value) == ("the 3 kv heads of a tensor-parallel rank (num_key_value_heads 3 / tensor_parallel_size 1) "
                              "and context_parallel_size (2) must divide one another")


def test_missing_config_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--deepspeed_config", str(tmp_path / "nope.json")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope.json'}: config file not found"


def test_overrides_route_to_the_right_section():
    raw = {"hybrid3d": {"train": {"steps": 5}}, "zero_optimization": {"stage": 1}}
    log = apply_overrides(raw, [("train.steps", "7"), ("zero_optimization.stage", "0"), ("model.preset", "tiny"),
                                ("hybrid3d.seed", "3"), ("bf16", '{"enabled": true}')])
    assert raw["hybrid3d"]["train"]["steps"] == 7 and raw["hybrid3d"]["model"]["preset"] == "tiny"
    assert raw["hybrid3d"]["seed"] == 3 and raw["zero_optimization"]["stage"] == 0 and raw["bf16"]["enabled"]
    assert log[0] == "hybrid3d.train.steps: 5 -> 7"


# Each shipped config at the world size it is written for.
SHIPPED = {"cpu_demo.json": 4, "zero1_pipeline.json": 4, "zero2_tp_dp.json": 4, "activation_checkpointing.json": 4,
           "bf16_fp32_masters.json": 4, "cpu_long_sequence.json": 4, "gpu_llama2-7b_8gpu.json": 8, "gpu_llama3-8b_64gpu.json": 64,
           "cpu_chat_finetune.json": 4, "cpu_smollm2_chat.json": 6, "cpu_smollm2_lora.json": 6,
           "gpu_llama3-8b_1gpu_offload.json": 1, "cpu_auto.json": 4, "gpu_llama3-8b_8x24gb.json": 8,
           "gpu_qwen3-30b-a3b_8gpu.json": 8}


def test_every_shipped_config_is_listed():
    assert {p.name for p in (REPO / "ds_configs").glob("*.json")} == set(SHIPPED)


def recipe_shape(name: str, raw: dict) -> LlamaShape:
    """The model a shipped recipe trains, without its files: cpu_chat_finetune.json fine-tunes the demo's model
    exported to HF (the tiny preset's shape); cpu_smollm2_lora.json takes its model folder on the command line
    (--model.hf_model: SmolLM2's shape, a placeholder folder written into `raw`)."""
    if name == "cpu_smollm2_lora.json":
        raw["hybrid3d"]["model"]["hf_model"] = "/models/SmolLM2-135M-Instruct"
    config = preset_config(raw["hybrid3d"]["model"].get("preset", "smollm2-135m" if "smollm2" in name else "tiny"))
    for key, value in raw["hybrid3d"]["model"].get("config_overrides", {}).items():
        setattr(config, key, value)
    return LlamaShape.from_hf(config)


@pytest.mark.parametrize("name, world", SHIPPED.items())
def test_shipped_config_is_valid(name, world):
    raw = json.loads((REPO / "ds_configs" / name).read_text())
    shape = recipe_shape(name, raw)
    raw, _ = resolve_auto(request_from(raw), shape, world, on_cpu=True)  # "auto" decided as launch/train.py does (cpu_auto.json)
    run = validate_run(raw, world, shape, on_cpu=False)  # every check a trainer's build relies on
    parsed, layout = run.config, run.layout
    ds = parsed.ds_config
    assert parsed.sequences_per_step == (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
                                         * layout.dp)
    assert ds["train_batch_size"] == parsed.sequences_per_step * layout.cp  # DeepSpeed counts the CP ranks
    assert parsed.hybrid.data.seq_length <= shape.max_position_embeddings


def test_start_up_phases_are_quick_on_every_recipe():
    """Start-up's phases (training/entry.py) timed on every shipped recipe: `read` (the JSON and overrides) plus
    `validate` (every refusal that needs no file) under 50 ms a recipe, the best of three (measured: 0.4-8 ms);
    `resolve`'s planner call (cpu_auto.json's "auto": 43 ms) is timed alongside and reported with them."""
    import time

    from hybrid3d.config.overrides import parse_override_args
    from hybrid3d.config.request import read_run

    timings = {}
    for name, world in SHIPPED.items():
        best = {}
        # the model folder cpu_smollm2_lora.json takes on the command line (recipe_shape's placeholder)
        overrides = parse_override_args(["--model.hf_model", "/models/SmolLM2-135M-Instruct"]
                                        if name == "cpu_smollm2_lora.json" else [])
        for _ in range(3):
            started = time.perf_counter()
            request = read_run(str(REPO / "ds_configs" / name), overrides)
            read_s = time.perf_counter() - started
            raw = request.raw
            shape = recipe_shape(name, raw)
            started = time.perf_counter()
            raw, _ = resolve_auto(request, shape, world, on_cpu=True)
            resolve_s = time.perf_counter() - started
            started = time.perf_counter()
            validate_run(raw, world, shape, on_cpu=False)
            validate_s = time.perf_counter() - started
            for phase, seconds in (("read", read_s), ("resolve", resolve_s), ("validate", validate_s)):
                best[phase] = min(best.get(phase, seconds), seconds)
        timings[name] = best
    slow = {name: t for name, t in timings.items() if t["read"] + t["validate"] >= 0.05}
    assert not slow, slow


# The cluster each GPU recipe is written for (docs/recipes.md): GPUs, GB per GPU, GPUs per node, the GPU
# (planning/gpus.py)
RECIPE_CLUSTERS = {"gpu_llama2-7b_8gpu.json": (8, 80, 8, "h100-sxm"), "gpu_llama3-8b_64gpu.json": (64, 80, 8, "h100-sxm"),
                   "gpu_llama3-8b_1gpu_offload.json": (1, 80, 8, "h100-sxm"),
                   "gpu_llama3-8b_8x24gb.json": (8, 24, 8, "rtx4090"), "gpu_qwen3-30b-a3b_8gpu.json": (8, 80, 8, "h100-sxm")}


@pytest.mark.parametrize("name", sorted(RECIPE_CLUSTERS))
def test_gpu_recipe_is_a_fastest_fitting_row_of_the_planner(name):
    """The GPU recipes cannot run here: each must be a row `python -m hybrid3d.plan` finds fitting its cluster and
    estimates within 1% of the fastest (the planner's memory model matches DeepSpeed's tensors on the CPU,
    tests/distributed/test_memory.py), with fp32 gradient accumulation (ZeRO-1: the planner's ZeRO-0 rows
    accumulate 128+ micro-batches in bf16), and an LR schedule whose shape is chosen, not DeepSpeed's defaults
    (log warm-up, decay to 1e-4 of the peak)."""
    from hybrid3d.planning.gpus import GPUS
    from hybrid3d.planning.machines import gpu_cluster
    from hybrid3d.planning.planner import plan
    from hybrid3d.planning.zero3_fetch import Zero3Knobs

    raw = json.loads((REPO / "ds_configs" / name).read_text())
    gpus, memory, per_node, gpu = RECIPE_CLUSTERS[name]
    shape = LlamaShape.from_hf(preset_config(raw["hybrid3d"]["model"]["preset"]))
    run = validate_run(raw, gpus, shape, on_cpu=False)
    parsed, layout = run.config, run.layout
    cluster = gpu_cluster(gpus, memory, per_node, GPUS[gpu], None)
    feasible, _ = plan(shape, cluster, parsed.hybrid.data.seq_length, parsed.sequences_per_step,
                       sequence_parallel=True, context_parallel=True, schedules=True,
                       zero3=Zero3Knobs.from_zero_config(raw["zero_optimization"]))  # its stage3_* knobs
    recipe = dict(tp=layout.tp, pp=layout.pp, cp=layout.cp, dp=layout.dp, zero=parsed.zero_stage,
                  checkpointing=parsed.checkpoint_interval > 0, micro_batch=parsed.micro_batch_size,
                  sp=parsed.hybrid.sequence_parallel, schedule=parsed.hybrid.pipeline_schedule)
    zero = raw["zero_optimization"]
    recipe["offload"] = ("none" if zero.get("offload_optimizer", {}).get("device", "none") == "none" else
                         "optimizer+params" if zero.get("offload_param", {}).get("device", "none") != "none"
                         else "optimizer")
    rows = [c for c in feasible if all(getattr(c, key) == value for key, value in recipe.items())]
    assert rows, f"{name}: {recipe} is not a row the planner finds fitting {gpus} x {memory} GB"
    # within its kind: a recipe that keeps the optimizer on the device against the rows that do (offload rows are
    # estimated with a host Adam rate measured on a 2-core VM, `step_time.Cluster.host_adam_gelems`); a ZeRO-3
    # recipe against the ZeRO-3 rows
    def kind(offload: str, zero: int) -> tuple:
        return offload == "none", zero == 3

    # packed documents under a pipeline run 1F1B only (config/support.py check_document_mask)
    def data_allows(c) -> bool:
        return c.pp == 1 or not parsed.hybrid.data.document_mask or c.schedule == "1f1b"

    fastest = next(c for c in feasible if kind(c.offload, c.zero) == kind(recipe["offload"], recipe["zero"])
                   and data_allows(c))
    assert rows[0].step_seconds <= 1.01 * fastest.step_seconds, (rows[0], fastest)
    # fp32 gradient accumulation on the device; with offload DeepSpeed accumulates through its host path in bf16, as
    # the planner's offload rows assume (planning/offload_plan.py)
    accumulation = "bf16" if recipe["offload"] != "none" else "fp32"
    assert raw["bf16"]["enabled"] and parsed.zero_stage >= 1
    assert raw.get("data_types", {}).get("grad_accum_dtype", "bf16") == accumulation
    schedule = raw["scheduler"]["params"]
    assert schedule["warmup_type"] == "linear" and schedule["cos_min_ratio"] == 0.1
