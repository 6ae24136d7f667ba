"""The "hybrid3d" section of the DeepSpeed JSON: its typed sections and their parsing. Each error is
one line that names the offending key."""

import dataclasses
import json
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from hybrid3d.config.blend_entries import check_blend
from hybrid3d.errors import ConfigError
from hybrid3d.model.config import EXPERT_KERNELS
from hybrid3d.model.pipe import DEFAULT_PARTITION_METHOD, PARTITION_METHODS
from hybrid3d.model.tp_plan import LORA_MODULES

SECTION = "hybrid3d"
DATA_FORMATS = ("text", "chat", "prompt_completion")  # hybrid3d.data.formats reads them


@dataclass(frozen=True)
class ModelSection:
    hf_model: Optional[str] = None  # a local HF Llama folder (config, tokenizer, optional weights)
    init_from_hf: bool = False  # load the folder's weights instead of a random initialisation
    preset: Optional[str] = None  # a named shape from hybrid3d.model.presets ('tiny', 'llama3-8b', ...)
    config_overrides: dict = field(default_factory=dict)  # LlamaConfig fields to change


@dataclass(frozen=True)
class DataSection:
    # text/json/jsonl/parquet file(s), a save_to_disk folder, a Megatron indexed-dataset prefix (P for P.bin + P.idx);
    # None = built-in corpus
    path: Optional[str] = None
    # a weighted blend instead of `path`: [{"path": ..., "weight": w, "eval_path": optional}, ...] (weights normalised;
    # megatron-core's blending order, hybrid3d.data.blend)
    blend: Optional[list] = None
    text_field: str = "text"
    tokenizer: Optional[str] = None  # HF tokenizer folder; None = the model folder's, else the built-in one
    seq_length: int = 128
    shuffle: bool = False
    seed: int = 1234
    eval_path: Optional[str] = None
    eval_fraction: float = 0.0  # held-out tail of the documents when no eval_path is given
    # "text" (pre-training), "chat" (a messages column; loss on assistant turns), "prompt_completion" (loss on the
    # completion); data with input_ids is used as given (+ labels or loss_mask columns: fine-tuning data)
    format: str = "text"
    chat_template: Optional[str] = None  # a Jinja chat-template file, for a tokenizer without one (or to replace it)
    document_mask: bool = False  # packed documents do not attend to each other; positions restart per document


@dataclass(frozen=True)
class TrainSection:
    steps: int = 100
    eval_interval: int = 0  # 0 = no periodic evaluation
    eval_steps: int = 1
    log_interval: int = 1
    output_dir: str = "outputs/run"
    peak_tflops: Optional[float] = None  # per device, for MFU; None = from the device table
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: "stop" the job, or "skip" the update
    # Start over an output folder that holds another run (its metrics.jsonl and checkpoints are removed first);
    # without it such a folder is refused unless checkpoint.load resumes that run.
    overwrite: bool = False


@dataclass(frozen=True)
class CheckpointSection:
    save_dir: Optional[str] = None  # None = <output_dir>/checkpoints
    save_interval: int = 0  # 0 = only at the end (and on SIGTERM/SIGINT)
    load: Optional[str] = None  # a checkpoint folder, or 'latest' for save_dir
    keep_last: int = 0  # 0 = keep all
    # JSON key "async": each rank copies its states at a save and trains on while a background thread writes them;
    # the commit follows once every rank's files are durable (checkpoint/async_save.py)
    asynchronous: bool = False
    # the background writer's CPU priority: "idle" runs it only on CPU time no other thread wants (Linux SCHED_IDLE),
    # so it never delays a training thread; "normal" shares the CPU like any thread (where the host's cores are
    # always busy, e.g. with data workers, an idle writer would only finish when training waits for it)
    async_writer: str = "idle"


