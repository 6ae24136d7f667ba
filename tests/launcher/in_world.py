"""The training job as a call in the session's pooled worlds (tests/distributed), not a launched process.

Most launcher-level tests check the job (resume, resharding, eval-only, schedules, families, data formats),
not the launcher: `run_job` gives them what `harness.launch` gives (exit code, stdout, stderr) without a
`deepspeed` launcher and N interpreters starting for each job. Tests whose subject is the launcher or the
process (signals, kill -9, hangs, multi-node, plain python, the README's commands) still launch.
"""

import dataclasses
import io
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from tests.distributed.worlds import run_world


@dataclasses.dataclass
class JobResult:
    """What a launch returns (subprocess.CompletedProcess's fields that the tests read)."""

    returncode: int
    stdout: str
    stderr: str


def job_rank(rank: int, world_size: int, argv: list[str], cwd: str, nan_loss_call: int | None = None) -> dict:
    """One rank of the job (hybrid3d.training.entry.main_in_world) with its console captured; `nan_loss_call`: the
    fault of tests/launcher/faults (the loss's n-th call on each rank returns NaN) for this job only."""
    from hybrid3d.model import llama
    from hybrid3d.training.entry import main_in_world
    from tests.launcher.faults.fault_patches import patch_nan_loss

    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    undo = patch_nan_loss(llama, nan_loss_call) if nan_loss_call else (lambda: None)
    os.chdir(cwd)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main_in_world(argv)
    finally:
        os.chdir(previous)
        undo()
    return dict(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def run_job(num_ranks: int, config: Path, *overrides: str, timeout: int = 600,
            nan_loss_call: int | None = None) -> JobResult:
    """`deepspeed --num_gpus num_ranks launch/train.py --deepspeed_config config *overrides`, run in the pooled
    world of that size: the ranks' output joined in rank order, the first non-zero exit code (as the launcher's)."""
    argv = ["--deepspeed_config", str(config), *overrides]
    ranks = run_world(job_rank, num_ranks, str(config.parent / f"ranks-{os.urandom(4).hex()}"), argv,
                      str(config.parent), nan_loss_call, timeout=timeout)
    codes = [r["returncode"] for r in ranks]
    return JobResult(next((c for c in codes if c), 0), "".join(r["stdout"] for r in ranks),
                     "".join(r["stderr"] for r in ranks))
