"""One mixture-of-experts layer's experts, forward + backward, hybrid3d's kernels against transformers' own.

A Qwen3-30B-A3B-shaped layer (E 128 experts, top-8, h 2048, moe_intermediate 768) and a smaller one (E 16, top-4),
fp32 on this CPU's threads, the same weights, tokens and routing for every implementation:
- hybrid3d `moe.Experts` with `expert_kernel` "grouped_mm" (model/expert_kernels.py) and "loop";
- transformers' `Qwen3MoeExperts` with `config._experts_implementation` "eager", "grouped_mm" and "batched_mm".
Each round runs every implementation once, in turn (the ratios come from the same minutes of the machine); a row's
time is the median over the rounds, after one warm-up each. batched_mm gathers one copy of an expert's weights per
assignment (n·k·3·h·f elements), so it runs only where that fits `--batched-mm-gb`; the table says where it did not.
Every implementation's output is checked against eager's before timing.

    python benchmarks/expert_kernels.py --tokens 32,512 --repeats 5
"""

import argparse
import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from common import environment_markdown, int_list, median, start_results  # noqa: E402

import torch  # noqa: E402

LAYERS = {"E128-k8": (128, 8, 2048, 768), "E16-k4": (16, 4, 2048, 768)}  # E, k, h, f
OURS = ("hybrid3d grouped_mm", "hybrid3d loop")
THEIRS = ("transformers eager", "transformers grouped_mm", "transformers batched_mm")


def build(num_experts: int, k: int, h: int, f: int):
    """(transformers' experts, hybrid3d's experts with the same weights, the LlamaShape)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hybrid3d.model import LlamaShape
    from hybrid3d.model.moe import Experts
    from hybrid3d.parallel.rank_groups import TensorParallelGroup

    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=f, num_experts=num_experts, num_experts_per_tok=k)
    theirs = Qwen3MoeExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.gate_up_proj.normal_(0, 0.02, generator=generator)
        theirs.down_proj.normal_(0, 0.02, generator=generator)
    shape = LlamaShape(vocab_size=256, hidden_size=h, intermediate_size=f, num_layers=1, num_heads=16, num_kv_heads=4,
                       head_dim=h // 16, num_experts=num_experts, experts_per_token=k, moe_intermediate_size=f,
                       model_type="qwen3_moe", qk_norm=True)
    ours = Experts(shape, TensorParallelGroup.single())
    with torch.no_grad():
        for e, expert in ours.named_children():
            gate, up = theirs.gate_up_proj[int(e)].chunk(2, dim=0)
            expert.gate_proj.weight.copy_(gate)
            expert.up_proj.weight.copy_(up)
            expert.down_proj.weight.copy_(theirs.down_proj[int(e)])
    return theirs, ours


def routing(n: int, num_experts: int, k: int, h: int):
    """Tokens (n, h), top-k indices and renormalised weights from a random router, and an output gradient."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, generator=generator)
    probs = torch.randn(n, num_experts, generator=generator).softmax(-1)
    weights, indices = probs.topk(k, dim=-1)
    return x, weights / weights.sum(-1, keepdim=True), indices, torch.randn(n, h, generator=generator)


def runner(name: str, theirs, ours):
    """fn(x, weights, indices) -> output for implementation `name`."""
    if name.startswith("hybrid3d"):
        ours.requested_kernel = name.split()[1]
        return lambda x, w, i: ours(x, w, i)
    theirs.config._experts_implementation = name.split()[1]
    return lambda x, w, i: theirs(x, i, w)


def step(fn, module, x, weights, indices, grad) -> tuple[float, torch.Tensor]:
    """Seconds of one forward + backward, and the output."""
    for p in module.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    start = time.perf_counter()
    out = fn(x, weights, indices)
    out.backward(grad)
    seconds = time.perf_counter() - start
    return seconds, out.detach()


