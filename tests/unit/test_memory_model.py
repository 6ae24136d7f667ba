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
    output_layer_activation_bytes,
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
    """Parameter totals of the released checkpoints: 6.74B, 8.03B, 1.236B (tied), 70.55B, and SmolLM2-135M's
    134,515,008 (tied; the sum of the tensors of hybrid3d.pretrained's folder, counted there with safetensors)."""
    expected = {"llama2-7b": 6.74e9, "llama3-8b": 8.03e9, "llama3.2-1b": 1.236e9, "llama3-70b": 70.55e9,
                "smollm2-135m": 134_515_008}
    for name, count in expected.items():
        assert model_parameters(LlamaShape.from_hf(preset_config(name))) == pytest.approx(count, rel=2e-3), name
    with pytest.raises(KeyError, match="known: tiny, llama2-7b"):
        preset_config("llama9")
    assert set(PRESETS) == {"tiny", "llama2-7b", "llama3-8b", "llama3.2-1b", "llama3-70b", "qwen2.5-7b", "qwen3-8b",
                            "mistral-7b-v0.1", "smollm2-135m", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3",
                            "moonlight-16b-a3b"}


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
    assert peak_tflops("NVIDIA H200") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H200 NVL") == pytest.approx(835.0)  # not the SXM part's peak
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == pytest.approx(312.0)
    assert peak_tflops("cpu") is None
    assert peak_tflops("cpu", override=2.5) == 2.5
    with pytest.raises(ValueError):
        peak_tflops(override=0)


def test_activation_model():
    """Per block, the terms the saved-tensor count found (activations.py docstring; measured in
    tests/distributed/test_sequence_parallel.py), for b 2, s 512, t 2, h 1024, a = kv 16, d 64, f 4096:
    norms 16sbh + 8sb, Q and attention output 2sbh/t each, K and V 4sbh/t, SwiGLU 8sbf/t, fused core 4asb/t,
    unfused 2as²b/t; RoPE's tables 4sd once per rank (every layer and micro-batch shares them)."""
    shape = LlamaShape(vocab_size=1000, hidden_size=1024, intermediate_size=4096, num_layers=8, num_heads=16,
                       num_kv_heads=16, head_dim=64)
    b, s, t = 2, 512, 2
    h, a, d, f = 1024, 16, 64, 4096
    rest = 16 * s * b * h + 8 * s * b + 2 * 2 * s * b * h / t + 4 * s * b * h / t + 8 * s * b * f / t
    assert activation_bytes_per_layer(shape, b, s, t) == pytest.approx(rest + 4 * a * s * b / t)
    assert activation_bytes_per_layer(shape, b, s, t, flash_attention=False) == pytest.approx(rest + 2 * a * s * s * b / t)
    # 1F1B: the first stage holds p micro-batches, so pipeline stages store L layers' worth in total.
    assert [in_flight_micro_batches(4, st, 8) for st in range(4)] == [4, 3, 2, 1]
    ids = 8 * s * b  # the first stage's int64 token ids
    full = activation_bytes(shape, b, s, 1, 4, 0, gas=8)
    assert full == pytest.approx(4 * (2 * activation_bytes_per_layer(shape, b, s, 1) + ids) + 4 * s * d)
    ckpt = activation_bytes(shape, b, s, 1, 4, 0, gas=8, checkpointing=True)
    assert ckpt == pytest.approx(4 * (2 * 2 * s * b * h + ids) + activation_bytes_per_layer(shape, b, s, 1) + 4 * s * d)


# A small GQA shape for the SP/CP hand counts: h 64, a 4, kv 2, head dim 16, f 128, 2 layers, V 256.
G = LlamaShape(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
               head_dim=16)


