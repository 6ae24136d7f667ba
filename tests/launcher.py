"""Run launch/train.py under the real `deepspeed` launcher in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "launch" / "train.py"


def deepspeed_command(num_gpus: int, config: Path, *overrides: str) -> list[str]:
    launcher = Path(sys.executable).with_name("deepspeed")
    return [str(launcher), "--num_gpus", str(num_gpus), "--master_port", str(_port()), str(TRAIN),
            "--deepspeed_config", str(config), *overrides]


def _port() -> int:
    from tests.distributed import free_port

    return free_port()


def launch(num_gpus: int, config: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(deepspeed_command(num_gpus, config, *overrides), capture_output=True, text=True,
                          timeout=timeout, cwd=config.parent, env=launch_env())


def launch_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # 4 ranks share 2 cores
    return env


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
