"""Pipeline stages cut by decoder-block count (`partition_method: "type:DecoderBlock"`, DeepSpeed's) against stages
cut by training FLOPs with the LM head counted ("cost", `model/pipe.stage_bounds`; the default, on these figures),
side by side at PP2 and PP4, 1F1B, on a model whose head is a quarter of its FLOPs (V 8192, h 256: the head
multiplies 2.8 blocks' weights).

One spawned world per pipeline size builds every (m, partition) configuration, then times `--repeats` rounds of one
step each, round-robin (the ratios come from the same minutes of the machine). Per configuration: the step's
wall-clock time (median), the measured bubble from every rank's instruction timeline against 1F1B's formula
(p-1)/(m+p-1) (`pipeline_schedules.step_bubble`), each stage's share of the FLOPs (`pipe.layer_costs`) and its
median forward + backward pass time.

    python benchmarks/stage_balance.py                  # PP2 and PP4, m = 4 and 8, 5 repeats
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from common import (bf16_zero1_config, environment_markdown, int_list, median, random_batches, run_world,  # noqa: E402
                    start_results, timed)
from pipeline_schedules import stage_pass_times, step_bubble  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_layers=8, num_heads=4, num_kv_heads=2,
             head_dim=64)
PARTITIONS = ("type:DecoderBlock", "cost")


def configs(p: int, ms: list[int]) -> list[dict]:
    return [dict(name=f"PP{p}-m{m}-{'count' if method.startswith('type') else 'cost'}", p=p, m=m, partition=method)
            for m in ms for method in PARTITIONS]


def ds_config(run: dict, args) -> dict:
    return bf16_zero1_config(args.micro_batch, run["m"], {"tensor_parallel_size": 1, "pipeline_parallel_size": run["p"],
                                                          "partition_method": run["partition"]})


def world_main(rank, world_size, runs, args):
    """Every configuration built and warmed up once, then `repeats` rounds of one timed step each, round-robin."""
    import deepspeed.comm as dist

    from hybrid3d.ds_internals import pipeline_parts
    from hybrid3d.ds_internals.timeline import InstructionTimeline
    from hybrid3d.model import LlamaShape
    from common import build_trainer_from_json

    shape = LlamaShape(**SHAPE)
    built, results = [], {}
    for run in runs:
        trainer = build_trainer_from_json(ds_config(run, args), shape)
        data = random_batches(shape.vocab_size, args.micro_batch, args.seq, seed=0)
        trainer.train_step(data)  # warm-up: Adam's moments, the activation spec, caches
        built.append((run, trainer, data, InstructionTimeline(trainer.engine)))
        results[run["name"]] = dict(bounds=pipeline_parts(trainer.module), steps=[])
    for _ in range(args.repeats):
        for run, trainer, data, timeline in built:
            timeline.clear()
            seconds = timed(lambda: trainer.train_step(data), dist.barrier)
            results[run["name"]]["steps"].append(dict(
                seconds=seconds, records=[(r.name, r.kwargs, r.start, r.end, r.waited) for r in timeline.records]))
    return results


def rows(runs: list, ranks: list, args) -> list[dict]:
    from hybrid3d.model import LlamaShape
    from hybrid3d.model.pipe import layer_costs

    costs = layer_costs(LlamaShape(**SHAPE))
    out = []
    for run in runs:
        p, m = run["p"], run["m"]
        steps = [[rank[run["name"]]["steps"][i]["records"] for rank in ranks] for i in range(args.repeats)]
        bounds = ranks[0][run["name"]]["bounds"]
        per_stage = [stage_pass_times(dict(run, schedule="1f1b"), records) for records in steps]
        formula = (p - 1) / (m + p - 1)
        measured = median([step_bubble(records)["bubble"] for records in steps])
        out.append(dict(
            config=run["name"], p=p, m=m, partition=run["partition"], bounds=bounds,
            flops_share=[round(sum(costs[bounds[s]:bounds[s + 1]]) / sum(costs), 3) for s in range(p)],
            stage_pass_ms=[round(1000 * median([t[s][0] + t[s][1] for t in per_stage]), 1) for s in range(p)],
            step_s=round(median([rank_steps["seconds"] for rank_steps in ranks[0][run["name"]]["steps"]]), 4),
            formula=round(formula, 4), measured=round(measured, 4), measured_over_formula=round(measured / formula, 2)))
    for row in out:  # the cost partition's step time against the count partition's, same p and m
        base = next(r for r in out if r["p"] == row["p"] and r["m"] == row["m"] and r["partition"] == PARTITIONS[0])
        row["step_vs_count"] = round(row["step_s"] / base["step_s"], 3)
    return out


def write(out_dir: str, table: list, env: dict, command: str, args) -> None:
    from hybrid3d.model import LlamaShape
    from hybrid3d.model.pipe import layer_costs

    costs = layer_costs(LlamaShape(**SHAPE))
    with open(os.path.join(out_dir, "stage_balance.json"), "w") as f:
        json.dump(dict(env=env, command=command, shape=SHAPE, rows=table), f, indent=1)
    lines = ["# Pipeline stages by block count and by training FLOPs", "", environment_markdown(env, command), "",
             f"Shape: {json.dumps(SHAPE)}; the LM head is {costs[-1] / sum(costs):.0%} of the training FLOPs "
             f"({costs[-1] / costs[1]:.2f} blocks); micro-batch {args.micro_batch}, sequence {args.seq}, bf16, "
             f"ZeRO-1, 1F1B; medians of {args.repeats} interleaved repeats.", "",
             "| config | bounds | FLOPs per stage | fwd+bwd ms per pass, per stage | step s | vs count | bubble "
             "(formula) | measured / formula |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['config']} | {r['bounds']} | {r['flops_share']} | {r['stage_pass_ms']} | {r['step_s']} | "
                     f"{r['step_vs_count']:.3f} | {r['measured']:.3f} ({r['formula']:.3f}) | "
                     f"{r['measured_over_formula']:.2f}x |")
    with open(os.path.join(out_dir, "stage_balance.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int_list, default="2,4", help="pipeline sizes; one world of p ranks each")
    parser.add_argument("--micro-batches", type=int_list, default="4,8",
                        help="values of m (gradient accumulation steps)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    command, out_dir, env = start_results("stage_balance.py", argv, args.out)
    table = []
    for p in args.pp:
        runs = configs(p, args.micro_batches)
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_world(world_main, p, tmp, runs, args)
        table += rows(runs, ranks, args)
    write(out_dir, table, env, command, args)
    for r in table:
        print(f"{r['config']:<16} bounds {r['bounds']}  FLOPs {r['flops_share']}  pass ms {r['stage_pass_ms']}  "
              f"step {r['step_s']:.3f} s ({r['step_vs_count']:.3f}x)  bubble {r['measured']:.3f} vs "
              f"{r['formula']:.3f} ({r['measured_over_formula']:.2f}x)")
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