def test_sequence_parallel_divides_the_norm_term_by_t():
    """b 2, s 32, t 2 (one kv head per rank): norms 16sbh + 8sb = 66048; Q, attention output 2sbh/t = 4096
    each; K, V 2·2·s·b·1·16 = 4096; SwiGLU 4·2·s·b·f/t = 32768; fused core 4·a·s·b/t = 512; RoPE's shared
    tables 4·s·16 = 2048 once per rank."""
    b, s, t = 2, 32, 2
    sharded = 3 * 4096 + 32768 + 512
    assert activation_bytes_per_layer(G, b, s, t) == 66048 + sharded
    assert activation_bytes_per_layer(G, b, s, t, sequence_parallel=True) == 66048 / 2 + sharded
    # Last stage: final norm 8sbh + 4sb = 33024 (/t with SP), fp32 softmax 4sbV/t = 32768 + 2 masks 128,
    # int64 targets 512.
    assert output_layer_activation_bytes(G, b, s, t) == 33024 + 32768 + 128 + 512
    assert output_layer_activation_bytes(G, b, s, t, sequence_parallel=True) == 16512 + 32768 + 128 + 512
    # Checkpointing with SP keeps each layer's input shard 2sbh/t = 4096 (like partition_activations);
    # the single stage also holds the ids (8sb = 512) and the embedding's mask (64).
    per_layer = activation_bytes_per_layer(G, b, s, t, sequence_parallel=True)
    ckpt = activation_bytes(G, b, s, t, 1, 0, 1, checkpointing=True, sequence_parallel=True)
    assert ckpt == 2 * 4096 + (16512 + 32768 + 128 + 512) + 576 + per_layer + 2048
    with pytest.raises(ValueError, match="exclude"):
        activation_bytes(G, b, s, t, 1, 0, 1, checkpointing=True, partition_activations=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="t > 1"):
        activation_bytes_per_layer(G, b, s, 1, sequence_parallel=True)
    with pytest.raises(ValueError, match="not divisible by tensor-parallel"):
        activation_bytes_per_layer(G, b, 34, t, sequence_parallel=True, cp=2)  # s/c = 17


def test_context_parallel_halves_per_token_terms_not_the_square():
    """t 1, c 2, b 2, s 32, unfused core: every per-token term is counted over s/c = 16 tokens; the
    softmax 2·a·s²·b/(t·c) runs over the whole sequence with a/c heads, so it halves too (16384 -> 8192),
    where s_c² would have quartered it (4096). RoPE's shared tables cover the whole sequence, once per rank."""
    b, s = 2, 32
    # c = 1: norms 66048, Q 8192, K and V (2 kv heads) 2·2·s·b·2·16 = 8192, output 8192, SwiGLU 65536,
    # softmax 2·4·32²·2 = 16384.
    assert activation_bytes_per_layer(G, b, s, 1, flash_attention=False) == 66048 + 3 * 8192 + 65536 + 16384
    # c = 2 (c divides the 2 kv heads: one each): norms 33024, Q 4096, K and V 4096, the output twice (the
    # core's, and o_proj's input from the exchange) 8192, SwiGLU 32768, softmax 8192.
    halved = 33024 + 4096 + 4096 + 8192 + 32768
    assert activation_bytes_per_layer(G, b, s, 1, flash_attention=False, cp=2) == halved + 8192
    # fused: log-sum-exp 4·a·s·b/(t·c) = 512 at c = 2
    assert activation_bytes_per_layer(G, b, s, 1, cp=2) == halved + 512
    # GQA repetition: t 2 leaves one kv head per rank; c 2 repeats it so each CP rank gets one, so K and V
    # stay 2·2·(s/c)·b·2·16 = 4096, as at c = 1 (2·2·s·b·1·16); the rest halves.
    assert activation_bytes_per_layer(G, b, s, 2, cp=2) == 33024 + 2048 + 4096 + 4096 + 16384 + 256
    with_sp = activation_bytes_per_layer(G, b, s, 2, cp=2, sequence_parallel=True)
    assert with_sp == 16512 + 2048 + 4096 + 4096 + 16384 + 256
    # Output layer at t 1, c 2: final norm 8·16·2·64 + 4·16·2, log-softmax 4·16·2·256, targets 8·16·2.
    assert output_layer_activation_bytes(G, b, s, 1, cp=2) == 16512 + 32768 + 256
    with pytest.raises(ValueError, match="context_parallel_size"):
        activation_bytes_per_layer(G, b, 33, 1, cp=2)


