"""Short training runs of hybrid3d and of the Hugging Face reference on identical batches.

Global batch k holds sequences [k*B, (k+1)*B) of a fixed random token stream; DP rank r takes
its contiguous B/d share, in order, split into micro-batches (the packing convention of the
training entry point). The reference trains HF `LlamaForCausalLM` on the whole global batch with
`torch.optim.AdamW`, DeepSpeed's own WarmupLR class and `clip_grad_norm_`.
"""

import torch
import torch.nn.functional as F

from tests.tiny_llama import load_hf

GLOBAL_BATCH = 8
MICRO_BATCH = 2
SEQ = 16
STEPS = 5
VOCAB = 203
OPTIM = dict(lr=2e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
WARMUP = dict(warmup_min_lr=0.0, warmup_max_lr=2e-2, warmup_num_steps=2, warmup_type="linear")
CLIP = 0.5


def global_batch(step: int):
    """(ids, targets), each (GLOBAL_BATCH, SEQ), for optimizer step `step`.

    Sequences are arithmetic progressions mod VOCAB (random start, stride 1-3): learnable, so the
    loss falls within a few steps (uniform random tokens would sit at log(VOCAB) throughout)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def micro_batches(step: int, dp_rank: int, dp: int, micro: int = MICRO_BATCH):
    ids, targets = global_batch(step)
    share = GLOBAL_BATCH // dp
    ids, targets = ids[dp_rank * share:(dp_rank + 1) * share], targets[dp_rank * share:(dp_rank + 1) * share]
    return iter(list(zip(ids.split(micro), targets.split(micro))))


def ds_config(tp: int, pp: int, zero: int, **extra) -> dict:
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {**OPTIM, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": dict(WARMUP)},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": zero},
        "steps_per_print": 10**6,
        "hybrid3d": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
    }
    for key, value in extra.items():
        config[key] = value
    return config


def hf_reference_run(model_dir, steps: int = STEPS, dtype=torch.float32) -> dict:
    from deepspeed.runtime.lr_schedules import WarmupLR

    model = load_hf(model_dir, dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], betas=tuple(OPTIM["betas"]), eps=OPTIM["eps"],
                                  weight_decay=OPTIM["weight_decay"])
    scheduler = WarmupLR(optimizer, **WARMUP)
    losses, grad_norms = [], []
    for step in range(steps):
        ids, targets = global_batch(step)
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten())
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())  # the norm before clipping
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": grad_norms, "weights": weights}
