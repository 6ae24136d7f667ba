""""auto" in a run's config: the planner chooses what the user left open, once, before validation. What the config
asks (its "auto" keys, the values it gives) is read, and the decision written back, by config/auto_values.py.

The decision is `planner.plan` over the run's own precision and machine (`planning.machines`), with the keys given
as an `accept` filter. Rows come ranked by the step-time estimate; among the rows whose estimates lie within
TIE_BAND of the fastest, the one with the most memory headroom under the budget wins, and the report says so:
within that band the estimate cannot tell two layouts apart, while a row that fills the budget to the last percent
is the one the memory model's error would push out. Headroom counts up to ENOUGH_HEADROOM of the budget (above the
memory model's largest under-prediction measured, 8.1%: benchmarks/results/2026-12-05-vm/auto_layout.md): rows with
that much left are equally safe, and the faster estimate among them wins; below it headroom is compared in whole
steps of HEADROOM_GRAIN of the budget (a difference of 0.16 MB in a 50 MB budget decided a case otherwise). It is
computed on every rank from the same inputs (the config, the model's shape, the world size, the budget), so every
rank takes the same decision with no communication; `apply_choice` writes it into the config, which then goes
through the one validation pass as any written-out config does.
"""

import dataclasses
from typing import Optional

from hybrid3d.config.auto_values import AutoRequest, write_decision
from hybrid3d.errors import ConfigError
from hybrid3d.model.config import LlamaShape
from hybrid3d.planning.hints import gb, job_fit_hints, least_memory_line
from hybrid3d.planning.memory import DEFAULT_REDUCE_BUCKET
from hybrid3d.planning.offload_plan import NO_OFFLOAD
from hybrid3d.planning.planner import Choice, plan
from hybrid3d.planning.step_time import Cluster
from hybrid3d.planning.zero3_fetch import Zero3Knobs

TIE_BAND = 0.05  # rows whose step-time estimates lie within 5% of the fastest's count as equally fast
ENOUGH_HEADROOM = 0.10  # of the budget: rows with this much memory left count as equally safe (module docstring)
HEADROOM_GRAIN = 0.01  # of the budget: headroom is compared in whole steps of it (smaller differences are noise)


def _accepts(request: AutoRequest, choice: Choice) -> bool:
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


def decide(shape: LlamaShape, cluster: Cluster, request: AutoRequest, offload: bool) -> Decision:
    """The planner's row for `request` on `cluster` (module docstring); `offload`: whether offload rows may be taken.
    Raises one line when no option fits or none has the values given."""
    least: list = []
    offload_rows = offload if request.offload is None else request.offload != NO_OFFLOAD
    bucket = DEFAULT_REDUCE_BUCKET if request.bucket is None else request.bucket
    rows, refused = plan(shape, cluster, request.seq, request.global_batch, bucket, sequence_parallel=True,
                         context_parallel=True, schedules=True, least=least, precision=request.precision,
                         accept=lambda c: _accepts(request, c), offload=offload_rows,
                         async_checkpoint=request.async_checkpoint, zero3=Zero3Knobs(**request.zero3))
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
    parts = [f"TP{c.tp} PP{c.pp} CP{c.cp} DP{c.dp}" + (f" EP{c.ep}" if c.ep > 1 else ""), "SP" if c.sp else "",
             f"ZeRO-{c.zero}",
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
    """`raw` with row `c` written out for the "auto" `keys` (config.auto_values.write_decision)."""
    return write_decision(raw, c, keys)
