"""Pipeline schedules side by side: 1F1B, interleaved 1F1B (v = 2) and DualPipeV at PP2 and PP4 over m
micro-batches. The bubble measured from every rank's instruction timeline, against each schedule's formula;
the activation bytes each rank holds at its peak, against the memory model of the schedule.

One spawned world per pipeline size runs every (m, schedule) configuration, `--repeats` times round-robin, so
the configurations being compared share the same minutes of the machine. Per step and rank
(`hybrid3d.ds_internals.timeline`):
- the forward and backward passes' wall-clock intervals, minus time spent inside them waiting for a message;
- measured bubble = 1 - (sum over ranks of pass time) / (p x the step's span from the first pass to the last);
  the optimizer step and gradient reductions are outside the span, as they are outside the formulas;
- peak bytes autograd holds for backward (distinct storages, parameters excluded): the in-flight activations.
The formula: (p-1)/(m+p-1) for 1F1B, (p-1)/(v m+p-1) interleaved (Narayanan et al. 2021), and for DualPipeV
the free-communication run of its orders (`hybrid3d.parallel.pipeline_schedules.ideal_bubble`). "simulated"
runs the same orders with the forward and backward times measured in this run.

    python benchmarks/pipeline_schedules.py               # PP2 and PP4, m = 4, 8, 16 (~15 min on 2 cores)
    python benchmarks/pipeline_schedules.py --quick       # PP2, m = 4, 8
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from common import (environment_markdown, int_list, median, random_batches, require_matplotlib, run_world,  # noqa: E402
                    start_results)

# 8 decoder blocks: 4 stages of 2 at PP2 x v2 and PP4 (DualPipeV), 8 of 1 at PP4 x v2.
SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=8, num_heads=4, num_kv_heads=2,
             head_dim=64)
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("dualpipev", 1))


def legal(schedule: str, p: int, m: int, v: int) -> bool:
    if schedule == "interleaved":
        return m % p == 0 and SHAPE["num_layers"] % (p * v) == 0
    if schedule == "dualpipev":
        return m >= 2 * p
    return True


def configs(p: int, ms: list[int]) -> list[dict]:
    return [dict(name=f"PP{p}-m{m}-{s}{f'-v{v}' if v > 1 else ''}", p=p, m=m, schedule=s, v=v)
            for m in ms for s, v in SCHEDULES if legal(s, p, m, v)]


def ds_config(run: dict, args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": run["m"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "hybrid3d": {"tensor_parallel_size": 1, "pipeline_parallel_size": run["p"], "pipeline_schedule": run["schedule"],
                     "virtual_pipeline_size": run["v"]},
    }


def world_main(rank, world_size, runs, args):
    """Every configuration built once, then `repeats` rounds of one timed step each, round-robin."""
    import gc

    from hybrid3d.ds_internals.timeline import InstructionTimeline, SavedActivationProbe
    from hybrid3d.model import LlamaShape
    from common import build_trainer_from_json

    shape = LlamaShape(**SHAPE)
    results = {}
    for group in sorted({r["m"] for r in runs}):
        built = []
        for run in (r for r in runs if r["m"] == group):
            trainer = build_trainer_from_json(ds_config(run, args), shape)
            data = random_batches(shape.vocab_size, args.micro_batch, args.seq, seed=0)
            trainer.train_step(data)  # warm-up: Adam's moments, the activation spec, caches
            built.append((run, trainer, data, InstructionTimeline(trainer.engine)))
        for _ in range(args.repeats):
            for run, trainer, data, timeline in built:
                timeline.clear()
                with SavedActivationProbe(trainer.module.parameters()) as probe:
                    trainer.train_step(data)
                results.setdefault(run["name"], []).append(dict(
                    records=[(r.name, r.kwargs, r.start, r.end, r.waited) for r in timeline.records],
                    peak_bytes=probe.peak))
        del built, trainer, data, timeline
        gc.collect()
    return results


def pass_stage(run: dict, rank: int, kwargs: dict) -> int:
    """The stage a timed pass ran: chunk k of rank r is stage r + k·p (interleaved), phase 1 of rank r
    stage 2p-1-r (DualPipeV)."""
    chunk, p = kwargs.get("chunk", kwargs.get("phase", 0)), run["p"]
    if run["schedule"] == "interleaved":
        return rank + chunk * p
    return rank if chunk == 0 else 2 * p - 1 - rank


def stage_pass_times(run: dict, per_rank: list[list[tuple]]) -> dict[int, tuple[float, float]]:
    """stage -> (median forward, median backward) seconds of one step's passes, message waits taken out."""
    times = {}
    for rank, records in enumerate(per_rank):
        for name, kwargs, start, end, waited in records:
            if name in ("ForwardPass", "BackwardPass"):
                times.setdefault((pass_stage(run, rank, kwargs), name), []).append(end - start - waited)
    stages = sorted({stage for stage, _ in times})
    return {s: (median(times[s, "ForwardPass"]), median(times[s, "BackwardPass"])) for s in stages}


