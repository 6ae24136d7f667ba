"""Rank-side code for the engine tests: build trainers, train, and report what the tests check."""

import gc
from pathlib import Path


from tests.distributed.async_saves import save_both_ways
from tests.distributed.worlds import each_run
from tests.distributed.engine_runs import STEPS, ds_config, indexed_micro_batches, micro_batches
from tests.tiny_llama import load_hf
from tests.counters import DrawCounter


def run_one(run: dict, model_dirs: dict, save_root: str = "") -> dict:
    import deepspeed.comm as dist
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    from hybrid3d.ds_internals import pipeline_stage_layers
    from hybrid3d.ds_internals.timeline import InstructionTimeline, SavedActivationProbe
    from hybrid3d.ds_internals.zero3 import full_numel, offloaded, partition_numels
    from hybrid3d.model import LlamaShape
    from hybrid3d.model.hf_weights import gather_hf_state_dict
    from hybrid3d.model.layers import DecoderBlock
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run

    hf = load_hf(model_dirs[run["case"]])
    shape = LlamaShape.from_hf(hf.config)
    config = ds_config(run["tp"], run["pp"], run["zero"], **run.get("extra", {}))
    config["hybrid3d"].update(run.get("hybrid", {}))  # sequence_parallel, context_parallel_size, ...
    if "optimizer" in run:
        config["optimizer"] = run["optimizer"]
    for key in ("offload_optimizer", "offload_param"):  # NVMe offload: swap files in a folder of the run's own
        offload = config["zero_optimization"].get(key, {})
        if offload.get("device") == "nvme":
            offload["nvme_path"] = str(Path(save_root) / run["name"] / "nvme")
    auto_lines = []
    if "auto" in run:  # "auto" keys decided as launch/train.py decides them, before the one validation pass
        config, auto_lines = decide_auto(config, run["auto"], shape, dist.get_world_size())
    with DrawCounter() as build_draws:  # HF weights follow: nothing to draw
        trainer = build_trainer(validate_run(config, dist.get_world_size(), shape), hf_state_dict=hf.state_dict())
    del hf

    block_forwards = [0]
    block_inputs = set()  # shapes of the decoder blocks' inputs: (b, s/(c·t), h) with SP and CP
    for module in trainer.module.modules():
        if isinstance(module, DecoderBlock):
            module.register_forward_hook(lambda *_: block_forwards.__setitem__(0, block_forwards[0] + 1))
            module.register_forward_pre_hook(lambda _, args: block_inputs.add(tuple(args[0].shape)))

    dp_rank, dp = trainer.groups.data_shard()  # the CP ranks of a data shard read the same batches
    batches, data_summary = (indexed_micro_batches(run["data_prefix"]) if "data_prefix" in run
                             else (micro_batches, None))
    losses, grad_norms, forwards_per_step = [], [], []
    timeline = InstructionTimeline(trainer.engine) if trainer.uses_pipeline else None
    for step in range(STEPS):
        before = block_forwards[0]
        with SavedActivationProbe(trainer.module.parameters()) as probe:
            losses.append(trainer.train_step(batches(step, dp_rank, dp, trainer.config.micro_batch_size)))
        norm = trainer.engine.get_global_grad_norm()  # before clipping
        grad_norms.append(None if norm is None else float(norm))
        forwards_per_step.append(block_forwards[0] - before)

    if run.get("save"):  # a checkpoint for the export tests, next to the world's results
        trainer.save(str(Path(save_root) / run["name"]), client_state={})
    async_files = None
    if run.get("async_save"):
        async_files = save_both_ways(trainer, str(Path(save_root) / run["name"]), "async")
    optimizer = trainer.engine.optimizer
    report = {
        "build_draws": build_draws.drawn,
        "async_files": async_files,
        "data_summary": data_summary,
        "losses": losses,
        "grad_norms": grad_norms,
        "weights": {k: v.float().cpu() for k, v in gather_hf_state_dict(
            trainer.module, trainer.shape, trainer.groups.tensor_parallel()).items()},
        "blocks_on_rank": sum(isinstance(m, DecoderBlock) for m in trainer.module.modules()),
        "compiled_blocks": sum(isinstance(m, DecoderBlock) and m._compiled_call_impl is not None  # nn.Module.compile's
                               for m in trainer.module.modules()),
        "stage_layers": pipeline_stage_layers(trainer.module) if trainer.uses_pipeline else None,
        # what the instruction timeline saw over the run, and the activations autograd held in the last step
        "passes": [(r.name, r.kwargs.get("chunk", r.kwargs.get("phase", 0)), r.kwargs["buffer_id"])
                   for r in timeline.passes()] if timeline else None,
        "saved_peak": probe.peak, "saved_after_step": probe.live,
        "forwards_per_step": forwards_per_step,
        "block_inputs": sorted(block_inputs),
        "optimizer": type(optimizer).__name__,
        "engine": type(trainer.engine).__name__,
        "inner_optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "param_dtypes": sorted({str(p.dtype) for p in trainer.module.parameters()}),
        "local_numel": sum(p.numel() for p in trainer.module.parameters()),
        "local_full_numel": sum(full_numel(p) for p in trainer.module.parameters()),  # ZeRO-3's whole tensors
        # One set of process groups: the pipeline engine runs on the layout's grid, not a second one.
        "shared_grid": getattr(trainer.engine, "grid", trainer.groups.grid) is trainer.groups.grid,
        "dp_rank": dp_rank,
        "stage": trainer.groups.stage_id,
        "tp_rank": trainer.groups.get_tensor_model_parallel_rank(),
        "ckpt_flags": dict(partition=ds_ckpt.PARTITION_ACTIVATIONS, contiguous=ds_ckpt.CONTIGUOUS_CHECKPOINTING,
                           cpu=ds_ckpt.CPU_CHECKPOINT, synchronize=ds_ckpt.SYNCHRONIZE, profile=ds_ckpt.PROFILE_TIME,
                           num_checkpoints=ds_ckpt.num_layers),
    }
    report["auto_lines"] = auto_lines
    report["layout"] = (trainer.layout.tp, trainer.layout.pp, trainer.layout.cp, trainer.layout.dp,
                        trainer.config.zero_stage, trainer.config.micro_batch_size)
    report["partitioned"] = partition_numels(trainer.module.parameters())  # ZeRO-3: (held, whole); (0, 0) else
    report["offloaded"] = offloaded(optimizer)
    if report["optimizer"] == "BF16_Optimizer":
        report["master_dtypes"] = sorted({str(t.dtype) for t in optimizer.fp32_groups_flat_partition})
        report["master_numel"] = sum(t.numel() for t in optimizer.fp32_groups_flat_partition)
    dist.barrier()
    trainer.close()
    del trainer, optimizer
    gc.collect()
    return report


