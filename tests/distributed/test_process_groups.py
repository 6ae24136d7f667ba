"""The process groups a trainer makes: each waits `2 * hybrid3d.timeout_seconds` in a collective (torch's default
for a group made without a timeout is 10 minutes on NCCL, 30 on gloo, which would abort a hang before hybrid3d's
Watchdog reports it), and a pooled world ends them between calls (on gloo each keeps two threads)."""

from datetime import timedelta

from tests.distributed.worlds import run_world

TIMEOUT_SECONDS = 41  # no default of torch's or hybrid3d's is near it


def _group_timeouts(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as torch_dist

    from hybrid3d.ds_internals.process_groups import release_process_groups
    from hybrid3d.model import LlamaShape
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run
    from tests.distributed.engine_runs import ds_config

    shape = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8)
    config = ds_config(2, 2, 1)
    config["hybrid3d"]["timeout_seconds"] = TIMEOUT_SECONDS
    trainer = build_trainer(validate_run(config, world_size, shape))
    world = torch_dist.distributed_c10d._get_default_group()
    timeouts = [pg._get_backend(torch.device("cpu")).options._timeout
                for pg in torch_dist.distributed_c10d._world.pg_map if pg is not world]
    del trainer
    released = release_process_groups()
    left = [pg for pg in torch_dist.distributed_c10d._world.pg_map if pg is not world]
    return {"timeouts": timeouts, "released": released, "left": len(left)}


def test_every_group_waits_the_configured_timeout_and_ends_between_calls(tmp_path):
    for result in run_world(_group_timeouts, 4, str(tmp_path)):
        assert len(result["timeouts"]) >= 4, result  # the grid's TP, DP, pipe and model groups at least
        assert set(result["timeouts"]) == {timedelta(seconds=2 * TIMEOUT_SECONDS)}, result
        assert result["released"] == len(result["timeouts"]) and result["left"] == 0, result
