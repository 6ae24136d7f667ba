""""auto" against every layout that fits: the planner's choice measured next to all the rows it ranked.

Per case (a model x a memory budget, at each world size): the decision launch/train.py takes for `"layout":
"auto"` (`planning.auto_layout.decide` on the CPU machine of `planning.machines`, fp32) and every row the planner
ranks for it (per tensor/pipeline/context sizes, ZeRO stage and schedule, the fastest option that fits). Every row of
every case of a world size is built from the config "auto" would write for it (`apply_choice`) and measured in one
spawned world, round-robin over `--repeats`, so all step times of a world come from the same minutes:
- step time: the median of `--steps` timed steps of every repeat, after a warm-up step;
- peak bytes per rank: the model states counted from the optimizer's tensors at their peak moment
  (`ds_internals.memory_probe.PeakProbe`) plus the activations autograd held at once during that step
  (`ds_internals.timeline.SavedActivationProbe`): the two parts the memory model predicts (no reserve on the CPU).
Rows of a model's two budgets that are the same configuration are measured once.

Per case: whether the choice fits (its measured peak within the budget), its step time over the fastest measured
fitting row's (the aim: within 10% in at least five of six cases), Kendall's tau-b of predicted and measured step
times over the fitting rows, and the memory model's largest under-prediction.

    python benchmarks/auto_layout.py                      # worlds 4 and 2, three models x two budgets
    python benchmarks/auto_layout.py --worlds 4 --models gqa --repeats 1 --steps 2   # a smoke run
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from hybrid3d.ds_internals.quiet_start import hold_back_deepspeed_log  # noqa: E402

hold_back_deepspeed_log(sys.argv)  # before DeepSpeed is imported, here and in the spawned ranks (same argv)
from common import environment_markdown, int_list, median, random_batches, start_results, timed  # noqa

from hybrid3d.model import LlamaShape  # noqa: E402
from hybrid3d.config.auto_values import auto_keys, read_request  # noqa: E402
from hybrid3d.planning.auto_layout import apply_choice, decide, row_label  # noqa: E402
from hybrid3d.planning.machines import cpu_cluster  # noqa: E402

# The three models the issue names, CPU-sized: dense GQA (the tiny preset's shape), a tied small-vocabulary one,
# and a long-sequence one (the GQA shape at 8x the tokens per sequence, a quarter of the sequences)
MODELS = {
    "gqa": (dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=32), 128, 16),
    "tied": (dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=4,
                  head_dim=32, tie_word_embeddings=True), 128, 16),
    "long": (dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=32), 1024, 4),
}
BUCKET = 500_000  # elements: zero_optimization.reduce_bucket_size (DeepSpeed's 5e8 would be 2 GB of every row)
BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "gradient_clipping": 1.0,
        "zero_optimization": {"reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET},
        "steps_per_print": 10**9}
SEARCH_BUDGET_GB = 100.0  # the budget every option of these models fits: all the rows there are
GB = 1e9


def auto_config(seq: int, global_batch: int) -> dict:
    return {**json.loads(json.dumps(BASE)), "train_batch_size": global_batch,
            "hybrid3d": {"layout": "auto", "data": {"seq_length": seq}}}


def row_key(c) -> tuple:
    return (c.tp, c.pp, c.cp, c.sp, c.zero, c.checkpointing, c.micro_batch, c.schedule, c.virtual)


def plan_cases(world: int, models: list[str], cores: int) -> tuple[list[dict], list[dict]]:
    """(cases, runs): per model a roomy budget (every option fits) and a tight one (the median of the roomy rows'
    predicted peaks: about half of them fit); runs: the distinct configurations of all their rows."""
    cases, runs = [], {}
    for model in models:
        shape_kwargs, seq, global_batch = MODELS[model]
        shape = LlamaShape(**shape_kwargs)
        raw = auto_config(seq, global_batch)
        keys = auto_keys(raw)
        request = read_request(raw, keys)

        def decision(budget):
            return decide(shape, cpu_cluster(world, budget, cores, request.precision), request, offload=False)

        everything = decision(SEARCH_BUDGET_GB)
        peaks = sorted(r.memory_gb for r in everything.ranked)
        roomy, tight = round(peaks[-1] * 1.25, 4), round(peaks[len(peaks) // 2], 4)
        for label, budget in (("roomy", roomy), ("tight", tight)):
            d = decision(budget)
            names = []
            for row in d.ranked:
                name = f"{model}-" + "-".join(map(str, row_key(row)))
                runs.setdefault(name, dict(name=name, model=model, seq=seq, shape=shape_kwargs,
                                           config=apply_choice(raw, row, keys), label=row_label(row)))
                names.append((name, row))
            cases.append(dict(world=world, model=model, budget_label=label, budget_gb=budget, chosen=row_key(d.chosen),
                              rows=[dict(name=n, label=row_label(r), key=row_key(r), predicted_s=r.step_seconds,
                                         predicted_gb=r.memory_gb, predicted_states_gb=r.states_gb,
                                         predicted_activations_gb=r.activations_gb) for n, r in names],
                              lines=[line for line in _report(d)]))
    return cases, list(runs.values())


def _report(decision) -> list[str]:
    from hybrid3d.planning.auto_layout import report_lines

    return report_lines(decision, "CPU rates measured by benchmarks/step_time_check.py")


def measure(run: dict, steps: int, probe: bool) -> dict:
    """Build the row's trainer, warm up, (with `probe`) count the peak bytes of a step, time `steps` steps."""
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.memory_probe import PeakProbe
    from hybrid3d.ds_internals.timeline import SavedActivationProbe
    from hybrid3d.training.console import deepspeed_prints
    from common import build_trainer_from_json

    gc.collect()
    shape = LlamaShape(**run["shape"])
    with deepspeed_prints(False):  # the pipeline's layer listing and topology, as the job holds them back
        trainer = build_trainer_from_json(json.loads(json.dumps(run["config"])), shape)
    data = random_batches(shape.vocab_size, trainer.config.micro_batch_size, run["seq"], trainer.groups.data_shard()[0])
    trainer.train_step(data)  # the warm-up: Adam's moments are created at the first step
    result = {}
    if probe:
        states = PeakProbe(trainer.engine)
        states.enabled = True
        with SavedActivationProbe(trainer.module.parameters()) as activations:
            trainer.train_step(data)
        states.enabled = False
        result.update(states_bytes=states.peak().model_states, activation_bytes=activations.peak)
    result["step_times"] = [timed(lambda: trainer.train_step(data), dist.barrier) for _ in range(steps)]
    del trainer, data  # the pool's end of call frees the engine, its groups and threads (parallel/spawn.end_run)
    return result