def decide_auto(config: dict, auto: dict, shape, world_size: int) -> tuple[dict, list[str]]:
    """`config` with the hybrid3d keys of `auto` ("auto" values, `layout`, `device_memory_gb`) written in, the
    micro-batch and ZeRO stage left to "auto" when `layout` is, then decided (training/auto_start.py)."""
    from hybrid3d.config.request import request_from
    from hybrid3d.training.auto_start import resolve_auto

    if auto.get("layout") == "auto":  # what the run's dict does not give is left open
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            config["hybrid3d"].pop(key)
        config.pop("train_micro_batch_size_per_gpu")
        config["zero_optimization"].pop("stage")
    config["hybrid3d"].update(auto)
    return resolve_auto(request_from(config), shape, world_size, on_cpu=True)


def train_runs(rank, world_size, runs, model_dirs, save_root: str = ""):
    return each_run(runs, lambda run: with_autograd_warnings(run_one, run, model_dirs, save_root))


def with_autograd_warnings(fn, *args) -> dict:
    """fn's report plus the warnings of autograd's fallback for operators without an autograd kernel that the run
    raised (DeepSpeed's broadcast of tied weights did, ds_internals/tied_sync.py): every time, not once a process."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = fn(*args)
    report["autograd_warnings"] = sorted({str(w.message)[:80] for w in caught
                                          if "autograd kernel was not registered" in str(w.message)})
    return report
