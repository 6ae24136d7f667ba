"""Training FLOPs per token and model FLOPs utilisation (MFU).

    FLOPs per token = 6N + 12·L·h·s        (PaLM, Chowdhery et al. 2022, App. B; Kaplan et al. 2020, §2.1)

N is the number of parameters that take part in matrix multiplies: every decoder-block weight plus the
LM head (V·h, also when tied to the embedding); in a mixture-of-experts block only the k experts a token is
routed to, and the router (E·h), count: Mixtral 8x7B's "12.9B active of 46.7B" (Jiang et al. 2024); the
embedding lookup and the RMSNorm weights are not matmuls and are left out. 6N is forward (2N) plus backward (4N); 12·L·h·s is attention's QKᵀ and
attention-times-V (2·2·s·h per token per layer forward, x3 for training), counted over the full s x s
score matrix as PaLM does (a causal kernel skips about half of it). Activation recomputation is
excluded: MFU counts the model's FLOPs, not the hardware's (Korthikanti et al. 2022, §5).

    MFU = achieved FLOP/s / peak FLOP/s,  achieved = FLOPs per token x tokens/s (per device)
"""

from typing import Optional

from hybrid3d.model.config import LlamaShape
from hybrid3d.model.flop_counts import blocks_matmul_parameters, head_matmul_parameters

# Dense bf16 tensor-core peaks in TFLOP/s from the vendors' data sheets (no sparsity).
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,
    "H200 NVL": 835.0,  # the PCIe card: 1,671 TFLOP/s with sparsity on its data sheet
    "H200": 989.4,
    "H800": 989.4,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
    "A10": 125.0,
    "B200": 2250.0,  # NVIDIA HGX B200 datasheet: 36 PFLOP/s with sparsity for 8 GPUs
    "RTX 4090": 165.2,  # NVIDIA Ada architecture whitepaper: BF16 with FP32 accumulate
    "RTX 3090": 71.0,  # NVIDIA GA102 architecture whitepaper: BF16 with FP32 accumulate
    "MI300X": 1307.4,
    "MI250X": 383.0,
}


def matmul_parameters(shape: LlamaShape) -> int:
    """N: parameters used in matrix multiplies per token (decoder-block weights, only the k routed experts of a
    mixture-of-experts block, and the LM head; `model/flop_counts.py`)."""
    return blocks_matmul_parameters(shape) + head_matmul_parameters(shape)


def training_flops_per_token(shape: LlamaShape, seq_length: int) -> float:
    """6N + 12·L·h·s: forward + backward FLOPs per trained token, recomputation excluded."""
    attention = 12 * shape.num_layers * shape.num_heads * shape.head_dim * seq_length
    return 6 * matmul_parameters(shape) + attention


def peak_tflops(device_name: Optional[str] = None, override: Optional[float] = None) -> Optional[float]:
    """Peak dense bf16 TFLOP/s of one device: `override` if given, else looked up from `device_name`
    (default: the current CUDA device's name). None when unknown (e.g. a CPU): then report no MFU."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak TFLOP/s must be positive, got {override}")
        return float(override)
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    key = peak_key(device_name)
    return None if key is None else PEAK_BF16_TFLOPS[key]


def peak_key(device_name: str) -> Optional[str]:
    """The row of PEAK_BF16_TFLOPS a device name matches (the longest name found in it), None if none."""
    name = device_name.upper()
    return next((key for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True) if key.upper() in name), None)


def mfu(tokens_per_second_per_device: float, shape: LlamaShape, seq_length: int,
        peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1], or None without a known peak (TFLOP/s)."""
    if peak is None:
        return None
    return tokens_per_second_per_device * training_flops_per_token(shape, seq_length) / (peak * 1e12)

