"""Chaos run: train a tiny model while a random rank is killed (SIGKILL) at random times, resuming from `latest`
after each kill, and check that the final weights equal an uninterrupted run's (fp32 CPU).

Both runs use the same config (the shipped CPU demo shrunk to the tiny preset, short sequences, a checkpoint every
`--save-interval` steps). The chaos run is restarted with `--checkpoint.load latest` after every kill until the
last step is done; a kill lands `--min-wait`..`--max-wait` seconds after the job's first logged step of that
attempt. Reported: faults survived, steps lost (steps trained past the checkpoint a resume went back to), time
lost (wall time of the chaos run minus the uninterrupted run's), and whether every weight of the last checkpoint
is equal.

    python benchmarks/chaos_run.py --steps 1000 --kills 20
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]
from common import environment, environment_markdown, results_dir  # noqa: E402


def write_config(path: Path, out: Path, steps: int, save_interval: int, world: int) -> Path:
    config = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())
    config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"] = 2, 1
    config["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=10)
    section = config["hybrid3d"]
    section.update(tensor_parallel_size=1, pipeline_parallel_size=world)
    section["data"]["seq_length"] = 32
    section["train"].update(steps=steps, log_interval=1, eval_interval=0, output_dir=str(out))
    section["checkpoint"] = {"save_interval": save_interval, "keep_last": 2}
    path.write_text(json.dumps(config))
    return path


def command(config: Path, world: int, port: int, *extra: str) -> list[str]:
    return [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(world), "--master_port", str(port),
            str(REPO / "launch" / "train.py"), "--deepspeed_config", str(config), *extra]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def latest_step(out: Path) -> int:
    latest = out / "checkpoints" / "latest"
    return int(latest.read_text().strip().removeprefix("global_step")) if latest.exists() else 0


def rank_processes(launcher: subprocess.Popen) -> list:
    import psutil

    return [p for p in psutil.Process(launcher.pid).children(recursive=True)
            if any(a.startswith("--local_rank=") for a in p.cmdline())]


def chaos(config: Path, out: Path, world: int, kills: int, min_wait: float, max_wait: float, rng: random.Random):
    """Run to the end, killing a random rank `kills` times; -> (kills done, steps lost, attempts)."""
    done, lost, attempts = 0, 0, 0
    while True:
        attempts += 1
        # killed before its first checkpoint: start over (its metrics.jsonl would be refused as a previous run's)
        resume = (["--checkpoint.load", "latest"] if (out / "checkpoints" / "latest").exists()
                  else ["--train.overwrite", "true"])
        logged = len(metrics(out))
        proc = subprocess.Popen(command(config, world, 29500 + attempts % 500, *resume), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env(), start_new_session=True)
        if done < kills:
            while proc.poll() is None and len(metrics(out)) <= logged:  # wait for this attempt's first step
                time.sleep(0.2)
            time.sleep(rng.uniform(min_wait, max_wait))
            ranks = rank_processes(proc) if proc.poll() is None else []
            if ranks:
                reached = metrics(out)[-1]["step"]
                rng.choice(ranks).send_signal(signal.SIGKILL)
                proc.wait(timeout=300)
                done += 1
                lost += max(0, reached - latest_step(out))
                print(f"kill {done}: step {reached} reached, resuming from {latest_step(out)}", flush=True)
                continue
        proc.wait(timeout=7200)
        if proc.returncode == 0:
            return done, lost, attempts
        raise SystemExit(f"attempt {attempts} failed with exit code {proc.returncode} without a kill")


def final_weights(out: Path) -> dict:
    import torch

    tag = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    return {f"{p.name}:{k}": v for p in sorted(tag.glob("layer_*-model_states.pt"))
            for k, v in torch.load(p, map_location="cpu", weights_only=True).items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--world", type=int, default=2, help="ranks (pipeline stages of the tiny model)")
    parser.add_argument("--save-interval", type=int, default=20)
    parser.add_argument("--min-wait", type=float, default=2.0)
    parser.add_argument("--max-wait", type=float, default=12.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    env_info = environment()
    cmd = "python benchmarks/chaos_run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        steady, chaotic = tmp / "steady", tmp / "chaos"
        started = time.time()
        config = write_config(tmp / "steady.json", steady, args.steps, args.save_interval, args.world)
        subprocess.run(command(config, args.world, 29499), check=True, stdout=subprocess.DEVNULL, env=env())
        steady_s = time.time() - started
        started = time.time()
        config = write_config(tmp / "chaos.json", chaotic, args.steps, args.save_interval, args.world)
        kills, lost, attempts = chaos(config, chaotic, args.world, args.kills, args.min_wait, args.max_wait,
                                      random.Random(args.seed))
        chaos_s = time.time() - started
        a, b = final_weights(steady), final_weights(chaotic)
        equal = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    lines = ["# Chaos run", "", environment_markdown(env_info, cmd), "",
             f"- {args.steps} steps of the tiny preset on {args.world} ranks (PP{args.world}, fp32), a checkpoint "
             f"every {args.save_interval} steps",
             f"- faults survived: {kills} (SIGKILL of a random rank, {args.min_wait:g}-{args.max_wait:g} s into an "
             f"attempt), {attempts} launches",
             f"- steps lost (trained again after a resume): {lost}",
             f"- time: uninterrupted {steady_s:.0f} s, chaos {chaos_s:.0f} s, lost {chaos_s - steady_s:.0f} s",
             f"- weights equal: {'yes' if equal else 'no'} ({len(a)} tensors of the last checkpoint)"]
    out_dir = Path(results_dir(args.out))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "chaos_run.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
