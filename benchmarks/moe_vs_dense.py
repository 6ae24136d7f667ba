"""A Mixtral-style MoE model against the dense Llama with the same active parameters, on one machine.

The dense model's SwiGLU is k experts wide (intermediate k·f), so a token runs through the same number of
weights in both (the router's E·h aside). Configurations, all on `--world` ranks, fp32 (the CPU has no native
bf16; bf16 with expert parallelism is not supported yet), ZeRO-1:
- dense DP, MoE DP (every rank holds all E experts), MoE EP (E/e experts a rank, tokens by all-to-all);
- MoE PP2 with one backward pass per stage (`ds_internals/tuple_backward.py`) and with DeepSpeed's own
  per-tensor backward of the (hidden, router_stats) stage output, the A/B of that change.
One spawned world runs every configuration `--repeats` times round-robin (built afresh each time), so the
ratios come from the same minutes of the same machine; step times are the median of each configuration's
timed steps over all repeats. Per configuration and rank: parameters held (against
`planning.memory.layer_parameter_numels`), model-state bytes (the optimizer's own tensors,
`ds_internals.memory_probe.PeakProbe`; the process's peak RSS is kept in the JSON only: it is a high-water mark
over all configurations run before), and one step's all_to_all_single bytes from DeepSpeed's
comms logger against `planning.traffic.ep_bytes_per_step`.

    python benchmarks/moe_vs_dense.py --quick
"""

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from common import (  # noqa: E402
    classify_comms,
    command_line,
    environment,
    environment_markdown,
    measure_second_step,
    median,
    peak_rss,
    random_batches,
    require_matplotlib,
    reset_peak_rss,
    results_dir,
    round_robin,
    run_world,
    timed,
)

BASE = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32)
EXPERTS, TOP_K, EXPERT_FFN = 8, 2, 256  # E, k, f per expert
SHAPES = {
    "dense": dict(BASE, intermediate_size=TOP_K * EXPERT_FFN),
    "moe": dict(BASE, intermediate_size=EXPERT_FFN, num_experts=EXPERTS, experts_per_token=TOP_K,
                router_aux_loss_coef=0.02),
}
# name -> (shape, pp, ep, one_backward)
CONFIGS = {
    "dense-DP2": ("dense", 1, 1, True),
    "moe-DP2": ("moe", 1, 1, True),
    "moe-EP2": ("moe", 1, 2, True),
    "dense-PP2": ("dense", 2, 1, True),
    "moe-PP2": ("moe", 2, 1, True),
    "moe-PP2-ds-backward": ("moe", 2, 1, False),
}


def ds_config(run: dict) -> dict:
    return {
        "train_batch_size": run["global_batch"],
        "train_micro_batch_size_per_gpu": run["micro_batch"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 4_000_000, "allgather_bucket_size": 4_000_000},
        "comms_logger": {"enabled": True, "prof_all": False, "verbose": False},
        "steps_per_print": 10**9,
        "hybrid3d": {"pipeline_parallel_size": run["pp"], "expert_parallel_size": run["ep"],
                     "data": {"seq_length": run["seq"]}},
    }


def run_config(run: dict, steps: int) -> dict:
    """Build, warm up, measure one step, time `steps` steps: this rank's figures."""
    import deepspeed
    import deepspeed.comm as dist

    from hybrid3d.ds_internals import swapped, tuple_backward
    from hybrid3d.ds_internals.memory_probe import PeakProbe
    from hybrid3d.model import LlamaShape
    from common import build_trainer_from_json

    gc.collect()
    rss_base = reset_peak_rss()
    shape = LlamaShape(**SHAPES[run["shape"]])
    stock = contextlib.nullcontext() if run["one_backward"] else swapped(tuple_backward, "initialize",
                                                                          deepspeed.initialize)
    with stock:
        trainer = build_trainer_from_json(ds_config(run), shape)
    probe = PeakProbe(trainer.engine)
    data = random_batches(shape.vocab_size, run["micro_batch"], run["seq"], trainer.groups.get_data_parallel_rank())
    comms = measure_second_step(trainer, data, probe)
    all_to_all = classify_comms(comms)[1].get("all_to_all_single", 0)  # no caller names: by op
    times = [timed(lambda: trainer.train_step(data), dist.barrier) for _ in range(steps)]
    result = {"stage": trainer.groups.stage_id, "engine": type(trainer.engine).__name__,
              "params": sum(p.numel() for p in trainer.module.parameters()),
              "states": sum(probe.peak().by_category.values()), "all_to_all": all_to_all,
              "step_times": times, "rss_base": rss_base}
    dist.barrier()
    del trainer, probe, data
    gc.collect()
    result["rss_peak"] = peak_rss()
    return result


def world_main(rank, world_size, runs, repeats, steps):
    return round_robin(lambda run: run_config(run, steps), runs, repeats, maxed=("rss_peak",))