def test_replicated_kv_heads_keep_the_one_head_a_rank_uses():
    """t 4 > 2 kv heads: the k/v weights are replicated, but each rank projects only its query heads'
    kv head, so K and V are 2·2·s·b·16 = 2048 (b 1, s 32), not the 2·2·s·b·32 of both replicated heads."""
    b, s, t = 1, 32, 4
    norms, q, out = 16 * 32 * 64 + 8 * 32, 2 * 32 * 64 // 4, 2 * 32 * 64 // 4
    swiglu, core = 8 * 32 * 128 // 4, 4 * 4 * 32 // 4
    assert activation_bytes_per_layer(G, b, s, t) == norms + q + 2048 + out + swiglu + core == 45440


def test_zero_partitions_over_the_sequence_data_parallel_group():
    """With CP, ZeRO shards over d·c ranks: ZeRO-1 on BF16_Optimizer is 2Ψ + 2Ψ + 4Ψ + 12Ψ/Nd (+4 for
    Adam's step), Ψ = 106816 for G (two 36992-element blocks, 2 x 16384 embedding/head, final norm 64,
    a multiple of 2·Nd), so d 2, c 2 -> Nd 4: 11Ψ + 4, not the 14Ψ + 4 of Nd = d = 2."""
    psi = 2 * (64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 64 + 3 * 64 * 128) + 2 * 256 * 64 + 64
    assert sum(stage_parameter_numels(G, 1, 1, 0)) == psi == 106816
    assert rank_model_states(G, 1, 1, 2 * 2, 1, "bf16+fp32acc").peak.total == 11 * psi + 4
    assert rank_model_states(G, 1, 1, 2, 1, "bf16+fp32acc").peak.total == 14 * psi + 4


def test_pipeline_zero2_counts_the_tied_gradient_sum_chunk():
    """pipeline_zero2 sums a tied weight's gradient across stages in fp32 chunks of min(B, 2**24, the weight)
    elements. With small buckets the chunk is the rank's peak; at DeepSpeed's default B (5e8 elements) the cap keeps
    it below the 2B-byte bucket, where a bucket-sized fp32 chunk of a 1B model's tied embedding (262M elements,
    1.05 GB) would have been the peak."""
    from hybrid3d.planning.memory import model_states_from_numels

    def grads(bucket: int, tied: int) -> int:
        return model_states_from_numels([1000] * 8, 8, 2, "bf16+fp32acc", 4, gas=4, reduce_bucket_size=bucket,
                                        pipeline_zero2=True, tied_numel=tied).boundary.grads

    embedding = 128256 * 2048
    assert grads(2**20, embedding) > grads(2**20, 0)  # 4 bytes x 2**20 against a 2-byte bucket of 2**20
    assert grads(500_000_000, embedding) == grads(500_000_000, 0)


def _lora_gqa(rank: int = 4, **changes) -> LlamaShape:
    """The gqa shape (h 64, a 4, kv 2, d 16, f 128, 4 layers, V 203 -> 256 at t <= 2) with LoRA on all 7 modules."""
    import dataclasses

    from hybrid3d.model.tp_plan import LORA_TARGETS

    return dataclasses.replace(LlamaShape(**{**SHAPES["gqa"], **changes}), lora_rank=rank, lora_alpha=8.0,
                               lora_targets=tuple(LORA_TARGETS))


