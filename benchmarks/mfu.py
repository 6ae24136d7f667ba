"""Model FLOPs utilisation of the training step: hybrid3d next to Hugging Face + DeepSpeed ZeRO-1.

A Llama-3.2-1B-shaped model (preset `llama3.2-1b`, random weights) in bf16 with fp32 master weights
(ZeRO-1 + `grad_accum_dtype: fp32`, DeepSpeed's BF16_Optimizer) and SDPA attention, trained on
random tokens at one batch and sequence length by both systems:

(a) hybrid3d (`build_trainer`: Megatron-style TP layers, here TP1 x DPn; DeepSpeedEngine + mpu),
(b) `transformers.LlamaForCausalLM` (attn_implementation="sdpa") under `deepspeed.initialize`.

Both run in one spawned world per world size (1 GPU, then every GPU of the machine), the systems
round-robin within each repeat. Per system: tokens/s (median of the per-repeat medians of the timed
steps), achieved TFLOP/s per device and MFU against the device's dense bf16 peak
(`hybrid3d.planning.flops`: 6N + 12·L·h·s FLOPs per token, recomputation excluded), peak
`max_memory_allocated`, and the ratio to HF + DeepSpeed (median of per-repeat ratios).

    python benchmarks/mfu.py                      # on a GPU machine: results/<date>-<machine>/mfu.md
    python benchmarks/mfu.py --smoke              # the same code on the CPU accelerator, tiny shape
    python benchmarks/mfu.py --variants compiled chunked-loss   # also hybrid3d with those options, side by side

Variants (`--variants`), each one more hybrid3d system in the same round-robin: `compiled` (`hybrid3d.compile`,
inductor: each decoder block compiled, the first warm-up step pays the compilation) and `chunked-loss`
(`hybrid3d.loss_chunk_tokens` 4096: the head and cross entropy 4096 tokens at a time, no (b, s, V) logits).
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import command_line, environment, environment_markdown, median, results_dir, run_world  # noqa: E402

SMOKE_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
SYSTEMS = ("hybrid3d", "hf-deepspeed")
# hybrid3d with one option more: the "hybrid3d" section's extra keys
VARIANTS = {"compiled": {"compile": {"enabled": True, "backend": "inductor"}},
            "chunked-loss": {"loss_chunk_tokens": 4096}}


def hf_config(args):
    from transformers import LlamaConfig

    from hybrid3d.model.presets import preset_config

    config = LlamaConfig(**SMOKE_SHAPE) if args.smoke else preset_config(args.preset)
    config.max_position_embeddings = max(config.max_position_embeddings, args.seq_length)
    config._attn_implementation = "sdpa"
    config.use_cache = False  # training: HF would otherwise build a KV cache in every forward
    return config


def ds_config(args, world: int, extra: dict) -> dict:
    optimizer = {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    if args.optimizer == "torch-fused":
        optimizer["params"]["torch_adam"] = True
        optimizer["params"]["adam_w_mode"] = True
        # DeepSpeed's torch_adam path passes `foreach` and the remaining params on: without `fused` torch would
        # run its foreach AdamW, not the fused kernel this option names
        optimizer["params"]["fused"] = True
    return {
        "train_batch_size": args.micro_batch * args.gas * world,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "optimizer": optimizer,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        **extra,
    }


def build(system: str, args):
    """(engine, micro-batch loss(ids, targets) -> scalar) for one system, weights on the device."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    from transformers import LlamaForCausalLM

    groups.mpu = None  # DeepSpeed keeps the last engine's mpu in a module global
    world = dist.get_world_size()
    config = hf_config(args)
    torch.manual_seed(0)
    if system.startswith("hybrid3d"):
        from hybrid3d.model import LlamaShape
        from common import build_trainer_from_json

        section = {"tensor_parallel_size": 1, **VARIANTS.get(system.removeprefix("hybrid3d+"), {})}
        trainer = build_trainer_from_json(ds_config(args, world, {"hybrid3d": section}), LlamaShape.from_hf(config))
        module = trainer.module
        return trainer.engine, lambda ids, t: module.loss_fn(trainer.engine(ids), t)
    model = LlamaForCausalLM(config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args, world, {}))

    def loss(ids, targets):
        logits = engine(input_ids=ids).logits  # (b, s, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return engine, loss


def run_system(system: str, args) -> dict:
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    gc.collect()
    accelerator.empty_cache()
    accelerator.reset_peak_memory_stats()
    engine, loss_fn = build(system, args)
    device = engine.device
    vocab = engine.module.shape.vocab_size if system.startswith("hybrid3d") else engine.module.config.vocab_size
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, vocab, (args.micro_batch, args.seq_length + 1), generator=generator)
               for _ in range(args.gas)]
    batches = [b.pin_memory() if device.type == "cuda" else b for b in batches]

    def step() -> float:
        for tokens in batches:
            tokens = tokens.to(device, non_blocking=True)
            loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        return loss

    for _ in range(args.warmup):
        step()
    accelerator.synchronize()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        loss = step()
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
    result = {"step_times": times, "loss": float(loss), "wrapper": type(engine.optimizer).__name__,
              "peak_memory": int(accelerator.max_memory_allocated()) if device.type == "cuda" else None}
    dist.barrier()
    del engine, loss_fn
    gc.collect()
    accelerator.empty_cache()
    return result


