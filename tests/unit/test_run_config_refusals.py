"""Config-only refusals and completions of parse_config (no process group): the layout, ZeRO, batch and
activation-checkpointing keys of the engine tests (moved from tests/distributed/test_engine.py) and the
pipeline_zero2 keys (from tests/distributed/test_pipeline_zero2.py)."""

import pytest

from hybrid3d.config.run_config import parse_config
from hybrid3d.errors import ConfigError, UserError
from tests.distributed.engine_runs import ds_config


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c["zero_optimization"].update(stage=2), "zero_optimization.stage=2 cannot run with "
                                                       "hybrid3d.pipeline_parallel_size=2 unless "
                                                       "hybrid3d.pipeline_zero2=true"),
    (lambda c: c.update(train_batch_size=10, gradient_accumulation_steps=4),
     "train_batch_size (10) != train_micro_batch_size_per_gpu (2) * gradient_accumulation_steps (4) * "
     "data-parallel size (1)"),
    (lambda c: c.update(train_batch_size=9), "train_batch_size (9) is not divisible by train_micro_batch_size_per_gpu"),
    (lambda c: c.update(gradient_accumulation_steps=3), "gradient_accumulation_steps (3)"),
    (lambda c: c["hybrid3d"].update(tensor_parallel_sizes=2), "hybrid3d.tensor_parallel_sizes is not a known key"),
    (lambda c: c["hybrid3d"].update(tensor_parallel_size=0), "hybrid3d.tensor_parallel_size must be >= 1, got 0"),
    (lambda c: c["hybrid3d"].update(tensor_parallel_size=3), "world size 4 is not divisible"),
    (lambda c: c.update(activation_checkpointing={"cpu_checkpointing": True}),
     "activation_checkpointing.cpu_checkpointing needs activation_checkpointing.partition_activations"),
    (lambda c: c.update(activation_checkpointing={"contiguous_memory_optimization": True}),
     "activation_checkpointing.contiguous_memory_optimization needs activation_checkpointing.partition_activations"),
    (lambda c: c.update(pipeline={"activation_checkpoint_interval": 1}, activation_checkpointing={
        "contiguous_memory_optimization": True, "partition_activations": True, "number_checkpoints": 3}),
     "activation_checkpointing.number_checkpoints (3) is below the 4 checkpoints"),
    (lambda c: c.update(pipeline={"activation_checkpoint_interval": 1, "use_reentrant": False},
                        activation_checkpointing={"profile": True}),
     "activation_checkpointing.profile works only with pipeline.use_reentrant=true"),
    (lambda c: c.update(pipeline={"activation_checkpoint_interval": -1}),
     "pipeline.activation_checkpoint_interval must be an integer >= 0"),
    (lambda c: c.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"},
                        zero_optimization={"stage": 0}), "data_types.grad_accum_dtype=fp32 with bf16 needs"),
    (lambda c: c["zero_optimization"].update(stage=3), "zero_optimization.stage=3 is not supported"),
    (lambda c: c["hybrid3d"].update(loss_chunk_tokens=-1), "hybrid3d.loss_chunk_tokens must be >= 0, got -1"),
])
def test_bad_configs_are_refused_with_the_key(edit, needle):
    config = ds_config(tp=2, pp=2, zero=1)
    edit(config)
    with pytest.raises(UserError) as err:  # ConfigError, or the layout's LayoutError
        parse_config(config, world_size=4, num_layers=4, on_cpu=True)
    message = str(err.value)
    assert needle in message and "\n" not in message


def test_batch_sizes_are_completed():
    config = ds_config(tp=1, pp=2, zero=1)
    del config["train_batch_size"]
    config["gradient_accumulation_steps"] = 3
    parsed = parse_config(config, world_size=4)
    assert parsed.ds_config["train_batch_size"] == 2 * 3 * 2
    assert "hybrid3d" not in parsed.ds_config


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c["zero_optimization"].update(stage=2),
     "zero_optimization.stage=2 cannot run with hybrid3d.pipeline_parallel_size=2 unless "
     "hybrid3d.pipeline_zero2=true"),
    (lambda c: c["hybrid3d"].update(pipeline_zero2=True), "hybrid3d.pipeline_zero2 needs zero_optimization.stage=2"),
    (lambda c: (c["hybrid3d"].update(pipeline_zero2=True, pipeline_parallel_size=1, tensor_parallel_size=1),
                c["zero_optimization"].update(stage=2)), "hybrid3d.pipeline_zero2 applies to"),
    (lambda c: (c["hybrid3d"].update(pipeline_zero2=True),
                c["zero_optimization"].update(stage=2, offload_optimizer={"device": "cpu"})),
     "zero_optimization.offload_optimizer is not supported with hybrid3d.pipeline_zero2"),
    (lambda c: c["hybrid3d"].update(pipeline_zero2_deferred_fraction=0.5),
     "hybrid3d.pipeline_zero2_deferred_fraction needs hybrid3d.pipeline_zero2=true"),
    (lambda c: (c["hybrid3d"].update(pipeline_zero2=True, pipeline_zero2_deferred_fraction=1.5),
                c["zero_optimization"].update(stage=2)), "must be between 0 and 1, got 1.5"),
])
def test_bad_pipeline_zero2_configs_are_refused(edit, needle):
    config = ds_config(tp=2, pp=2, zero=1)
    edit(config)
    with pytest.raises(ConfigError) as err:
        parse_config(config, world_size=4, num_layers=4, on_cpu=True)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_opt_in_is_accepted():
    config = ds_config(tp=1, pp=2, zero=2)
    config["hybrid3d"].update(pipeline_zero2=True, pipeline_zero2_deferred_fraction=0.25)
    parsed = parse_config(config, world_size=4, num_layers=4, on_cpu=True)
    assert parsed.hybrid.pipeline_zero2 and parsed.zero_stage == 2
