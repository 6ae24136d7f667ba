"""Write zero_compare's results: rows.csv (one row per configuration and rank), table.md (measured next
to predicted with relative errors), memory.png and throughput.png, and README.md (the write-up)."""

import csv
import os

from common import TRAFFIC_CLASSES, environment_markdown, median

from hybrid3d.model import LlamaShape
from hybrid3d.planning.memory import layer_parameter_numels, rank_model_states, rank_parameter_numels
from hybrid3d.planning.traffic import dp_bytes_per_step, pp_bytes_per_step, tp_bytes_per_step
from hybrid3d.planning.zero3_fetch import zero3_step_traffic
from hybrid3d.planning.zero3_memory import offload_states, zero3_model_states

CATEGORIES = ("params", "grads", "master", "optim_states")
STATE_TARGET, COMM_TARGET = 0.02, 0.05
NOTES = """## How to read it

- Model states: the larger of two snapshots of the optimizer's tensors in the second step (after the
  last backward, before the DP reduction; at the base optimizer's step), one row per configuration
  and stage showing its rank with the largest error; `rows.csv` has every rank and category.
  Predicted by `hybrid3d.planning.memory.rank_model_states` (see docs/memory.md).
- Peak RSS: the process's high-water mark while the configuration was built and trained (reset
  before each); it includes the ~0.4 GB of Python, torch and DeepSpeed every rank carries.
- Traffic: bytes passed to collectives in one step as DeepSpeed's comms logger records them (message
  sizes, not wire bytes), classified by calling function: TP = hybrid3d's mappings and cross entropy,
  DP = DeepSpeed's gradient reduction and ZeRO's parameter all-gather, PP = pipeline send/recv.
  Not predicted: `pp_gather` (PipelineEngine re-assembling TP-partitioned activations with
  all-gathers), `control` (scalar norms, overflow checks, loss broadcasts); both are in `rows.csv`.
- With dp = 1 DeepSpeed still issues its gradient all-reduce over a group of one rank: logged and
  predicted, but no byte moves.
- Pipeline send/recv carries a small metadata tensor per partitioned message (72 bytes here), which the
  prediction leaves out: the residual pipeline error.
- Wire traffic of an all-reduce of M bytes is 2(n-1)/n·M per rank: ZeRO-0's all-reduce of Ψ is the
  paper's 2Ψ; ZeRO-1/2 add an all-gather of Ψ/Nd (DeepSpeed all-reduces gradients where the paper
  reduce-scatters), ~3Ψ on the wire; ZeRO-2 reduces on every micro-batch (m·Ψ).
- Step time: median over all timed steps of all repeats (repeats run round-robin over the
  configurations); throughput bars show the range of the per-repeat medians. 4 ranks share 2 cores,
  so times compare configurations with each other, not with GPUs."""


def rel_error(predicted, measured):
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return (predicted - measured) / measured


def zero3_dp_bytes(shape, tp: int, dp: int, gas: int, lp: int) -> int:
    """ZeRO-3's logged data-parallel bytes of a step with DeepSpeed's stage3_* defaults (zero_compare sets none):
    the coordinator's all-gathers, the persistent parameters' after the step, the gradient reduce-scatters."""
    traffic = zero3_step_traffic(shape, tp, dp, gas, lp)
    return traffic.gather_bytes + traffic.reduce_scatter_bytes


def predicted_states(shape, run: dict, stage: int, dp_rank: int, gas: int):
    """The memory model's RankModelStates of a rank: `memory.rank_model_states`, or for ZeRO-3 and offload
    `zero3_memory` (device and host together, as the probe counts them)."""
    tp, pp, dp, zero, precision = run["tp"], run["pp"], run["dp"], run["zero"], run["precision"]
    offload = run.get("offload", "none")
    if zero == 3:
        embedding = sum(layer_parameter_numels(shape, tp)[0][1])  # gathered when the reduction starts
        return zero3_model_states(rank_parameter_numels(shape, tp, pp, stage), dp, precision, run["bucket"],
                                  offload=offload, gathered_numel=embedding).states
    states = rank_model_states(shape, tp, pp, dp, zero, precision, stage, dp_rank, gas, run["bucket"],
                               pipeline_zero2=zero == 2 and pp > 1)
    if offload == "none":
        return states
    return offload_states(states, rank_parameter_numels(shape, tp, pp, stage), dp, zero, precision, dp_rank, gas,
                          run["bucket"]).states


