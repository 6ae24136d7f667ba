"""Run launch/train.py under the real `deepspeed` launcher in a subprocess."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
STEPS = 8  # steps of the shortened demo run
TRAIN = REPO / "launch" / "train.py"


def deepspeed_launcher() -> list[str]:
    """DeepSpeed's `deepspeed` command: the script pip put next to this interpreter, else the same runner as a
    module (pip may put scripts elsewhere, e.g. /usr/local/bin beside /usr/bin/python3 on a GPU machine)."""
    script = Path(sys.executable).with_name("deepspeed")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "deepspeed.launcher.runner"]


def deepspeed_command(num_gpus: int, config: Path, *overrides: str) -> list[str]:
    return [*deepspeed_launcher(), "--num_gpus", str(num_gpus), "--master_port", str(_port()), str(TRAIN),
            "--deepspeed_config", str(config), *overrides]


def _port() -> int:
    from tests.distributed.worlds import free_port

    return free_port()


def launch(num_gpus: int, config: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(deepspeed_command(num_gpus, config, *overrides), capture_output=True, text=True,
                          timeout=timeout, cwd=config.parent, env=launch_env())


def launch_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # 4 ranks share 2 cores
    return env


def read_metrics(output_dir: Path, kind: str = "all") -> list[dict]:
    """metrics.jsonl's records: "all", the "steps" (they have a loss) or the asynchronous "saves" (they name their
    checkpoint; training/metrics.py writes no other kind)."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    keep = {"all": lambda r: True, "steps": lambda r: "loss" in r, "saves": lambda r: "checkpoint" in r}[kind]
    return [r for r in records if keep(r)]


def demo_config(tmp: Path, **hybrid_edits) -> Path:
    """The shipped CPU demo, shortened: 8 steps of 64 tokens, checkpoints and evals every 4, torch's AdamW.

    torch's AdamW (`torch_adam`) instead of DeepSpeed's JIT-built one spares each rank its op load (3-6 s: the
    builder runs cpuinfo in a subprocess); DeepSpeed's is what the README's commands run
    (test_first_run.test_readme_hugging_face_commands_run_as_written) and is checked against torch's AdamW in
    tests/distributed/test_engine.py::test_json_optimizer_default_adamw_matches_hf."""
    config = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())
    config["optimizer"]["params"]["torch_adam"] = True
    config["scheduler"]["params"]["total_num_steps"] = STEPS
    config["scheduler"]["params"]["warmup_num_steps"] = 2
    section = config["hybrid3d"]
    section["data"]["seq_length"] = 64
    section["train"].update(steps=STEPS, log_interval=1, eval_interval=4, eval_steps=2, output_dir=str(tmp / "run"))
    section["checkpoint"] = {"save_interval": 4, "keep_last": 0}
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp / "monitor"), "job_name": "demo"}
    for key, value in hybrid_edits.items():
        section[key] = value
    path = tmp / "config.json"
    path.write_text(json.dumps(config))
    return path


def layer_states(tag_dir: Path) -> dict:
    """The module weights of a pipeline checkpoint tag, by layer file."""
    import torch

    return {p.name: torch.load(p, map_location="cpu", weights_only=True)
            for p in sorted(tag_dir.glob("layer_*-model_states.pt"))}


def copy_checkpoint(run_dir: Path, tag: str, out_dir: Path) -> None:
    """Copy checkpoint `tag` (and the run's `hf` folder) of `run_dir` into `out_dir`/checkpoints as its `latest`."""
    target = out_dir / "checkpoints"
    target.mkdir(parents=True)
    for name in (tag, "hf"):
        shutil.copytree(run_dir / "checkpoints" / name, target / name)
    (target / "latest").write_text(tag)


def resume_copy(num_gpus: int, config: Path, run_dir: Path, tag: str, out_dir: Path) -> subprocess.CompletedProcess:
    """Run the job again from a copy of checkpoint `tag` of `run_dir` (`copy_checkpoint`), `out_dir` its output."""
    from tests.launcher.in_world import run_job

    copy_checkpoint(run_dir, tag, out_dir)
    return run_job(num_gpus, config, "--train.output_dir", str(out_dir), "--checkpoint.load", "latest")


def config_copy(config: Path, path: Path, output_dir: Path, **hybrid_edits) -> Path:
    """`config` written to `path` with another train.output_dir (and other `hybrid3d` keys replaced)."""
    raw = json.loads(config.read_text())
    raw["hybrid3d"]["train"]["output_dir"] = str(output_dir)
    raw["hybrid3d"].update(hybrid_edits)
    path.write_text(json.dumps(raw))
    return path


def launcher_env_by_rank(nodes: int = 2, slots: int = 2) -> list[dict]:
    """The launcher variables each rank of a job on `nodes` nodes of `slots` ranks gets, numbered node by node
    (as `placement.json` records them)."""
    world = nodes * slots
    return [{"RANK": str(r), "LOCAL_RANK": str(r % slots), "WORLD_SIZE": str(world), "LOCAL_SIZE": str(slots),
             "CROSS_RANK": str(r // slots), "CROSS_SIZE": str(nodes)} for r in range(world)]


# Fault injection (tests/launcher/faults/): a rank imports the fault patches found first on its PYTHONPATH
FAULTS = str(Path(__file__).parent / "faults")


def fault_env(fault: dict) -> dict:
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [FAULTS, env.get("PYTHONPATH")]))
    env["HYBRID3D_TEST_FAULT"] = json.dumps(fault)
    return env


def rank_process(launcher: subprocess.Popen, local_rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        if any(arg == f"--local_rank={local_rank}" for arg in child.cmdline()):
            return child
    raise AssertionError(f"rank {local_rank} not found")


def wait_for(predicate, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.1)
    return False
