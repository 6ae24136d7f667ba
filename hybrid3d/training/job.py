"""The distributed part of the training job: data, engine, resume, the step loop, checkpoints."""

import json
import math
import os
import shutil
import time
from pathlib import Path

import deepspeed.comm as dist
import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from hybrid3d.checkpoint.files import HF_FILES_DIR, tag_for_step
from hybrid3d.checkpoint.schema import client_section, layout_record, tag_record
from hybrid3d.checkpoint.saver import CheckpointSaver, verify_archives, weights_are_finite
from hybrid3d.checkpoint.universal import convert_to_universal, scratch_folder
from hybrid3d.data import DataCursor, build_training_data, micro_batches
from hybrid3d.data.baseline import baseline_entropy
from hybrid3d.data.blended import BlendedSamples
from hybrid3d.ds_internals import pipeline_parts, pipeline_stage_layers
from hybrid3d.ds_internals.shm_buffers import remove_shm_buffers
from hybrid3d.ds_internals.zero3 import full_numel
from hybrid3d.errors import ConfigError, NonFiniteError, ReportedError
from hybrid3d.model.expert_kernels import kernel_line
from hybrid3d.model.pipe import layer_costs
from hybrid3d.parallel.attention_blocks import block_kernel
from hybrid3d.planning.flops import peak_tflops, training_flops_per_token
from hybrid3d.parallel.world import process_group_timeout, start_world
from hybrid3d.parallel.placement import gather_placement, placement_lines
from hybrid3d.parallel.threads import local_rank, local_ranks, set_cpu_threads
from hybrid3d.training.output_folder import clear_previous_run
from hybrid3d.training.console import deepspeed_prints, hold_back_deprecated_alias_warnings, set_deepspeed_verbosity
from hybrid3d.training.metrics import MetricsLogger, info
from hybrid3d.training.trainer import build_trainer
from hybrid3d.training.rng import restore_rng, rng_state
from hybrid3d.training.signals import StopRequest
from hybrid3d.training.step_policies import EvalSchedule, NonFinitePolicy, SaveSchedule
from hybrid3d.training.watchdog import Watchdog

hold_back_deprecated_alias_warnings()


def leaders_first(fn, rank: int, leader: bool):
    """Run `fn` on the leaders first (they fill caches), then on the others; a user error on a leader is re-raised on
    every rank (rank 0 prints it) instead of leaving the others waiting."""
    error, result = None, None
    if leader:
        try:
            result = fn()
        except ConfigError as e:
            error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise ConfigError(first) if rank == 0 else ReportedError(first)
    return result if leader else fn()


def rank0_first(fn, rank: int):
    """`fn` on rank 0, then on the others (a universal conversion: rank 0 writes it for everyone)."""
    return leaders_first(fn, rank, rank == 0)


def node_leaders_first(fn, rank: int):
    """`fn` on every host's first rank (LOCAL_RANK 0) at once, then on the others, so that each host fills its cache
    once: with a cache every host sees, the leaders race to one atomic rename (data/pipeline.py) in the time one
    build takes; with a cache per host, each host builds its own in that same time, where `rank0_first` would have
    every other rank of a remote host build at once."""
    return leaders_first(fn, rank, local_rank(rank) == 0)


def schedule_note(pp: int, hybrid) -> str:
    """How the pipeline is scheduled, when it is not DeepSpeed's 1F1B."""
    if pp == 1 or hybrid.pipeline_schedule == "1f1b":
        return ""
    if hybrid.pipeline_schedule == "interleaved":
        return f", interleaved 1F1B schedule ({hybrid.virtual_pipeline_size} chunks per rank)"
    return ", DualPipeV schedule"