def build_rows(runs, results, sizes) -> list:
    rows = []
    for run in runs:
        shape = LlamaShape(**sizes[run["size"]])
        tp, pp, dp, zero, precision = run["tp"], run["pp"], run["dp"], run["zero"], run["precision"]
        gas = run["global_batch"] // (dp * run["micro_batch"])
        lp = 4 if precision == "fp32" else 2
        rank0 = results[0][run["name"]]
        step = median(rank0["step_times"])
        for rank, per_rank in enumerate(results):
            r = per_rank[run["name"]]
            stage = r["stage"]
            predicted = predicted_states(shape, run, stage, r["dp_rank"], gas)
            measured_total = sum(r["states"][k] for k in CATEGORIES)
            row = dict(config=run["name"], size=run["size"], layout=run["layout"], tp=tp, pp=pp, dp=dp, zero=zero,
                       precision=precision, gas=gas, rank=rank, stage=stage, tp_rank=r["tp_rank"],
                       dp_rank=r["dp_rank"], wrapper=r["wrapper"], predicted_wrapper=predicted.wrapper)
            for k in CATEGORIES:
                row[f"measured_{k}"] = r["states"][k]
                row[f"predicted_{k}"] = getattr(predicted.peak, k)
            row.update(measured_states=measured_total, predicted_states=predicted.peak.total,
                       states_error=rel_error(predicted.peak.total, measured_total),
                       measured_boundary=sum(r["states_boundary"][k] for k in CATEGORIES),
                       predicted_boundary=predicted.boundary.total,
                       measured_step=sum(r["states_step"][k] for k in CATEGORIES), predicted_step=predicted.step.total,
                       rss_base_mb=r["rss_base"] / 2**20, rss_peak_mb=r["rss_peak"] / 2**20)
            theory = {
                "tp": tp_bytes_per_step(shape, run["micro_batch"], run["seq"], tp, pp, stage, gas, act_bytes=lp),
                "dp": (zero3_dp_bytes(shape, tp, dp, gas, lp) if zero == 3
                       else dp_bytes_per_step(shape, tp, pp, dp, stage, zero, gas, precision)),
                "pp": pp_bytes_per_step(shape, run["micro_batch"], run["seq"], tp, pp, stage, gas, act_bytes=lp),
            }
            for cls in TRAFFIC_CLASSES:
                row[f"{cls}_bytes"] = r["traffic"][cls]
            for cls, value in theory.items():
                row[f"{cls}_predicted"] = value
                row[f"{cls}_error"] = None if value is None else rel_error(value, r["traffic"][cls])
            row.update(step_s=step, step_s_min_repeat=min(rank0["repeat_medians"]),
                       step_s_max_repeat=max(rank0["repeat_medians"]),
                       tokens_per_s=run["global_batch"] * run["seq"] / step)
            rows.append(row)
    return rows


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _pct(x):
    return "n/a" if x == float("inf") else f"{x:+.2%}"


