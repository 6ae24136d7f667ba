"""hybrid3d against the best peer at each layout, side by side in one spawned world per world size.

Layouts and the peer each is measured against (same model, weights, token stream and global batch):

    DP2, DP4           Hugging Face `LlamaForCausalLM` under DeepSpeed ZeRO (same stage)
    TP2, TP2xDP2       `LlamaForCausalLM` under DeepSpeed AutoTP (`tensor_parallel.autotp_size`) x ZeRO
    PP2xDP2, TP2xPP2   `LlamaForCausalLM` under DeepSpeed ZeRO at DP over the same ranks (DP4)

and a single-process plain PyTorch row (HF model + torch AdamW, no DeepSpeed, all cores) as the
no-framework reference. fp32 and bf16 (fp32 masters; plain PyTorch uses bf16 autocast).

Repeats run round-robin over every (system, layout, precision) of a world; reported per row: tokens/s
(median over the timed steps of every repeat), the ratio to the peer at that layout as the median of
per-repeat ratios and its range, the overhead against plain PyTorch, model-state bytes and peak RSS.

    python benchmarks/vs_peers.py --quick
    python benchmarks/vs_peers.py --zero 3 --layouts DP2 DP4     # ZeRO-3: hybrid3d against HF + DeepSpeed ZeRO-3
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
from common import (  # noqa: E402
    command_line,
    environment,
    environment_markdown,
    median,
    peak_rss,
    random_batches,
    reset_peak_rss,
    results_dir,
    run_world,
    timed,
)

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
REDUCE_BUCKET = 4_000_000  # elements, for every system (DeepSpeed's default 5e8 would dominate these sizes)

# layout name -> (world, tp, pp, peer system); the peer runs at (tp, pp=1) for TP, at DP=world for PP.
LAYOUTS = {
    "DP2": (2, 1, 1, "hf-deepspeed"), "TP2": (2, 2, 1, "hf-autotp"),
    "DP4": (4, 1, 1, "hf-deepspeed"), "TP2xDP2": (4, 2, 1, "hf-autotp"),
    "PP2xDP2": (4, 1, 2, "hf-deepspeed"), "TP2xPP2": (4, 2, 2, "hf-deepspeed"),
}
PRECISIONS = ("fp32", "bf16")


def ds_config(args, precision: str, extra: dict, batch_scale: int = 1) -> dict:
    config = {
        "train_batch_size": args.global_batch * batch_scale, "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "gradient_clipping": 1.0, "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {"stage": args.zero, "reduce_bucket_size": REDUCE_BUCKET,
                              "allgather_bucket_size": REDUCE_BUCKET},
        "steps_per_print": 10**9,
    }
    config.update(extra)
    return config


def build(system: str, tp: int, pp: int, precision: str, args, hf_model_dir: str):
    """(engine, step(batches) -> loss, data-parallel rank). Each system must process `args.global_batch`
    sequences per step; that is checked from the engine's own micro-batch, GAS and DP size."""
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
        from common import build_trainer_from_json

        config = ds_config(args, precision, {"hybrid3d": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                                                         "partition_method": args.partition_method}})
        trainer = build_trainer_from_json(config, LlamaShape.from_hf(hf.config), hf_state_dict=hf.state_dict())
        check_sequences_per_step(system, trainer.engine, trainer.layout.dp, args.global_batch)
        return trainer.engine, trainer.train_step, trainer.groups.get_data_parallel_rank()
    extra = {"tensor_parallel": {"autotp_size": tp}} if system == "hf-autotp" else {}
    # Without an mpu DeepSpeed's batch arithmetic takes every rank for a data-parallel replica
    # (runtime/config.py: world_size = dist.get_world_size()), TP ranks included: AutoTP asked for
    # train_batch_size B runs B/t sequences per step. Asking for B·t makes it run B, like the others.
    engine, _, _, _ = deepspeed.initialize(model=hf, model_parameters=hf.parameters(),
                                           config=ds_config(args, precision, extra, batch_scale=tp))
    check_sequences_per_step(system, engine, world // tp, args.global_batch)

    def step(batches):
        losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            ids, targets = next(batches)
            logits = engine(input_ids=ids).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        # The step's loss as hybrid3d reports it: the mean over micro-batches and data-parallel replicas
        # (TP ranks of one replica hold the same loss, so the world mean is the replicas' mean).
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)
        return mean.item() / world

    return engine, step, dist.get_rank() // tp  # AutoTP's mesh: rank = data x t + tensor


