"""Checks of the DeepSpeed keys hybrid3d depends on, run before anything is built.

DeepSpeed would fail on these deep inside `deepspeed.initialize` (or not at all: the
activation-checkpointing section is silently ignored); here each is one line naming the key.
"""

import math

from hybrid3d.config.sections import SECTION, HybridSection, positive_int
from hybrid3d.config.support import check_schedule_with_pipeline_zero2
from hybrid3d.errors import ConfigError
from hybrid3d.parallel.pipeline_schedules import SCHEDULES


def complete_batch_sizes(ds: dict, dp: int) -> None:
    """Fill in the missing one of train_batch_size / micro / GAS, checking train = micro x GAS x dp."""
    tbs, mbs, gas = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps"))
    for key, value in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mbs),
                       ("gradient_accumulation_steps", gas)):
        if value is not None:
            positive_int(value, key)
    if tbs is None and mbs is None:
        raise ConfigError("train_batch_size or train_micro_batch_size_per_gpu must be set")
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * dp:
            raise ConfigError(
                f"train_batch_size ({tbs}) != train_micro_batch_size_per_gpu ({mbs}) * gradient_accumulation_steps "
                f"({gas}) * data-parallel size ({dp})")
    elif tbs is not None and mbs is not None:
        if tbs % (mbs * dp):
            raise ConfigError(f"train_batch_size ({tbs}) is not divisible by train_micro_batch_size_per_gpu ({mbs}) "
                              f"* data-parallel size ({dp})")
        gas = tbs // (mbs * dp)
    elif tbs is not None:
        gas = gas or 1
        if tbs % (gas * dp):
            raise ConfigError(f"train_batch_size ({tbs}) is not divisible by gradient_accumulation_steps ({gas}) "
                              f"* data-parallel size ({dp})")
        mbs = tbs // (gas * dp)
    else:
        gas = gas or 1
        tbs = mbs * gas * dp
    ds.update(train_batch_size=tbs, train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas)


def check_zero_and_precision(ds: dict, pp: int, pipeline_zero2: bool = False) -> None:
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError("zero_optimization must be a JSON object")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage == 3 and pp > 1:
        raise ConfigError(f"zero_optimization.stage=3 runs with {SECTION}.pipeline_parallel_size 1 only (DeepSpeed's "
                          f"PipelineEngine refuses ZeRO-3), not {pp}: with pipeline stages use stage 1, or 2 with "
                          f"{SECTION}.pipeline_zero2")
    if stage == 2 and pp > 1 and not pipeline_zero2:
        raise ConfigError(
            f"zero_optimization.stage=2 cannot run with {SECTION}.pipeline_parallel_size={pp} unless "
            f"{SECTION}.pipeline_zero2=true, which reduces gradients every micro-batch (gradient traffic x "
            "gradient_accumulation_steps, on the pipeline's critical path); or use stage 1")
    bf16 = ds.get("bf16", {}).get("enabled", False)
    fp16 = ds.get("fp16", {}).get("enabled", False)
    accum = ds.get("data_types", {}).get("grad_accum_dtype")
    if bf16 and fp16:
        raise ConfigError("bf16.enabled and fp16.enabled cannot both be true")
    if bf16 and accum in ("fp32", "float32") and stage == 0:
        raise ConfigError("data_types.grad_accum_dtype=fp32 with bf16 needs zero_optimization.stage >= 1 "
                          "(DeepSpeed's BF16_Optimizer shards fp32 masters over data parallel)")


OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# ZeRO-3 options that build their process groups from the whole world or per node, not from the mpu's
# data-parallel group (DeepSpeed 0.19.8 runtime/zero/mics.py, partition_parameters.py's hpZ groups): with TP or CP
# ranks in the world they would partition across TP shards.
WORLD_GROUP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                    "zero_quantized_gradients", "mics_shard_size")


