"""The DeepSpeed JSON plus its "hybrid3d" section: parsing and every check that can run before
anything is built. Each error is one line that names the offending key."""

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Optional


class ConfigError(ValueError):
    """A user error in the config: one line naming the key (the launcher exits with code 2)."""


class ReportedError(ConfigError):
    """A user error that rank 0 reports; the other ranks exit 2 without repeating the line."""


SECTION = "hybrid3d"


@dataclass(frozen=True)
class ModelSection:
    hf_model: Optional[str] = None  # a local HF Llama folder (config, tokenizer, optional weights)
    init_from_hf: bool = False  # load the folder's weights instead of a random initialisation
    preset: Optional[str] = None  # a named shape from hybrid3d.model.presets ('tiny', 'llama3-8b', ...)
    config_overrides: dict = field(default_factory=dict)  # LlamaConfig fields to change


@dataclass(frozen=True)
class DataSection:
    path: Optional[str] = None  # text/json/jsonl/parquet file(s), a save_to_disk folder; None = built-in corpus
    text_field: str = "text"
    tokenizer: Optional[str] = None  # HF tokenizer folder; None = the model folder's, else the built-in one
    seq_length: int = 128
    shuffle: bool = False
    seed: int = 1234
    eval_path: Optional[str] = None
    eval_fraction: float = 0.0  # held-out tail of the documents when no eval_path is given


@dataclass(frozen=True)
class TrainSection:
    steps: int = 100
    eval_interval: int = 0  # 0 = no periodic evaluation
    eval_steps: int = 1
    log_interval: int = 1
    output_dir: str = "outputs/run"
    peak_tflops: Optional[float] = None  # per device, for MFU; None = from the device table
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: "stop" the job, or "skip" the update


@dataclass(frozen=True)
class CheckpointSection:
    save_dir: Optional[str] = None  # None = <output_dir>/checkpoints
    save_interval: int = 0  # 0 = only at the end (and on SIGTERM/SIGINT)
    load: Optional[str] = None  # a checkpoint folder, or 'latest' for save_dir
    keep_last: int = 0  # 0 = keep all


@dataclass(frozen=True)
class HybridSection:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    seed: int = 1234
    timeout_seconds: int = 1800  # collective timeout and the hang watchdog's limit
    vocab_pad_multiple: int = 128
    # DeepSpeed PipelineModule partition method: 'type:DecoderBlock', 'parameters' or 'uniform'.
    partition_method: str = "type:DecoderBlock"
    # ZeRO-2 with pipeline_parallel_size > 1 (hybrid3d.pipeline_zero2): gradients are reduced over
    # data parallel every micro-batch, so that traffic is paid gradient_accumulation_steps times.
    pipeline_zero2: bool = False
    # Share of each stage's gradient elements accumulated locally and reduced once per step instead.
    pipeline_zero2_deferred_fraction: float = 0.0
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)


@dataclass
class RunConfig:
    """`ds_config` is what DeepSpeed receives: the JSON without the hybrid3d section, with the
    batch sizes completed (train = micro x GAS x DP)."""

    hybrid: HybridSection
    ds_config: dict = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return self.hybrid.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.hybrid.pipeline_parallel_size

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    @property
    def micro_batch_size(self) -> int:
        return self.ds_config["train_micro_batch_size_per_gpu"]

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.ds_config["gradient_accumulation_steps"]

    @property
    def checkpoint_interval(self) -> int:
        return int(self.ds_config.get("pipeline", {}).get("activation_checkpoint_interval", 0))

    @property
    def use_reentrant(self) -> bool:
        return self.ds_config.get("pipeline", {}).get("use_reentrant", True) is not False


def read_json(path) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a JSON object")
    return raw


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


NON_NEGATIVE = {"seed", "eval_interval", "save_interval", "keep_last"}


def _check_value(value: Any, annotation: Any, key: str, field_name: str) -> Any:
    """Type-check one JSON value against a dataclass field annotation."""
    optional = typing.get_origin(annotation) is typing.Union and type(None) in typing.get_args(annotation)
    if optional:
        if value is None:
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
    elif annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        minimum = 0 if field_name in NON_NEGATIVE else 1
        if value < minimum:
            raise ConfigError(f"{key} must be >= {minimum}, got {value}")
    elif annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{key} must be a non-negative number, got {value!r}")
        value = float(value)
    elif annotation is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a non-empty string, got {value!r}")
    elif annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a JSON object, got {value!r}")
    return value


def _parse_section(section: Any, cls, prefix: str):
    if not isinstance(section, dict):
        raise ConfigError(f"{prefix} must be a JSON object")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key in section:
        if key not in known:
            raise ConfigError(f"{prefix}.{key} is not a known key (known: {', '.join(sorted(known))})")
    values = {}
    for name in known & set(section):
        annotation = hints[name]
        key = f"{prefix}.{name}"
        if dataclasses.is_dataclass(annotation):
            values[name] = _parse_section(section[name], annotation, key)
        else:
            values[name] = _check_value(section[name], annotation, key, name)
    return cls(**values)


