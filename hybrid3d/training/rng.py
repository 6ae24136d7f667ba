"""Every random-number generator a rank draws from, saved with each checkpoint so a resumed run draws
the same numbers (dropout masks, data shuffles) as an uninterrupted one."""

import random

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker


def rng_state() -> dict:
    """Every RNG this rank draws from, as tensors and plain data (loadable with weights_only=True)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position,
                                                   has_gauss, gauss),
            "torch": torch.get_rng_state(), "accelerator": get_accelerator().get_rng_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])
    get_cuda_rng_tracker().set_states(state["tracker"])
