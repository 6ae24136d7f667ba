"""Decoder blocks eager against compiled (`hybrid3d.compile`, torch.compile with inductor per block), side by side
in one world: the step time (medians of interleaved repeats, after a warm-up step that compiles) and the first
step's time, which includes the compilation. bf16 with fp32 masters, ZeRO-1.

    python benchmarks/compile_blocks.py                 # TP1 on one rank and TP2 on two, h 512, 4 layers, s 512
"""

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from common import (bf16_zero1_config, environment_markdown, int_list, median, random_batches, run_world,  # noqa: E402
                    start_results, timed)

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=4,
             head_dim=64)


def ds_config(tp: int, compiled: bool, args) -> dict:
    return bf16_zero1_config(args.micro_batch, 1, {"tensor_parallel_size": tp, "data": {"seq_length": args.seq},
                                                   "compile": {"enabled": compiled, "backend": "inductor"}})


def world_main(rank, world_size, args):
    import deepspeed.comm as dist

    from hybrid3d.model import LlamaShape
    from common import build_trainer_from_json

    shape = LlamaShape(**SHAPE)
    built, out = [], {}
    for compiled in (False, True):
        trainer = build_trainer_from_json(ds_config(world_size, compiled, args), shape)
        data = random_batches(shape.vocab_size, args.micro_batch, args.seq, seed=0)
        start = time.perf_counter()
        trainer.train_step(data)  # compiles the blocks when compiled
        out[compiled] = dict(first_step=time.perf_counter() - start, step_times=[])
        built.append((compiled, trainer, data))
    for _ in range(args.repeats):
        for compiled, trainer, data in built:
            out[compiled]["step_times"].append(timed(lambda: trainer.train_step(data), dist.barrier))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int_list, default="1,2", help="tensor-parallel sizes; one world of t ranks each")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    command, out_dir, env = start_results("compile_blocks.py", argv, args.out)
    rows = []
    for tp in args.tp:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_world(world_main, tp, tmp, args)[0]
        eager = median(result[False]["step_times"])
        for compiled in (False, True):
            step = median(result[compiled]["step_times"])
            rows.append(dict(tp=tp, blocks="compiled" if compiled else "eager", step_s=round(step, 4),
                             first_step_s=round(result[compiled]["first_step"], 1),
                             vs_eager=round(step / eager, 3)))
    with open(os.path.join(out_dir, "compile_blocks.json"), "w") as f:
        json.dump(dict(env=env, command=command, shape=SHAPE, rows=rows), f, indent=1)
    lines = ["# Decoder blocks eager and compiled", "", environment_markdown(env, command), "",
             f"Shape: {json.dumps(SHAPE)}; micro-batch {args.micro_batch}, sequence {args.seq}, bf16, ZeRO-1, "
             f"torch.compile (inductor) per block; medians of {args.repeats} interleaved repeats.", "",
             "| TP | blocks | step s | vs eager | first step s (with compilation) |", "|---|---|---|---|---|"]
    lines += [f"| {r['tp']} | {r['blocks']} | {r['step_s']} | {r['vs_eager']:.3f} | {r['first_step_s']} |" for r in rows]
    with open(os.path.join(out_dir, "compile_blocks.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-(len(rows) + 2):]))
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
