"""TORCH_CUDA_ARCH_LIST with arch-specific targets (`9.0a`, as the lent H200's environment sets it) is rewritten
so that DeepSpeed's JIT op builder, which FusedAdam runs on a GPU's first step, can parse it."""

import os

import pytest
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builder, whatever the accelerator

from hybrid3d.ds_internals.op_build_arch import deepspeed_readable_arch_list, make_arch_list_readable_for_op_builds


def _deepspeed_parses(monkeypatch, value: str) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    builder = FusedAdamBuilder()
    builder.jit_mode = True  # as in builder.load() -> jit_load()
    builder.compute_capability_args()


def test_deepspeed_cannot_parse_an_arch_specific_target_and_reads_the_rewritten_list(monkeypatch):
    with pytest.raises(ValueError, match="'0a'"):  # what the H200 run hit (benchmarks/results/2026-12-04-h200)
        _deepspeed_parses(monkeypatch, "9.0a")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0f+PTX")
    note = make_arch_list_readable_for_op_builds()
    assert "'8.0;9.0a 10.0f+PTX' read as '8.0;9.0 10.0+PTX'" in note
    _deepspeed_parses(monkeypatch, os.environ["TORCH_CUDA_ARCH_LIST"])


def test_a_list_deepspeed_reads_is_left_alone(monkeypatch):
    for value in ["9.0", "8.0;8.6+PTX", "7.5 8.0"]:
        assert deepspeed_readable_arch_list(value) == value
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        assert make_arch_list_readable_for_op_builds() is None
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert make_arch_list_readable_for_op_builds() is None
