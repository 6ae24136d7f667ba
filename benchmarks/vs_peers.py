"""The same small Llama, same batch, same steps, side by side in one spawned world:

(a) hybrid3d (`build_trainer`, Megatron-style TP layers, DeepSpeedEngine + mpu),
(b) Hugging Face `LlamaForCausalLM` under plain DeepSpeed ZeRO data parallelism,
(c) `LlamaForCausalLM` under DeepSpeed AutoTP (`"tensor_parallel": {"autotp_size": t}`) x ZeRO DP.

Each system trains at the layouts it supports: DP (a, b) and TPxDP (a, c). All start from the same
weights (hybrid3d loads the HF state dict) and see the same token stream. Reported per system and
layout: tokens/s (median over the timed steps of every repeat; repeats run round-robin), its ratio
to hybrid3d at the same layout (median of the per-repeat ratios), model-state bytes
(`hybrid3d.memory_probe`) and peak RSS.

    python benchmarks/vs_peers.py --quick
"""

import argparse
import gc
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import (  # noqa: E402
    environment,
    environment_markdown,
    median,
    peak_rss,
    reset_peak_rss,
    results_dir,
    run_world,
    timed,
)

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
REDUCE_BUCKET = 4_000_000  # elements, for every system (DeepSpeed's default 5e8 would dominate these sizes)
SYSTEMS = {"hybrid3d": ("DP", "TP"), "hf-deepspeed": ("DP",), "hf-autotp": ("TP",)}


def ds_config(args, dp: int, extra: dict) -> dict:
    config = {
        "train_batch_size": args.global_batch, "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.zero, "reduce_bucket_size": REDUCE_BUCKET,
                              "allgather_bucket_size": REDUCE_BUCKET},
        "steps_per_print": 10**9,
    }
    config.update(extra)
    return config


def build(system: str, tp: int, args, hf_model_dir: str):
    """(engine, loss(ids, targets) -> scalar, data-parallel rank)."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    from transformers import LlamaForCausalLM

    # DeepSpeed keeps the last engine's mpu in a module global and an mpu-less engine would reuse it.
    groups.mpu = None
    world = dist.get_world_size()
    hf = LlamaForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32)
    if system == "hybrid3d":
        from hybrid3d.model import LlamaShape
        from hybrid3d.training.trainer import build_trainer

        config = ds_config(args, world // tp, {"hybrid3d": {"tensor_parallel_size": tp}})
        trainer = build_trainer(config, LlamaShape.from_hf(hf.config), hf_state_dict=hf.state_dict())
        module = trainer.module
        return trainer.engine, lambda ids, t: module.loss_fn(trainer.engine(ids), t), \
            trainer.groups.get_data_parallel_rank()
    extra = {"tensor_parallel": {"autotp_size": tp}} if system == "hf-autotp" else {}
    engine, _, _, _ = deepspeed.initialize(model=hf, model_parameters=hf.parameters(),
                                           config=ds_config(args, world // tp, extra))

    def loss(ids, targets):
        logits = engine(input_ids=ids).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return engine, loss, dist.get_rank() // tp  # AutoTP's mesh: rank = data x t + tensor


def run_system(system: str, tp: int, args, hf_model_dir: str) -> dict:
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.memory_probe import PeakProbe

    gc.collect()
    reset_peak_rss()
    engine, loss_fn, dp_rank = build(system, tp, args, hf_model_dir)
    probe = PeakProbe(engine)
    generator = torch.Generator().manual_seed(dp_rank)
    gas = engine.gradient_accumulation_steps()

    def step():
        for _ in range(gas):
            tokens = torch.randint(0, MODEL["vocab_size"], (args.micro_batch, args.seq_length + 1),
                                   generator=generator)
            loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        return loss.item()

    step()
    probe.enabled = True
    step()
    probe.enabled = False
    times = [timed(step, dist.barrier) for _ in range(args.steps)]
    result = {"step_times": times, "states": probe.peak().model_states, "wrapper": type(engine.optimizer).__name__,
              "last_loss": step()}
    dist.barrier()
    del engine, probe
    gc.collect()
    result["rss_peak"] = peak_rss()
    return result


def world_main(rank, world_size, runs, args, hf_model_dir):
    out = {}
    for _ in range(args.repeats):
        for system, tp in runs:
            result = run_system(system, tp, args, hf_model_dir)
            entry = out.setdefault(f"{system}@TP{tp}", {**result, "repeat_medians": []})
            entry["repeat_medians"].append(median(result["step_times"]))
            entry["rss_peak"] = max(entry["rss_peak"], result["rss_peak"])
    return out


def write_report(out_dir, runs, results, args, command):
    tokens = args.global_batch * args.seq_length
    lines = ["| system | layout | optimizer wrapper | tokens/s | vs hybrid3d (median of per-repeat ratios) | "
             "model states MiB (max rank) | peak RSS MiB (max rank) | final loss |",
             "|---|---|---|---|---|---|---|---|"]
    for system, tp in runs:
        key = f"{system}@TP{tp}"
        r0 = results[0][key]
        base = results[0][f"hybrid3d@TP{tp}"]["repeat_medians"]
        ratios = [b / m for m, b in zip(r0["repeat_medians"], base)]
        layout = f"TP{tp}xDP{args.world // tp}" if tp > 1 else f"DP{args.world}"
        lines.append(f"| {system} | {layout} | {r0['wrapper']} | {tokens / median(r0['repeat_medians']):.0f} | "
                     f"{median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}) | "
                     f"{max(r[key]['states'] for r in results) / 2**20:.2f} | "
                     f"{max(r[key]['rss_peak'] for r in results) / 2**20:.0f} | {r0['last_loss']:.4f} |")
    table = "\n".join(lines)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vs_peers.md"), "w") as f:
        f.write("\n".join(["# hybrid3d vs peers", "", environment_markdown(environment(), command), "",
                           f"Model: {MODEL}; bf16, ZeRO-{args.zero}, global batch {args.global_batch} x "
                           f"{args.seq_length} tokens, micro-batch {args.micro_batch}; {args.steps} timed steps x "
                           f"{args.repeats} repeats.", "", table, ""]))
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats x 3 timed steps")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2, help="TP degree for hybrid3d and AutoTP")
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 2
    runs = [(s, 1) for s, kinds in SYSTEMS.items() if "DP" in kinds] + \
           [(s, args.tp) for s, kinds in SYSTEMS.items() if "TP" in kinds]
    command = "python benchmarks/vs_peers.py " + " ".join(sys.argv[1:] if argv is None else argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(os.path.join(tmp, "model"))
        results = run_world(world_main, args.world, os.path.join(tmp, "ranks"), runs, args, os.path.join(tmp, "model"))
    out_dir = results_dir(args.out)
    print(write_report(out_dir, runs, results, args, command))
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