def rank_main(rank, world_size, run, steps, probe):
    """One configuration on one rank of the pooled world (a call of its own, so the pool retires a world whose ranks
    gathered too many threads from earlier configurations: hybrid3d.parallel.spawn)."""
    from hybrid3d.training.console import hold_back_deprecated_alias_warnings, set_deepspeed_verbosity

    set_deepspeed_verbosity(False)
    hold_back_deprecated_alias_warnings()
    return measure(run, steps, probe)


def measure_all(world: int, runs: list[dict], repeats: int, steps: int, tmp: str) -> dict:
    """{run name: [each rank's figures]}: every run once per repeat, in turn (round-robin), step times of all repeats
    pooled; the bytes from the first repeat."""
    from hybrid3d.parallel.spawn import WorldPool

    out, began, total = {}, time.perf_counter(), repeats * len(runs)
    with WorldPool() as pool:
        for repeat in range(repeats):
            for index, run in enumerate(runs):
                ranks = pool.run(rank_main, world, os.path.join(tmp, "call"), run, steps, repeat == 0)
                kept = out.setdefault(run["name"], [dict(r, step_times=[], repeats=[]) for r in ranks])
                for mine, result in zip(kept, ranks):
                    mine["step_times"] += result["step_times"]
                    mine["repeats"].append(result["step_times"])
                done = repeat * len(runs) + index + 1
                elapsed = time.perf_counter() - began
                print(f"[world {world}: {done}/{total}] {run['label']} ({run['model']}, repeat {repeat + 1}): "
                      f"{median(ranks[0]['step_times']):.3f} s/step; ETA {elapsed / done * (total - done) / 60:.1f} "
                      "min", flush=True)
    return out


