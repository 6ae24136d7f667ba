"""LoRA against full fine-tuning at the same layout, on one machine: model-state bytes per rank (measured and the
memory model's) and tokens/s, side by side.

Both start from the same random Hugging Face Llama (built in each rank from one seed, so no folder is needed). LoRA
trains rank-r adapters beside all seven projections (`hybrid3d.lora`), full fine-tuning trains every weight; same
layout, ZeRO stage, precision, batch and sequence. One spawned world runs the two `--repeats` times round-robin
(built afresh each time), so the ratio comes from the same minutes of the same machine; step times are the median of
each configuration's timed steps over all repeats. Model-state bytes: the optimizer's and the module's own tensors
after the second step (`ds_internals.memory_probe.PeakProbe`), against `planning.memory.rank_model_states`.

    python benchmarks/lora_vs_full.py --quick
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
    measure_second_step,
    median,
    random_batches,
    results_dir,
    round_robin,
    run_world,
    timed,
)

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=4,
             head_dim=64)
BUCKET = 4_000_000
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def ds_config(run: dict) -> dict:
    config = {
        "train_batch_size": run["global_batch"],
        "train_micro_batch_size_per_gpu": run["micro_batch"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "gradient_clipping": 1.0,
        # buckets of 4M elements: DeepSpeed's default (5e8, a 2 GB buffer) would hide the parameters' states
        "zero_optimization": {"stage": run["zero"], "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET},
        "steps_per_print": 10**9,
        "hybrid3d": {"tensor_parallel_size": run["tp"], "pipeline_parallel_size": run["pp"],
                     "data": {"seq_length": run["seq"]},
                     "model": {"hf_model": "(built in each rank)", "init_from_hf": True}},
    }
    if run["precision"] == "bf16":
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    if run["lora_rank"]:
        config["hybrid3d"]["lora"] = {"rank": run["lora_rank"], "alpha": 2 * run["lora_rank"], "target_modules": TARGETS}
    return config


def hf_weights(shape):
    """A random HF Llama's state dict of `shape`, the same on every rank."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, max_position_embeddings=4096)
    return LlamaForCausalLM(config).state_dict()


def run_config(run: dict, steps: int) -> dict:
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.memory_probe import PeakProbe
    from hybrid3d.model import LlamaShape
    from common import build_trainer_from_json

    gc.collect()
    shape = LlamaShape(**SHAPE)
    trainer = build_trainer_from_json(ds_config(run), shape, hf_state_dict=hf_weights(shape))
    probe = PeakProbe(trainer.engine)
    data = random_batches(shape.vocab_size, run["micro_batch"], run["seq"], trainer.groups.get_data_parallel_rank())
    measure_second_step(trainer, data, probe)
    times = [timed(lambda: trainer.train_step(data), dist.barrier) for _ in range(steps)]
    result = {"stage": trainer.groups.stage_id, "dp_rank": trainer.groups.get_data_parallel_rank(),
              "trained": sum(p.numel() for p in trainer.module.parameters() if p.requires_grad),
              "params": sum(p.numel() for p in trainer.module.parameters()),
              "states": sum(probe.peak().by_category.values()), "by_category": probe.peak().by_category,
              "step_times": times}
    dist.barrier()
    del trainer, probe, data
    gc.collect()
    return result


def world_main(rank, world_size, runs, repeats, steps):
    return round_robin(lambda run: run_config(run, steps), runs, repeats)


def modelled_states(run: dict, stage: int, dp_rank: int) -> int:
    """The memory model's model-state bytes of one rank."""
    from hybrid3d.model import LlamaShape
    from hybrid3d.planning.memory import rank_model_states
    from hybrid3d.planning.planner import with_lora

    shape = with_lora(LlamaShape(**SHAPE), run["lora_rank"])
    dp = run["world"] // (run["tp"] * run["pp"])
    return rank_model_states(shape, run["tp"], run["pp"], dp, run["zero"], precision_key(run["precision"]),
                             stage=stage, dp_rank=dp_rank, reduce_bucket_size=BUCKET).peak.total


def precision_key(precision: str) -> str:
    return "bf16+fp32acc" if precision == "bf16" else precision


def summarize(runs, results) -> list:
    rows = []
    for run in runs:
        ranks = results[run["name"]]
        step = median([t for r in ranks for t in r["step_times"]])
        rows.append({
            "name": run["name"], "step_s": step, "tokens_per_s": run["global_batch"] * run["seq"] / step,
            "trained_per_rank": max(r["trained"] for r in ranks), "params_per_rank": max(r["params"] for r in ranks),
            "states_mib": [r["states"] / 2**20 for r in ranks],
            "model_mib": [modelled_states(run, r["stage"], r["dp_rank"]) / 2**20 for r in ranks],
        })
    return rows


def markdown(rows, env, command, run) -> str:
    full = next((r for r in rows if r["name"] == "full"), None)
    lines = ["# LoRA against full fine-tuning at the same layout", "", f"Command: `{command}`", "",
             environment_markdown(env, command), "",
             f"Shape: {json.dumps(SHAPE)}; layout TP{run['tp']} x PP{run['pp']} x DP"
             f"{run['world'] // (run['tp'] * run['pp'])}, ZeRO-{run['zero']}, {run['precision']}; micro-batch "
             f"{run['micro_batch']}, global batch {run['global_batch']}, sequence {run['seq']}", "",
             "| config | trained / held params per rank | step (s) | tokens/s | vs full | model states MiB per rank, "
             "measured | memory model |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x" if full else "n/a"
        lines.append(f"| {r['name']} | {r['trained_per_rank']:,} / {r['params_per_rank']:,} | {r['step_s']:.3f} "
                     f"| {r['tokens_per_s']:,.0f} | {ratio} | {', '.join(f'{m:.1f}' for m in r['states_mib'])} "
                     f"| {', '.join(f'{m:.1f}' for m in r['model_mib'])} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats x 3 steps")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 2
    return args


def main(argv=None):
    args = parse_args(argv)
    env = environment()
    common_run = dict(world=args.world, tp=args.tp, pp=args.pp, zero=args.zero, precision=args.precision,
                      seq=args.seq_length, micro_batch=args.micro_batch, global_batch=args.global_batch)
    runs = [dict(common_run, name="full", lora_rank=0),
            dict(common_run, name=f"lora-r{args.lora_rank}", lora_rank=args.lora_rank)]
    command = command_line("lora_vs_full.py", argv)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_world(world_main, args.world, tmp, runs, args.repeats, args.steps)
    rows = summarize(runs, {run["name"]: [rank[run["name"]] for rank in ranks] for run in runs})
    out_dir = results_dir(args.out)
    os.makedirs(out_dir, exist_ok=True)
    text = markdown(rows, env, command, common_run)
    with open(os.path.join(out_dir, "lora_vs_full.json"), "w") as f:
        json.dump({"environment": env, "command": command, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "lora_vs_full.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