@dataclass(frozen=True)
class LoraSection:
    """LoRA fine-tuning (Hu et al. 2021) in PEFT's terms: the base frozen, adapters of `rank` beside the
    `target_modules`, scaled by alpha / rank. `rank` unset: full fine-tuning."""
    rank: Optional[int] = None
    alpha: float = 8.0  # PEFT's default lora_alpha
    dropout: float = 0.0
    target_modules: list = field(default_factory=lambda: list(LORA_MODULES))
    adapter: Optional[str] = None  # a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from


@dataclass(frozen=True)
class CompileSection:
    """torch.compile of each decoder block (torchtitan's per-block compile): one compiled graph serves every block
    (their parameters are graph inputs), so it compiles once per process; opt-in (`training/compile.py`)."""
    enabled: bool = False
    backend: str = "inductor"  # torch._dynamo.list_backends(); "aot_eager" traces without generating kernels


@dataclass(frozen=True)
class HybridSection:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Megatron sequence parallelism (Korthikanti et al. 2022): activations between TP regions split along
    # the sequence over the TP group; needs tensor_parallel_size > 1.
    sequence_parallel: bool = False
    # DeepSpeed-Ulysses context parallelism: each sequence split over c more ranks (world = t·p·d·c).
    context_parallel_size: int = 1
    # How the c ranks share attention (Megatron's names): "a2a" DeepSpeed-Ulysses (heads exchanged all-to-all; c
    # divides the heads of a TP rank), "p2p" ring attention (K/V blocks passed around the ring; any c).
    # "a2a+p2p": Ulysses inside groups of context_parallel_a2a_size consecutive CP ranks, a ring across them.
    context_parallel_comm: str = "a2a"
    context_parallel_a2a_size: int = 1
    # Expert parallelism (GShard; DeepSpeed-MoE) for mixture-of-experts models: each of e data-parallel ranks
    # holds E/e whole experts and tokens travel to them by all-to-all; e divides the data-parallel size.
    expert_parallel_size: int = 1
    # Expert capacity (GShard; Switch): null drops nothing (HF Mixtral's results); c caps each expert at
    # ceil(c·n·k/E) of a rank's n tokens' k assignments and drops the rest (hybrid3d.model.moe.capacity_keep).
    expert_capacity_factor: Optional[float] = None
    # How a rank's experts run: "grouped_mm" (torch.nn.functional.grouped_mm; refused where it cannot run), "loop"
    # (one GEMM per expert) or null (the loop); model/expert_kernels.py.
    expert_kernel: Optional[str] = None
    # Aux-loss-free load balancing (DeepSeek-V3 report §2.1.2; Megatron's moe_router_bias_update_rate): once per
    # optimizer step each router's e_score_correction_bias moves by rate · sign(mean − count) of its experts' token
    # counts over the data-parallel ranks (training/expert_bias.py). 0: off. Needs a router with that bias (DeepSeek).
    expert_bias_update_rate: float = 0.0
    seed: int = 1234
    timeout_seconds: int = 1800  # collective timeout and the hang watchdog's limit
    vocab_pad_multiple: int = 128
    # The LM head and the cross entropy over this many tokens at a time (0: all at once): the last stage then keeps
    # each token's fp32 log-sum-exp, not its (V/t) fp32 probabilities, and backward recomputes the logits chunk by
    # chunk (one more head GEMM); a chunk's transient logits take 8·chunk·V/t bytes (docs/configuration.md).
    loss_chunk_tokens: int = 0
    # The pipeline schedule: "1f1b" (DeepSpeed's TrainSchedule) or "dualpipev" (DeepSpeed's DualPipeVEngine:
    # each rank holds stages r and 2p-1-r) or "interleaved" (Megatron's interleaved 1F1B: each rank holds
    # virtual_pipeline_size chunks, stages r, r+p, ...; hybrid3d.ds_internals.interleaved_pipeline).
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_size: int = 1
    # How the layers are cut into pipeline stages (PARTITION_METHODS; model/pipe.stage_bounds): the layers' training
    # FLOPs balanced, the LM head's included ("cost", the default), or decoder blocks balanced by count
    # ("type:DecoderBlock"), or DeepSpeed's own 'parameters' and 'uniform'.
    partition_method: str = DEFAULT_PARTITION_METHOD
    # ZeRO-2 with pipeline_parallel_size > 1 (hybrid3d.pipeline_zero2): gradients are reduced over
    # data parallel every micro-batch, so that traffic is paid gradient_accumulation_steps times.
    pipeline_zero2: bool = False
    # Share of each stage's gradient elements accumulated locally and reduced once per step instead.
    pipeline_zero2_deferred_fraction: float = 0.0
    # Full activation checkpointing of every decoder block (true: DeepSpeed's pipeline.activation_checkpoint_interval
    # 1 unless the JSON sets its own interval; false: none); null: as the DeepSpeed part says. "auto" is decided by
    # the planner (planning/auto_layout.py), as are the sizes above.
    activation_checkpointing: Optional[bool] = None
    # The memory budget of a device in GB for "auto" (default: the accelerator's total memory; required on the CPU,
    # where it is an artificial cap on what the memory model counts)
    device_memory_gb: Optional[float] = None
    # "auto": shorthand for "auto" in each key above that may take it and the config leaves out (decided, then
    # dropped, by the training job's entry before this section is parsed)
    layout: Optional[str] = None
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)
    compile: CompileSection = field(default_factory=CompileSection)

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints are saved (and `checkpoint.load` "latest" looks): checkpoint.save_dir, else
        <train.output_dir>/checkpoints."""
        return self.checkpoint.save_dir or str(Path(self.train.output_dir) / "checkpoints")


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


def positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


NON_NEGATIVE = {"seed", "eval_interval", "save_interval", "keep_last", "loss_chunk_tokens"}


def _check_value(value: Any, annotation: Any, key: str, field_name: str) -> Any:
    """Type-check one JSON value against a dataclass field annotation."""
    if value == "auto":  # training/entry.py (and plan --write-config) write the planner's values in first
        raise ConfigError(f"{key} is \"auto\": only launch/train.py and python -m hybrid3d.plan --write-config "
                          "decide \"auto\" (the config as given here must be written out)")
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


# JSON keys that are Python keywords, and the field each fills
JSON_ALIASES = {"async": "asynchronous"}


def _parse_section(section: Any, cls, prefix: str):
    if not isinstance(section, dict):
        raise ConfigError(f"{prefix} must be a JSON object")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    aliases = {json_key: name for json_key, name in JSON_ALIASES.items() if name in known}
    if any(name in section for name in aliases.values()):  # the field's own name is not a key of the JSON
        raise ConfigError(f"{prefix}.{next(n for n in aliases.values() if n in section)} is not a known key "
                          f"(known: {', '.join(sorted(known - set(aliases.values()) | set(aliases)))})")
    section = {aliases.get(key, key): value for key, value in section.items()}
    known_json = sorted(known - set(aliases.values()) | set(aliases))
    for key in section:
        if key not in known:
            raise ConfigError(f"{prefix}.{key} is not a known key (known: {', '.join(known_json)})")
    values = {}
    for name in known & set(section):
        annotation = hints[name]
        key = f"{prefix}.{next((k for k, n in aliases.items() if n == name), name)}"
        if dataclasses.is_dataclass(annotation):
            values[name] = _parse_section(section[name], annotation, key)
        else:
            values[name] = _check_value(section[name], annotation, key, name)
    return cls(**values)


def parse_hybrid_section(raw: dict) -> HybridSection:
    section = _parse_section(raw.get(SECTION, {}), HybridSection, SECTION)
    if section.layout is not None:
        raise ConfigError(f"{SECTION}.layout must be \"auto\" (decided by launch/train.py), got {section.layout!r}")
    if section.device_memory_gb is not None and section.device_memory_gb <= 0:
        raise ConfigError(f"{SECTION}.device_memory_gb must be positive, got {section.device_memory_gb}")
    if section.data.eval_fraction >= 1:
        raise ConfigError(f"{SECTION}.data.eval_fraction must be below 1, got {section.data.eval_fraction}")
    if section.data.format not in DATA_FORMATS:
        raise ConfigError(f"{SECTION}.data.format must be one of {', '.join(DATA_FORMATS)}, got {section.data.format!r}")
    if section.checkpoint.async_writer not in ASYNC_WRITERS:
        raise ConfigError(f"{SECTION}.checkpoint.async_writer must be one of {', '.join(ASYNC_WRITERS)}, "
                          f"got {section.checkpoint.async_writer!r}")
    if section.train.on_nonfinite not in ("skip", "stop"):
        raise ConfigError(f"{SECTION}.train.on_nonfinite must be 'skip' or 'stop', got {section.train.on_nonfinite!r}")
    model = section.model
    if model.hf_model and model.preset:
        raise ConfigError(f"{SECTION}.model.hf_model and {SECTION}.model.preset are exclusive: set one")
    if model.init_from_hf and not model.hf_model:
        raise ConfigError(f"{SECTION}.model.init_from_hf needs {SECTION}.model.hf_model")
    check_blend(section.data.blend, section.data.path)
    _check_lora(section)
    _check_context_parallel_comm(section)
    if section.expert_kernel not in EXPERT_KERNELS:
        raise ConfigError(f"{SECTION}.expert_kernel must be null, 'grouped_mm' or 'loop', "
                          f"got {section.expert_kernel!r}")
    if section.partition_method not in PARTITION_METHODS:
        raise ConfigError(f"{SECTION}.partition_method must be one of {', '.join(PARTITION_METHODS)}, "
                          f"got {section.partition_method!r}")
    return section


CONTEXT_PARALLEL_COMMS = ("a2a", "p2p", "a2a+p2p")
ASYNC_WRITERS = ("idle", "normal")  # CheckpointSection.async_writer


def _check_context_parallel_comm(section: HybridSection) -> None:
    comm, key = section.context_parallel_comm, f"{SECTION}.context_parallel_comm"
    if comm not in CONTEXT_PARALLEL_COMMS:
        raise ConfigError(f"{key} must be one of {', '.join(CONTEXT_PARALLEL_COMMS)}, got {comm!r}")
    c, u = section.context_parallel_size, section.context_parallel_a2a_size
    if comm != "a2a+p2p":
        if u != 1:
            raise ConfigError(f"{SECTION}.context_parallel_a2a_size applies to context_parallel_comm 'a2a+p2p' only")
        return
    if not 1 < u < c or c % u:
        raise ConfigError(f"{SECTION}.context_parallel_a2a_size ({u}) must divide context_parallel_size ({c}) and lie "
                          "strictly between 1 and it (Ulysses inside, a ring of at least 2 across)")


def _check_lora(section: HybridSection) -> None:
    lora, key = section.lora, f"{SECTION}.lora"
    if lora.rank is None:
        if lora.adapter is not None:
            raise ConfigError(f"{key}.adapter needs {key}.rank (the adapter's r)")
        return
    if lora.dropout >= 1:
        raise ConfigError(f"{key}.dropout must be below 1, got {lora.dropout}")
    if not lora.alpha > 0:
        raise ConfigError(f"{key}.alpha must be > 0, got {lora.alpha}")
    targets = lora.target_modules
    if not isinstance(targets, list) or not targets or any(t not in LORA_MODULES for t in targets):
        raise ConfigError(f"{key}.target_modules must be a non-empty list of {', '.join(LORA_MODULES)}, got {targets!r}")
    if not section.model.init_from_hf:
        raise ConfigError(f"{key} trains adapters on a pretrained base: set {SECTION}.model.hf_model and "
                          f"{SECTION}.model.init_from_hf")