def test_lora_model_states_by_hand():
    """LoRA rank 4 on the gqa shape at TP2 x PP2 (stage 0: embedding and 2 blocks) x DP2, ZeRO-1. Adapters per TP
    rank, A (r x in) and B (out x r): beside a column base (q, k, v, gate, up) A whole and B out/t rows, beside a row
    base (o, down) A in/t columns and B whole. The frozen base is 2 bytes per element (bf16; 4 in fp32), with no
    gradient, master or Adam state and not sharded; the adapters get the stage's full accounting."""
    from hybrid3d.planning.memory import adapter_parameters, rank_adapter_numels

    shape, r, t = _lora_gqa(), 4, 2
    h, f, q, kv = 64, 128, 4 * 16, 2 * 16

    def column(out, inp):
        return r * inp + out // t * r

    def row(out, inp):
        return r * inp // t + out * r

    block = column(q, h) + 2 * column(kv, h) + row(h, q) + 2 * column(f, h) + row(h, f)
    assert block == 2944
    adapters = 2 * block  # stage 0 holds blocks 1 and 2; a multiple of 2·Nd = 4, so no alignment padding
    base = 256 // t * h + 2 * (h + q * h // t + 2 * kv // t * h + h * q // t + h + 3 * f // t * h)
    assert sum(rank_adapter_numels(shape, t, 2, 0)) == adapters
    assert sum(stage_parameter_numels(shape, t, 2, 0)) == base == 45312  # the frozen base: LoRA adds none to it

    def states(precision, zero=1, **kw):
        return rank_model_states(shape, t, 2, 2, zero, precision, stage=0, **kw).peak.total

    # The planner's ZeRO-1 (BF16_Optimizer, fp32 accumulation): 2Ψ + 2Ψ bf16 .grad + 4Ψ buffer + 12Ψ/Nd (+4 step).
    assert states("bf16+fp32acc") == 2 * base + 2 * adapters + 2 * adapters + 4 * adapters + 12 * adapters // 2 + 4
    # bf16 ZeRO-1 (DeepSpeedZeroOptimizer) at the boundary: 2Ψ + 2Ψ + a 2-byte bucket of B + 12Ψ/Nd.
    assert states("bf16", reduce_bucket_size=1000) == 2 * base + 4 * adapters + 2 * 1000 + 12 * adapters // 2 + 4
    # fp32 ZeRO-0 (torch Adam): 4 + 4 + 8 bytes per adapter element, a step counter per adapter tensor (2 x 14).
    assert states("fp32", zero=0) == 4 * base + 16 * adapters + 4 * 28
    # Without LoRA the same rank trains the base: 14Ψ + 4 at Nd = 2.
    plain = LlamaShape(**SHAPES["gqa"])
    assert rank_model_states(plain, t, 2, 2, 1, "bf16+fp32acc").peak.total == 14 * base + 4
    # kv heads replicated at TP4 (> 2 kv heads): k and v adapters whole, A (r x h) and B (kv·d x r).
    t4 = r * h + q // 4 * r + 2 * (r * h + kv * r) + r * q // 4 + h * r + 2 * (r * h + f // 4 * r) + r * f // 4 + h * r
    assert sum(rank_adapter_numels(shape, 4, 1, 0)) == 4 * t4 == 10240
    # Every schedule places each block's adapters on exactly one rank.
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("dualpipev", 1)):
        assert sum(sum(rank_adapter_numels(shape, 1, 2, rank, schedule, v)) for rank in range(2)) == \
            adapter_parameters(shape) == 4 * r * (2 * (h + q) + 2 * (h + kv) + 3 * (h + f))


def test_lora_numels_match_the_built_model():
    """The TP model built (meta device) with LoRA: its `.lora_` parameters are `rank_adapter_numels`, in order,
    the rest `stage_parameter_numels`."""
    from hybrid3d.convert.model_layout import meta_model
    from hybrid3d.planning.memory import rank_adapter_numels

    shape = _lora_gqa()
    for tp in (1, 2, 4):
        named = list(meta_model(shape, tp - 1, tp).named_parameters())
        assert [p.numel() for n, p in named if ".lora_" in n] == rank_adapter_numels(shape, tp, 1, 0), tp
        assert [p.numel() for n, p in named if ".lora_" not in n] == stage_parameter_numels(shape, tp, 1, 0), tp


def test_lora_refusals_in_the_memory_model():
    """As the trainer refuses them (config.support.check_lora): LoRA on a mixture-of-experts model, pipeline_zero2."""
    from hybrid3d.errors import ConfigError

    with pytest.raises(ConfigError, match="mixture-of-experts"):
        rank_model_states(_lora_gqa(num_experts=4), 1, 1, 1, 1, "bf16+fp32acc")
    with pytest.raises(ConfigError, match="pipeline_zero2"):
        rank_model_states(_lora_gqa(), 1, 2, 2, 2, "bf16+fp32acc", pipeline_zero2=True)