def layout_summary(trainer) -> list[str]:
    """One line per pipeline stage: its layers, their share of the model's training FLOPs (`pipe.layer_costs`,
    what the "cost" partition method balances) and parameters (per TP rank); a MoE model's experts' kernel."""
    module = trainer.module
    ranges = pipeline_stage_layers(module) if trainer.uses_pipeline else [(0, len(module.layers) - 1)]
    layers = " and ".join(f"{first}-{last}" for first, last in ranges)  # DualPipeV: stages r and 2p-1-r
    costs = layer_costs(trainer.shape)  # one per layer spec; a single stage holds them all (a tied head included)
    share = sum(sum(costs[first:last + 1]) for first, last in ranges) / sum(costs) if trainer.uses_pipeline else 1
    local = dict(stage=trainer.groups.stage_id, tp=trainer.groups.get_tensor_model_parallel_rank(),
                 dp=trainer.groups.data_shard()[0], cp=trainer.groups.context_parallel().rank,
                 layers=f"{layers} ({share:.0%} of the FLOPs)",
                 params=sum(full_numel(p) for p in module.parameters()),  # ZeRO-3 holds 1/Nd of them
                 trained=sum(full_numel(p) for p in module.parameters() if p.requires_grad))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    lines = []
    for stage in range(trainer.layout.pp):
        ranks = [r for r in everyone if r["stage"] == stage and r["dp"] == 0 and r["cp"] == 0]
        r0 = ranks[0]
        lines.append(f"  stage {stage}: layers {r0['layers']}, "
                     f"{r0['params'] / 1e6:.2f}M params per TP rank ({sum(r['params'] for r in ranks) / 1e6:.2f}M "
                     f"in the stage)" + (f", {r0['trained'] / 1e6:.2f}M of them LoRA adapters trained per TP rank"
                                         if r0["trained"] < r0["params"] else ""))
    return lines + [kernel_line(trainer.shape, trainer.layout.tp, next(module.parameters()).dtype)] * trainer.shape.is_moe


def sequence_split(layout, seq: int, device_type: str = "cpu") -> str:
    """How a sequence is split over ranks, for the layout line ('' when it is not); with a ring, its comm and the
    kernel its blocks run on `device_type` (parallel/attention_blocks.py)."""
    ring = ""
    if layout.ring:
        comm = "p2p" if layout.cp_a2a == 1 else f"a2a {layout.cp_a2a} + p2p"
        ring = f" ({comm}, ring blocks: {block_kernel(torch.device(device_type)).LABEL})"
    parts = ([f"context_parallel_size {layout.cp}{ring}"] if layout.cp > 1 else []) + (
        [f"sequence_parallel over TP{layout.tp}"] if layout.sp else [])
    if not parts:
        return ""
    return f" ({seq // (layout.cp * (layout.tp if layout.sp else 1))} tokens per rank: {', '.join(parts)})"


def evaluate(trainer, data, job, dp_rank) -> tuple[float, dict]:
    """The eval loss, and a blend's loss per dataset by name ({} otherwise). A blend without data.eval_path scores
    the datasets' losses weighted by its (normalised) weights: the loss on evaluation data drawn as it trains."""
    batch = job.config.sequences_per_step

    def loss_on(samples) -> float:
        return float(np.mean([trainer.eval_step(micro_batches(samples, k * batch, batch, dp_rank, job.layout.dp,
                                                              job.config.micro_batch_size,
                                                              job.hybrid.data.document_mask))
                              for k in range(job.hybrid.train.eval_steps)]))

    per_dataset = {name: loss_on(samples) for name, samples in data.evals.items()}
    if data.eval is not None:
        return loss_on(data.eval), per_dataset
    weights = {part.name: w for part, w in zip(data.train.parts, data.train.index.weights)}
    total = sum(weights[name] for name in per_dataset)
    if total == 0:  # only datasets the blend never draws from are evaluated
        return float(np.mean(list(per_dataset.values()))), per_dataset
    return sum(weights[name] * loss for name, loss in per_dataset.items()) / total, per_dataset


def dataset_losses(per_dataset: dict) -> str:
    return f" [{', '.join(f'{name} {loss:.4f}' for name, loss in per_dataset.items())}]" if per_dataset else ""


def load_checkpoint(trainer, plan, universal_dir: Path | None) -> dict:
    """Load per the plan (a reshard from `universal_dir`); return the hybrid3d client state ({} for a
    weights-only checkpoint)."""
    folder = universal_dir if plan.universal else plan.load_dir / plan.tag
    client_state = trainer.load(str(folder.parent), tag=folder.name, module_only=plan.module_only)
    if plan.module_only:
        return {}
    if not client_state:
        raise ConfigError(f"hybrid3d.checkpoint.load: DeepSpeed found no checkpoint in {folder}")
    return client_section(client_state)


