"""Tokens/s and peak memory of `python -m hybrid3d.data.preprocess` against the `datasets.map` tokenization of the
training path, on one synthetic corpus.

    python benchmarks/preprocess.py --workdir /tmp/preprocess-bench --corpus-mb 2000 [--workers 1,2] [--tokenizer DIR]

Writes a JSON-lines corpus of `--corpus-mb` MB (random words, one document per line, streamed to disk), then runs,
each in a process of its own: the preprocessor with each `--workers` count, and the training path's tokenization
(`datasets.load_dataset("json")` + `hybrid3d.data.formats.encode_rows`, what `data.path` does at a first launch;
its Arrow cache goes to the work folder). Each process imports first, then resets the kernel's peak-RSS counter
(`/proc/self/clear_refs`, Linux) and reports its VmHWM, and the largest peak of its worker processes. The
preprocessor should stay flat as the corpus grows (memory independent of the corpus): run it with a corpus at least
10 times the peak it reports. Prints a Markdown table and writes it with the machine and versions to
benchmarks/results/<date>-<machine>/preprocess.md.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from common import environment_markdown, int_list, start_results

MB = 10**6

# Runs in the child: imports, then the peak-RSS reset, then the work; prints one MEASURED line.
PREPROCESS = """
import json, re, resource, sys, time
import transformers, hybrid3d.data.preprocess
from hybrid3d.data.preprocess import preprocess
def mib(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
open("/proc/self/clear_refs", "w").write("5")
before, start = mib("VmRSS"), time.perf_counter()
written = preprocess([sys.argv[1]], sys.argv[2], sys.argv[3] or None, append_eos=True, workers=int(sys.argv[4]),
                     progress=False)
print("MEASURED " + json.dumps({"tokens": written.tokens, "seconds": time.perf_counter() - start, "before": before,
                                "peak": mib("VmHWM"),
                                "workers_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""

DATASETS_MAP = """
import json, re, resource, sys, time
import datasets, transformers
from hybrid3d.data.formats import encode_rows
from hybrid3d.data.preprocess import load_tokenizer
def mib(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
tokenizer = load_tokenizer(sys.argv[3] or None, None)
open("/proc/self/clear_refs", "w").write("5")
before, start = mib("VmRSS"), time.perf_counter()
documents = datasets.load_dataset("json", data_files=[sys.argv[1]], split="train", cache_dir=sys.argv[2])
encoded = encode_rows(documents, "text", "text", tokenizer, tokenizer.eos_token_id, "corpus")
tokens = sum(len(ids) + 1 for ids in encoded.with_format("numpy")["input_ids"])  # + the EOS joining them
print("MEASURED " + json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start, "before": before,
                                "peak": mib("VmHWM"),
                                "workers_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """JSON lines of random words until `megabytes` MB are written; returns the bytes."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    written = 0
    with open(path, "w") as f:
        while written < megabytes * MB:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 400)))}) + "\n"
            f.write(line)
            written += len(line)
    return written


def measure(script: str, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MEASURED ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"failed: {args}\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][len("MEASURED "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="scratch folder (emptied first)")
    parser.add_argument("--corpus-mb", type=float, default=2000.0, help="corpus size in MB (default 2000)")
    parser.add_argument("--workers", type=int_list, default=[1, 2], help="worker counts to run (default 1,2)")
    parser.add_argument("--tokenizer", default="", help="HF tokenizer folder (default: the built-in one)")
    parser.add_argument("--skip-datasets", action="store_true", help="do not run the datasets.map path")
    parser.add_argument("--out-root", default="benchmarks/results")
    args = parser.parse_args()
    command, out_dir, env = start_results("preprocess.py", None, args.out_root)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = work / "corpus.jsonl"
    size = write_corpus(corpus, args.corpus_mb)
    runs = [(f"preprocess --workers {n}", PREPROCESS, [str(corpus), str(work / f"out{n}"), args.tokenizer, str(n)])
            for n in args.workers]
    if not args.skip_datasets:
        runs.append(("datasets.map (the data.path cache)", DATASETS_MAP, [str(corpus), str(work / "hf"),
                                                                          args.tokenizer]))
    rows = ["| path | tokens | seconds | tokens/s | RSS after imports (MiB) | peak RSS (MiB) | worker peak (MiB) | "
            "corpus / peak |", "|---|---|---|---|---|---|---|---|"]
    print(f"corpus: {size / MB:,.0f} MB of JSON lines\n\n" + "\n".join(rows), flush=True)
    for label, script, script_args in runs:
        m = measure(script, script_args)
        peak = max(m["peak"], m["workers_peak"])
        rows.append(f"| {label} | {m['tokens']:,} | {m['seconds']:.1f} | {m['tokens'] / m['seconds']:,.0f} | "
                    f"{m['before']:.0f} | {m['peak']:.0f} | {m['workers_peak']:.0f} | "
                    f"{size / (peak * 2**20):.1f}x |")
        print(rows[-1], flush=True)
    report = Path(out_dir) / "preprocess.md"
    report.write_text(f"# Preprocessing: tokens/s and peak memory\n\n{environment_markdown(env, command)}\n"
                      f"- corpus: {size / MB:,.0f} MB of JSON lines (random words)\n\n" + "\n".join(rows) + "\n")
    print(f"\nwrote {report}")


if __name__ == "__main__":
    main()