def check_sequences_per_step(system: str, engine, dp: int, expected: int) -> None:
    """The sequences one optimizer step really consumes: micro-batch x GAS x data-parallel replicas."""
    real = engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps() * dp
    if real != expected:
        raise RuntimeError(f"{system} would process {real} sequences per step, not {expected}")


def system_tp_pp(system: str, layout: str) -> tuple[int, int]:
    """(tp, pp) at which `system` runs for `layout`: hybrid3d at the layout's own, a peer at its own
    layout over the same ranks (AutoTP keeps the TP size, HF + ZeRO is pure DP; neither has a pipeline)."""
    _, tp, pp, _ = LAYOUTS[layout]
    if system == "hybrid3d":
        return tp, pp
    return (tp if system == "hf-autotp" else 1), 1


def run_system(system: str, layout: str, precision: str, args, hf_model_dir: str) -> dict:
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.memory_probe import PeakProbe

    tp, pp = system_tp_pp(system, layout)
    gc.collect()
    reset_peak_rss()
    engine, step, dp_rank = build(system, tp, pp, precision, args, hf_model_dir)
    probe = PeakProbe(engine)
    batches = random_batches(MODEL["vocab_size"], args.micro_batch, args.seq_length, seed=dp_rank)
    step(batches)
    probe.enabled = True
    step(batches)
    probe.enabled = False
    times = [timed(lambda: step(batches), dist.barrier) for _ in range(args.steps)]
    result = {"step_times": times, "states": probe.peak().model_states, "wrapper": type(engine.optimizer).__name__,
              "last_loss": step(batches)}
    dist.barrier()
    del engine, probe, step
    gc.collect()
    result["rss_peak"] = peak_rss()
    return result


def world_runs(world: int, args) -> list[tuple[str, str, str]]:
    """(system, layout, precision) measured in the world of this size, hybrid3d next to its peer.
    A peer row shared by two layouts (HF + ZeRO at DP4 for DP4 and the PP layouts) runs once."""
    runs = []
    for precision in args.precisions:
        for layout, (size, _, _, peer) in LAYOUTS.items():
            if size != world or layout not in args.layouts:
                continue
            runs.append(("hybrid3d", layout, precision))
            peer_layout = peer_layout_of(layout)
            if (peer, peer_layout, precision) not in runs:
                runs.append((peer, peer_layout, precision))
    return runs


def peer_layout_of(layout: str) -> str:
    world, tp, pp, peer = LAYOUTS[layout]
    return layout if pp == 1 else f"DP{world}"


def world_main(rank, world_size, runs, args, hf_model_dir):
    out = {}
    for _ in range(args.repeats):
        for system, layout, precision in runs:
            result = run_system(system, layout, precision, args, hf_model_dir)
            entry = out.setdefault(f"{system}@{layout}@{precision}", {**result, "repeat_medians": []})
            entry["repeat_medians"].append(median(result["step_times"]))
            entry["rss_peak"] = max(entry["rss_peak"], result["rss_peak"])
    return out


