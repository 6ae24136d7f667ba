""""auto" as the config says it: which keys are "auto", what the keys given ask of the planner, and the decided
values written back as a user would write them. The decision itself is planning/auto_layout.py's; this module is the
only one that reads or writes the JSON for it (start-up's `resolve` phase and `python -m hybrid3d.plan
--write-config`).

Keys that may be "auto" (docs/configuration.md): in the hybrid3d section `tensor_parallel_size`,
`pipeline_parallel_size`, `context_parallel_size`, `sequence_parallel`, `pipeline_schedule` and
`activation_checkpointing`; in DeepSpeed's part `zero_optimization.stage`, `train_micro_batch_size_per_gpu` and
`gradient_accumulation_steps` (with `train_batch_size` given: the global batch every layout is compared at).
`"layout": "auto"` makes each of them "auto" unless the config gives it. A key given as a value (or left to its
default) constrains the search: only options with that value are rows. With `zero_optimization.stage` "auto" and no
offload key, GPU runs may also take the planner's offload rows (`offload_optimizer`, `offload_param`); a given
offload device constrains them; CPU runs never offload (the host is the device).
"""

import copy
import dataclasses
from typing import Optional, Protocol

from hybrid3d.config.sections import SECTION
from hybrid3d.errors import ConfigError

AUTO = "auto"
# The hybrid3d section's keys that may be "auto", and the planner's field (planning.planner.Choice) each decides
HYBRID_KEYS = {"tensor_parallel_size": "tp", "pipeline_parallel_size": "pp", "context_parallel_size": "cp",
               "sequence_parallel": "sp", "pipeline_schedule": "schedule", "activation_checkpointing": "checkpointing",
               "expert_parallel_size": "ep"}
# DeepSpeed's keys that may be "auto" (dotted: inside zero_optimization), and the field each decides
DS_KEYS = {"zero_optimization.stage": "zero", "train_micro_batch_size_per_gpu": "micro_batch",
           "gradient_accumulation_steps": "gas"}
HYBRID_DEFAULTS = {"tp": 1, "pp": 1, "cp": 1, "sp": False, "schedule": "1f1b", "ep": 1}  # config.sections.HybridSection's
NO_OFFLOAD = "none"  # the planner's offload kinds: "none", "optimizer", "optimizer+params"
# (offload_optimizer.device, offload_param.device) -> the offload kind
OFFLOAD_KINDS = {("cpu", None): "optimizer", ("cpu", "cpu"): "optimizer+params", (None, None): NO_OFFLOAD}
# DeepSpeed's zero_optimization key for each ZeRO-3 knob the planner models (planning.zero3_fetch.Zero3Knobs' fields)
ZERO3_KNOB_KEYS = {"persistence_threshold": "stage3_param_persistence_threshold",
                   "prefetch_bucket": "stage3_prefetch_bucket_size", "max_live": "stage3_max_live_parameters",
                   "max_reuse_distance": "stage3_max_reuse_distance"}


class Decided(Protocol):
    """The decided values `write_decision` writes (planning.planner.Choice has them)."""

    tp: int
    pp: int
    cp: int
    sp: bool
    schedule: str
    virtual: int
    checkpointing: bool
    zero: int
    offload: str
    micro_batch: int
    gas: int
    ep: int
    precision: str


def zero3_knobs(zero_optimization: dict) -> dict:
    """The ZeRO-3 knobs a `zero_optimization` section sets, by field (numbers; the config checks refuse the rest)."""
    return {field: int(zero_optimization[key]) for field, key in ZERO3_KNOB_KEYS.items()
            if isinstance(zero_optimization.get(key), (int, float)) and not isinstance(zero_optimization[key], bool)}


def _ds_value(raw: dict, dotted: str):
    """The value of a DeepSpeed key (`a.b`: b inside the object a), None if absent."""
    outer, _, inner = dotted.partition(".")
    value = raw.get(outer)
    return (value.get(inner) if isinstance(value, dict) else None) if inner else value


def auto_keys(raw: dict) -> list[str]:
    """The keys of `raw` that are "auto" (`hybrid3d.layout` "auto" counting each key it leaves open), as the config
    names them; empty for a config that is written out."""
    section = raw.get(SECTION, {}) if isinstance(raw.get(SECTION), dict) else {}
    layout = section.get("layout")
    if layout is not None and layout != AUTO:
        raise ConfigError(f"{SECTION}.layout must be \"auto\" (the only value it takes), got {layout!r}")
    keys = [f"{SECTION}.{k}" for k in HYBRID_KEYS if section.get(k) == AUTO or (layout and k not in section)]
    keys += [k for k in DS_KEYS if _ds_value(raw, k) == AUTO or (layout and _ds_value(raw, k) is None)]
    return keys


