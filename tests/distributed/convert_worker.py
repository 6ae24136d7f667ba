"""Rank-side code for the conversion tests: load converted checkpoints into trainers, train, save,
and run `hybrid3d.verify`; everything is returned to the pytest process for checking."""

import gc

import numpy as np

from tests.distributed.engine_runs import STEPS, ds_config, micro_batches

EVAL_STEP = 100  # the global batch used for evaluation, never trained on


def train_from_converted(job: dict) -> dict:
    import deepspeed.comm as dist
    from transformers import AutoConfig

    from hybrid3d.model import LlamaShape
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run

    shape = LlamaShape.from_hf(AutoConfig.from_pretrained(job["hf_dir"]))
    config = ds_config(job["tp"], job["pp"], job["zero"])
    config["hybrid3d"].update(job.get("hybrid", {}))  # the pipeline schedule
    trainer = build_trainer(validate_run(config, dist.get_world_size(), shape))  # random init, then load
    client = trainer.load(job["checkpoint"])
    steps_after_load = trainer.global_steps
    dp_rank, dp = trainer.groups.data_shard()  # d, not DeepSpeed's d·c: the CP ranks of a shard read alike
    first_eval = trainer.eval_step(micro_batches(EVAL_STEP, dp_rank, dp))
    losses = [trainer.train_step(micro_batches(step, dp_rank, dp)) for step in range(STEPS)]
    last_eval = trainer.eval_step(micro_batches(EVAL_STEP, dp_rank, dp))
    if job["keep_client_state"]:  # what the converter stored travels on into the training checkpoint
        state = {key: client[key] for key in ("hybrid3d", "universal_checkpoint_info")}
    else:  # as the training entry point does: no HF config, and numpy's RNG state
        state = {"rng": {"numpy": np.random.get_state()}}
    trainer.save(job["save_dir"], client_state=state)
    dist.barrier()
    del trainer
    gc.collect()
    return {"client_keys": sorted(client), "steps_after_load": steps_after_load, "first_eval": first_eval,
            "losses": losses, "last_eval": last_eval}


def convert_world(rank, world_size, jobs: list, verify_runs: dict) -> dict:
    from hybrid3d.convert.verify import main as verify_main

    results = {job["name"]: train_from_converted(job) for job in jobs}
    results["verify"] = {name: verify_main(argv) for name, argv in verify_runs.items()}
    return results
