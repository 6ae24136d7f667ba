"""Ring attention against DeepSpeed-Ulysses at the same context-parallel size, on one machine: step time, the bytes
the ring sends (counted at `torch.distributed.batch_isend_irecv`) against `planning.traffic.ring_bytes_per_layer`,
and the activation bytes autograd holds (`ds_internals.timeline.SavedActivationProbe`) against
`planning.activations.activation_bytes` of each (Ulysses' SDPA, the ring's blocks).

One spawned world of c ranks runs both configurations `--repeats` times round-robin (built afresh each time), so the
ratio comes from the same minutes of the same machine; step times are medians over all timed steps. bf16 with fp32
masters (the activation model's dtype), ZeRO-1,
one micro-batch per step.

    python benchmarks/ring_vs_ulysses.py --quick
"""

import argparse
import gc
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from common import (  # noqa: E402
    command_line,
    environment,
    environment_markdown,
    median,
    random_batches,
    results_dir,
    round_robin,
    run_world,
    timed,
)

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=4,
             head_dim=32)
COMMS = {"ulysses": "a2a", "ring": "p2p"}


def ds_config(run: dict) -> dict:
    return {
        "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
        "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
        "hybrid3d": {"context_parallel_size": run["world"], "context_parallel_comm": COMMS[run["name"]],
                     "data": {"seq_length": run["seq"]}},
    }


class SentBytes:
    """Counts the bytes this rank's isend ops carry through `torch.distributed.batch_isend_irecv` while active."""

    def __init__(self):
        import torch.distributed as torch_dist

        self.module, self.original, self.sent = torch_dist, torch_dist.batch_isend_irecv, 0

    def __enter__(self):
        def counting(ops):
            self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                             if op.op is self.module.isend)
            return self.original(ops)

        self.module.batch_isend_irecv = counting
        return self

    def __exit__(self, *exc):
        self.module.batch_isend_irecv = self.original


def run_config(run: dict, steps: int) -> dict:
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.timeline import SavedActivationProbe
    from hybrid3d.model import LlamaShape
    from common import build_trainer_from_json

    gc.collect()
    shape = LlamaShape(**SHAPE)
    trainer = build_trainer_from_json(ds_config(run), shape)
    data = random_batches(shape.vocab_size, 1, run["seq"], 0)  # every CP rank reads the same sequence
    trainer.train_step(data)  # warm-up
    with SavedActivationProbe(trainer.module.parameters()) as probe, SentBytes() as sent:
        trainer.train_step(data)
    times = [timed(lambda: trainer.train_step(data), dist.barrier) for _ in range(steps)]
    result = {"step_times": times, "saved_peak": probe.peak, "sent": sent.sent}
    dist.barrier()
    del trainer, data
    gc.collect()
    return result


def world_main(rank, world_size, runs, repeats, steps):
    return round_robin(lambda run: run_config(run, steps), runs, repeats)


def modelled(run: dict) -> dict:
    from hybrid3d.model import LlamaShape
    from hybrid3d.planning.activations import activation_bytes
    from hybrid3d.planning.traffic import ring_bytes_per_layer

    shape = LlamaShape(**SHAPE)
    forward, backward = ring_bytes_per_layer(shape, 1, run["seq"], 1, run["world"], act_bytes=2)
    sent = shape.num_layers * (forward + backward) if run["name"] == "ring" else 0
    return {"sent": sent, "activations": activation_bytes(shape, 1, run["seq"], 1, 1, 0, 1, cp=run["world"],
                                                          comm=COMMS[run["name"]])}


def markdown(rows, env, command, seq, world) -> str:
    ulysses = next((r for r in rows if r["name"] == "ulysses"), None)
    lines = ["# Ring attention against DeepSpeed-Ulysses", "", f"Command: `{command}`", "",
             environment_markdown(env, command), "",
             f"Shape: {json.dumps(SHAPE)}; context_parallel_size {world}, sequence {seq}, micro-batch 1, bf16, ZeRO-1", "",
             "| attention | step (s) | tokens/s | vs Ulysses | ring bytes sent per rank and step (model) "
             "| saved activations MiB per rank (model) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / ulysses['tokens_per_s']:.2f}x" if ulysses else "n/a"
        lines.append(f"| {r['name']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {ratio} "
                     f"| {r['sent']:,} ({r['sent_model']:,}) | {r['saved_mib']:.1f} ({r['activations_model_mib']:.1f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats x 3 steps")
    parser.add_argument("--world", type=int, default=2, help="context_parallel_size (the whole world)")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 2
    env = environment()
    runs = [dict(name=name, world=args.world, seq=args.seq_length) for name in COMMS]
    command = command_line("ring_vs_ulysses.py", argv)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_world(world_main, args.world, tmp, runs, args.repeats, args.steps)
    rows = []
    for run in runs:
        measured = [rank[run["name"]] for rank in ranks]
        step = median([t for r in measured for t in r["step_times"]])
        model = modelled(run)
        rows.append({"name": run["name"], "step_s": step, "tokens_per_s": args.seq_length / step,
                     "sent": max(r["sent"] for r in measured), "sent_model": model["sent"],
                     "saved_mib": max(r["saved_peak"] for r in measured) / 2**20,
                     "activations_model_mib": model["activations"] / 2**20})
    out_dir = results_dir(args.out)
    os.makedirs(out_dir, exist_ok=True)
    text = markdown(rows, env, command, args.seq_length, args.world)
    with open(os.path.join(out_dir, "ring_vs_ulysses.json"), "w") as f:
        json.dump({"environment": env, "command": command, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "ring_vs_ulysses.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
