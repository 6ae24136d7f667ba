"""Short training runs of hybrid3d and of the Hugging Face reference on identical batches.

Global batch k holds sequences [k*B, (k+1)*B) of a fixed random token stream; DP rank r takes
its contiguous B/d share, in order, split into micro-batches (the packing convention of the
training entry point). The reference trains HF `LlamaForCausalLM` on the whole global batch with
`torch.optim.AdamW`, DeepSpeed's own WarmupLR class and `clip_grad_norm_`.

A run with `data_prefix` takes its batches from a Megatron indexed dataset instead, through hybrid3d's data path (the
functions the trainer calls); its reference trains on windows cut here from the documents themselves (`windows`).
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
EOS = VOCAB - 1  # what ends each Megatron document (`megatron_documents`): a token like any other to the model


def global_batch(step: int):
    """(ids, targets), each (GLOBAL_BATCH, SEQ), for optimizer step `step`.

    Sequences are arithmetic progressions mod VOCAB (random start, stride 1-3): learnable, so the
    loss falls within a few steps (uniform random tokens would sit at log(VOCAB) throughout)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def megatron_documents() -> list[list[int]]:
    """60 documents of 3-24 tokens, each an arithmetic progression mod VOCAB like `global_batch`'s (learnable), ending
    in EOS as Megatron's preprocessing writes them (--append-eos): 803 tokens, more than the 5 x 8 samples of 16
    tokens (+1) that 5 steps read, so no window wraps."""
    g = torch.Generator().manual_seed(77)
    lengths = torch.randint(3, 25, (60,), generator=g).tolist()
    starts = torch.randint(0, VOCAB, (60,), generator=g).tolist()
    strides = torch.randint(1, 4, (60,), generator=g).tolist()
    return [[(start + stride * j) % VOCAB for j in range(n)] + [EOS]
            for n, start, stride in zip(lengths, starts, strides)]


def write_megatron_prefix(prefix: str, docs: list[list[int]]) -> str:
    """`docs`, one document each, as megatron-core's `IndexedDatasetBuilder` writes them (prefix.bin + prefix.idx,
    uint16); -> who wrote them. Without megatron-core (launch/test.sh installs it) hybrid3d's own writer writes the same
    format, so that the module's other runs still run; the test of the writer's files then skips."""
    import importlib.util

    import numpy as np

    if importlib.util.find_spec("megatron") is None:
        from hybrid3d.data.indexed import IndexedWriter

        with IndexedWriter(prefix, np.uint16) as writer:
            for doc in docs:
                writer.add_document(doc)
        return "hybrid3d"
    from tests.megatron_oracle import megatron_datasets

    builder = megatron_datasets().indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.asarray(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return "megatron-core"


def windows(docs: list[list[int]]):
    """`global_batch`'s interface over documents: batch k = the (s+1)-token windows [i*s, i*s + s + 1) of the
    documents' concatenation, i = k*B .. k*B + B - 1, in order (Megatron's GPT sample without shuffling), cut here
    so that the reference does not depend on hybrid3d's packing."""
    stream = torch.tensor([t for doc in docs for t in doc])  # (N,)

    def batch(step: int):
        first = step * GLOBAL_BATCH
        rows = torch.stack([stream[i * SEQ:i * SEQ + SEQ + 1] for i in range(first, first + GLOBAL_BATCH)])  # (B, s+1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    assert (STEPS * GLOBAL_BATCH) * SEQ + 1 <= len(stream)  # no window wraps into a second epoch
    return batch


def indexed_micro_batches(prefix: str):
    """`micro_batches`' interface over the Megatron prefix, through hybrid3d's data path as the trainer takes it:
    `build_training_data` on `data.path` (in stored order), `hybrid3d.data.micro_batches` from sample step*B; with
    the data's summary line."""
    from hybrid3d.config.sections import DataSection
    from hybrid3d.data import build_training_data, micro_batches as packed_micro_batches
    from hybrid3d.data.pipeline import TokenizerSource
    from hybrid3d.errors import ConfigError

    def no_tokenizer():
        raise ConfigError("the data is pre-tokenized")

    data = build_training_data(DataSection(path=prefix, seq_length=SEQ),
                               TokenizerSource(load=no_tokenizer, identity="none", config_eos_id=EOS), VOCAB)

    def batches(step: int, dp_rank: int, dp: int, micro: int = MICRO_BATCH):
        return packed_micro_batches(data.train, step * GLOBAL_BATCH, GLOBAL_BATCH, dp_rank, dp, micro)

    return batches, data.summary


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


def hf_reference_run(model_dir, steps: int = STEPS, dtype=torch.float32, batches=global_batch) -> dict:
    from deepspeed.runtime.lr_schedules import WarmupLR

    model = load_hf(model_dir, dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], betas=tuple(OPTIM["betas"]), eps=OPTIM["eps"],
                                  weight_decay=OPTIM["weight_decay"])
    scheduler = WarmupLR(optimizer, **WARMUP)
    losses, grad_norms = [], []
    for step in range(steps):
        ids, targets = batches(step)
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten())
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())  # the norm before clipping
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": grad_norms, "weights": weights}