def kendall_tau_b(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b of two paired lists (ties counted as tau-b does); nan below two pairs."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = ((concordant + discordant + ties_x) * (concordant + discordant + ties_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else float("nan")


def summarise(case: dict, measured: dict) -> dict:
    """The case's figures from the per-rank measurements of its rows."""
    rows = []
    for row in case["rows"]:
        ranks = measured[row["name"]]
        step = median([t for r in ranks for t in r["step_times"]])  # every rank times the same barriers
        # each repeat's median: how far apart the same row measures minutes apart (the noise a ranking must beat)
        by_repeat = [median([t for r in ranks for t in r["repeats"][i]]) for i in range(len(ranks[0]["repeats"]))]
        worst = max(ranks, key=lambda r: r["states_bytes"] + r["activation_bytes"])
        peak = (worst["states_bytes"] + worst["activation_bytes"]) / GB
        rows.append(dict(row, measured_s=step, repeat_s=by_repeat, spread=max(by_repeat) / min(by_repeat) - 1,
                         measured_gb=peak, fits=peak <= case["budget_gb"],
                         measured_states_gb=worst["states_bytes"] / GB,
                         measured_activations_gb=worst["activation_bytes"] / GB))
    fitting = [r for r in rows if r["fits"]]
    chosen = next(r for r in rows if r["key"] == case["chosen"])
    fastest = min(fitting, key=lambda r: r["measured_s"]) if fitting else None
    under = max(rows, key=lambda r: r["measured_gb"] / r["predicted_gb"])
    return dict(case, rows=rows, chosen_fits=chosen["fits"], chosen_label=chosen["label"],
                chosen_over_fastest=chosen["measured_s"] / fastest["measured_s"] if fastest else float("nan"),
                fastest_label=fastest["label"] if fastest else None,
                tau=kendall_tau_b([r["predicted_s"] for r in fitting], [r["measured_s"] for r in fitting]),
                spread=median([r["spread"] for r in rows]),
                worst_under=dict(label=under["label"], ratio=under["measured_gb"] / under["predicted_gb"] - 1))


def markdown(cases: list[dict], env: dict, command: str) -> str:
    hits = sum(c["chosen_fits"] and c["chosen_over_fastest"] <= 1.10 for c in cases)
    lines = ["# \"auto\" against every layout that fits", "", environment_markdown(env, command), "",
             f"The choice fits and is within 10% of the fastest measured fitting row in {hits} of {len(cases)} cases.",
             "A row's repeat spread is its slowest repeat's median over its fastest's (each repeat minutes apart); the "
             "case's is the median over its rows: differences below it are not resolved by the measurement.",
             "", "| world | model | budget GB | rows (fit) | auto's choice | fits | its step / fastest | fastest measured "
             "| Kendall tau | repeat spread | largest under-prediction |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        fit = sum(r["fits"] for r in c["rows"])
        lines.append(f"| {c['world']} | {c['model']} | {c['budget_gb']:.4g} ({c['budget_label']}) | {len(c['rows'])} "
                     f"({fit}) | {c['chosen_label']} | {'yes' if c['chosen_fits'] else 'NO'} | "
                     f"{c['chosen_over_fastest']:.3f} | {c['fastest_label']} | {c['tau']:.2f} | {c['spread']:.1%} | "
                     f"{c['worst_under']['ratio']:+.1%} ({c['worst_under']['label']}) |")
    for c in cases:
        lines += ["", f"## world {c['world']}, {c['model']}, {c['budget_gb']:.4g} GB ({c['budget_label']})", "",
                  "```", *c["lines"], "```", "",
                  "| row | predicted s | measured s | each repeat s | predicted GB (states + activations) | measured GB "
                  "| fits |", "|---|---|---|---|---|---|---|"]
        for r in sorted(c["rows"], key=lambda r: r["measured_s"]):
            mark = " (auto)" if r["key"] == c["chosen"] else ""
            lines.append(f"| {r['label']}{mark} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
                         f"{' '.join(f'{t:.3f}' for t in r['repeat_s'])} | "
                         f"{r['predicted_gb']:.4f} ({r['predicted_states_gb']:.4f} + {r['predicted_activations_gb']:.4f}) "
                         f"| {r['measured_gb']:.4f} ({r['measured_states_gb']:.4f} + {r['measured_activations_gb']:.4f}) "
                         f"| {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int_list, default=[4, 2])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per row and repeat")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]} (known: {', '.join(MODELS)})")
    from hybrid3d.parallel.threads import usable_cores

    command, out_dir, env = start_results("auto_layout.py", argv, args.out)
    cases = []
    for world in args.worlds:
        planned, runs = plan_cases(world, models, usable_cores())
        print(f"world {world}: {len(planned)} cases, {len(runs)} configurations x {args.repeats} repeats", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            measured = measure_all(world, runs, args.repeats, args.steps, tmp)
        cases += [summarise(case, measured) for case in planned]
    with open(os.path.join(out_dir, "auto_layout.json"), "w") as f:
        json.dump(dict(command=command, environment=env, cases=cases), f, indent=1, default=str)
    text = markdown(cases, env, command)
    with open(os.path.join(out_dir, "auto_layout.md"), "w") as f:
        f.write(text)
    print(text.split("\n## ")[0])
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