def modelled(run: dict, stage: int) -> dict:
    """The memory and traffic models' figures for one rank of `run` at `stage`."""
    from hybrid3d.model import LlamaShape
    from hybrid3d.planning.memory import layer_parameter_numels, stage_parameter_numels
    from hybrid3d.planning.traffic import ep_bytes_per_step

    shape = LlamaShape(**SHAPES[run["shape"]])
    if run["ep"] > 1:  # without a pipeline (expert parallelism with stages is not benchmarked here)
        params = sum(sum(sizes) for _, sizes in layer_parameter_numels(shape, 1, run["ep"]))
    else:
        params = sum(stage_parameter_numels(shape, 1, run["pp"], stage))
    dp = run["world"] // run["pp"]
    gas = run["global_batch"] // (run["micro_batch"] * dp)
    return {"params": params, "all_to_all": ep_bytes_per_step(shape, run["micro_batch"], run["seq"], run["ep"],
                                                               run["pp"], stage, gas, act_bytes=4)}


def summarize(runs, results) -> list:
    rows = []
    for run in runs:
        ranks = results[run["name"]]
        step = median([t for r in ranks for t in r["step_times"]])
        model = [modelled(run, r["stage"]) for r in ranks]
        rows.append({
            "name": run["name"], "engine": ranks[0]["engine"], "step_s": step,
            "tokens_per_s": run["global_batch"] * run["seq"] / step,
            "params_per_rank": [r["params"] for r in ranks], "params_model": [m["params"] for m in model],
            "states_mib": max(r["states"] for r in ranks) / 2**20,
            "rss_peak_mib": max(r["rss_peak"] for r in ranks) / 2**20,
            "all_to_all_mean": sum(r["all_to_all"] for r in ranks) / len(ranks),
            "all_to_all_model": sum(m["all_to_all"] for m in model) / len(model),
        })
    return rows


def markdown(rows, env, command) -> str:
    base = {r["name"]: r for r in rows}
    lines = ["# MoE against dense with the same active parameters", "", f"Command: `{command}`", "",
             environment_markdown(env, command), "",
             f"Shapes: {json.dumps(SHAPES)}", "",
             "| config | engine | step (s) | tokens/s | vs dense-DP2 | params/rank (model) | model states MiB "
             "| all-to-all B/rank/step (model) |",
             "|---|---|---|---|---|---|---|---|"]
    dense = base.get("dense-DP2")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / dense['tokens_per_s']:.2f}x" if dense else "n/a"
        params = ", ".join(f"{p:,}" for p in r["params_per_rank"])
        model = ", ".join(f"{p:,}" for p in r["params_model"])
        lines.append(f"| {r['name']} | {r['engine']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {ratio} "
                     f"| {params} ({model}) | {r['states_mib']:.1f} "
                     f"| {r['all_to_all_mean']:,.0f} ({r['all_to_all_model']:,.0f}) |")
    if "moe-PP2" in base and "moe-PP2-ds-backward" in base:
        gain = base["moe-PP2-ds-backward"]["step_s"] / base["moe-PP2"]["step_s"]
        lines += ["", f"One backward pass per MoE pipeline stage: step time {gain:.2f}x faster than DeepSpeed's "
                      "per-tensor backward of the (hidden, router_stats) output (moe-PP2 vs moe-PP2-ds-backward)."]
    return "\n".join(lines) + "\n"


def render(out_dir) -> None:
    """Write the markdown again from a run's JSON (`python benchmarks/moe_vs_dense.py --render DIR`)."""
    with open(os.path.join(out_dir, "moe_vs_dense.json")) as f:
        saved = json.load(f)
    with open(os.path.join(out_dir, "moe_vs_dense.md"), "w") as f:
        f.write(markdown(saved["rows"], saved["environment"], saved["command"]))


def write_chart(path, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["name"] for r in rows]
    left.barh(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    left.set_xlabel("tokens/s (median step)")
    right.barh(names, [r["states_mib"] for r in rows], color="tab:orange")
    right.set_xlabel("model-state MiB (largest rank)")
    for ax in (left, right):
        ax.invert_yaxis()
    fig.suptitle("MoE (E=8, k=2) vs dense with the same active parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats x 3 steps")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--render", metavar="DIR", help="only rewrite DIR/moe_vs_dense.md from its JSON")
    args = parser.parse_args(argv)
    require_matplotlib(parser)
    if args.quick:
        args.steps, args.repeats = 3, 2
    args.configs = [c for c in args.configs.split(",") if c]
    for name in args.configs:
        if name not in CONFIGS:
            parser.error(f"unknown config {name} (known: {', '.join(CONFIGS)})")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    env = environment()
    runs = []
    for name in args.configs:
        shape, pp, ep, one_backward = CONFIGS[name]
        runs.append(dict(name=name, shape=shape, pp=pp, ep=ep, one_backward=one_backward, world=args.world,
                         seq=args.seq_length, micro_batch=args.micro_batch, global_batch=args.global_batch))
    command = command_line("moe_vs_dense.py", argv)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_world(world_main, args.world, tmp, runs, args.repeats, args.steps)
    rows = summarize(runs, {run["name"]: [rank[run["name"]] for rank in ranks] for run in runs})
    out_dir = results_dir(args.out)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "moe_vs_dense.json"), "w") as f:
        json.dump({"environment": env, "command": command, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "moe_vs_dense.md"), "w") as f:
        f.write(markdown(rows, env, command))
    write_chart(os.path.join(out_dir, "moe_vs_dense.png"), rows)
    print(markdown(rows, env, command))
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
