"""Peak memory and time of `python -m hybrid3d.convert` against the model size.

    python benchmarks/convert_memory.py --preset small --workdir /tmp/convert-bench

Writes a random-weight HF Llama of the preset's shape (tensor by tensor, 100 MB shards), then
runs hf2hybrid at TP2xPP2 and TP2xPP1 and hybrid2hf back from each, every one in its own
process. That process imports the converter (torch, deepspeed, transformers: a few hundred MB
whose import-time peak would hide the conversion's), resets the kernel's peak-RSS counter
(`/proc/self/clear_refs`, Linux), runs the CLI and reports VmHWM: the peak during conversion,
shown against RSS after the imports. Prints a Markdown table.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from hybrid3d.convert.model_layout import hf_parameter_shapes
from hybrid3d.convert.safetensors_stream import ShardedSafetensorsWriter

PRESETS = {
    # ~490 MB in fp32: eight 45 MB decoder layers, a 65 MB embedding and LM head.
    "small": dict(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4),
    # TinyLlama-1.1B's shape: 4.4 GB in fp32.
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4),
}
MB = 2**20


def write_random_llama(directory: Path, preset: str) -> dict:
    """A random HF Llama written without holding it: one tensor at a time into 100 MB shards."""
    config = LlamaConfig(**PRESETS[preset], max_position_embeddings=2048, dtype=torch.float32)
    shapes = hf_parameter_shapes(config)
    directory.mkdir(parents=True)
    writer = ShardedSafetensorsWriter(directory, [(n, torch.float32, s) for n, s in shapes.items()], 100 * 10**6)
    generator = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        tensor = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.02
        writer.write(name, tensor)
    writer.close()
    config.save_pretrained(directory)
    sizes = [s.numel() * 4 for s in shapes.values()]
    layer = sum(s.numel() * 4 for n, s in shapes.items() if n.startswith("model.layers.0."))
    return {"model": sum(sizes), "largest": max(sizes), "layer": layer}


# Runs in the child: imports first, then the peak-RSS counter is reset and the CLI runs.
MEASURE = """
import json, re, sys, time
import hybrid3d.convert.hf_to_hybrid, hybrid3d.convert.hybrid_to_hf
from hybrid3d.convert.__main__ import main
def mib(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
open("/proc/self/clear_refs", "w").write("5")
before, start = mib("VmRSS"), time.perf_counter()
code = main(sys.argv[1:])
print("MEASURED " + json.dumps({"code": code, "before": before, "peak": mib("VmHWM"),
                                "seconds": time.perf_counter() - start}))
"""


def measure(cli_args: list) -> dict:
    """{'before': RSS after imports, 'peak': peak RSS while converting (MiB), 'seconds'}."""
    proc = subprocess.run([sys.executable, "-c", MEASURE] + cli_args, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MEASURED ")]
    if proc.returncode != 0 or not lines or json.loads(lines[0][9:])["code"] != 0:
        raise SystemExit(f"failed: {' '.join(cli_args)}\n{proc.stderr}")
    return json.loads(lines[0][9:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--workdir", required=True, help="scratch folder (emptied first)")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    sizes = write_random_llama(work / "hf", args.preset)
    hf, pp2, pp1 = str(work / "hf"), str(work / "pp2"), str(work / "pp1")
    runs = [
        ("hf2hybrid --tp 2 --pp 2", ["hf2hybrid", "--hf-model", hf, "--out", pp2, "--tp", "2", "--pp", "2"]),
        ("hf2hybrid --tp 2 --pp 1", ["hf2hybrid", "--hf-model", hf, "--out", pp1, "--tp", "2", "--pp", "1"]),
        ("hybrid2hf (from tp2 pp2)", ["hybrid2hf", "--checkpoint", pp2, "--out", str(work / "hf-from-pp2")]),
        ("hybrid2hf (from tp2 pp1)", ["hybrid2hf", "--checkpoint", pp1, "--out", str(work / "hf-from-pp1")]),
    ]
    print(f"preset {args.preset}: model {sizes['model'] / MB:.0f} MiB fp32, largest tensor "
          f"{sizes['largest'] / MB:.1f} MiB, one decoder layer {sizes['layer'] / MB:.1f} MiB\n")
    print("| command | RSS after imports (MiB) | peak RSS converting (MiB) | peak - imports (MiB) | "
          "/ largest tensor | / model | seconds |")
    print("|---|---|---|---|---|---|---|")
    for label, cli_args in runs:
        m = measure(cli_args)
        extra = m["peak"] - m["before"]
        print(f"| {label} | {m['before']:.0f} | {m['peak']:.0f} | {extra:.0f} | {extra * MB / sizes['largest']:.2f} | "
              f"{extra * MB / sizes['model']:.2f} | {m['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
