""""auto" in a run's config: the planner chooses what the user left open, once, before validation.

Keys that may be "auto" (docs/configuration.md): in the hybrid3d section `tensor_parallel_size`,
`pipeline_parallel_size`, `context_parallel_size`, `sequence_parallel`, `pipeline_schedule` and
`activation_checkpointing`; in DeepSpeed's part `zero_optimization.stage`, `train_micro_batch_size_per_gpu` and
`gradient_accumulation_steps` (with `train_batch_size` given: the global batch every layout is compared at).
`"layout": "auto"` makes each of them "auto" unless the config gives it. A key given as a value (or left to its
default) constrains the search: only options with that value are rows. With `zero_optimization.stage` "auto" and no
offload key, GPU runs may also take the planner's offload rows (`offload_optimizer`, `offload_param`); a given
offload device constrains them; CPU runs never offload (the host is the device).

The decision is `planner.plan` over the run's own precision and machine (`planning.machines`), with the keys given
as an `accept` filter. Rows come ranked by the step-time estimate; among the rows whose estimates lie within
TIE_BAND of the fastest, the one with the most memory headroom under the budget wins, and the report says so:
within that band the estimate cannot tell two layouts apart, while a row that fills the budget to the last percent
is the one the memory model's error would push out. Headroom counts up to ENOUGH_HEADROOM of the budget (above the
memory model's largest under-prediction measured, 8.1%: benchmarks/results/2026-12-05-vm/auto_layout.md): rows with
that much left are equally safe, and the faster estimate among them wins; below it headroom is compared in whole
steps of HEADROOM_GRAIN of the budget (a difference of 0.16 MB in a 50 MB budget decided a case otherwise). It is computed on every rank from the same inputs (the
config, the model's shape, the world size, the budget), so every rank takes the same decision with no
communication; `apply_choice` writes it into the config, which then goes through the one validation pass as any
written-out config does.
"""

import copy
import dataclasses
from typing import Optional

from hybrid3d.config.sections import SECTION
from hybrid3d.errors import ConfigError
from hybrid3d.model.config import LlamaShape
from hybrid3d.planning.hints import gb, job_fit_hints, least_memory_line
from hybrid3d.planning.memory import DEFAULT_REDUCE_BUCKET
from hybrid3d.planning.offload_plan import NO_OFFLOAD
from hybrid3d.planning.planner import Choice, plan
from hybrid3d.planning.step_time import Cluster
from hybrid3d.planning.zero3_fetch import Zero3Knobs

AUTO = "auto"
# The hybrid3d section's keys that may be "auto", and the Choice field each decides
HYBRID_KEYS = {"tensor_parallel_size": "tp", "pipeline_parallel_size": "pp", "context_parallel_size": "cp",
               "sequence_parallel": "sp", "pipeline_schedule": "schedule", "activation_checkpointing": "checkpointing"}
# DeepSpeed's keys that may be "auto" (dotted: inside zero_optimization), and the Choice field each decides
DS_KEYS = {"zero_optimization.stage": "zero", "train_micro_batch_size_per_gpu": "micro_batch",
           "gradient_accumulation_steps": "gas"}
HYBRID_DEFAULTS = {"tp": 1, "pp": 1, "cp": 1, "sp": False, "schedule": "1f1b"}  # config.sections.HybridSection's
TIE_BAND = 0.05  # rows whose step-time estimates lie within 5% of the fastest's count as equally fast
ENOUGH_HEADROOM = 0.10  # of the budget: rows with this much memory left count as equally safe (module docstring)
HEADROOM_GRAIN = 0.01  # of the budget: headroom is compared in whole steps of it (smaller differences are noise)
OFFLOAD_KINDS = {("cpu", None): "optimizer", ("cpu", "cpu"): "optimizer+params", (None, None): NO_OFFLOAD}


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
class Request:
    """What a config asks the planner: the keys left "auto" and the values the others hold."""

    open: frozenset  # Choice fields to decide
    fixed: dict  # Choice field -> the value the config gives (or its default)
    global_batch: int
    seq: int
    precision: str  # memory.PRECISIONS
    virtual: Optional[int]  # virtual_pipeline_size when given
    pipeline_zero2: Optional[bool]  # hybrid3d.pipeline_zero2 when given
    offload: Optional[str]  # the offload the config gives (OFFLOAD_KINDS); None: the planner's choice
    bucket: int = DEFAULT_REDUCE_BUCKET  # zero_optimization.reduce_bucket_size (elements)
    async_checkpoint: bool = False  # hybrid3d.checkpoint.async: its host copy counts as host memory
    zero3: Zero3Knobs = Zero3Knobs()  # zero_optimization.stage3_*: what ZeRO-3 rows gather and hold