def measure_layer(label: str, n: int, repeats: int, batched_gb: float) -> dict:
    num_experts, k, h, f = LAYERS[label]
    theirs, ours = build(num_experts, k, h, f)
    x, weights, indices, grad = routing(n, num_experts, k, h)
    gathered_gb = n * k * 3 * h * f * 4 * 2 / 1e9  # batched_mm's per-assignment weights and their gradients
    names = [*OURS, *(t for t in THEIRS if t != "transformers batched_mm" or gathered_gb <= batched_gb)]
    fns = {name: runner(name, theirs, ours) for name in names}
    modules = {name: ours if name.startswith("hybrid3d") else theirs for name in names}
    reference = None
    errors = {}
    for name in names:  # warm-up, and every output against eager's
        runner(name, theirs, ours)
        _, out = step(fns[name], modules[name], x, weights, indices, grad)
        if name == "transformers eager":
            reference = out
        errors[name] = out
    errors = {name: float((out - reference).abs().max()) for name, out in errors.items()}
    times = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            runner(name, theirs, ours)
            seconds, _ = step(fns[name], modules[name], x, weights, indices, grad)
            times[name].append(seconds)
    del theirs, ours
    gc.collect()
    result = {"layer": label, "tokens": n, "experts": num_experts, "top_k": k, "hidden": h, "moe_intermediate": f,
              "seconds": {name: median(t) for name, t in times.items()}, "all_seconds": times,
              "max_abs_vs_eager": errors, "batched_mm_gb": gathered_gb,
              "batched_mm_skipped": "transformers batched_mm" not in names}
    best_theirs = min(result["seconds"][t] for t in THEIRS[1:] if t in names)
    result["grouped_vs_eager"] = result["seconds"]["transformers eager"] / result["seconds"]["hybrid3d grouped_mm"]
    result["grouped_vs_best_fused"] = best_theirs / result["seconds"]["hybrid3d grouped_mm"]
    return result


def markdown(results: list, env: dict, command: str) -> str:
    lines = ["# Experts of one MoE layer: hybrid3d's kernels against transformers' (forward + backward, fp32)", "",
             environment_markdown(env, command), f"- threads: {torch.get_num_threads()}", "",
             "| layer | tokens | implementation | median s | tokens/s | max abs vs eager |",
             "|---|---:|---|---:|---:|---:|"]
    for r in results:
        for name, seconds in r["seconds"].items():
            lines.append(f"| {r['layer']} | {r['tokens']} | {name} | {seconds:.4f} | {r['tokens'] / seconds:,.0f} | "
                         f"{r['max_abs_vs_eager'][name]:.1e} |")
        if r["batched_mm_skipped"]:
            lines.append(f"| {r['layer']} | {r['tokens']} | transformers batched_mm | not run: its per-assignment "
                         f"weights and gradients need {r['batched_mm_gb']:.0f} GB | | |")
    lines += ["", "| layer | tokens | hybrid3d grouped vs eager | vs transformers' best of grouped_mm/batched_mm |",
              "|---|---:|---:|---:|"]
    lines += [f"| {r['layer']} | {r['tokens']} | {r['grouped_vs_eager']:.2f}x | {r['grouped_vs_best_fused']:.2f}x |"
              for r in results]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int_list, default=[32, 512], help="tokens per layer call (comma-separated)")
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {', '.join(LAYERS)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batched-mm-gb", type=float, default=8.0,
                        help="run transformers' batched_mm only where its gathered weights fit this")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    command, out_dir, env = start_results("expert_kernels.py", argv, args.out)
    torch.manual_seed(0)
    results = [measure_layer(label, n, args.repeats, args.batched_mm_gb)
               for label in args.layers.split(",") for n in args.tokens]
    text = markdown(results, env, command)
    print(text)
    with open(os.path.join(out_dir, "expert_kernels.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "expert_kernels.json"), "w") as f:
        json.dump({"env": env, "command": command, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