def check_offload(ds: dict, tp: int, cp: int) -> None:
    """DeepSpeed's offload keys (`zero_optimization.offload_optimizer`, `offload_param`) as DeepSpeed 0.19.8 takes
    them (runtime/zero/config.py, offload_config.py): a device of none/cpu/nvme; nvme needs `nvme_path`; parameter
    offload, NVMe and a partial `ratio` need stage 3. DeepSpeed would refuse or ignore some of these deep inside
    `initialize`. Also the ZeRO-3 options whose groups ignore the layout (`WORLD_GROUP_KEYS`)."""
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    for name in ("offload_optimizer", "offload_param"):
        section = zero.get(name)
        if section is None:
            continue
        key = f"zero_optimization.{name}"
        if not isinstance(section, dict):
            raise ConfigError(f"{key} must be a JSON object like {{\"device\": \"cpu\"}}")
        device = section.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(f"{key}.device must be one of {', '.join(OFFLOAD_DEVICES)}, got {device!r}")
        if device == "none":
            continue
        if stage == 0:
            raise ConfigError(f"{key} needs zero_optimization.stage 1, 2 or 3 (DeepSpeed offloads ZeRO's partitions)")
        if name == "offload_param" and stage != 3:
            raise ConfigError(f"{key} needs zero_optimization.stage 3 (only ZeRO-3 partitions parameters), got {stage}")
        if device == "nvme":
            if stage != 3:
                raise ConfigError(f"{key}.device nvme needs zero_optimization.stage 3, got {stage}")
            if not section.get("nvme_path"):
                raise ConfigError(f"{key}.device nvme needs {key}.nvme_path (a folder on a fast local disk)")
        ratio = section.get("ratio", 1.0)
        if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ConfigError(f"{key}.ratio must be in (0, 1], got {ratio!r}")
        if ratio < 1 and stage != 3:
            raise ConfigError(f"{key}.ratio < 1 (a partial offload) needs zero_optimization.stage 3, got {stage}")
    if zero.get("cpu_offload") or zero.get("cpu_offload_params"):
        raise ConfigError("zero_optimization.cpu_offload is DeepSpeed's old spelling: use "
                          "zero_optimization.offload_optimizer {\"device\": \"cpu\"} (and offload_param)")
    if tp * cp > 1:
        for name in WORLD_GROUP_KEYS:
            if zero.get(name) not in (None, False, 0, 1):
                raise ConfigError(f"zero_optimization.{name} builds its groups from the whole world, which would "
                                  f"mix tensor- or context-parallel ranks: not supported with "
                                  f"{SECTION}.tensor_parallel_size {tp} x context_parallel_size {cp}")


def check_checkpoint_engine(ds: dict) -> None:
    """hybrid3d's commit (checkpoint/commit.py) needs every file written and fsync'ed when the engine's save
    returns; DeepSpeed's fast and decoupled writers (`checkpoint.writer`) and DataStates (`datastates_ckpt`)
    write in the background."""
    if ds.get("checkpoint", {}).get("writer") is not None:
        raise ConfigError("checkpoint.writer (DeepSpeed's fast/decoupled checkpoint writers) is not supported: "
                          "hybrid3d commits a checkpoint only once every file is on disk (the decoupled writer "
                          "commits inside DeepSpeedEngine.step, which the pipeline engine never calls); remove the "
                          "key, and for saves written in the background set hybrid3d.checkpoint.async")
    if ds.get("datastates_ckpt", {}).get("enabled", False):
        raise ConfigError("datastates_ckpt.enabled (asynchronous DataStates checkpoints) is not supported: "
                          "hybrid3d commits a checkpoint only once every file is on disk; remove the key, and for "
                          "saves written in the background set hybrid3d.checkpoint.async")


