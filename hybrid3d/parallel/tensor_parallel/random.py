"""TP-aware random number generation (Megatron-LM's `model_parallel_cuda_manual_seed`).

Two streams:
- the default stream, seeded with `seed` on every rank: identical across TP ranks, so
  replicated work (weight init before slicing, dropout on replicated activations) agrees;
- a tensor-parallel stream, seeded with `seed + 2718 + tp_rank`: different per TP rank, for
  dropout inside TP regions (attention heads), so each shard drops independently.

The TP stream lives in DeepSpeed's RNG tracker, which activation checkpointing saves and
restores around recomputation, so recomputed dropout masks equal the original ones.
"""

import contextlib

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

TP_RNG_OFFSET = 2718
TP_RNG_NAME = "model-parallel-rng"  # the name DeepSpeed's checkpointing forks by default


def seed_tensor_parallel_rng(seed: int, tp_rank: int) -> None:
    """Seed the default stream with `seed` and the TP stream with `seed + 2718 + tp_rank`."""
    torch.manual_seed(seed)
    get_accelerator().manual_seed(seed)
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(TP_RNG_NAME, seed + TP_RNG_OFFSET + tp_rank)


def tensor_parallel_rng():
    """Context manager running its body on the TP stream (no-op until seeded)."""
    tracker = get_cuda_rng_tracker()
    if TP_RNG_NAME not in tracker.get_states():
        return contextlib.nullcontext()
    return tracker.fork(TP_RNG_NAME)