def open_fields(keys: list[str]) -> set:
    """The Choice fields the "auto" `keys` leave to the planner (field names, not config keys)."""
    return {HYBRID_KEYS.get(k.removeprefix(f"{SECTION}."), DS_KEYS.get(k)) for k in keys}


def read_request(raw: dict, keys: list[str]) -> Request:
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
    return Request(frozenset(fields), fixed, tbs, seq, precision, section.get("virtual_pipeline_size"),
                   section.get("pipeline_zero2"), offload, int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)),
                   bool(checkpoint.get("async", False)), Zero3Knobs.from_zero_config(zero))


def _accepts(request: Request, choice: Choice) -> bool:
    """Whether a planner option has every value the config gives."""
    if any(getattr(choice, field) != value for field, value in request.fixed.items()):
        return False
    if request.precision == "bf16+fp32acc" and choice.zero == 0:  # DeepSpeed refuses it (config.ds_checks)
        return False
    if request.virtual is not None and choice.pp > 1 and choice.virtual != request.virtual:
        return False
    if request.pipeline_zero2 is not None and (choice.zero == 2 and choice.pp > 1) != request.pipeline_zero2:
        return False
    return request.offload is None or choice.offload == request.offload


@dataclasses.dataclass(frozen=True)
class Decision:
    """The row chosen, the rows ranked after it and the refusals, for the start-up report."""

    chosen: Choice
    ranked: list  # the feasible rows, fastest first (the chosen one among them)
    refused: list[str]
    budget_gb: float
    by_headroom: bool  # chosen over a faster row within TIE_BAND for its headroom
    kept: Optional[str] = None  # where the sizes came from when a checkpoint fixed them


def decide(shape: LlamaShape, cluster: Cluster, request: Request, offload: bool) -> Decision:
    """The planner's row for `request` on `cluster` (module docstring); `offload`: whether offload rows may be taken.
    Raises one line when no option fits or none has the values given."""
    least: list = []
    offload_rows = offload if request.offload is None else request.offload != NO_OFFLOAD
    rows, refused = plan(shape, cluster, request.seq, request.global_batch, request.bucket, sequence_parallel=True,
                         context_parallel=True, schedules=True, least=least, precision=request.precision,
                         accept=lambda c: _accepts(request, c), offload=offload_rows,
                         async_checkpoint=request.async_checkpoint, zero3=request.zero3)
    if not rows:
        given = ", ".join(f"{k}={v}" for k, v in sorted(request.fixed.items())) or "nothing"
        if least:
            hints = job_fit_hints(least[0], cluster.gpus, cluster.gpu_memory_gb, cluster.reserve_gb)
            raise ConfigError(f"\"auto\": no layout fits {cluster.gpu_memory_gb:g} GB per device "
                              f"(hybrid3d.device_memory_gb): "
                              f"{least_memory_line(least[0], cluster.gpu_memory_gb, cluster.reserve_gb)}; "
                              f"what would fit: {'; '.join(hints)}")
        first = next((r for r in refused if "needs >=" not in r), "the values given exclude every layout")
        raise ConfigError(f"\"auto\": no layout of {cluster.gpus} ranks has the values given ({given}): {first}")
    chosen = choose(rows, cluster.gpu_memory_gb)
    return Decision(chosen, rows, refused, cluster.gpu_memory_gb, chosen is not rows[0])


def choose(rows: list[Choice], budget_gb: float) -> Choice:
    """Of `rows` (fastest first), the one with the most headroom under `budget_gb`, counted up to ENOUGH_HEADROOM of
    it in steps of HEADROOM_GRAIN, among those within TIE_BAND of the fastest's estimate (the fastest estimate of them
    on equal headroom)."""
    ties = [r for r in rows if r.step_seconds <= rows[0].step_seconds * (1 + TIE_BAND)]
    enough, grain = ENOUGH_HEADROOM * budget_gb, HEADROOM_GRAIN * budget_gb
    return max(ties, key=lambda r: (int(min(budget_gb - r.memory_gb, enough) / grain + 1e-9), -r.step_seconds))


