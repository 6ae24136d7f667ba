"""Fine-tuning batches (loss masks, packed documents) through hybrid3d and through the Hugging Face reference.

The data: 5 global batches of 8 samples of 16 tokens, each sample's 16 input positions filled with documents of
3-9 tokens (arithmetic progressions mod the vocabulary, so the loss falls), each document a "prompt" (no loss)
followed by a "completion" (loss), as `PackedSamples` arrays (tokens, learn, starts) that hybrid3d's own
`micro_batches` turns into micro-batches.

The reference is written from the definitions, not from hybrid3d's code: a target counts when the token it
names is learned (and, with documents masked from each other, is not a document's first token); the loss is the
sum of the counted tokens' cross entropies over the global batch divided by their count (HF's loss over one
batch with -100 labels); with documents masked HF runs each document on its own (positions from 0, no other
document in view).
"""

import gc

import numpy as np
import torch
import torch.nn.functional as F

from tests.distributed.worlds import each_run
from tests.distributed.engine_runs import CLIP, GLOBAL_BATCH, OPTIM, SEQ, STEPS, WARMUP, ds_config
from tests.tiny_llama import load_hf

VOCAB = 203
IGNORE = -100
# Adam's eps at 1e-3, not engine_runs' 1e-8. With eps far below a gradient element, Adam's first steps move it
# by about lr·sign(g), so where |g| is near eps the fp32 rounding of two equal sums (a row under a block-diagonal
# mask vs one document at a time: different matmul shapes) flips whole lr-sized steps: measured 1.2e-5 of the
# embedding's scale after 5 steps with eps 1e-8, 4.5e-5 with 1e-6, while the gradients agreed to 3e-7. With eps
# above most gradient elements the update is near-linear in g: a wrong gradient (a wrong loss normalisation, a
# leaked token) still moves the weights, and rounding no longer does.
OPTIM = dict(OPTIM, eps=1e-3)


def packed_arrays(seed: int = 0) -> dict:
    """{tokens, learn, starts} for STEPS global batches: (STEPS·B·SEQ + 1,) each."""
    rng = np.random.default_rng(seed)
    tokens, learn, starts = [], [], []
    for _ in range(STEPS * GLOBAL_BATCH):
        left = SEQ
        while left:
            n = min(int(rng.integers(3, 10)), left)
            first, stride = int(rng.integers(0, VOCAB)), int(rng.integers(1, 4))
            tokens += [(first + stride * i) % VOCAB for i in range(n)]
            prompt = int(rng.integers(1, n)) if n > 1 else 1
            learn += [0] * prompt + [1] * (n - prompt)
            starts += [1] + [0] * (n - 1)
            left -= n
    tokens.append(0), learn.append(0), starts.append(1)  # the last sample's (s+1)-th token
    return {"tokens": np.asarray(tokens), "learn": np.asarray(learn, dtype=np.uint8),
            "starts": np.asarray(starts, dtype=np.uint8)}


def samples(arrays: dict, masked: bool):
    from hybrid3d.data.packing import PackedSamples

    return PackedSamples(arrays["tokens"], SEQ, learn=arrays["learn"] if masked else None, starts=arrays["starts"])


def reference_targets(arrays: dict, row: int, masked: bool, document_mask: bool) -> torch.Tensor:
    """(SEQ,) targets of sample `row` from the definitions above."""
    window = slice(row * SEQ + 1, row * SEQ + SEQ + 1)  # the tokens the SEQ positions predict
    tokens, learn, starts = (torch.from_numpy(arrays[k][window].astype(np.int64)) for k in ("tokens", "learn", "starts"))
    counted = torch.ones(SEQ, dtype=torch.bool)
    if masked:
        counted &= learn == 1
    if document_mask:
        counted &= starts == 0
    return torch.where(counted, tokens, torch.full_like(tokens, IGNORE))


def documents_of(arrays: dict, row: int) -> list[tuple[int, int]]:
    """[start, end) of each document among sample `row`'s input positions."""
    starts = arrays["starts"][row * SEQ:row * SEQ + SEQ].copy()
    starts[0] = 1
    bounds = [int(i) for i in np.flatnonzero(starts)] + [SEQ]
    return list(zip(bounds[:-1], bounds[1:]))


def reference_loss(model, arrays: dict, step: int, masked: bool, document_mask: bool):
    """Σ counted cross entropies / count over global batch `step`, HF's model run per row or per document."""
    total, count = 0.0, 0
    for row in range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH):
        ids = torch.from_numpy(arrays["tokens"][row * SEQ:row * SEQ + SEQ].astype(np.int64))
        targets = reference_targets(arrays, row, masked, document_mask)
        pieces = documents_of(arrays, row) if document_mask else [(0, SEQ)]
        for start, end in pieces:
            logits = model(ids[start:end].unsqueeze(0)).logits[0]  # (n, V): this piece alone
            total = total + F.cross_entropy(logits, targets[start:end], ignore_index=IGNORE, reduction="sum")
        count += int((targets != IGNORE).sum())
    return total / count


def reference_run(model_dir, arrays: dict, masked: bool, document_mask: bool) -> dict:
    from deepspeed.runtime.lr_schedules import WarmupLR

    model = load_hf(model_dir).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], betas=tuple(OPTIM["betas"]), eps=OPTIM["eps"],
                                  weight_decay=OPTIM["weight_decay"])
    scheduler = WarmupLR(optimizer, **WARMUP)
    losses, grad_norms = [], []
    for step in range(STEPS):
        loss = reference_loss(model, arrays, step, masked, document_mask)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": grad_norms,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def run_one(run: dict, model_dirs: dict, arrays: dict) -> dict:
    import deepspeed.comm as dist

    from hybrid3d.data.packing import micro_batches
    from hybrid3d.model import LlamaShape
    from hybrid3d.model.hf_weights import gather_hf_state_dict
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run

    hf = load_hf(model_dirs[run["case"]])
    shape = LlamaShape.from_hf(hf.config)
    config = ds_config(run["tp"], run["pp"], run["zero"], **run.get("extra", {}))
    config["optimizer"]["params"]["eps"] = OPTIM["eps"]
    config["hybrid3d"].update(run.get("hybrid", {}))
    trainer = build_trainer(validate_run(config, dist.get_world_size(), shape), hf_state_dict=hf.state_dict())
    del hf
    data = samples(arrays, run["masked"])
    dp_rank, dp = trainer.groups.data_shard()
    losses, grad_norms = [], []
    for step in range(STEPS):
        batches = micro_batches(data, step * GLOBAL_BATCH, GLOBAL_BATCH, dp_rank, dp, trainer.config.micro_batch_size,
                                run["document_mask"])
        losses.append(trainer.train_step(batches))
        grad_norms.append(float(trainer.engine.get_global_grad_norm()))
    report = {"losses": losses, "grad_norms": grad_norms,
              "weights": {k: v.float().cpu() for k, v in gather_hf_state_dict(
                  trainer.module, trainer.shape, trainer.groups.tensor_parallel()).items()}}
    dist.barrier()
    del trainer
    gc.collect()
    return report


def train_runs(rank, world_size, runs, model_dirs, arrays):
    return each_run(runs, lambda run: run_one(run, model_dirs, arrays))
