"""RoPE's inverse frequencies move with the module but never change dtype; its tables are shared by the layers."""

import torch

from hybrid3d.model.rope import RotaryFrequencies, inverse_frequencies, rope_cos_sin

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def test_inverse_frequencies_stay_fp32_and_follow_the_device():
    rotary = RotaryFrequencies(64, 500000.0, LLAMA3)
    expected = inverse_frequencies(64, 500000.0, LLAMA3)
    assert "inv_freq" in dict(rotary.named_buffers()) and "inv_freq" not in rotary.state_dict()  # not saved
    rotary.bfloat16()
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, expected)
    module = torch.nn.Sequential(rotary).to(torch.float16)
    assert module[0].inv_freq.dtype == torch.float32
    module.to("meta")  # another device: the buffer goes with it
    assert module[0].inv_freq.device.type == "meta" and module[0].inv_freq.dtype == torch.float32


def test_cos_sin_tables_are_shared_per_length_device_and_dtype():
    """Every layer with the same frequencies gets the same tables (a rank keeps one copy, not one per layer), per
    sequence length, device and dtype; other frequencies get their own."""
    rotary, other_layer = RotaryFrequencies(16, 10000.0), RotaryFrequencies(16, 10000.0)
    cos, sin = rotary.cos_sin(8, "cpu", torch.float32)
    expected = rope_cos_sin(rotary.inv_freq, 8, "cpu", torch.float32)
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])
    assert rotary.cos_sin(8, "cpu", torch.float32)[0] is cos  # the same tables, not recomputed
    assert other_layer.cos_sin(8, "cpu", torch.float32)[0] is cos  # and not another layer's copy
    assert rotary.cos_sin(8, "cpu", torch.bfloat16)[0].dtype == torch.bfloat16
    longer = rotary.cos_sin(12, "cpu", torch.float32)[0]
    assert longer.shape == (12, 16) and torch.equal(longer[:8], cos)
    scaled = RotaryFrequencies(16, 10000.0, dict(LLAMA3, original_max_position_embeddings=4)).cos_sin(8, "cpu",
                                                                                                    torch.float32)
    assert torch.equal(scaled[0], rope_cos_sin(inverse_frequencies(16, 10000.0, dict(
        LLAMA3, original_max_position_embeddings=4)), 8, "cpu", torch.float32)[0]) and not torch.equal(scaled[0], cos)
