"""Which SDPA kernel hybrid3d's attention reaches, per mask case, with its time and memory.

`CoreAttention` (model/attention.py) at one shape, forward and backward, for each case:

- causal: no mask, `is_causal` with `enable_gqa` (flash on the kv heads as they are);
- documents: packed documents (`positions` restarting at 0), an additive (b, 1, s, s) mask shared by the layers;
- window: a sliding window shorter than the sequence, an additive (s, s) mask;
- documents, as before: the boolean mask passed with `enable_gqa` (what hybrid3d did before repeating kv heads),
  to show what the math kernel costs.

Per case: the aten attention ops and (on a GPU) the device kernels the profiler saw, the median forward+backward
time over the repeats, and the peak memory above what was allocated before (CUDA's allocator; none on CPU).

    python benchmarks/attention_probe.py               # on a GPU: Llama-3.2-1B's attention, s 4096, bf16
    python benchmarks/attention_probe.py --smoke       # the same code on the CPU, tiny shape, fp32
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import environment, environment_markdown, median, results_dir  # noqa: E402

# Llama-3.2-1B's attention: 32 query heads, 8 kv heads, head_dim 64
SHAPES = {"1b": dict(heads=32, kv=8, head_dim=64, seq=4096, batch=1, documents=4, window=1024),
          "smoke": dict(heads=4, kv=2, head_dim=16, seq=128, batch=1, documents=4, window=32)}
CASES = ("causal", "documents", "window", "documents, enable_gqa (before)")
KERNEL_WORDS = ("attention", "fmha", "flash", "softmax", "cutlass")


def core_attention(shape: dict, window):
    from hybrid3d.model import LlamaShape
    from hybrid3d.model.attention import CoreAttention

    return CoreAttention(LlamaShape(vocab_size=128, hidden_size=shape["heads"] * shape["head_dim"],
                                    intermediate_size=128, num_layers=1, num_heads=shape["heads"],
                                    num_kv_heads=shape["kv"], head_dim=shape["head_dim"], sliding_window=window))


def document_positions(shape: dict, device) -> torch.Tensor:
    """(b, s) positions of `documents` equal documents per row."""
    length = shape["seq"] // shape["documents"]
    return torch.arange(shape["seq"], device=device).remainder(length).expand(shape["batch"], -1).contiguous()


def case_fn(case: str, shape: dict, q, k, v, device):
    """A closure running one forward + backward of the case."""
    positions = document_positions(shape, device) if case.startswith("documents") else None
    if case == "documents, enable_gqa (before)":
        from hybrid3d.model.masks import document_causal_mask

        mask = document_causal_mask(positions)  # (b, 1, s, s) bool

        def before():
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, enable_gqa=True)
            out.float().sum().backward()
        return before
    attention = core_attention(shape, shape["window"] if case == "window" else None).to(device)

    def run():
        attention(q, k, v, positions=positions).float().sum().backward()
    return run


def probe_case(case: str, shape: dict, dtype, device, repeats: int) -> dict:
    b, s, d = shape["batch"], shape["seq"], shape["head_dim"]
    generator = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, device=device, dtype=dtype, generator=generator).requires_grad_()
               for n in (shape["heads"], shape["kv"], shape["kv"]))  # (b, s, heads or kv, d)
    run = case_fn(case, shape, q, k, v, device)
    cuda = device.type == "cuda"
    run()  # warm-up (kernel selection, caches)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as profile:
        run()
        if cuda:
            torch.cuda.synchronize()
    names = sorted({event.key for event in profile.key_averages()
                    if any(word in event.key.lower() for word in KERNEL_WORDS)})
    times = []
    for _ in range(repeats):
        for tensor in (q, k, v):
            tensor.grad = None
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"case": case, "ops": [n for n in names if n.startswith("aten::")],
            "kernels": [n for n in names if "::" not in n and "Backward" not in n], "ms": 1e3 * median(times),
            "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None}


def markdown(rows: list, shape: dict, env: dict, command: str, dtype) -> str:
    lines = ["# SDPA kernels of hybrid3d's attention per mask case", "", environment_markdown(env, command),
             f"- shape: b {shape['batch']}, s {shape['seq']}, {shape['heads']} heads, {shape['kv']} kv heads, "
             f"head_dim {shape['head_dim']}, {dtype}; documents: {shape['documents']} per row; window "
             f"{shape['window']}; forward + backward, median of the repeats", "",
             "| case | aten attention ops | device kernels | ms | peak MiB |", "|---|---|---|---:|---:|"]
    for row in rows:
        peak = "" if row["peak_mib"] is None else f"{row['peak_mib']:.0f}"
        lines.append(f"| {row['case']} | {'<br>'.join(row['ops'])} | {'<br>'.join(row['kernels'][:4])} | "
                     f"{row['ms']:.2f} | {peak} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape, fp32, on the CPU (checks the code)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("error: benchmarks/attention_probe.py needs a CUDA device (use --smoke to check it on the CPU)")
    shape = SHAPES["smoke" if args.smoke else "1b"]
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows = []
    for case in CASES:
        rows.append(probe_case(case, shape, dtype, device, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    env = environment()
    command = "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:])
    out = args.out if args.smoke else results_dir(args.out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "attention_probe.md"), "w") as f:
        f.write(markdown(rows, shape, env, command, dtype))
    with open(os.path.join(out, "attention_probe.json"), "w") as f:
        json.dump({"environment": env, "shape": shape, "rows": rows}, f, indent=1)
    print(f"written: {out}/attention_probe.md")


if __name__ == "__main__":
    main()