def check_nonfinite_policy(ds: dict, policy: str) -> None:
    """'skip' relies on DeepSpeed's optimizer wrappers, which skip a step whose gradient norm is not
    finite (BF16_Optimizer, DeepSpeedZeroOptimizer); plain fp32 without ZeRO has no wrapper."""
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    low_precision = ds.get("bf16", {}).get("enabled", False) or ds.get("fp16", {}).get("enabled", False)
    if policy == "skip" and stage == 0 and not low_precision:
        raise ConfigError(f"{SECTION}.train.on_nonfinite='skip' needs zero_optimization.stage >= 1 or bf16 "
                          "(DeepSpeed skips non-finite steps only in its optimizer wrappers); use 'stop'")
    # the wrappers skip a step only when they check the gradients for inf/NaN; with the check off they apply it
    if policy == "skip" and ds.get("bf16", {}).get("check_grad_overflow", True) is False:
        raise ConfigError(f"{SECTION}.train.on_nonfinite='skip' needs bf16.check_grad_overflow true (without it "
                          "DeepSpeed applies a non-finite update); remove the key or use 'stop'")


def check_pipeline_zero2(ds: dict, hybrid: HybridSection) -> None:
    """The opt-in runs ds_internals/pipeline_zero2.py's `ZeRO2PipelineEngine`: ZeRO-2 in a pipeline, no offload."""
    key, fraction = f"{SECTION}.pipeline_zero2", hybrid.pipeline_zero2_deferred_fraction
    if fraction > 1:
        raise ConfigError(f"{key}_deferred_fraction must be between 0 and 1, got {fraction}")
    if not hybrid.pipeline_zero2:
        if fraction > 0:
            raise ConfigError(f"{key}_deferred_fraction needs {key}=true")
        return
    zero = ds.get("zero_optimization", {})
    if zero.get("stage", 0) != 2:
        raise ConfigError(f"{key} needs zero_optimization.stage=2, got {zero.get('stage', 0)}")
    if hybrid.pipeline_parallel_size == 1:
        raise ConfigError(f"{key} applies to {SECTION}.pipeline_parallel_size > 1 only "
                          "(ZeRO-2 without a pipeline needs no opt-in)")
    offload = zero.get("offload_optimizer") or {}
    if isinstance(offload, dict) and offload.get("device", "none") != "none":
        raise ConfigError(f"zero_optimization.offload_optimizer is not supported with {key}")


def turn_off_pipe_partitioning(ds: dict, needed_by: str) -> None:
    """Set DeepSpeed's `pipeline.pipe_partitioned` and `grad_partitioned` false; either set true is refused,
    naming what needs them off."""
    pipeline = ds.setdefault("pipeline", {})
    for name in ("pipe_partitioned", "grad_partitioned"):
        if pipeline.get(name, False):
            raise ConfigError(f"pipeline.{name}=true cannot be combined with {needed_by}")
        pipeline[name] = False


def check_pipeline_schedule(ds: dict, hybrid: HybridSection) -> None:
    """`pipeline_schedule`: what DualPipeV (DeepSpeed 0.19.8 `runtime/pipe/dualpipev.py` asserts it deep in
    start-up) and the interleaved schedule need, one line each; pipe/grad partitioning set false when absent
    (both send whole activations between stages)."""
    schedule, key = hybrid.pipeline_schedule, f"{SECTION}.pipeline_schedule"
    if schedule not in SCHEDULES:
        raise ConfigError(f"{key} must be one of {', '.join(repr(s) for s in SCHEDULES)}, got {schedule!r}")
    v, pp, gas = hybrid.virtual_pipeline_size, hybrid.pipeline_parallel_size, ds["gradient_accumulation_steps"]
    if schedule == "interleaved":
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:
            raise ConfigError(f"{key}='interleaved' needs {SECTION}.virtual_pipeline_size >= 2 (model chunks per "
                              f"rank), got {v!r}")
    elif v != 1:
        raise ConfigError(f"{SECTION}.virtual_pipeline_size={v!r} applies to {key}='interleaved' only, "
                          f"not {schedule!r}")
    if schedule == "1f1b":
        return
    if pp == 1:
        raise ConfigError(f"{key}={schedule!r} needs {SECTION}.pipeline_parallel_size > 1")
    if schedule == "dualpipev" and gas < 2 * pp:
        raise ConfigError(f"{key}='dualpipev' needs gradient_accumulation_steps >= 2 * pipeline_parallel_size "
                          f"= {2 * pp}, got {gas}")
    if schedule == "interleaved" and gas % pp:
        raise ConfigError(f"{key}='interleaved' needs gradient_accumulation_steps ({gas}) divisible by "
                          f"pipeline_parallel_size ({pp}): micro-batches go through the chunks in groups of p")
    check_schedule_with_pipeline_zero2(hybrid)
    turn_off_pipe_partitioning(ds, f"{key}={schedule!r}")


