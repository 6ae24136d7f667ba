"""Rank-side code for the memory-model test: train a few steps per configuration and count the
model-state bytes the optimizer holds (`hybrid3d.memory_probe`)."""

import gc

import torch

from tests.distributed.worlds import each_run

SHAPES = {
    # GQA, untied: kv heads split over TP.
    "gqa": dict(vocab_size=203, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                head_dim=16),
    # Tied embedding: a copy on the first and the last stage.
    "tied": dict(vocab_size=203, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=4,
                 head_dim=16, tie_word_embeddings=True),
    # One kv head: replicated on every rank at TP4.
    "mqa": dict(vocab_size=203, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=1,
                head_dim=16),
}
# Mixture of experts: 6 experts of 48 (3 per rank at EP2) beside a dense first block of 128: DeepSpeed's expert
# parameter group, partitioned over the expert-data-parallel ranks
SHAPES["moe"] = dict(SHAPES["gqa"], model_type="qwen3_moe", qk_norm=True, num_experts=6, experts_per_token=3, moe_intermediate_size=48, dense_layers=(0,))
MICRO_BATCH, SEQ, GAS, BUCKET = 2, 16, 2, 20000


def ds_config(tp: int, pp: int, dp: int, zero: int, precision: str, ep: int = 1) -> dict:
    config = {
        "train_batch_size": MICRO_BATCH * GAS * dp,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET},
        "steps_per_print": 10**6,
        "hybrid3d": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "expert_parallel_size": ep},
    }
    if precision != "fp32":
        config["bf16"] = {"enabled": True}
    if precision == "bf16+fp32acc":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def measure(run: dict) -> dict:
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.memory_probe import PeakProbe
    from hybrid3d.model import LlamaShape
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run

    shape = LlamaShape(**SHAPES[run["shape"]])
    world = dist.get_world_size()
    dp = world // (run["tp"] * run["pp"])
    trainer = build_trainer(validate_run(ds_config(run["tp"], run["pp"], dp, run["zero"], run["precision"], run["ep"]), world, shape))
    probe = PeakProbe(trainer.engine)
    generator = torch.Generator().manual_seed(0)

    def batches():
        while True:
            tokens = torch.randint(0, shape.vocab_size, (MICRO_BATCH, SEQ + 1), generator=generator)
            yield tokens[:, :-1], tokens[:, 1:]

    data = batches()
    for step in range(2):
        probe.enabled = step == 1  # Adam's moments exist from the first step on
        trainer.train_step(data)
    report = {
        "wrapper": type(trainer.engine.optimizer).__name__,
        "stage": trainer.groups.stage_id,
        "dp_rank": trainer.groups.get_data_parallel_rank(),
        "measured": {label: snap.by_category for label, snap in probe.snapshots.items()},
        "other": {label: snap.other_names for label, snap in probe.snapshots.items()},
        "numels": [p.numel() for p in trainer.module.parameters()],
    }
    dist.barrier()
    del trainer, probe
    gc.collect()
    return report


def measure_runs(rank, world_size, runs):
    return each_run(runs, measure)
