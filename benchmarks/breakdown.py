"""Where a training step's time goes, per layout: compute, TP comm, DP comm, pipeline send/recv (with
the bubble's waiting), optimizer, control collectives and Python/framework overhead, from torch.profiler.

The same model, batch and layouts as `vs_peers.py`; each system (hybrid3d and its peer) runs a warm-up
step and then `--steps` steps under `torch.profiler.profile` on every rank, and rank 0's events are
attributed to categories:

- every `deepspeed.comm` collective is wrapped (this script only) in a `record_function` range named by
  its traffic class, found from its calling function as `common.CALLER_CLASSES` classifies the comms
  logger's records (TP: hybrid3d's mappings and cross entropy; DP: DeepSpeed's gradient reduction and
  ZeRO's all-gather; PP: pipeline send/recv and the partitioned-activation all-gathers; control: norms,
  overflow checks, loss averaging); AutoTP's own layers count as TP;
- DeepSpeedEngine's model step (ds_internals/step_timing.py) is the optimizer range (its collectives keep their
  own class);
- each event's self time goes to the innermost range it runs in; outside every range, `aten::` ops
  are compute, and what is left of the step's wall time is Python/framework overhead.

Writes breakdown.md, breakdown.json and breakdown.png (stacked bars, seconds per step) next to the other
results.

    python benchmarks/breakdown.py --layouts TP2 TP2xDP2 --precisions bf16
"""

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import (CALLER_CLASSES, command_line, environment, environment_markdown, random_batches, require_matplotlib,  # noqa: E402
                    results_dir, run_world)
from vs_peers import LAYOUTS, MODEL, PRECISIONS, build, peer_layout_of, system_tp_pp  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "broadcast",
               "send", "recv", "isend", "irecv", "all_to_all_single", "reduce_scatter_fn", "allgather_fn")
CATEGORIES = ("compute", "tp_comm", "dp_comm", "pp_p2p_and_bubble", "optimizer", "control_comm", "overhead")
RANGE_CATEGORY = {"tp": "tp_comm", "dp": "dp_comm", "pp": "pp_p2p_and_bubble", "pp_gather": "pp_p2p_and_bubble",
                  "pp_tied": "dp_comm", "control": "control_comm", "other": "control_comm", "optimizer": "optimizer"}
AUTOTP_CALLERS = ("forward", "backward")  # module_inject/layers.py's autograd functions call dist directly
PREFIX = "cat::"


def instrument():
    """Wrap deepspeed.comm's collectives in named profiler ranges (the optimizer step: `around_model_steps`)."""
    import sys as _sys

    import deepspeed.comm as dist

    def wrap(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            caller = _sys._getframe(1).f_code
            kind = CALLER_CLASSES.get(caller.co_name)
            if kind is None:
                kind = "tp" if caller.co_name in AUTOTP_CALLERS and "module_inject" in caller.co_filename else "other"
            with torch.profiler.record_function(PREFIX + kind):
                return fn(*args, **kwargs)
        return wrapped

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(getattr(dist, name)))


def attribute(events, wall_s: float, steps: int) -> dict:
    """Seconds per step in each category from the profiler's events of this rank's main thread."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        category = None
        node = event
        while node is not None:
            if node.name.startswith(PREFIX):
                category = RANGE_CATEGORY[node.name[len(PREFIX):]]
                break
            node = node.cpu_parent
        if category is None:
            if not event.name.startswith("aten::"):
                continue  # its time is left to overhead (python, autograd bookkeeping, hooks)
            category = "compute"
        totals[category] += event.self_cpu_time_total / 1e6
    totals = {k: v / steps for k, v in totals.items()}
    totals["overhead"] = max(0.0, wall_s / steps - sum(totals.values()))
    totals["step_s"] = wall_s / steps
    return totals


def profile_system(system: str, layout: str, precision: str, args, hf_model_dir: str) -> dict:
    import deepspeed.comm as dist

    tp, pp = system_tp_pp(system, layout)
    engine, step, dp_rank = build(system, tp, pp, precision, args, hf_model_dir)
    batches = random_batches(MODEL["vocab_size"], args.micro_batch, args.seq_length, seed=dp_rank)
    step(batches)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step(batches)
        dist.barrier()
        wall = time.perf_counter() - start
    events = prof.events()
    busy = {}
    for event in events:
        busy[event.thread] = busy.get(event.thread, 0) + event.self_cpu_time_total
    main_thread = [e for e in events if e.thread == max(busy, key=busy.get)]  # gloo/autograd helpers excluded
    del engine, step
    return attribute(main_thread, wall, args.steps)


def world_main(rank, world_size, runs, args, hf_model_dir):
    from hybrid3d.ds_internals.step_timing import around_model_steps

    instrument()
    with around_model_steps(lambda: torch.profiler.record_function(PREFIX + "optimizer")):
        return {f"{system}@{layout}@{precision}": profile_system(system, layout, precision, args, hf_model_dir)
                for system, layout, precision in runs}


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    labels = [f"{r['system']}\n{r['layout']}\n{r['precision']}" for r in rows]
    bottom = [0.0] * len(rows)
    for category in CATEGORIES:
        values = [r[category] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=category)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per step (rank 0)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--precisions", nargs="+", default=["bf16"], choices=PRECISIONS)
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1))
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-peers", action="store_true", help="hybrid3d only")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    require_matplotlib(parser)
    command = command_line("breakdown.py", argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model_dir = os.path.join(tmp, "model")
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(model_dir)
        for world in sorted({LAYOUTS[layout][0] for layout in args.layouts}):
            runs = []
            for precision in args.precisions:
                for layout in args.layouts:
                    if LAYOUTS[layout][0] != world:
                        continue
                    runs.append(("hybrid3d", layout, precision))
                    peer = (LAYOUTS[layout][3], peer_layout_of(layout), precision)
                    if not args.no_peers and peer not in runs:
                        runs.append(peer)
            result = run_world(world_main, world, os.path.join(tmp, f"ranks{world}"), runs, args, model_dir)[0]
            for system, layout, precision in runs:
                rows.append({"system": system, "layout": layout, "precision": precision,
                             **result[f"{system}@{layout}@{precision}"]})
    lines = ["| system | layout | precision | step s | " + " | ".join(CATEGORIES) + " |",
             "|---|---|---|---|" + "---|" * len(CATEGORIES)]
    for r in rows:
        shares = " | ".join(f"{r[c]:.3f} ({r[c] / r['step_s']:.0%})" for c in CATEGORIES)
        lines.append(f"| {r['system']} | {r['layout']} | {r['precision']} | {r['step_s']:.3f} | {shares} |")
    text = "\n".join(lines)
    out_dir = results_dir(args.out)
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    with open(os.path.join(out_dir, "breakdown.md"), "w") as f:
        f.write("\n".join(["# Step-time breakdown (rank 0, seconds per step and share)", "",
                           environment_markdown(env, command), "",
                           f"Model: {MODEL}; ZeRO-{args.zero}, global batch {args.global_batch} x {args.seq_length} "
                           f"tokens, micro-batch {args.micro_batch}; {args.steps} profiled steps after one warm-up. "
                           "Profiling adds per-op overhead, so these step times are longer than vs_peers.py's.",
                           "", text, "", "![breakdown](breakdown.png)", ""]))
    with open(os.path.join(out_dir, "breakdown.json"), "w") as f:
        json.dump({"rows": rows, "environment": env, "command": command}, f, indent=1)
    chart(rows, os.path.join(out_dir, "breakdown.png"))
    print(text)
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