def run_job(job, eval_only: bool, rank: int) -> int:
    """The job in a process of its own (a launched rank): start the world, run the job in it, tear it down.

    On every exit path the world goes down in one order: the step loop's helper thread (joined inside
    `run_in_world`), a barrier on success only (an error may be on some ranks only, so waiting for the
    others could hang), the process groups, the shared-memory buffers. A rank leaving with its process
    group alive aborts in C++ ("terminate called without an active exception") when the interpreter
    destroys the communicator's threads at exit."""
    set_deepspeed_verbosity(job.verbose)
    # The watchdog (timeout_seconds) reports a hang with the rank and step; the process group's own
    # timeout is a backstop behind it, so the clearer message wins.
    with deepspeed_prints(job.verbose):
        start_world(process_group_timeout(job.hybrid.timeout_seconds))  # this rank's device first
    succeeded = False
    try:
        code = run_in_world(job, eval_only, rank)
        succeeded = True
        return code
    finally:
        if dist.is_initialized():
            if succeeded:
                dist.barrier()
            dist.destroy_process_group()
        if get_accelerator().device_name() == "cpu":
            remove_shm_buffers(os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500"),
                               local_rank(rank))


def run_in_world(job, eval_only: bool, rank: int) -> int:
    """The job in a world that already exists (`deepspeed.comm` initialised over the job's ranks), which it
    leaves running: `run_job` for a launched rank, or a caller that runs many jobs in one world (the tests'
    pooled worlds)."""
    hybrid, layout = job.hybrid, job.layout
    set_deepspeed_verbosity(job.verbose)
    # CPU threads on every accelerator: a GPU rank's host work (data, the optimizer's host side) would otherwise
    # run as many threads as the node has cores, once per rank on the node
    threads = set_cpu_threads(local_ranks())
    is_rank0 = rank == 0
    for line in job.override_log:
        info(f"override {line}", is_rank0)
    for line in job.auto_lines:
        info(line, is_rank0)
    info(threads, is_rank0)

    source = job.source
    data = node_leaders_first(
        lambda: build_training_data(hybrid.data, source.tokenizers(), source.hf_config.vocab_size), rank)
    info(f"data: {data.summary}" + (" (documents masked from each other)" if hybrid.data.document_mask else ""),
         is_rank0)
    if isinstance(data.train, BlendedSamples) and is_rank0:
        for line in data.train.lines(hybrid.train.steps * job.config.sequences_per_step):
            info(line)
    universal_dir = None
    if job.plan is not None and job.plan.universal:
        info(f"resharding {job.plan.load_dir / job.plan.tag} (layout {job.plan.meta['layout']}) to {layout.name} "
             "through DeepSpeed's universal checkpoint" + (f": {job.plan.why}" if job.plan.why else ""), is_rank0)
        scratch = scratch_folder(job.plan) if eval_only else None  # an evaluation writes nothing into the checkpoint
        universal_dir = rank0_first(lambda: convert_to_universal(job.plan, scratch), rank)
    elif job.plan is not None and job.plan.why:
        info(f"keeping the pipeline stages of {job.plan.load_dir / job.plan.tag}: {job.plan.why}", is_rank0)

    if job.plan is not None and not job.plan.module_only:
        verify_archives(job.plan.load_dir / job.plan.tag, job.plan.meta, rank, dist.get_world_size())
    with deepspeed_prints(job.verbose):
        trainer = build_trainer(job.run, hf_state_dict=job.hf_weights, load_universal=universal_dir is not None,
                                checkpoint_follows=job.plan is not None)
    config = trainer.config
    step, client = 0, {}
    if job.plan is not None:
        client = load_checkpoint(trainer, job.plan, universal_dir)
        step = int(client.get("step", 0))
        if "rng" in client and not job.plan.universal:
            restore_rng(client["rng"])
        info(f"loaded {job.plan.load_dir / job.plan.tag} at step {step}", is_rank0)

    dp_rank = trainer.groups.data_shard()[0]
    info(f"layout {layout.name}{schedule_note(layout.pp, hybrid)}: {job.shape.num_layers} decoder layers, "
         f"ZeRO stage {config.zero_stage}, "
         f"micro-batch {config.micro_batch_size} x GAS {config.gradient_accumulation_steps} x DP {layout.dp} "
         f"= {config.sequences_per_step} sequences of {hybrid.data.seq_length} tokens"
         f"{sequence_split(layout, hybrid.data.seq_length, get_accelerator().device_name())}", is_rank0)
    for line in layout_summary(trainer):
        info(line, is_rank0)
    places = gather_placement(layout)  # hosts and launcher variables of every rank (parallel/placement.py)
    for line in placement_lines(places, layout):
        info(line, is_rank0)

    if eval_only:
        if data.eval is None and not data.evals:
            raise ConfigError("--eval-only needs hybrid3d.data.eval_path or hybrid3d.data.eval_fraction")
        eval_loss, per_dataset = evaluate(trainer, data, job, dp_rank)
        info(f"eval_loss {eval_loss:.6f} perplexity {math.exp(min(eval_loss, 50)):.3f}{dataset_losses(per_dataset)} "
             f"({hybrid.train.eval_steps} batches, checkpoint step {step})", is_rank0)
        if universal_dir is not None:
            dist.barrier()  # every rank has loaded it
            if local_rank(rank) == 0:
                shutil.rmtree(universal_dir.parent, ignore_errors=True)
        return 0

    output_dir, save_dir = job.output_dir, job.save_dir
    if is_rank0:
        if job.start_over:
            info(f"train.overwrite: removed the previous run's {clear_previous_run(output_dir, save_dir)}", is_rank0)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(job.given if job.given is not None else job.raw, indent=1))
        (output_dir / "resolved_config.json").write_text(json.dumps(job.raw, indent=1))  # what ran: "auto" decided
        (output_dir / "placement.json").write_text(json.dumps(places, indent=1))
        (save_dir / HF_FILES_DIR).mkdir(parents=True, exist_ok=True)
        source.hf_config.save_pretrained(save_dir / HF_FILES_DIR)
        tokenizer = source.tokenizer_if_any()
        if tokenizer is not None:
            tokenizer.save_pretrained(save_dir / HF_FILES_DIR)
    dist.barrier()

    batch, seq = config.sequences_per_step, hybrid.data.seq_length
    flops = training_flops_per_token(job.shape, seq)
    peak = hybrid.train.peak_tflops or peak_tflops()
    logger = MetricsLogger(str(output_dir), hybrid.train.steps, batch * seq, dist.get_world_size(), flops, peak,
                           enabled=is_rank0, monitor=getattr(trainer.engine, "monitor", None))
    bounds = pipeline_parts(trainer.module) if trainer.uses_pipeline else None
    meta = tag_record(layout_record(layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, hybrid.pipeline_schedule,
                                    hybrid.virtual_pipeline_size, hybrid.partition_method, bounds,
                                    zero=trainer.config.zero_stage),
                      job.shape, source.hf_config, module_only=False)
    saver = CheckpointSaver(trainer, save_dir, meta, hybrid.checkpoint.keep_last, is_rank0,
                            asynchronous=hybrid.checkpoint.asynchronous,
                            idle_writer=hybrid.checkpoint.async_writer == "idle")
    # Checkpoints before samples_consumed was read back (and module-only ones) count steps of this run's batch.
    cursor = DataCursor(int(client.get("samples_consumed", step * batch)))
    if job.plan is not None and cursor.samples_consumed != step * batch:
        info(f"data: continuing at sample {cursor.samples_consumed:,} (the checkpoint's samples consumed; "
             f"{step} steps of this run's {batch} sequences would be {step * batch:,})", is_rank0)
    last_saved = step if job.plan is not None and not job.plan.module_only else None
    saves = SaveSchedule(hybrid.checkpoint.save_interval,
                         lambda at: saver.save(at, rng_state(), cursor.samples_consumed),
                         lambda at: save_dir / tag_for_step(at), last_saved)
    stop = StopRequest(device=get_accelerator().current_device_name())
    try:
        with Watchdog(hybrid.timeout_seconds, rank) as watchdog:
            return _step_loop(job, trainer, data, logger, saves, stop, watchdog, step, dp_rank, is_rank0, cursor,
                              saver)
    finally:
        trainer.close()  # a caller that runs the next job in this world gets this one's groups back