def check_evaluation(hybrid: HybridSection) -> None:
    """An evaluation schedule needs data to evaluate on (checked with the config, so a shipped recipe that
    lacks it fails its test, not its first launch)."""
    data = hybrid.data
    per_dataset = any(entry.get("eval_path") for entry in data.blend or [])
    if hybrid.train.eval_interval and not (data.eval_path or data.eval_fraction or per_dataset):
        raise ConfigError(f"{SECTION}.train.eval_interval needs {SECTION}.data.eval_path or "
                          f"{SECTION}.data.eval_fraction" + (" (or an eval_path in data.blend's entries)"
                                                             if data.blend else ""))


def check_sequence_splits(ds: dict, hybrid: HybridSection) -> None:
    """Sequence and context parallelism: the combinations that cannot work, one line each, and the
    pipeline keys SP needs (set here when absent).

    With SP, DeepSpeed's pipe/grad partitioning and `partition_activations` would split the (b, s/t, h)
    shards again over TP as if they were replicated, then gather the other ranks' different shards."""
    sp, cp = hybrid.sequence_parallel, hybrid.context_parallel_size
    tp, pp = hybrid.tensor_parallel_size, hybrid.pipeline_parallel_size
    seq = hybrid.data.seq_length
    if sp:  # with tp > 1 (parallel/layout.py)
        if ds.get("activation_checkpointing", {}).get("partition_activations", False):
            raise ConfigError(f"activation_checkpointing.partition_activations cannot be combined with "
                              f"{SECTION}.sequence_parallel: the checkpointed activations are already split over TP")
        if pp > 1:
            turn_off_pipe_partitioning(ds, f"{SECTION}.sequence_parallel: the stage-to-stage activations are "
                                           "already split over TP")
    ring = cp > 1 and hybrid.context_parallel_comm != "a2a"  # 2c chunks, each split over TP with SP
    split = cp * (2 if ring else 1) * (tp if sp else 1)
    if seq % split:
        what = " * ".join(([f"context_parallel_size ({cp})"] if cp > 1 else []) + (["2 (ring attention)"] if ring else [])
                          + ([f"tensor_parallel_size ({tp}, sequence_parallel)"] if sp else []))
        raise ConfigError(f"{SECTION}.data.seq_length ({seq}) is not divisible by {what}")


def apply_activation_checkpointing(ds: dict, hybrid: HybridSection) -> None:
    """`hybrid3d.activation_checkpointing` as DeepSpeed's key: true sets pipeline.activation_checkpoint_interval 1
    where the JSON gives none; a given interval that says the opposite is refused."""
    wanted = hybrid.activation_checkpointing
    if wanted is None:
        return
    interval = ds.get("pipeline", {}).get("activation_checkpoint_interval")
    if interval is not None and bool(interval) != wanted:
        raise ConfigError(f"{SECTION}.activation_checkpointing is {str(wanted).lower()} but "
                          f"pipeline.activation_checkpoint_interval is {interval!r}: remove one of them")
    if wanted and interval is None:
        ds.setdefault("pipeline", {})["activation_checkpoint_interval"] = 1