def markdown_table(rows) -> str:
    """One line per configuration and pipeline stage: the rank with the largest state error."""
    lines = ["| config | wrapper | stage | states MiB meas / pred | err | TP KB meas / pred | err | "
             "DP KB meas / pred | err | PP KB meas / pred | err | peak RSS MiB | step s | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    seen = {}
    for row in rows:
        key = (row["config"], row["stage"])
        if key not in seen or abs(row["states_error"]) > abs(seen[key]["states_error"]):
            seen[key] = row
    for row in seen.values():
        comm = []
        for cls in ("tp", "dp", "pp"):
            if row[f"{cls}_predicted"] is None:
                comm.append(f"{row[f'{cls}_bytes'] / 1e3:.1f} / n/p | -")  # not predicted
            elif row[f"{cls}_predicted"] == 0 and row[f"{cls}_bytes"] == 0:
                comm.append("- | -")
            else:
                comm.append(f"{row[f'{cls}_bytes'] / 1e3:.1f} / {row[f'{cls}_predicted'] / 1e3:.1f} | "
                            f"{_pct(row[f'{cls}_error'])}")
        lines.append(f"| {row['config']} | {row['wrapper']} | {row['stage']} | "
                     f"{row['measured_states'] / 2**20:.3f} / {row['predicted_states'] / 2**20:.3f} | "
                     f"{_pct(row['states_error'])} | {' | '.join(comm)} | {row['rss_peak_mb']:.0f} | "
                     f"{row['step_s']:.3f} | {row['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def summary(rows) -> dict:
    worst = {"states": max(abs(r["states_error"]) for r in rows)}
    for cls in ("tp", "dp", "pp"):
        errors = [abs(r[f"{cls}_error"]) for r in rows
                  if r[f"{cls}_error"] is not None and (r[f"{cls}_predicted"] or r[f"{cls}_bytes"])]
        worst[cls] = max(errors) if errors else 0.0
    return worst


def write_charts(out_dir, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(len(sizes), 1, figsize=(12, 4 * len(sizes)), squeeze=False)
    for ax, size in zip(axes[:, 0], sizes):
        labels, bottoms = [], []
        bars = {k: [] for k in CATEGORIES}
        predicted = []
        for config in (c for c in configs if c.startswith(size + "-")):
            for stage in sorted({r["stage"] for r in rows if r["config"] == config}):
                row = max((r for r in rows if r["config"] == config and r["stage"] == stage),
                          key=lambda r: r["measured_states"])
                labels.append(f"{config[len(size) + 1:]}\nstage {stage}")
                for k in CATEGORIES:
                    bars[k].append(row[f"measured_{k}"] / 2**20)
                predicted.append(row["predicted_states"] / 2**20)
        bottoms = [0.0] * len(labels)
        for k in CATEGORIES:
            ax.bar(range(len(labels)), bars[k], bottom=bottoms, label=f"measured {k}")
            bottoms = [b + v for b, v in zip(bottoms, bars[k])]
        ax.scatter(range(len(labels)), predicted, color="black", marker="_", s=400, label="predicted total", zorder=3)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("model states per rank (MiB)")
        ax.set_title(f"size {size}: largest rank per stage")
        ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(12, 4))
    first = [next(r for r in rows if r["config"] == c) for c in configs]
    tokens = [r["tokens_per_s"] for r in first]
    low = [r["tokens_per_s"] - r["tokens_per_s"] * r["step_s"] / r["step_s_max_repeat"] for r in first]
    high = [r["tokens_per_s"] * r["step_s"] / r["step_s_min_repeat"] - r["tokens_per_s"] for r in first]
    ax.bar(range(len(configs)), tokens, yerr=[low, high], capsize=3)
    ax.set_xticks(range(len(configs)), configs, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s (world); bars: range of repeat medians")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "throughput.png"), dpi=110)
    plt.close(fig)


def write_results(out_dir, runs, results, sizes, env, command):
    os.makedirs(out_dir, exist_ok=True)
    rows = build_rows(runs, results, sizes)
    write_csv(os.path.join(out_dir, "rows.csv"), rows)
    table = markdown_table(rows)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(table + "\n")
    write_charts(out_dir, rows)
    worst = summary(rows)
    text = [
        "# ZeRO comparison", "", environment_markdown(env, command), "",
        "## Largest relative errors (predicted vs measured)", "",
        f"- model states (peak per rank): {worst['states']:.2%} (target {STATE_TARGET:.0%})",
        f"- TP collective bytes: {worst['tp']:.2%}, DP: {worst['dp']:.2%}, pipeline send/recv: {worst['pp']:.2%} "
        f"(target {COMM_TARGET:.0%})", "",
        "## Results", "", table, "", "![memory](memory.png)", "", "![throughput](throughput.png)", "",
        NOTES, "",
        "Sizes: " + "; ".join(f"{k}: {v}" for k, v in sizes.items()), "",
    ]
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write("\n".join(text))
    return rows, worst
