"""The training job: `deepspeed launch/train.py --deepspeed_config CFG.json [--section.key value ...]`.

Everything that can be checked before any process group or file exists is checked first, so a
user error ends every rank with one line on stderr, exit code 2, and nothing written.
"""

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

from hybrid3d.checkpoint.experts import check_expert_checkpoints
from hybrid3d.checkpoint.resume import ResumePlan, check_steps_left, plan_run_resume
from hybrid3d.config.overrides import parse_override_args
from hybrid3d.config.request import RunRequest, read_run
from hybrid3d.config.sections import HybridSection, parse_hybrid_section
from hybrid3d.config.validation import ValidRun, check_single_process, validate_run
from hybrid3d.data.pipeline import check_data_paths
from hybrid3d.ds_internals import check_deepspeed_version
from hybrid3d.errors import NonFiniteError, PeerLostError, ReportedError, UserError
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_source import HFSource, open_hf_weights
from hybrid3d.parallel.standalone import launched, use_single_process_world
from hybrid3d.training.auto_start import resolve_auto
from hybrid3d.training.model_source import ModelSource, resolve_model
from hybrid3d.training.output_folder import check_output_folder, output_folders


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="launch/train.py", description="Train a Llama with TP x PP x DP (ZeRO) on DeepSpeed.",
        epilog="Any other --section.key value pair overrides the JSON, e.g. --train.steps 200 "
               "--checkpoint.load latest --zero_optimization.stage 1")
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with a \"hybrid3d\" section")
    parser.add_argument("--eval-only", action="store_true", help="load checkpoint.load, evaluate, print, exit")
    parser.add_argument("--verbose", action="store_true", help="show DeepSpeed's own log lines and prints")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    args, rest = parser.parse_known_args(argv)
    return args, parse_override_args(rest)


@dataclasses.dataclass(frozen=True)
class ResolvedRun:
    """Start-up phase 2, `resolve`: every "auto" decided (a request without one passes through unchanged), with the
    model the decision was made for and the lines saying what was chosen and why."""

    raw: dict  # what runs: <output_dir>/resolved_config.json
    hybrid: HybridSection
    source: ModelSource
    shape: LlamaShape  # as the HF config gives it (validate applies the section's padding and adapters)
    reasons: list


