"""Helpers shared by the benchmarks: a spawned gloo world, peak-RSS windows, collective accounting from
DeepSpeed's comms logger, and the machine/version block of a write-up."""

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from hybrid3d.ds_internals.comms_callers import CALLER_CLASSES, TRAFFIC_CLASSES, op_and_caller  # noqa: F401
from hybrid3d.parallel.spawn import run_world  # noqa: F401  (the benchmarks' spawned worlds)


def classify_comms(comms_dict: dict) -> tuple[dict, dict]:
    """Bytes per traffic class and per caller from `deepspeed.comm.comms_logger.comms_dict`
    ({record name: {message bytes: [count, latencies, ...]}})."""
    by_class = dict.fromkeys(TRAFFIC_CLASSES, 0)
    by_caller = {}
    for record, sizes in comms_dict.items():
        caller = op_and_caller(record)[1]
        total = sum(int(size) * entry[0] for size, entry in sizes.items())
        by_class[CALLER_CLASSES.get(caller, "other")] += total
        by_caller[caller] = by_caller.get(caller, 0) + total
    return by_class, by_caller


def require_matplotlib(parser) -> None:
    """Exit 2 with one line before any measurement when the charts cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.exit(2, "error: this benchmark draws charts with matplotlib: pip install -e '.[bench]'\n")


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark of this process (Linux clear_refs 5); returns the RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


def peak_rss() -> int:
    """Peak RSS in bytes since the last `reset_peak_rss`."""
    return _status_kb("VmHWM") * 1024


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def random_batches(vocab_size: int, micro_batch: int, seq: int, seed: int):
    """Endless (ids, targets) micro-batches of uniform random tokens. Seed by DP rank: the TP ranks
    and the first and last pipeline stages of one replica must read the same stream."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab_size, (micro_batch, seq + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def measure_second_step(trainer, data, probe) -> dict:
    """Step 1 warms up (it creates Adam's moments); step 2 runs with the memory probe and the comms
    logger on. Returns the comms logger's records of step 2; the logger is off afterwards, so timed
    steps carry no per-collective synchronisation."""
    from deepspeed.comm import comms_logger

    trainer.train_step(data)
    probe.enabled = True
    comms_logger.comms_dict.clear()
    comms_logger.prof_all = True
    trainer.train_step(data)
    comms_logger.prof_all = False
    comms_logger.enabled = False
    probe.enabled = False
    return comms_logger.comms_dict


def timed(fn, barrier) -> float:
    """Seconds `fn()` takes between two barriers (every rank calls it)."""
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def round_robin(measure, runs: list, repeats: int, maxed: tuple = ()) -> dict:
    """{run name: measure(run)} over `repeats` rounds of every run in turn (the configurations' ratios then come from
    the same minutes of the machine), each result's `step_times` concatenated over the rounds and its `maxed` keys
    kept at their largest; every other key as the first round measured it."""
    out = {}
    for _ in range(repeats):
        for run in runs:
            result = measure(run)
            kept = out.setdefault(run["name"], {**result, "step_times": []})
            kept["step_times"] += result["step_times"]
            for key in maxed:
                kept[key] = max(kept[key], result[key])
    return out


def median(values):
    return statistics.median(values) if values else float("nan")


def machine_name() -> str:
    return platform.node().split(".")[0] or "machine"


def results_dir(root: str) -> str:
    return os.path.join(root, f"{datetime.date.today().isoformat()}-{machine_name()}")


def command_line(script: str, argv=None) -> str:
    """How a benchmark was run, for its results: `python benchmarks/<script> <arguments>` (`argv`, or the
    process's own)."""
    return " ".join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


def start_results(script: str, argv, out_root: str) -> tuple[str, str, dict]:
    """(`command_line`, the results folder under `out_root` (created), `environment()`), the environment read now,
    before the measurements start: the commit and tree they ran on."""
    out_dir = results_dir(out_root)
    os.makedirs(out_dir, exist_ok=True)
    return command_line(script, argv), out_dir, environment()


def int_list(text: str) -> list[int]:
    """argparse type of a comma-separated list of integers: "2,4" -> [2, 4]."""
    return [int(x) for x in text.split(",") if x]


def bf16_zero1_config(micro_batch: int, gas: int, hybrid: dict) -> dict:
    """A DeepSpeed JSON of bf16 weights with fp32 masters and gradient accumulation (ZeRO-1, torch's AdamW), the
    precision the activation and memory models count, with the "hybrid3d" section `hybrid`."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "hybrid3d": hybrid,
    }


def environment() -> dict:
    """Hardware, versions and commit for a write-up."""
    import deepspeed
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {
        "machine": machine_name(), "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu,
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "commit": git("rev-parse", "--short", "HEAD"),
        # results written by an earlier benchmark of the same session do not make the code dirty
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")),
    }


def environment_markdown(env: dict, command: str) -> str:
    return "\n".join([
        f"- machine: {env['machine']}, {env['cpu']}, {env['cores']} cores, {env['memory_gb']} GiB RAM, "
        f"GPU: {env['gpu']}",
        f"- versions: Python {env['python']}, torch {env['torch']}, deepspeed {env['deepspeed']}, "
        f"transformers {env['transformers']}",
        f"- commit: {env['commit']}{' (with uncommitted changes)' if env['dirty'] else ''}",
        f"- command: `{command}`",
    ])


def build_trainer_from_json(raw: dict, shape, hf_state_dict=None):
    """A trainer from a DeepSpeed JSON with its "hybrid3d" section, validated once for this world."""
    import deepspeed.comm as dist

    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run

    return build_trainer(validate_run(raw, dist.get_world_size(), shape), hf_state_dict=hf_state_dict)