def check_activation_checkpointing(ds: dict, pp: int, num_layers: int | None, on_cpu: bool) -> None:
    pipe = ds.get("pipeline", {})
    interval = pipe.get("activation_checkpoint_interval", 0)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ConfigError(f"pipeline.activation_checkpoint_interval must be an integer >= 0, got {interval!r}")
    ac = ds.get("activation_checkpointing", {})
    if not isinstance(ac, dict):
        raise ConfigError("activation_checkpointing must be a JSON object")
    partition = ac.get("partition_activations", False)
    if ac.get("contiguous_memory_optimization", False):
        if not partition:
            raise ConfigError("activation_checkpointing.contiguous_memory_optimization needs "
                              "activation_checkpointing.partition_activations=true")
        if ac.get("number_checkpoints") is None:
            raise ConfigError("activation_checkpointing.contiguous_memory_optimization needs "
                              "activation_checkpointing.number_checkpoints")
        if interval == 0:
            raise ConfigError("activation_checkpointing.contiguous_memory_optimization needs "
                              "pipeline.activation_checkpoint_interval > 0")
        if num_layers is not None:
            needed = checkpoints_in_flight(num_layers, pp, interval, ds["gradient_accumulation_steps"])
            if ac["number_checkpoints"] < needed:
                raise ConfigError(
                    f"activation_checkpointing.number_checkpoints ({ac['number_checkpoints']}) is below the "
                    f"{needed} checkpoints a stage holds ({num_layers} layers, pipeline_parallel_size {pp}, "
                    f"activation_checkpoint_interval {interval})")
    if ac.get("cpu_checkpointing", False) and not partition and on_cpu:
        raise ConfigError("activation_checkpointing.cpu_checkpointing needs "
                          "activation_checkpointing.partition_activations=true on the CPU accelerator "
                          "(DeepSpeed empties the saved tensor otherwise)")
    if ac.get("profile", False) and pipe.get("use_reentrant", True) is False:
        raise ConfigError("activation_checkpointing.profile works only with pipeline.use_reentrant=true")


def checkpoints_in_flight(num_layers: int, pp: int, interval: int, gas: int) -> int:
    """Checkpointed chunks one stage holds at once: its chunks per micro-batch times the 1F1B
    micro-batches in flight on the first stage, min(pp, GAS) (one without a pipeline)."""
    chunks = math.ceil(math.ceil(num_layers / pp) / interval)
    return chunks * (min(pp, gas) if pp > 1 else 1)


def check_expert_parallel(ds: dict, hybrid: HybridSection) -> None:
    """`expert_parallel_size` (e): the combinations tested against HF, one line for each of the others.
    e divides the data-parallel size d (the expert-parallel groups are e of the d data ranks). ZeRO stage 0
    clips with DeepSpeed's fp32 `clip_grad_norm_`, which averages per-rank norms where the experts' squares
    must be summed (ds_internals/experts.py); fp16, context and sequence parallelism and pipeline_zero2 are
    untested with experts spread over ranks."""
    e, key = hybrid.expert_parallel_size, f"{SECTION}.expert_parallel_size"  # e divides d: parallel/layout.py
    if e == 1:
        return
    if hybrid.context_parallel_size > 1:
        raise ConfigError(f"{key} > 1 cannot be combined with {SECTION}.context_parallel_size > 1 yet")
    if hybrid.sequence_parallel:
        raise ConfigError(f"{key} > 1 cannot be combined with {SECTION}.sequence_parallel yet")
    if ds.get("zero_optimization", {}).get("stage", 0) == 0:
        raise ConfigError(f"{key} > 1 needs zero_optimization.stage 1 or 2 (stage 0's clipping miscounts experts)")
    if ds.get("fp16", {}).get("enabled", False):
        raise ConfigError(f"{key} > 1 runs in fp32 or bf16 (fp16.enabled: its loss scaling is untested with experts)")
    if hybrid.pipeline_zero2:
        raise ConfigError(f"{key} > 1 runs without {SECTION}.pipeline_zero2 only for now")