@dataclasses.dataclass(frozen=True)
class OpenedRun:
    """Start-up phase 4, `open`: what the files say (output folders, the checkpoint to resume, the HF weights)."""

    run: ValidRun  # the checkpoint's stages kept on a resume
    save_dir: Path
    output_dir: Path
    plan: ResumePlan | None
    hf_weights: HFSource | None
    start_over: bool  # train.overwrite over a previous run's folders


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything validated before the process group starts: the request as given (config.json), what it resolved
    to (resolved_config.json) and what its files say."""

    request: RunRequest
    resolved: ResolvedRun
    opened: OpenedRun
    verbose: bool = False

    # what the job reads, by name
    raw = property(lambda self: self.resolved.raw)  # what runs ("auto" decided)
    given = property(lambda self: self.request.raw)  # as given (overrides applied, "auto" kept)
    override_log = property(lambda self: self.request.override_log)
    auto_lines = property(lambda self: self.resolved.reasons)  # what "auto" chose and why
    source = property(lambda self: self.resolved.source)
    run = property(lambda self: self.opened.run)
    save_dir = property(lambda self: self.opened.save_dir)
    output_dir = property(lambda self: self.opened.output_dir)
    plan = property(lambda self: self.opened.plan)
    hf_weights = property(lambda self: self.opened.hf_weights)
    start_over = property(lambda self: self.opened.start_over)
    hybrid = property(lambda self: self.run.config.hybrid)
    config = property(lambda self: self.run.config)
    layout = property(lambda self: self.run.layout)
    shape = property(lambda self: self.run.shape)


def resolve(request: RunRequest, world_size: int, standalone: bool, on_cpu: bool) -> ResolvedRun:
    """The model the run trains and the "auto" keys decided for it (training/auto_start.py: the planner, once)."""
    hybrid = request.hybrid
    if standalone:
        check_single_process(hybrid)
    source = resolve_model(hybrid.model, hybrid.data)
    shape = LlamaShape.from_hf(source.hf_config, vocab_pad_multiple=hybrid.vocab_pad_multiple)
    raw, reasons = request.raw, []  # the planner writes its decision into a copy: the request stays as given
    if request.auto:  # validate then checks the config it wrote like any written-out one
        raw, reasons = resolve_auto(request, shape, world_size, on_cpu)
        hybrid = parse_hybrid_section(raw)
    return ResolvedRun(raw, hybrid, source, shape, reasons)


def validate(resolved: ResolvedRun, world_size: int, on_cpu: bool) -> ValidRun:
    """Every refusal that needs no file, in one pass (config/validation.py: the support table, DeepSpeed's checks,
    the layout against the model, the sequence), and whether the run's experts can be saved (the checkpoint's)."""
    run = validate_run(resolved.raw, world_size, resolved.shape, on_cpu=on_cpu, hybrid=resolved.hybrid)
    check_expert_checkpoints(run.layout.ep, run.layout.pp)  # the job always saves at the end
    return run


def open_run(run: ValidRun, request: RunRequest, eval_only: bool) -> OpenedRun:
    """Every refusal that reads a file, each in the owner of that file: the data, the output folder, the checkpoint
    to resume, the HF weights."""
    hybrid, shape = run.config.hybrid, run.shape
    check_data_paths(hybrid.data)
    output_dir, save_dir = output_folders(hybrid)
    plan = plan_run_resume(run, save_dir, request.partition_set) if hybrid.checkpoint.load else None
    if plan is not None and plan.partition is not None:  # the checkpoint's stages, kept
        run = run.with_partition(plan.partition)
    check_steps_left(plan, hybrid.train.steps, eval_only)
    start_over = not eval_only and check_output_folder(output_dir, save_dir, plan, hybrid.train.overwrite)
    # a LoRA run's checkpoints hold its adapters only: the frozen base always comes from the HF folder
    needs_weights = hybrid.model.init_from_hf and (plan is None or shape.lora_rank)
    hf_weights = open_hf_weights(hybrid.model.hf_model, shape, run.layout.tp) if needs_weights else None
    return OpenedRun(run, save_dir, output_dir, plan, hf_weights, start_over)


def prepare(args, overrides, world_size: int, standalone: bool = False) -> Job:
    """Start-up in four phases before any process group exists: read, resolve, validate, open. `standalone`: a single
    process started without a launcher (world size 1)."""
    from deepspeed.accelerator import get_accelerator

    check_deepspeed_version()
    on_cpu = get_accelerator().device_name() == "cpu"
    request = read_run(args.deepspeed_config, overrides)
    resolved = resolve(request, world_size, standalone, on_cpu)
    run = validate(resolved, world_size, on_cpu)
    opened = open_run(run, request, args.eval_only)
    return Job(request, resolved, opened, verbose=args.verbose)


def main(argv=None) -> int:
    """A launched rank (or a plain `python launch/train.py`): the job in a world of its own."""
    code = _main(argv, in_existing_world=False)
    # The process ends next. The interpreter's last garbage collection would scan every object torch, DeepSpeed and
    # transformers made (~1.1 s per rank, measured with py-spy): nothing the job owns is left to finalise there (its
    # files are closed, its world torn down), so everything alive now is exempted from that scan.
    gc.freeze()
    return code


def main_in_world(argv) -> int:
    """The job in a world the caller started (`deepspeed.comm` initialised over RANK/WORLD_SIZE), left running
    afterwards: many jobs in one world, as the tests' pooled worlds run them."""
    return _main(argv, in_existing_world=True)


# How long a launched rank other than 0 waits, after finding a user error before start-up, for rank 0 to print it
RANK0_REPORT_GRACE_S = 60.0


def wait_for_rank0_to_report() -> None:
    """DeepSpeed's launcher ends every rank as soon as one exits non-zero (`launcher/launch.py: sigkill_handler`),
    so a rank that found the error first would end rank 0 before its one line is printed (seen under load). The
    other ranks wait instead: rank 0 prints and exits with the same code, and the launcher ends them then. A rank
    still waiting after RANK0_REPORT_GRACE_S found an error rank 0 did not (a file only its node lacks)."""
    time.sleep(RANK0_REPORT_GRACE_S)


def _main(argv, in_existing_world: bool) -> int:
    args, overrides = None, None
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        job = prepare(args, overrides, world_size, standalone=not launched())
    except UserError as e:
        if rank == 0:  # every rank found the same error; one line is enough
            print(f"error: {e}", file=sys.stderr, flush=True)
        elif not in_existing_world:
            wait_for_rank0_to_report()  # usually ended here by the launcher, once rank 0 has reported
            print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)  # rank 0 found none: say it here
        return e.exit_code
    if not in_existing_world:
        use_single_process_world()  # `python launch/train.py`: the variables the launcher would set, for one rank
    from hybrid3d.training.job import run_in_world, run_job  # heavy imports only once the job is known to be valid

    try:
        return (run_in_world if in_existing_world else run_job)(job, eval_only=args.eval_only, rank=rank)
    except ReportedError as e:  # rank 0 prints this one
        return e.exit_code
    except UserError as e:  # found after start-up (e.g. in a checkpoint): may be on some ranks only
        print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except PeerLostError as e:  # each surviving rank says which phase it was in
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return e.exit_code
    except NonFiniteError as e:  # every rank sees the same values
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
