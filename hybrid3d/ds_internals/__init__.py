"""Everything that depends on DeepSpeed's private attributes, behind one version check.

hybrid3d uses DeepSpeed's public API everywhere else. The modules here read or replace internals
that DeepSpeed may change in any release (PipelineEngine's instruction table and ZeRO-2 bookkeeping
in pipeline_zero2.py, optimizer buffers in memory_probe.py, the CPU shared-memory segments in
shm_buffers.py, PipelineModule's stage bounds below), so they are written and tested against one
version: `check_deepspeed_version()` turns any other into one line at start-up.
"""

TESTED_DEEPSPEED = "0.19.8"


def check_deepspeed_version(installed: str | None = None) -> None:
    """Raise a UserError unless the installed DeepSpeed is the one these internals were written for."""
    from hybrid3d.errors import UserError

    if installed is None:
        import deepspeed

        installed = deepspeed.__version__
    if installed.split("+")[0] != TESTED_DEEPSPEED:
        raise UserError(f"deepspeed {installed} is installed; hybrid3d is tested with deepspeed {TESTED_DEEPSPEED} "
                        f"(pip install deepspeed=={TESTED_DEEPSPEED})")


def pipeline_stage_layers(module) -> tuple[int, int]:
    """(first, last) global layer index a PipelineModule built on this rank (DeepSpeed keeps them private)."""
    return int(module._local_start), int(module._local_stop) - 1
