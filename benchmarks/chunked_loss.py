"""The LM head and cross entropy all at once against `loss_chunk_tokens` chunks, side by side on one rank: the bytes
autograd holds at the step's peak (`ds_internals.timeline.SavedActivationProbe`) against the activation model
(`planning.activations.activation_bytes`), and the step time (medians of interleaved repeats), at a vocabulary of
32,768 where the (b·s, V) fp32 probabilities dwarf a block's activations.

    python benchmarks/chunked_loss.py            # V 32768, h 256, 2 layers, b 2, s 1024, bf16, chunks of 512
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from common import (bf16_zero1_config, environment_markdown, median, random_batches, run_world,  # noqa: E402
                    start_results, timed)

SHAPE = dict(vocab_size=32768, hidden_size=256, intermediate_size=704, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=64)


def ds_config(chunk: int, args) -> dict:
    return bf16_zero1_config(args.micro_batch, 1, {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                                   "loss_chunk_tokens": chunk, "data": {"seq_length": args.seq}})


def world_main(rank, world_size, chunks, args):
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.timeline import SavedActivationProbe
    from hybrid3d.model import LlamaShape
    from common import build_trainer_from_json

    shape = LlamaShape(**SHAPE)
    built, out = [], {}
    for chunk in chunks:
        trainer = build_trainer_from_json(ds_config(chunk, args), shape)
        data = random_batches(shape.vocab_size, args.micro_batch, args.seq, seed=0)
        trainer.train_step(data)  # warm-up
        with SavedActivationProbe(trainer.module.parameters()) as probe:
            trainer.train_step(data)
        built.append((chunk, trainer, data))
        out[chunk] = dict(saved_peak=probe.peak, step_times=[])
    for _ in range(args.repeats):
        for chunk, trainer, data in built:
            out[chunk]["step_times"].append(timed(lambda: trainer.train_step(data), dist.barrier))
    return out


def modelled(chunk: int, args) -> float:
    from hybrid3d.model import LlamaShape
    from hybrid3d.planning.activations import activation_bytes

    shape = LlamaShape(**SHAPE, loss_chunk_tokens=chunk)
    return activation_bytes(shape, args.micro_batch, args.seq, 1, 1, 0, 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    command, out_dir, env = start_results("chunked_loss.py", argv, args.out)
    chunks = [0, args.chunk]
    with tempfile.TemporaryDirectory() as tmp:
        result = run_world(world_main, 1, tmp, chunks, args)[0]
    logits = 4 * args.micro_batch * args.seq * SHAPE["vocab_size"]  # the (b·s, V) fp32 probabilities
    rows = []
    for chunk in chunks:
        step = median(result[chunk]["step_times"])
        rows.append(dict(chunk=chunk, saved_MiB=round(result[chunk]["saved_peak"] / 2**20, 2),
                         model_MiB=round(modelled(chunk, args) / 2**20, 2), step_s=round(step, 4)))
    base = rows[0]
    for row in rows:
        row["step_vs_whole"] = round(row["step_s"] / base["step_s"], 3)
        row["saved_reduction_MiB"] = round(base["saved_MiB"] - row["saved_MiB"], 2)
    with open(os.path.join(out_dir, "chunked_loss.json"), "w") as f:
        json.dump(dict(env=env, command=command, shape=SHAPE, rows=rows), f, indent=1)
    lines = ["# The LM head and cross entropy in chunks", "", environment_markdown(env, command), "",
             f"Shape: {json.dumps(SHAPE)}; micro-batch {args.micro_batch}, sequence {args.seq}, bf16 (fp32 masters), one rank; "
             f"the (b·s, V) fp32 probabilities are {logits / 2**20:.1f} MiB; medians of {args.repeats} interleaved "
             "repeats.", "",
             "| loss_chunk_tokens | saved activations at the peak, MiB (model) | reduction MiB | step s | vs whole |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['chunk'] or 'off'} | {r['saved_MiB']} ({r['model_MiB']}) | {r['saved_reduction_MiB']} | "
                     f"{r['step_s']} | {r['step_vs_whole']:.3f} |")
    with open(os.path.join(out_dir, "chunked_loss.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-(len(rows) + 2):]))
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