def step_bubble(per_rank: list[list[tuple]]) -> dict:
    """Measured bubble of one step from every rank's pass records, and the mean pass times."""
    passes = [[r for r in records if r[0] in ("ForwardPass", "BackwardPass")] for records in per_rank]
    start = min(r[2] for rank in passes for r in rank)
    end = max(r[3] for rank in passes for r in rank)
    busy = sum(r[3] - r[2] - r[4] for rank in passes for r in rank)
    forward = [r[3] - r[2] - r[4] for rank in passes for r in rank if r[0] == "ForwardPass"]
    backward = [r[3] - r[2] - r[4] for rank in passes for r in rank if r[0] == "BackwardPass"]
    return dict(bubble=1 - busy / (len(per_rank) * (end - start)), span=end - start,
                forward=sum(forward) / len(forward), backward=sum(backward) / len(backward))


def modelled_peak_bytes(run: dict, rank: int, args) -> float:
    from hybrid3d.model import LlamaShape
    from hybrid3d.planning.activations import activation_bytes

    return activation_bytes(LlamaShape(**SHAPE), args.micro_batch, args.seq, 1, run["p"], rank, run["m"],
                            schedule=run["schedule"], virtual=run["v"])


def rows(runs: list, ranks: list, args) -> list[dict]:
    from hybrid3d.parallel.pipeline_schedules import ideal_bubble, run_timeline, schedule_orders

    out = []
    for run in runs:
        p, m, v = run["p"], run["m"], run["v"]
        steps = [step_bubble([rank[run["name"]][i]["records"] for rank in ranks]) for i in range(args.repeats)]
        measured = median([s["bubble"] for s in steps])
        forward, backward = median([s["forward"] for s in steps]), median([s["backward"] for s in steps])
        orders = schedule_orders(run["schedule"], p, m, v)
        simulated = run_timeline(orders, forward, backward).bubble_fraction()
        per_stage = [stage_pass_times(run, [rank[run["name"]][i]["records"] for rank in ranks])
                     for i in range(args.repeats)]
        stage_times = {s: (median([t[s][0] for t in per_stage]), median([t[s][1] for t in per_stage]))
                       for s in per_stage[0]}
        staged = run_timeline(orders, stage_times=stage_times).bubble_fraction()
        formula = ideal_bubble(run["schedule"], p, m, v)
        peaks = [max(rep["peak_bytes"] for rep in rank[run["name"]]) for rank in ranks]
        models = [modelled_peak_bytes(run, r, args) for r in range(p)]
        out.append(dict(
            config=run["name"], p=p, m=m, schedule=run["schedule"], v=v, formula=round(formula, 4),
            simulated=round(simulated, 4), stage_simulated=round(staged, 4), measured=round(measured, 4),
            imbalance=round(staged - formula, 4), communication=round(measured - staged, 4),
            stage_ms={s: [round(1000 * f, 1), round(1000 * b, 1)] for s, (f, b) in stage_times.items()},
            measured_over_formula=round(measured / formula, 3),
            step_span_ms=round(1000 * median([s["span"] for s in steps]), 1),
            forward_ms=round(1000 * forward, 2), backward_ms=round(1000 * backward, 2),
            peak_act_MiB=[round(b / 2**20, 2) for b in peaks],
            model_act_MiB=[round(b / 2**20, 2) for b in models],
            act_model_error=[f"{mo / me - 1:+.1%}" for mo, me in zip(models, peaks)],
            bubbles=[round(s["bubble"], 4) for s in steps]))
    return out