def plain_pytorch(args, hf_model_dir: str, precision: str, steps: int) -> list[float]:
    """Step times of HF + torch AdamW in this process (all cores), global batch by accumulation."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = random_batches(MODEL["vocab_size"], args.micro_batch, args.seq_length, seed=0)
    micro_steps = args.global_batch // args.micro_batch

    def step():
        for _ in range(micro_steps):
            ids, targets = next(batches)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = model(input_ids=ids).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / micro_steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def rows(results_by_world: dict, plain: dict, args) -> list[dict]:
    tokens = args.global_batch * args.seq_length
    out = []
    for precision in args.precisions:
        plain_tps = tokens / median(plain[precision])
        out.append({"system": "plain PyTorch (1 process)", "layout": "1 process", "precision": precision,
                    "tokens_per_s": plain_tps, "wrapper": "torch.optim.AdamW"})
        for layout, (world, _, _, peer) in LAYOUTS.items():
            if layout not in args.layouts:
                continue
            ranks = results_by_world[world]
            key = f"hybrid3d@{layout}@{precision}"
            peer_key = f"{peer}@{peer_layout_of(layout)}@{precision}"
            for system, k in (("hybrid3d", key), (peer, peer_key)):
                r0 = ranks[0][k]
                peer_medians = ranks[0][peer_key]["repeat_medians"]
                ratios = [p / m for m, p in zip(r0["repeat_medians"], peer_medians)]  # tokens/s vs the peer
                tps = tokens / median(r0["repeat_medians"])
                out.append({"system": system, "layout": layout if system == "hybrid3d" else peer_layout_of(layout),
                            "for_layout": layout, "precision": precision, "wrapper": r0["wrapper"],
                            "tokens_per_s": tps, "vs_peer": median(ratios), "vs_peer_range": (min(ratios), max(ratios)),
                            "vs_plain": tps / plain_tps, "step_s": median(r0["repeat_medians"]),
                            "states_mib": max(r[k]["states"] for r in ranks) / 2**20,
                            "rss_mib": max(r[k]["rss_peak"] for r in ranks) / 2**20, "last_loss": r0["last_loss"]})
    return out


def table(all_rows: list[dict]) -> str:
    lines = ["| precision | layout | system | optimizer wrapper | tokens/s | vs peer (median of per-repeat ratios) "
             "| vs plain PyTorch | model states MiB (max rank) | peak RSS MiB (max rank) | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in all_rows:
        if "vs_peer" not in r:
            lines.append(f"| {r['precision']} | {r['layout']} | {r['system']} | {r['wrapper']} | "
                         f"{r['tokens_per_s']:.0f} | | 1.00 | | | |")
            continue
        low, high = r["vs_peer_range"]
        layout = r["for_layout"] if r["system"] == "hybrid3d" else f"{r['for_layout']} (peer at {r['layout']})"
        lines.append(f"| {r['precision']} | {layout} | {r['system']} | {r['wrapper']} | {r['tokens_per_s']:.0f} | "
                     f"{r['vs_peer']:.2f} ({low:.2f}-{high:.2f}) | {r['vs_plain']:.2f} | {r['states_mib']:.2f} | "
                     f"{r['rss_mib']:.0f} | {r['last_loss']:.4f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats x 3 timed steps")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3),
                        help="ZeRO stage of every system; 2 and 3 at the layouts without a pipeline only")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--partition-method", default="type:DecoderBlock", choices=["type:DecoderBlock", "cost"],
                        help="hybrid3d.partition_method of the pipeline layouts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 2
    piped = [layout for layout in args.layouts if LAYOUTS[layout][2] > 1]
    if args.zero >= 2 and piped:
        parser.error(f"--zero {args.zero} runs without a pipeline: leave out {', '.join(piped)}")
    command = command_line("vs_peers.py", argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    results_by_world = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model_dir = os.path.join(tmp, "model")
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(model_dir)
        for world in sorted({LAYOUTS[layout][0] for layout in args.layouts}):
            runs = world_runs(world, args)
            results_by_world[world] = run_world(world_main, world, os.path.join(tmp, f"ranks{world}"), runs, args,
                                                model_dir)
        plain = {p: plain_pytorch(args, model_dir, p, args.steps * args.repeats) for p in args.precisions}
    all_rows = rows(results_by_world, plain, args)
    env = environment()
    text = table(all_rows)
    out_dir = results_dir(args.out)
    os.makedirs(out_dir, exist_ok=True)
    name = "vs_peers" if args.zero <= 1 else f"vs_peers_zero{args.zero}"  # ZeRO-0/1 are the default table
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join([
            "# hybrid3d vs peers", "", environment_markdown(env, command), "",
            f"Model: {MODEL}; ZeRO-{args.zero}, global batch {args.global_batch} x {args.seq_length} tokens, "
            f"micro-batch {args.micro_batch}; hybrid3d.partition_method {args.partition_method!r} at the pipeline "
            f"layouts; {args.steps} timed steps x {args.repeats} interleaved repeats. "
            "'vs peer' is the peer's step time over hybrid3d's (> 1: hybrid3d is faster); the PP layouts' "
            "peer is HF + ZeRO over the same ranks as pure DP. 'vs plain PyTorch' is tokens/s over one "
            "process's on the same cores.", "", text, ""]))
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"rows": all_rows, "environment": env, "command": command}, f, indent=1)
    print(text)
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
