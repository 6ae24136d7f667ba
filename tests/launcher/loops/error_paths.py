"""Run each error path of the training job N times and count exits that are not the documented one.

Not part of the suite (minutes per path): `python -m tests.launcher.loops.error_paths --runs 20`. Each run
launches a 2-rank job with the real `deepspeed` launcher and checks its exit code (docs/reliability.md)
and that no rank aborted ("terminate called", a negative or 128+ exit status).
"""

import argparse
import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from tests.launcher.harness import deepspeed_command, demo_config, launch_env
from tests.launcher.harness import fault_env, rank_process, wait_for

TWO_RANKS = ("--tensor_parallel_size", "2", "--pipeline_parallel_size", "1")


def _config(tmp: Path, **train) -> Path:
    config = demo_config(tmp)
    raw = json.loads(config.read_text())
    raw["hybrid3d"]["train"].update(train)
    config.write_text(json.dumps(raw))
    return config


def _run(cmd, tmp, env=None, timeout=300):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env or launch_env(), timeout=timeout)


def user_error_before_start(tmp):
    config = _config(tmp, stepz=3)
    return 2, _run(deepspeed_command(2, config, *TWO_RANKS), tmp)


def user_error_after_start(tmp):
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    config = _config(tmp, eval_interval=0)
    return 2, _run(deepspeed_command(2, config, *TWO_RANKS, "--data.path", str(empty), "--data.eval_fraction", "0"), tmp)


def nonfinite_stop(tmp):
    config = _config(tmp, on_nonfinite="stop", eval_interval=0)
    return 1, _run(deepspeed_command(2, config, *TWO_RANKS), tmp, env=fault_env({"kind": "nan_loss", "call": 3}))


def _interrupt(tmp, action, timeout_seconds=600):
    config = _config(tmp, timeout_seconds=timeout_seconds, eval_interval=0)
    proc = subprocess.Popen(deepspeed_command(2, config, *TWO_RANKS), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp, env=launch_env())
    metrics = tmp / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1, proc)
    victim = rank_process(proc, 1)
    action(victim)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if victim.is_running():
            victim.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def sigterm(tmp):
    return 0, _interrupt(tmp, lambda p: p.send_signal(signal.SIGTERM))


def hang_timeout(tmp):
    return 3, _interrupt(tmp, psutil.Process.suspend, timeout_seconds=10)


PATHS = [user_error_before_start, user_error_after_start, nonfinite_stop, sigterm, hang_timeout]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--paths", nargs="*", default=[p.__name__ for p in PATHS])
    args = parser.parse_args()
    for path in [p for p in PATHS if p.__name__ in args.paths]:
        counts = {"expected": 0, "other exit": 0, "abort": 0}
        codes = []
        started = time.time()
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                expected, result = path(Path(tmp))
            output = result.stdout + result.stderr
            codes.append(result.returncode)
            if "terminate called" in output or result.returncode < 0 or result.returncode >= 128:
                counts["abort"] += 1
                print(f"  abort: rc {result.returncode}: {output[-600:]}", flush=True)
            elif result.returncode == expected:
                counts["expected"] += 1
            else:
                counts["other exit"] += 1
                print(f"  rc {result.returncode} (expected {expected}): {output[-600:]}", flush=True)
        print(f"{path.__name__}: {args.runs} runs in {time.time() - started:.0f} s, exit codes "
              f"{sorted(set(codes))}: {counts}", flush=True)


if __name__ == "__main__":
    main()