def _step_loop(job, trainer, data, logger, saves, stop, watchdog, step, dp_rank, is_rank0, cursor, saver) -> int:
    """Train from `step` to train.steps; each policy decides when it acts. A save in flight (hybrid3d.checkpoint.async)
    is committed once written, and waited for before the next save, at the end, at a stop and at a non-finite stop."""
    try:
        return _steps(job, trainer, data, logger, saves, stop, watchdog, step, dp_rank, is_rank0, cursor, saver)
    except NonFiniteError:  # every rank stops at the same step: the save in flight can still be committed
        committed(saver.finish(), logger, is_rank0)
        raise


def committed(report, logger, is_rank0: bool) -> None:
    """The line and metrics record of an asynchronous save just committed (`CheckpointSaver.poll`/`finish`)."""
    if report is not None:
        info(f"checkpoint {report['checkpoint']} committed: the step was held {report['held_s']:.2f} s for the copy "
             f"({report['copied_bytes'] / 2**20:,.1f} MiB), the files took {report['write_s']:.2f} s in the background",
             is_rank0)
        logger.checkpoint(report)


def _steps(job, trainer, data, logger, saves, stop, watchdog, step, dp_rank, is_rank0, cursor, saver) -> int:
    hybrid, layout, config = job.hybrid, job.layout, trainer.config
    batch = config.sequences_per_step
    evals, nonfinite = EvalSchedule(hybrid.train.eval_interval), NonFinitePolicy(hybrid.train.on_nonfinite)

    def save(at_step: int, wait: bool = False) -> Path:
        """`wait`: an asynchronous save is also committed before returning (the end, a stop)."""
        watchdog.beat(f"the checkpoint save at step {at_step}")
        in_flight = saver.in_flight
        path = saves.save(at_step)
        if saver.waited_seconds > 0.01 and in_flight is not None:
            info(f"checkpoint: the save at step {at_step} waited {saver.waited_seconds:.2f} s for the save of step "
                 f"{in_flight.step} to be written", is_rank0)
        if in_flight is not None and saver.in_flight is not in_flight:  # committed by that wait
            committed(saver.last_report, logger, is_rank0)
        if wait:
            committed(saver.finish(), logger, is_rank0)
        return path

    info(f"training steps {step + 1}-{hybrid.train.steps}; metrics -> {job.output_dir / 'metrics.jsonl'}", is_rank0)
    # fine-tuning data: the tokens the loss counts (answers), not the prompts and padding around them
    baseline, what = baseline_entropy(data.train) if is_rank0 else (None, None)
    if is_rank0:
        info(f"unigram entropy of the {what}: {baseline:.3f} nats (the loss of a model that knows only token "
             "frequencies)", is_rank0)
    last_eval = None
    while step < hybrid.train.steps:
        watchdog.beat(f"step {step + 1}")
        started = time.perf_counter()
        first = cursor.next_batch(batch)
        loss = trainer.train_step(micro_batches(data.train, first, batch, dp_rank, layout.dp, config.micro_batch_size,
                                                hybrid.data.document_mask))
        get_accelerator().synchronize()
        step_time = time.perf_counter() - started
        extra = {"samples_consumed": cursor.samples_consumed, **trainer.router_metrics()}  # routing: MoE only
        step += 1
        grad_norm = trainer.engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        lr = float(trainer.engine.get_lr()[0])
        try:
            warning = nonfinite.check(loss, grad_norm, step, last_checkpoint=saves.last_path())
        except NonFiniteError:
            logger.record(step, loss, lr, grad_norm, step_time, extra=extra)
            raise
        if warning and not weights_are_finite(trainer.module):  # 'skip' said the update was dropped: was it?
            logger.record(step, loss, lr, grad_norm, step_time, extra=extra)
            raise NonFiniteError(f"step {step} applied a non-finite update under train.on_nonfinite=skip (the "
                                 f"weights now hold NaN or inf); the last checkpoint is {saves.last_path() or 'none'}")
        if warning:
            info(warning, is_rank0)
        eval_loss, per_dataset = None, None
        if evals.due(step):
            watchdog.beat(f"the evaluation at step {step}")
            eval_loss, per_dataset = evaluate(trainer, data, job, dp_rank)
            last_eval = eval_loss
        should_log = step % hybrid.train.log_interval == 0 or step == hybrid.train.steps or eval_loss is not None
        # after a signal the console carries only the stop line: the launcher may have returned already
        logger.record(step, loss, lr, grad_norm, step_time, eval_loss, log=should_log or warning is not None,
                      extra=extra, echo=stop.signal_name is None, eval_losses=per_dataset)
        if saves.due(step):
            save(step)
        committed(saver.poll(), logger, is_rank0)
        if stop.agreed():
            who = stop.who()
            path = save(step, wait=True)
            # the last line of the job: nothing is printed after it (run_job's teardown is silent)
            info(f"stopped by {who} after step {step}; checkpoint {path} committed (resume with --checkpoint.load "
                 f"{'latest' if path.parent == job.save_dir else path.parent})", is_rank0)
            return 0
    path = save(step, wait=True)
    if last_eval is not None and is_rank0:
        side = "below" if last_eval <= baseline else "above"
        info(f"last eval loss {last_eval:.4f}: {abs(baseline - last_eval):.3f} nats {side} the unigram entropy "
             f"{baseline:.3f}", is_rank0)
    info(f"done: {step} steps; checkpoint {path}; metrics {job.output_dir / 'metrics.jsonl'}", is_rank0)
    return 0
