"""What an asynchronous save holds the step for, and what its background write costs the training thread: the host
copy of checkpoint/host_copy.py against serialising the files into memory (`torch.save` to a BytesIO, how
checkpoint/async_save.py copied before), side by side on the same states in one process.

The states are a ZeRO-1 rank's in small: a module state dict of fp32 weights (a quarter of the bytes) and three
flat fp32 partitions (master, Adam's two moments). Per repeat, both ways in turn (interleaved):
- hold: the copy the step waits for (the host copy reuses its buffers from the first save, as a run does; the first
  save's, which allocates them, is reported apart);
- write: the background thread's work, each way as the writer did it (the serialised bytes written to a file; the
  host copy `torch.save`d to the file), fsync included;
- the training thread meanwhile: small matrix products in a loop, what the loop achieves during the write over what
  it achieves alone (1.0: the write costs the training thread nothing; Python's lock and the cores are shared).

    python benchmarks/host_copy.py --mib 283 --repeats 5     # a SmolLM2-135M TP3 x PP2 rank's save
"""

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import OrderedDict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]
from common import environment_markdown, start_results  # noqa: E402
from hybrid3d.checkpoint.host_copy import HostBuffers, Snapshot  # noqa: E402
from hybrid3d.ds_internals.durable_save import fsync_file  # noqa: E402


def rank_states(mib: int) -> dict:
    numel = mib * 2**20 // 4 // 4  # elements of each of the four fp32 parts
    width = 576  # SmolLM2-135M's hidden size
    rows = max(1, numel // width // 30)
    module = OrderedDict((f"{i}.weight", torch.randn(rows, width)) for i in range(30))
    partitions = {key: torch.randn(numel) for key in ("fp32_master", "exp_avg", "exp_avg_sq")}
    return {"module": module, "optimizer": partitions, "global_steps": 100}


def training_rate(stop: threading.Event) -> float:
    """Small matrix products a second until `stop` (the training thread's stand-in: Python and small kernels)."""
    a = torch.randn(64, 64)
    count, started = 0, time.perf_counter()
    while not stop.is_set():
        a = torch.mm(a, a).clamp_(-1, 1)
        count += 1
    return count / (time.perf_counter() - started)


def alone_rate(seconds: float) -> float:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    return training_rate(stop)


def while_writing(write) -> tuple[float, float]:
    """(the write's seconds, the training loop's rate meanwhile), the write on a thread of its own."""
    stop, took = threading.Event(), []

    def run():
        started = time.perf_counter()
        write()
        took.append(time.perf_counter() - started)
        stop.set()

    thread = threading.Thread(target=run)
    thread.start()
    rate = training_rate(stop)
    thread.join()
    return took[0], rate


def one_repeat(states: dict, buffers: HostBuffers, folder: str) -> dict:
    out = {}
    path = os.path.join(folder, "mp_rank_00_model_states.pt")
    started = time.perf_counter()
    data = io.BytesIO()
    torch.save(states, data)
    data = data.getbuffer()
    out["serialise_hold_s"] = time.perf_counter() - started

    def write_bytes():
        with open(path, "wb") as f:
            f.write(data)
        fsync_file(path)
    out["serialise_write_s"], out["serialise_rate"] = while_writing(write_bytes)
    os.remove(path)

    started = time.perf_counter()
    snapshot = Snapshot(buffers)
    snapshot.add(path, states)
    snapshot.wait_for_copies()
    out["copy_hold_s"] = time.perf_counter() - started
    [(copied, zipfile)] = snapshot.files.values()

    def write_copy():
        torch.save(copied, path, _use_new_zipfile_serialization=zipfile)
        fsync_file(path)
    out["copy_write_s"], out["copy_rate"] = while_writing(write_copy)
    os.remove(path)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=283, help="the rank's states in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    command, out_dir, env = start_results("host_copy.py", argv, args.out)
    torch.manual_seed(0)
    states = rank_states(args.mib)
    buffers = HostBuffers()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as folder:
        started = time.perf_counter()
        Snapshot(buffers).add(os.path.join(folder, "mp_rank_00_model_states.pt"), states)
        first_copy = time.perf_counter() - started
        runs = []
        for repeat in range(args.repeats):
            alone = alone_rate(1.0)
            run = one_repeat(states, buffers, folder)
            run.update(serialise_rate=run["serialise_rate"] / alone, copy_rate=run["copy_rate"] / alone)
            runs.append(run)
            print(f"[repeat {repeat + 1}] " + ", ".join(f"{k} {v:.3f}" for k, v in run.items()), flush=True)
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    nbytes = sum(t.numel() * 4 for t in states["module"].values()) + sum(
        t.numel() * 4 for t in states["optimizer"].values())
    lines = ["# The asynchronous save's hold: host copy against serialising into memory", "",
             environment_markdown(env, command), "",
             f"States: {nbytes / 2**20:.0f} MiB (a module state dict and three flat fp32 partitions); medians of "
             f"{args.repeats} interleaved repeats; the first host copy (allocating its buffers): {first_copy:.3f} s.",
             "", "| copy | hold s | background write s | training loop during the write / alone |", "|---|---|---|---|",
             f"| serialise into memory (before) | {median['serialise_hold_s']:.3f} | {median['serialise_write_s']:.3f}"
             f" | {median['serialise_rate']:.2f} |",
             f"| host copy (checkpoint/host_copy.py) | {median['copy_hold_s']:.3f} | {median['copy_write_s']:.3f} | "
             f"{median['copy_rate']:.2f} |",
             "", f"Hold, serialise over host copy: {median['serialise_hold_s'] / median['copy_hold_s']:.1f}x.", ""]
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "host_copy.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "host_copy.json"), "w") as f:
        json.dump({"command": command, "environment": env, "first_copy_s": first_copy, "runs": runs,
                   "median": median}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