def row_label(c: Choice) -> str:
    """One row as the config would say it."""
    parts = [f"TP{c.tp} PP{c.pp} CP{c.cp} DP{c.dp}", "SP" if c.sp else "", f"ZeRO-{c.zero}",
             {NO_OFFLOAD: "", "optimizer": "offload optimizer", "optimizer+params": "offload optimizer+params"}[
                 c.offload], "checkpointing" if c.checkpointing else "",
             f"micro-batch {c.micro_batch} x {c.gas}", "" if c.pp == 1 else c.schedule_label]
    return ", ".join(p for p in parts if p)


def _gb(value: float) -> str:
    """GB with three significant digits: a CPU run's budgets are fractions of a GB."""
    return f"{value:.3g}"


def report_lines(decision: Decision, source: str) -> list[str]:
    """The start-up lines: the chosen row, the next two and why they lost, the refusals; `source`: where the
    machine's figures come from."""
    c, budget = decision.chosen, decision.budget_gb
    lines = [f"auto: {row_label(c)}" + (f" ({decision.kept})" if decision.kept else ""),
             f"auto:   predicted {_gb(c.memory_gb)} of {budget:g} GB per device (model states {_gb(c.states_gb)}, "
             f"activations {_gb(c.activations_gb)}" + (f", {gb(c.host_gb)} GB in host memory" if c.host_gb else "")
             + f"), step {c.step_seconds:.3g} s ({source})"]
    if decision.by_headroom:
        lines.append(f"auto:   chosen for its headroom over the fastest estimate, {row_label(decision.ranked[0])}, "
                     f"{1 - decision.ranked[0].step_seconds / c.step_seconds:.1%} faster: within the "
                     f"{TIE_BAND:.0%} the estimate cannot tell apart, with {_gb(budget - c.memory_gb)} GB left "
                     f"instead of {_gb(budget - decision.ranked[0].memory_gb)}")
    sizes = (c.tp, c.pp, c.cp)  # the next rows of other layouts first: a stage of this layout is seldom the question
    others = sorted((r for r in decision.ranked if r is not c), key=lambda r: (r.tp, r.pp, r.cp) == sizes)
    for other in others[:2]:
        ratio = other.step_seconds / c.step_seconds - 1
        speed = (f"{ratio:.1%} slower" if ratio >= 0.0005 else f"{-ratio:.1%} faster" if ratio <= -0.0005
                 else "as fast")
        room = "" if ratio >= 0.0005 else f" but less headroom ({_gb(budget - other.memory_gb)} GB left)"
        lines.append(f"auto:   next: {row_label(other)}: {speed}{room} (predicted {_gb(other.memory_gb)} GB)")
    memory = sum("needs >=" in r for r in decision.refused)
    rules = len(decision.refused) - memory
    if decision.refused:
        lines.append(f"auto:   refused: {memory} over {budget:g} GB, {rules} by the layout rules (heads, divisibility, "
                     f"placement)" + (f"; e.g. {decision.refused[0]}" if decision.refused else ""))
    return lines


def apply_choice(raw: dict, c: Choice, keys: list[str]) -> dict:
    """`raw` with the decided values written out: the "auto" `keys` (and what they imply: the interleaved schedule's
    virtual size, pipeline_zero2, offload) set from `c`, `layout` dropped. The result is a config as a user would
    write it for that row."""
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


def config_for_row(base: dict, c: Choice, model: dict, seq: int, global_batch: int) -> dict:
    """A ready config for planner row `c` (`python -m hybrid3d.plan --write-config`): `base` with every key "auto"
    decides set from the row, the row's precision (bf16; fp32 gradient accumulation where the row plans it), the
    model section `model`, `seq` tokens a sequence and `global_batch` sequences a step."""
    out = apply_choice(base, c, [f"{SECTION}.{k}" for k in HYBRID_KEYS] + list(DS_KEYS))
    section = out[SECTION]
    section["model"] = model
    section.setdefault("data", {})["seq_length"] = seq
    out["train_batch_size"] = global_batch
    if c.offload == NO_OFFLOAD:
        for key in ("offload_optimizer", "offload_param"):
            out["zero_optimization"].pop(key, None)
    out["bf16"] = {**out.get("bf16", {}), "enabled": True}
    out.pop("fp16", None)
    types = out.setdefault("data_types", {})
    if c.precision == "bf16+fp32acc":
        types["grad_accum_dtype"] = "fp32"
    else:
        types.pop("grad_accum_dtype", None)
    if not types:
        del out["data_types"]
    return out
