"""Rank-side code for tests/test_pipeline_zero2.py: train, save, resume and report per run.

A run is a dict: name, case ('gqa' or 'tied'), tp, pp, zero, optional `extra` (DeepSpeed keys),
`hybrid` (hybrid3d keys), `save_at` (steps before saving; the run then resumes from that checkpoint
in a fresh trainer and trains to the end again), `load` ((folder, tag) of a universal checkpoint to
start from, at step `start`), `probe` (count gradient bytes during the second step,
`hybrid3d.memory_probe.PeakProbe`).
"""

import gc


from tests.distributed.async_saves import save_both_ways
from tests.distributed.worlds import each_run
from tests.distributed.engine_runs import STEPS, ds_config, micro_batches
from tests.tiny_llama import load_hf


def _config(run: dict) -> dict:
    config = ds_config(run["tp"], run["pp"], run["zero"], **run.get("extra", {}))
    config["hybrid3d"].update(run.get("hybrid", {}))
    return config


def _build(run: dict, model_dir: str):
    import deepspeed.comm as dist

    from hybrid3d.model import LlamaShape
    from hybrid3d.model.layers import DecoderBlock
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run

    hf = load_hf(model_dir)
    trainer = build_trainer(validate_run(_config(run), dist.get_world_size(), LlamaShape.from_hf(hf.config)),
                            hf_state_dict=hf.state_dict())
    forwards = [0]
    for module in trainer.module.modules():
        if isinstance(module, DecoderBlock):
            module.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    return trainer, forwards


def _weights(trainer) -> dict:
    from hybrid3d.model.hf_weights import gather_hf_state_dict

    return {k: v.float().clone() for k, v in gather_hf_state_dict(
        trainer.module, trainer.shape, trainer.groups.tensor_parallel()).items()}


def _train(trainer, forwards, steps, probe=None) -> tuple[list, list]:
    dp_rank, dp = trainer.groups.data_shard()  # d, not DeepSpeed's d·c: the CP ranks of a shard read alike
    losses, forwards_per_step = [], []
    for step in steps:
        if probe is not None:
            probe.enabled = step == 1  # Adam's moments exist from the first step on
        before = forwards[0]
        losses.append(trainer.train_step(micro_batches(step, dp_rank, dp)))
        forwards_per_step.append(forwards[0] - before)
    return losses, forwards_per_step


def run_one(run: dict, model_dirs: dict, ckpt_dir: str) -> dict:
    import deepspeed.comm as dist

    model_dir = model_dirs[run["case"]]
    trainer, forwards = _build(run, model_dir)
    optimizer = trainer.engine.optimizer
    report = {"engine": type(trainer.engine).__name__, "optimizer": type(optimizer).__name__,
              "partition_gradients": bool(getattr(optimizer, "partition_gradients", False)),
              "stage": trainer.groups.stage_id, "tp_rank": trainer.groups.get_tensor_model_parallel_rank(),
              "dp_rank": trainer.groups.get_data_parallel_rank(),
              "blocks_on_rank": sum(1 for m in trainer.module.modules() if type(m).__name__ == "DecoderBlock")}
    start = 0
    if "load" in run:
        folder, tag = run["load"]
        trainer.load(folder, tag=tag, module_only=False)
        report["loaded_weights"] = _weights(trainer)
        start = run["start"]
    save_at = run.get("save_at")
    if save_at is None:
        probe = None
        if run.get("probe"):
            from hybrid3d.ds_internals.memory_probe import PeakProbe

            probe = PeakProbe(trainer.engine)
        report["losses"], report["forwards_per_step"] = _train(trainer, forwards, range(start, STEPS), probe)
        if probe is not None:
            report["grads"] = {label: s.by_category["grads"] for label, s in probe.snapshots.items()}
    else:
        first, _ = _train(trainer, forwards, range(save_at))
        # the resume below and the universal run load the background-written files
        report["async_files"] = save_both_ways(trainer, ckpt_dir, run["name"])
        report["saved_weights"] = _weights(trainer)
        rest, _ = _train(trainer, forwards, range(save_at, STEPS))
        report["losses"] = first + rest
    report["weights"] = _weights(trainer)
    if getattr(trainer.module, "tied_modules", None):
        report["tied_copy"] = {key: m.weight.detach().float().clone() for key, m in trainer.module.tied_modules.items()}
    dist.barrier()
    del trainer, optimizer
    gc.collect()
    if save_at is not None:
        resumed, forwards = _build(run, model_dir)
        resumed.load(ckpt_dir, tag=run["name"], module_only=False)
        report["resumed_losses"], _ = _train(resumed, forwards, range(save_at, STEPS))
        report["resumed_weights"] = _weights(resumed)
        dist.barrier()
        del resumed
        gc.collect()
    return report


def train_runs(rank, world_size, runs, model_dirs, ckpt_dir):
    return each_run(runs, lambda run: run_one(run, model_dirs, ckpt_dir))