def parse_hybrid_section(raw: dict) -> HybridSection:
    section = _parse_section(raw.get(SECTION, {}), HybridSection, SECTION)
    if section.data.eval_fraction >= 1:
        raise ConfigError(f"{SECTION}.data.eval_fraction must be below 1, got {section.data.eval_fraction}")
    if section.train.on_nonfinite not in ("skip", "stop"):
        raise ConfigError(f"{SECTION}.train.on_nonfinite must be 'skip' or 'stop', got {section.train.on_nonfinite!r}")
    model = section.model
    if model.hf_model and model.preset:
        raise ConfigError(f"{SECTION}.model.hf_model and {SECTION}.model.preset are exclusive: set one")
    if model.init_from_hf and not model.hf_model:
        raise ConfigError(f"{SECTION}.model.init_from_hf needs {SECTION}.model.hf_model")
    return section


def complete_batch_sizes(ds: dict, dp: int) -> None:
    """Fill in the missing one of train_batch_size / micro / GAS, checking train = micro x GAS x dp."""
    tbs, mbs, gas = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps"))
    for key, value in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mbs),
                       ("gradient_accumulation_steps", gas)):
        if value is not None:
            _positive_int(value, key)
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
        raise ConfigError(f"zero_optimization.stage must be 0, 1 or 2, got {stage!r}")
    if stage == 3:
        raise ConfigError("zero_optimization.stage=3 is not supported: use stage 1 (with pipeline parallelism) "
                          "or 2 (pipeline_parallel_size 1)")
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


def check_nonfinite_policy(ds: dict, policy: str) -> None:
    """'skip' relies on DeepSpeed's optimizer wrappers, which skip a step whose gradient norm is not
    finite (BF16_Optimizer, DeepSpeedZeroOptimizer); plain fp32 without ZeRO has no wrapper."""
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    low_precision = ds.get("bf16", {}).get("enabled", False) or ds.get("fp16", {}).get("enabled", False)
    if policy == "skip" and stage == 0 and not low_precision:
        raise ConfigError(f"{SECTION}.train.on_nonfinite='skip' needs zero_optimization.stage >= 1 or bf16 "
                          "(DeepSpeed skips non-finite steps only in its optimizer wrappers); use 'stop'")


def check_pipeline_zero2(ds: dict, hybrid: HybridSection) -> None:
    """The opt-in runs `hybrid3d.pipeline_zero2.ZeRO2PipelineEngine`: ZeRO-2 in a pipeline, no offload."""
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
    if zero.get("cpu_offload") or (isinstance(offload, dict) and offload.get("device", "none") != "none"):
        raise ConfigError(f"zero_optimization.offload_optimizer is not supported with {key}")


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


def parse_config(raw: dict, world_size: int, num_layers: int | None = None, on_cpu: bool = True) -> RunConfig:
    """Validate a DeepSpeed JSON (already loaded) for `world_size` ranks."""
    hybrid = parse_hybrid_section(raw)
    tp, pp = hybrid.tensor_parallel_size, hybrid.pipeline_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by {SECTION}.tensor_parallel_size * "
            f"{SECTION}.pipeline_parallel_size = {tp} * {pp}")
    ds = {k: v for k, v in raw.items() if k != SECTION}
    ds = json.loads(json.dumps(ds))  # a private deep copy: DeepSpeed edits its config in place
    complete_batch_sizes(ds, world_size // (tp * pp))
    check_zero_and_precision(ds, pp, hybrid.pipeline_zero2)
    check_pipeline_zero2(ds, hybrid)
    check_nonfinite_policy(ds, hybrid.train.on_nonfinite)
    check_activation_checkpointing(ds, pp, num_layers, on_cpu)
    return RunConfig(hybrid=hybrid, ds_config=ds)


def parse_override_args(args: list[str]) -> list[tuple[str, str]]:
    """`--section.key value` pairs (also `--key=value`) from the command line, in order."""
    pairs = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --train.steps 100")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            key, value = arg[2:], args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def apply_overrides(raw: dict, overrides: list[tuple[str, str]]) -> list[str]:
    """Write dotted overrides into the raw config; return one 'key: old -> new' line per change.

    A key whose first part is a field of the hybrid3d section (`train.steps`, `model.preset`,
    `tensor_parallel_size`) goes under "hybrid3d"; `hybrid3d.` may also be spelled out; any
    other key is a DeepSpeed key (`zero_optimization.stage`). Values are JSON when they parse
    as JSON (numbers, true/false, null, objects), else strings.
    """
    hybrid_fields = {f.name for f in fields(HybridSection)}
    log = []
    for key, text in overrides:
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"override --{key} is not a valid dotted key")
        if parts[0] in hybrid_fields:
            parts = [SECTION] + parts
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override --{key}: {part} is not a JSON object in the config")
            node = child
        old = node.get(parts[-1], "<unset>")
        node[parts[-1]] = value
        log.append(f"{'.'.join(parts)}: {json.dumps(old) if old != '<unset>' else old} -> {json.dumps(value)}")
    return log