def placeholder_config(raw: dict) -> dict:
    """`raw` with every "auto" replaced by the section's default and `layout` dropped: a config whose hybrid3d
    section parses, for reading the model and data before the decision (nothing else is taken from it)."""
    out = copy.deepcopy(raw)
    section = out.get(SECTION)
    if isinstance(section, dict):
        section.pop("layout", None)
        for key in HYBRID_KEYS:
            if section.get(key) == AUTO:
                del section[key]
    return out


@dataclasses.dataclass(frozen=True)
class AutoRequest:
    """What a config asks the planner: the keys left "auto" and the values the others hold."""

    open: frozenset  # Choice fields to decide
    fixed: dict  # Choice field -> the value the config gives (or its default)
    global_batch: int
    seq: int
    precision: str  # memory.PRECISIONS
    virtual: Optional[int]  # virtual_pipeline_size when given
    pipeline_zero2: Optional[bool]  # hybrid3d.pipeline_zero2 when given
    offload: Optional[str]  # the offload the config gives (OFFLOAD_KINDS); None: the planner's choice
    bucket: Optional[int] = None  # zero_optimization.reduce_bucket_size (elements); None: DeepSpeed's default
    async_checkpoint: bool = False  # hybrid3d.checkpoint.async: its host copy counts as host memory
    zero3: dict = dataclasses.field(default_factory=dict)  # the zero_optimization.stage3_* knobs given (ZERO3_KNOB_KEYS)


def open_fields(keys: list[str]) -> set:
    """The Choice fields the "auto" `keys` leave to the planner (field names, not config keys)."""
    return {HYBRID_KEYS.get(k.removeprefix(f"{SECTION}."), DS_KEYS.get(k)) for k in keys}


def read_request(raw: dict, keys: list[str]) -> AutoRequest:
    """The planner's question from a config with "auto" `keys` (`auto_keys`). Raises one line for what the search
    cannot model: a config "auto" needs to be comparable across layouts, or keys that exclude each other."""
    section = raw.get(SECTION, {})
    fields = open_fields(keys)
    fixed = {field: section.get(key, HYBRID_DEFAULTS.get(field)) for key, field in HYBRID_KEYS.items()
             if field not in fields}
    fixed.update({field: _ds_value(raw, key) for key, field in DS_KEYS.items()
                  if field not in fields and _ds_value(raw, key) is not None})
    if "zero" not in fields:
        fixed.setdefault("zero", 0)  # DeepSpeed's default stage
    interval = _ds_value(raw, "pipeline.activation_checkpoint_interval")
    if "checkpointing" in fields and interval is not None:
        raise ConfigError(f"{SECTION}.activation_checkpointing \"auto\" and pipeline.activation_checkpoint_interval "
                          "both set: remove the interval (auto chooses 1 or none) or give activation_checkpointing")
    if fixed.get("checkpointing") is None and "checkpointing" not in fields:
        fixed["checkpointing"] = bool(interval)
    if {"micro_batch", "gas"} & fields:  # DeepSpeed derives the one left out: it is open too
        fields |= {f for f in ("micro_batch", "gas") if f not in fixed}
    tbs = raw.get("train_batch_size")
    if not isinstance(tbs, int) or isinstance(tbs, bool) or tbs < 1:
        raise ConfigError(f"\"auto\" ({keys[0]}) needs train_batch_size, a positive integer: the global batch every "
                          "layout is compared at")
    bf16, fp16 = (bool(_ds_value(raw, f"{k}.enabled")) for k in ("bf16", "fp16"))
    if fp16:
        raise ConfigError(f"\"auto\" ({keys[0]}) plans fp32 and bf16 runs; fp16.enabled is not modelled: give the "
                          "layout explicitly")
    accum = _ds_value(raw, "data_types.grad_accum_dtype")
    precision = "fp32" if not bf16 else ("bf16+fp32acc" if accum in ("fp32", "float32") else "bf16")
    for key, allowed in (("expert_parallel_size", (1,)), ("context_parallel_comm", ("a2a",))):
        if section.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"\"auto\" ({keys[0]}) with {SECTION}.{key} {section[key]!r}: the planner's search "
                              f"covers {key} {allowed[0]!r} only; give the layout explicitly")
    zero = raw.get("zero_optimization", {}) if isinstance(raw.get("zero_optimization"), dict) else {}
    devices = tuple((zero.get(k) or {}).get("device") if isinstance(zero.get(k), dict) else None
                    for k in ("offload_optimizer", "offload_param"))
    devices = tuple(None if d == "none" else d for d in devices)
    if "nvme" in devices:
        raise ConfigError(f"\"auto\" ({keys[0]}) with NVMe offload: not modelled by the planner; give the layout "
                          "explicitly")
    if devices not in OFFLOAD_KINDS:
        raise ConfigError(f"\"auto\" ({keys[0]}) with offload_param but not offload_optimizer: not modelled by the "
                          "planner; give the layout explicitly")
    # no offload key with the stage open: the planner's choice (None); else what the keys say
    offload = None if devices == (None, None) and "zero" in fields else OFFLOAD_KINDS[devices]
    seq = (section.get("data") or {}).get("seq_length", 128)
    checkpoint = section.get("checkpoint") if isinstance(section.get("checkpoint"), dict) else {}
    bucket = zero.get("reduce_bucket_size")
    return AutoRequest(frozenset(fields), fixed, tbs, seq, precision, section.get("virtual_pipeline_size"),
                       section.get("pipeline_zero2"), offload, None if bucket is None else int(bucket),
                       bool(checkpoint.get("async", False)), zero3_knobs(zero))


