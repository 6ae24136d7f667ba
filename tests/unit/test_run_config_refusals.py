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
    (lambda c: c["zero_optimization"].update(stage=3), "zero_optimization.stage=3 runs with "
                                                       "hybrid3d.pipeline_parallel_size 1 only"),
    (lambda c: c["hybrid3d"].update(loss_chunk_tokens=-1), "hybrid3d.loss_chunk_tokens must be >= 0, got -1"),
    (lambda c: c["hybrid3d"].update(checkpoint={"async": True, "async_writer": "low"}),
     "hybrid3d.checkpoint.async_writer must be one of idle, normal, got 'low'"),
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


OFFLOAD_CPU = {"device": "cpu"}


@pytest.mark.parametrize("zero, needle", [
    ({"stage": 4}, "zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
    ({"stage": 0, "offload_optimizer": OFFLOAD_CPU}, "zero_optimization.offload_optimizer needs zero_optimization."
                                                     "stage 1, 2 or 3"),
    ({"stage": 2, "offload_param": OFFLOAD_CPU}, "zero_optimization.offload_param needs zero_optimization.stage 3"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "zero_optimization.offload_param.device nvme needs "
                                                         "zero_optimization.offload_param.nvme_path"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
     "zero_optimization.offload_optimizer.device nvme needs zero_optimization.stage 3, got 2"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
     "zero_optimization.offload_optimizer.ratio < 1 (a partial offload) needs zero_optimization.stage 3"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0}}, "offload_optimizer.ratio must be in (0, 1]"),
    ({"stage": 3, "offload_optimizer": {"device": "gpu"}}, "offload_optimizer.device must be one of none, cpu, nvme"),
    ({"stage": 3, "offload_optimizer": "cpu"}, "zero_optimization.offload_optimizer must be a JSON object"),
    ({"stage": 2, "cpu_offload": True}, "zero_optimization.cpu_offload is DeepSpeed's old spelling"),
    ({"stage": 3, "zero_hpz_partition_size": 2}, "zero_optimization.zero_hpz_partition_size builds its groups from "
                                                 "the whole world"),
])
def test_zero3_and_offload_keys_are_refused_with_the_key(zero, needle):
    """TP2 x DP2 without a pipeline, where ZeRO-3 runs: each offload or ZeRO-3 key DeepSpeed would take wrongly."""
    config = ds_config(tp=2, pp=1, zero=1)
    config["zero_optimization"] = zero
    with pytest.raises(ConfigError) as err:
        parse_config(config, world_size=4, num_layers=4, on_cpu=True)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("zero", [{"stage": 3}, {"stage": 3, "offload_param": OFFLOAD_CPU,
                                                 "offload_optimizer": OFFLOAD_CPU},
                                  {"stage": 1, "offload_optimizer": OFFLOAD_CPU},
                                  {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "ratio": 0.3}}])
def test_zero3_and_offload_are_accepted(zero):
    config = ds_config(tp=2, pp=1, zero=1)
    config["zero_optimization"] = zero
    assert parse_config(config, world_size=4, num_layers=4, on_cpu=True).zero_stage == zero["stage"]


def test_zero3_support_table_refusals_name_what_works():
    """validate_run's ZeRO-3 rows (config.support.check_zero3): experts, the chunked loss, compiled blocks."""
    import dataclasses

    from transformers import LlamaConfig

    from hybrid3d.model import LlamaShape
    from hybrid3d.config.validation import validate_run

    shape = LlamaShape.from_hf(LlamaConfig(vocab_size=203, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2))
    cases = [
        ({}, dataclasses.replace(shape, num_experts=4), "zero_optimization.stage=3 is not supported with a "
                                                        "mixture-of-experts model yet (use stage 1 or 2)"),
        ({"loss_chunk_tokens": 8}, shape, "hybrid3d.loss_chunk_tokens cannot run with zero_optimization.stage=3"),
        ({"compile": {"enabled": True}}, shape, "hybrid3d.compile.enabled is not supported with "
                                                "zero_optimization.stage=3"),
    ]
    for hybrid, model_shape, needle in cases:
        config = ds_config(tp=1, pp=1, zero=3)
        config["hybrid3d"].update(hybrid)
        with pytest.raises(ConfigError) as err:
            validate_run(config, 2, model_shape)
        assert str(err.value).startswith(needle), err.value
    assert validate_run(ds_config(tp=1, pp=1, zero=3), 2, shape).config.zero_stage == 3


def test_nvme_offload_without_libaio_is_one_line(monkeypatch):
    """`device: nvme` swaps through DeepSpeed's async I/O op; where it cannot build (no libaio) the build stops
    before DeepSpeed's swapper with one line naming the key and the package."""
    from deepspeed.accelerator import get_accelerator

    from hybrid3d.ds_internals.zero3 import check_nvme_offload

    class Incompatible:
        def is_compatible(self, verbose=False):
            return False

    monkeypatch.setattr(get_accelerator(), "get_op_builder", lambda name: Incompatible)
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}
    with pytest.raises(UserError, match=r"^zero_optimization.offload_param.device nvme needs DeepSpeed's async I/O "
                                        r"op, which needs libaio .*libaio-dev\)$"):
        check_nvme_offload(nvme)
    check_nvme_offload({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})  # nothing to check
