"""The training job: `deepspeed launch/train.py --deepspeed_config CFG.json [--section.key value ...]`.

Everything that can be checked before any process group or file exists is checked first, so a
user error ends every rank with one line on stderr, exit code 2, and nothing written.
"""

import argparse
import dataclasses
import gc
import glob
import os
import sys
import time
from pathlib import Path

from hybrid3d.checkpoint.experts import check_expert_checkpoints
from hybrid3d.checkpoint.resume import ResumePlan, plan_resume
from hybrid3d.checkpoint.schema import recorded_schedule, saved_step as checkpoint_step, structure
from hybrid3d.config.overrides import apply_overrides, parse_override_args
from hybrid3d.config.sections import SECTION, HybridSection, parse_hybrid_section, read_json
from hybrid3d.data.indexed import is_indexed_prefix
from hybrid3d.data.pipeline import data_paths
from hybrid3d.ds_internals import check_deepspeed_version
from hybrid3d.errors import ConfigError, NonFiniteError, PeerLostError, ReportedError, UserError
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_source import HFSource
from hybrid3d.model.hf_weights import is_adapter, param_specs
from hybrid3d.model.pipe import run_stage_bounds
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.parallel.standalone import launch_hint, launched, use_single_process_world
from hybrid3d.planning.auto_layout import auto_keys, placeholder_config
from hybrid3d.training.auto_start import resolve_auto
from hybrid3d.training.model_source import ModelSource, resolve_model
from hybrid3d.training.output_folder import check_output_folder
from hybrid3d.training.validation import ValidRun, validate_run


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


@dataclasses.dataclass
class Job:
    """Everything validated before the process group starts."""

    raw: dict
    run: ValidRun
    source: ModelSource
    save_dir: Path
    output_dir: Path
    plan: ResumePlan | None
    hf_weights: HFSource | None
    override_log: list
    verbose: bool = False
    start_over: bool = False  # train.overwrite over a previous run's folders
    given: dict | None = None  # the config as given (overrides applied, "auto" kept); `raw` is what runs
    auto_lines: list = dataclasses.field(default_factory=list)  # what "auto" chose and why

    @property
    def hybrid(self):
        return self.run.config.hybrid

    @property
    def config(self):
        return self.run.config

    @property
    def layout(self) -> ParallelLayout:
        return self.run.layout

    @property
    def shape(self) -> LlamaShape:
        return self.run.shape


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """Start-up phase 1, `read`: the JSON with the command line's overrides applied, "auto" values kept."""

    raw: dict  # as given: <output_dir>/config.json
    override_log: list
    auto: list  # the keys left "auto" (planning.auto_layout.auto_keys)


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
    start_over: bool


def read(config_path: str, overrides) -> RunRequest:
    """The JSON and the overrides; refusals: the file, a key's value that cannot be read."""
    raw = read_json(config_path)
    override_log = apply_overrides(raw, overrides)
    return RunRequest(raw, override_log, auto_keys(raw))


def resolve(request: RunRequest, world_size: int, standalone: bool, on_cpu: bool) -> ResolvedRun:
    """The model the run trains and the "auto" keys decided for it (training/auto_start.py, called once)."""
    raw = request.raw  # the planner writes its decision into a copy (auto_layout.apply_choice): `raw` stays as given
    hybrid = parse_hybrid_section(placeholder_config(raw) if request.auto else raw)
    ranks = hybrid.tensor_parallel_size * hybrid.pipeline_parallel_size * hybrid.context_parallel_size
    if standalone and ranks > 1:
        sizes = " x ".join(f"{k} {getattr(hybrid, k)}" for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                                  "context_parallel_size") if getattr(hybrid, k) > 1)
        raise ConfigError(launch_hint(ranks, f"hybrid3d.{sizes}", "launch/train.py --deepspeed_config ..."))
    source = resolve_model(hybrid.model, hybrid.data)
    shape = LlamaShape.from_hf(source.hf_config, vocab_pad_multiple=hybrid.vocab_pad_multiple)
    reasons = []
    if request.auto:  # the planner decides; validate then checks the config it wrote like any written-out one
        raw, reasons = resolve_auto(raw, shape, world_size, on_cpu)
        hybrid = parse_hybrid_section(raw)
    return ResolvedRun(raw, hybrid, source, shape, reasons)


def validate(resolved: ResolvedRun, world_size: int, on_cpu: bool) -> ValidRun:
    """Every refusal that needs no file, in one pass (training/validation.py: the support table, DeepSpeed's checks,
    the layout against the model, the sequence), and whether the run's experts can be saved."""
    run = validate_run(resolved.raw, world_size, resolved.shape, on_cpu=on_cpu, hybrid=resolved.hybrid)
    check_expert_checkpoints(run.layout.ep, run.layout.pp)  # the job always saves at the end
    return run