def systems(args) -> list[str]:
    return [*SYSTEMS, *(f"hybrid3d+{v}" for v in args.variants)]


def world_main(rank, world_size, args):
    out = {system: {"repeat_medians": [], "peak_memory": 0} for system in systems(args)}
    for _ in range(args.repeats):
        for system in systems(args):
            result = run_system(system, args)
            entry = out[system]
            entry["repeat_medians"].append(median(result["step_times"]))
            entry["wrapper"], entry["loss"] = result["wrapper"], result["loss"]
            entry["peak_memory"] = max(entry["peak_memory"], result["peak_memory"] or 0)
    return out


def summarize(results: dict, world: int, args, shape, peak) -> list[dict]:
    from hybrid3d.planning.flops import training_flops_per_token

    tokens = args.micro_batch * args.gas * world * args.seq_length
    flops = training_flops_per_token(shape, args.seq_length)
    rows = []
    base = results["hf-deepspeed"]["repeat_medians"]
    for system in systems(args):
        entry = results[system]
        step = median(entry["repeat_medians"])
        tps = tokens / step
        tflops = flops * tps / world / 1e12
        rows.append({"system": system, "devices": world, "wrapper": entry["wrapper"], "step_s": step,
                     "tokens_per_s": tps, "tflops_per_device": tflops, "mfu": tflops / peak if peak else None,
                     "vs_hf": median([b / s for s, b in zip(entry["repeat_medians"], base)]),
                     "peak_memory_gib": entry["peak_memory"] / 2**30, "loss": entry["loss"]})
    return rows


def write_report(rows, args, env, command, peak, device_name):
    lines = [f"# Training-step MFU: hybrid3d vs Hugging Face + DeepSpeed ZeRO-1 ({device_name})", "",
             environment_markdown(env, command),
             f"- model: {'smoke shape' if args.smoke else args.preset}, bf16 + fp32 masters (BF16_Optimizer), SDPA; "
             f"micro-batch {args.micro_batch} x GAS {args.gas} per device, sequence {args.seq_length}; "
             f"optimizer {args.optimizer}; {args.warmup} warm-up + {args.steps} timed steps x {args.repeats} "
             "interleaved repeats",
             f"- MFU: 6N + 12·L·h·s FLOPs per token (recomputation excluded) / {peak} TFLOP/s dense bf16 peak; "
             "the 12·L·h·s term counts the full s x s score matrix (PaLM's convention), which a causal kernel "
             "half skips (at 1B and s = 4096 about 9% of the FLOPs)", "",
             "| system | devices | optimizer wrapper | step s | tokens/s | TFLOP/s per device | MFU | vs HF + DeepSpeed "
             "| peak memory GiB | last loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['system']} | {r['devices']} | {r['wrapper']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} "
                     f"| {r['tflops_per_device']:.1f} | {mfu} | {r['vs_hf']:.2f}x | {r['peak_memory_gib']:.1f} "
                     f"| {r['loss']:.3f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--gas", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--optimizer", choices=["deepspeed-fused", "torch-fused"], default="deepspeed-fused",
                        help="DeepSpeed's FusedAdam (JIT-built) or torch.optim.AdamW")
    parser.add_argument("--worlds", type=int, nargs="*", help="world sizes (default: 1 and every device)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU accelerator (checks the code)")
    parser.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS),
                        help="hybrid3d with these options too, side by side")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    command = command_line("mfu.py", None)
    if args.smoke:
        os.environ["DS_ACCELERATOR"] = "cpu"
        args.seq_length, args.gas, args.steps, args.warmup, args.repeats = min(args.seq_length, 128), 2, 2, 1, 2
        devices, device_name = 2, "CPU smoke run"
    else:
        if not torch.cuda.is_available():
            sys.exit("error: benchmarks/mfu.py needs CUDA devices (use --smoke to check it on the CPU)")
        os.environ["DS_ACCELERATOR"] = "cuda"
        devices, device_name = torch.cuda.device_count(), torch.cuda.get_device_name()
    from hybrid3d.model import LlamaShape
    from hybrid3d.planning.flops import peak_tflops

    shape = LlamaShape.from_hf(hf_config(args))
    peak = None if args.smoke else peak_tflops(device_name)
    worlds = args.worlds or sorted({1, devices})
    rows = []
    with tempfile.TemporaryDirectory(prefix="mfu_ranks_") as tmp:  # per-rank results, not a result to keep
        for world in worlds:
            results = run_world(world_main, world, os.path.join(tmp, f"world{world}"), args)[0]
            rows += summarize(results, world, args, shape, peak)
    env = environment()
    report = write_report(rows, args, env, command, peak, device_name)
    print(report)
    if not args.smoke:
        out_dir = results_dir(args.out)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "mfu.md"), "w") as f:
            f.write(report)
        with open(os.path.join(out_dir, "mfu.json"), "w") as f:
            json.dump({"rows": rows, "environment": env, "command": command}, f, indent=1)


if __name__ == "__main__":
    main()