def write_decision(raw: dict, c: Decided, keys: list[str]) -> dict:
    """`raw` with the decided values written out: the "auto" `keys` (and what they imply: the interleaved schedule's
    virtual size, pipeline_zero2, offload) set from `c`, `layout` dropped. The result is a config as a user would
    write it for that row (a copy: `raw` stays as given)."""
    out = copy.deepcopy(raw)
    section = out.setdefault(SECTION, {})
    section.pop("layout", None)
    decided = open_fields(keys)
    if "micro_batch" in decided or "gas" in decided:  # DeepSpeed derives the other: both are written
        decided |= {"micro_batch", "gas"}
    for key, field in HYBRID_KEYS.items():
        if field in decided:
            section[key] = getattr(c, field)
    if "schedule" in decided and c.schedule == "interleaved":
        section["virtual_pipeline_size"] = c.virtual
    if c.zero == 2 and c.pp > 1:
        section["pipeline_zero2"] = True
    zero = out.setdefault("zero_optimization", {})
    if "zero" in decided:
        zero["stage"] = c.zero
        if c.offload != NO_OFFLOAD:
            zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "cpu"}
        if c.offload == "optimizer+params":
            zero["offload_param"] = {**zero.get("offload_param", {}), "device": "cpu"}
    if "micro_batch" in decided:
        out["train_micro_batch_size_per_gpu"] = c.micro_batch
        out["gradient_accumulation_steps"] = c.gas
    return out


def config_for_row(base: dict, c: Decided, model: dict, seq: int, global_batch: int, zero3: dict,
                   lora: Optional[dict] = None) -> dict:
    """A ready config for planner row `c` (`python -m hybrid3d.plan --write-config`): `base` with every key "auto"
    decides set from the row, the row's precision (bf16, fp32 gradient accumulation where the row plans it; fp32), the
    model section `model`, `seq` tokens a sequence and `global_batch` sequences a step; `zero3`: the ZeRO-3 knobs
    (ZERO3_KNOB_KEYS' fields) to write for a stage-3 row; `lora`: hybrid3d.lora keys to set."""
    out = write_decision(base, c, [f"{SECTION}.{k}" for k in HYBRID_KEYS] + list(DS_KEYS))
    section = out[SECTION]
    section["model"] = model
    section.setdefault("data", {})["seq_length"] = seq
    out["train_batch_size"] = global_batch
    if c.offload == NO_OFFLOAD:
        for key in ("offload_optimizer", "offload_param"):
            out["zero_optimization"].pop(key, None)
    out["bf16"] = {**out.get("bf16", {}), "enabled": c.precision != "fp32"}  # fp32: a run's own precision
    out.pop("fp16", None)
    types = out.setdefault("data_types", {})
    if c.precision == "bf16+fp32acc":
        types["grad_accum_dtype"] = "fp32"
    else:
        types.pop("grad_accum_dtype", None)
    if not types:
        del out["data_types"]
    if c.zero == 3:
        out["zero_optimization"].update({ZERO3_KNOB_KEYS[k]: v for k, v in zero3.items()})
    if lora:
        section["lora"] = {**section.get("lora", {}), **lora}
    return out