def open_run(run: ValidRun, raw: dict, eval_only: bool) -> OpenedRun:
    """Every refusal that reads a file: the data, the output folder, the checkpoint to resume, the HF weights."""
    hybrid, layout, shape = run.config.hybrid, run.layout, run.shape
    train, data = hybrid.train, hybrid.data
    for key, path in data_paths(data):
        if not (glob.glob(path) or is_indexed_prefix(path)):
            raise ConfigError(f"{key}: {path} does not exist")
    output_dir = Path(train.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"hybrid3d.train.output_dir: {output_dir} exists and is not a folder")
    save_dir = Path(hybrid.checkpoint.save_dir or output_dir / "checkpoints")
    plan = None
    if hybrid.checkpoint.load:
        schedule = (hybrid.pipeline_schedule, hybrid.virtual_pipeline_size)
        plan = plan_resume(hybrid.checkpoint.load, str(save_dir), layout.tp, layout.pp, layout.dp,
                           structure(dataclasses.asdict(shape)),
                           cp=layout.cp, **recorded_schedule(layout.pp, *schedule, hybrid.partition_method),
                           ep=layout.ep, partition_set="partition_method" in raw.get(SECTION, {}),
                           bounds=run_stage_bounds(shape, layout.pp, *schedule, hybrid.partition_method),
                           zero=run.config.zero_stage)
        if plan.partition is not None:  # the checkpoint's stages, kept
            run = run.with_partition(plan.partition)
        if plan.universal and shape.is_moe:  # ds_to_universal knows nothing of experts (or their placement)
            raise ConfigError(f"hybrid3d.checkpoint.load: {plan.load_dir / plan.tag} was saved at layout "
                              f"{plan.meta['layout']}; a mixture-of-experts checkpoint resumes at the same layout only")
        if plan.universal and shape.lora_rank:  # adapter-only files: no universal conversion built for them yet
            raise ConfigError(f"hybrid3d.checkpoint.load: {plan.load_dir / plan.tag} was saved at layout "
                              f"{plan.meta['layout']}; a LoRA checkpoint resumes at the same layout only (or export "
                              "it with hybrid2hf --lora adapter and start from it with hybrid3d.lora.adapter)")
    if eval_only and plan is None:
        raise ConfigError("--eval-only needs hybrid3d.checkpoint.load")
    saved_step = checkpoint_step(plan.meta) if plan is not None else 0
    if not eval_only and saved_step >= train.steps:
        raise ConfigError(f"hybrid3d.train.steps ({train.steps}) is not above the step of the checkpoint "
                          f"{plan.load_dir / plan.tag} ({saved_step}): nothing to train (raise train.steps, or "
                          "use --eval-only to evaluate it)")
    start_over = not eval_only and check_output_folder(output_dir, save_dir, plan, train.overwrite)
    hf_weights = None
    # a LoRA run's checkpoints hold its adapters only: the frozen base always comes from the HF folder
    if hybrid.model.init_from_hf and (plan is None or shape.lora_rank):
        hf_weights = HFSource.open(hybrid.model.hf_model)
        names = {s.hf_name for s in param_specs(shape, layout.tp) if not is_adapter(s)}
        missing = sorted(names - set(hf_weights))
        if missing:
            raise ConfigError(f"hybrid3d.model.hf_model: {hybrid.model.hf_model} lacks weight {missing[0]}")
    return OpenedRun(run, save_dir, output_dir, plan, hf_weights, start_over)


def prepare(args, overrides, world_size: int, standalone: bool = False) -> Job:
    """Start-up in four phases before any process group exists: read, resolve, validate, open. `standalone`: a single
    process started without a launcher (world size 1)."""
    from deepspeed.accelerator import get_accelerator

    check_deepspeed_version()
    on_cpu = get_accelerator().device_name() == "cpu"
    request = read(args.deepspeed_config, overrides)
    resolved = resolve(request, world_size, standalone, on_cpu)
    run = validate(resolved, world_size, on_cpu)
    opened = open_run(run, resolved.raw, args.eval_only)
    return Job(resolved.raw, opened.run, resolved.source, opened.save_dir, opened.output_dir, opened.plan,
               opened.hf_weights, request.override_log, verbose=args.verbose, start_over=opened.start_over,
               given=request.raw, auto_lines=resolved.reasons)


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