def draw_timelines(out_dir: str, runs: list, ranks: list, p: int, m: int) -> str:
    """One panel per schedule: each rank's passes of the first timed step (forward light, backward dark,
    hue by stage), time from the first pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in runs if r["p"] == p and r["m"] == m]
    fig, axes = plt.subplots(len(chosen), 1, figsize=(12, 1.1 + 0.55 * p * len(chosen)), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, run in zip(axes[:, 0], chosen):
        records = [rank[run["name"]][0]["records"] for rank in ranks]
        origin = min(r[2] for rank in records for r in rank if r[0] in ("ForwardPass", "BackwardPass"))
        for rank, rank_records in enumerate(records):
            for name, kwargs, start, end, waited in rank_records:
                if name not in ("ForwardPass", "BackwardPass"):
                    continue
                stage = pass_stage(run, rank, kwargs)
                ax.barh(rank, (end - start - waited) * 1000, left=(start + waited - origin) * 1000,
                        color=colours(stage % 10), alpha=0.45 if name == "ForwardPass" else 0.95,
                        edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.invert_yaxis()
        ax.set_title(f"{run['name']}: measured bubble {step_bubble(records)['bubble']:.1%}", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the step's first pass (light: forward, dark: backward; colour: stage)")
    fig.tight_layout()
    path = os.path.join(out_dir, f"pipeline_timeline_pp{p}_m{m}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_bubbles(out_dir: str, table: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["p"] for r in table})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 3.6), squeeze=False)
    for ax, p in zip(axes[0], sizes):
        for i, (schedule, v) in enumerate(SCHEDULES):
            rows_ = [r for r in table if r["p"] == p and r["schedule"] == schedule]
            if not rows_:
                continue
            label = schedule + (f" v{v}" if v > 1 else "")
            ms = [r["m"] for r in rows_]
            ax.plot(ms, [r["measured"] for r in rows_], "o-", color=f"C{i}", label=f"{label} measured")
            ax.plot(ms, [r["formula"] for r in rows_], "--", color=f"C{i}", label=f"{label} formula")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("bubble (share of the step)")
        ax.set_title(f"PP{p}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "pipeline_bubbles.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out_dir: str, table: list[dict], env: dict, command: str, args, pictures: list[str]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "pipeline_schedules.json"), "w") as f:
        json.dump(dict(environment=env, command=command, shape=SHAPE, rows=table), f, indent=1)
    columns = ["config", "formula", "simulated", "stage_simulated", "measured", "measured_over_formula", "imbalance",
               "communication", "step_span_ms", "forward_ms", "backward_ms", "peak_act_MiB", "model_act_MiB",
               "act_model_error"]
    lines = [
        "# Pipeline schedules: measured bubble and in-flight activations", "",
        environment_markdown(env, command),
        f"- model: Llama {SHAPE}, TP1 DP1, bf16 weights with fp32 accumulation (BF16_Optimizer), micro-batch "
        f"{args.micro_batch} x seq {args.seq}; {args.repeats} timed steps per configuration after a warm-up "
        "step, round-robin; bubble columns are medians",
        "- formula: (p-1)/(m+p-1) for 1F1B, (p-1)/(v m+p-1) for interleaved (Narayanan et al. 2021), the "
        "free-communication run of DeepSpeed's DualPipeV orders (backward = 2 x forward); simulated: the same "
        "orders with this run's median forward and backward times; stage_simulated: the same with each stage's own "
        "median pass times (the last stage carries the head and the loss); measured: 1 - pass time / (p x span)",
        "- where the time goes: imbalance = stage_simulated - formula (unequal stages), communication = measured - "
        "stage_simulated (send/recv on gloo and the engine's instruction loop between passes)",
        "- activations: peak bytes autograd held for backward per rank (parameters excluded), against "
        "`hybrid3d.planning.activations.activation_bytes` for the schedule", "",
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in table]
    lines += [""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pictures]
    with open(os.path.join(out_dir, "pipeline_schedules.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int_list, default="2,4", help="pipeline sizes; one world of p ranks each")
    parser.add_argument("--micro-batches", type=int_list, default="4,8,16",
                        help="values of m (gradient accumulation steps)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="PP2, m = 4, 8, 2 repeats")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    require_matplotlib(parser)
    if args.quick:
        args.pp, args.micro_batches, args.repeats = [2], [4, 8], 2
    return args


def main(argv=None):
    args = parse_args(argv)
    command, out_dir, env = start_results("pipeline_schedules.py", argv, args.out)
    table, pictures = [], []
    for p in args.pp:
        runs = configs(p, args.micro_batches)
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_world(world_main, p, tmp, runs, args)
        table += rows(runs, ranks, args)
        pictures.append(draw_timelines(out_dir, runs, ranks, p, max(m for m in args.micro_batches if m >= 2 * p)
                                       if any(m >= 2 * p for m in args.micro_batches) else args.micro_batches[-1]))
    pictures.append(draw_bubbles(out_dir, table))
    write(out_dir, table, env, command, args, pictures)
    for row in table:
        print(f"{row['config']:<26} formula {row['formula']:.3f}  stages {row['stage_simulated']:.3f}  "
              f"measured {row['measured']:.3f}  "
              f"({row['measured_over_formula']:.2f}x)  act MiB {row['peak_act_MiB']} model {row['model_act_MiB']}")
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
