"""The memory model against the ZeRO paper and hand counts; the FLOPs formula against torch's FLOP
counter on the Hugging Face model. (The model against DeepSpeed's real tensors: tests/distributed/test_memory.py.)"""

import pytest
import torch

from hybrid3d.model import LlamaShape
from hybrid3d.model.presets import PRESETS, preset_config
from hybrid3d.planning.flops import matmul_parameters, peak_tflops, training_flops_per_token
from hybrid3d.planning.memory import (
    activation_bytes,
    activation_bytes_per_layer,
    in_flight_micro_batches,
    model_parameters,
    rank_model_states,
    stage_parameter_numels,
    zero_paper_bytes,
)
from tests.distributed.memory_worker import SHAPES


def test_zero_paper_table_1():
    """Rajbhandari et al. 2020, Table 1 / Fig. 1: Ψ = 7.5B, Nd = 64, K = 12."""
    psi, nd = 7.5e9, 64
    assert zero_paper_bytes(psi, nd, 0) / 1e9 == pytest.approx(120, abs=0.05)
    assert zero_paper_bytes(psi, nd, 1) / 1e9 == pytest.approx(31.4, abs=0.05)
    assert zero_paper_bytes(psi, nd, 2) / 1e9 == pytest.approx(16.6, abs=0.05)


def test_published_parameter_counts():
    """Parameter totals of the released checkpoints: 6.74B, 8.03B, 1.236B (tied), 70.55B."""
    expected = {"llama2-7b": 6.74e9, "llama3-8b": 8.03e9, "llama3.2-1b": 1.236e9, "llama3-70b": 70.55e9}
    for name, count in expected.items():
        assert model_parameters(LlamaShape.from_hf(preset_config(name))) == pytest.approx(count, rel=2e-3), name
    with pytest.raises(KeyError, match="known: tiny, llama2-7b"):
        preset_config("llama9")
    assert set(PRESETS) == {"tiny", "llama2-7b", "llama3-8b", "llama3.2-1b", "llama3-70b"}


def test_hand_counted_tiny_model_per_layout():
    """Ψ per rank counted by hand for the gqa shape (h 64, f 128, 4 layers, V 203 -> 256 at t<=2)."""
    shape = LlamaShape(**SHAPES["gqa"])
    block = 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 64 + 3 * 64 * 128  # norms, q, k, v, o, gate/up/down
    embed = 256 * 64
    assert sum(stage_parameter_numels(shape, 1, 1, 0)) == embed + 4 * block + 64 + embed
    assert sum(stage_parameter_numels(shape, 1, 2, 0)) == embed + 2 * block
    assert sum(stage_parameter_numels(shape, 1, 2, 1)) == 2 * block + 64 + embed
    tp_block = 64 + 32 * 64 + 2 * 16 * 64 + 32 * 64 + 64 + 3 * 64 * 64
    assert sum(stage_parameter_numels(shape, 2, 2, 1)) == 2 * tp_block + 64 + 128 * 64
    # ZeRO-1 on BF16_Optimizer: 2Ψ + 2Ψ (bf16 .grad) + 4Ψ buffer + 12Ψ/Nd, Ψ a multiple of 2·Nd here.
    psi = embed + 2 * block
    states = rank_model_states(shape, 1, 2, 2, 1, "bf16+fp32acc", stage=0).peak
    assert states.total == 2 * psi + 2 * psi + 4 * psi + 12 * psi // 2 + 4


def test_flops_match_torch_flop_counter():
    """6N + 12·L·h·s per token against FlopCounterMode over forward + backward of HF LlamaForCausalLM
    (eager attention, so QKᵀ and AV are counted as matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    for kv, tied in ((2, False), (4, True)):
        config = LlamaConfig(vocab_size=203, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=kv, tie_word_embeddings=tied,
                             attn_implementation="eager")
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        b, s = 2, 24
        with FlopCounterMode(display=False) as counter:
            model(torch.randint(0, 203, (b, s))).logits.sum().backward()
        shape = LlamaShape.from_hf(config)
        assert training_flops_per_token(shape, s) * b * s == counter.get_total_flops()
        assert matmul_parameters(shape) < model_parameters(shape) + (203 * 64 if tied else 0)


def test_peak_lookup():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe") == pytest.approx(756.0)
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == pytest.approx(312.0)
    assert peak_tflops("cpu") is None
    assert peak_tflops("cpu", override=2.5) == 2.5
    with pytest.raises(ValueError):
        peak_tflops(override=0)


def test_activation_model():
    """Korthikanti et al. 2022 Eq. 2 (no SP) for a GPT-shaped block: with f = 4h, kv = a, an unfused
    softmax and no dropout, sbh(10 + 24/t + 5as/(ht)) loses 2sbh (the two hidden-state dropout masks),
    gains 16sbh/t (SwiGLU keeps 4 tensors of 4h/t where GeLU keeps 2) and loses the as²b/t dropout
    mask and the 2as²b/t dropout output of the attention probabilities."""
    shape = LlamaShape(vocab_size=1000, hidden_size=1024, intermediate_size=4096, num_layers=8, num_heads=16,
                       num_kv_heads=16, head_dim=64)
    b, s, t = 2, 512, 2
    h, a = 1024, 16
    korthikanti = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    adapted = korthikanti - 2 * s * b * h + 16 * s * b * h / t - 3 * a * s * s * b / t
    assert activation_bytes_per_layer(shape, b, s, t, flash_attention=False) == pytest.approx(adapted)
    # 1F1B: the first stage holds p micro-batches, so pipeline stages store L layers' worth in total.
    assert [in_flight_micro_batches(4, st, 8) for st in range(4)] == [4, 3, 2, 1]
    full = activation_bytes(shape, b, s, 1, 4, 0, gas=8)
    assert full == pytest.approx(4 * 2 * activation_bytes_per_layer(shape, b, s, 1))
    ckpt = activation_bytes(shape, b, s, 1, 4, 0, gas=8, checkpointing=True)
    assert ckpt == pytest.approx(4 * 2 * 2 * s * b * h + activation_bytes_per_layer(shape, b, s, 1))
