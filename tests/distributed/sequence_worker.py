"""Rank-side code for the sequence/context-parallel measurements: the bytes autograd saves for backward
in one micro-batch's forward (saved-tensor hooks), and the collective bytes of one training step
(DeepSpeed's comms logger), per layout, in bf16 as the memory and traffic models count them."""

import gc

import torch

from tests.distributed.worlds import each_run

SHAPE = dict(vocab_size=203, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16)
MICRO_BATCH, SEQ = 2, 64


def ds_config(tp: int, cp: int, sp: bool, world: int, comm: str = "a2a", chunk: int = 0) -> dict:
    return {
        "train_batch_size": MICRO_BATCH * (world // (tp * cp)),
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**6,
        "comms_logger": {"enabled": True, "debug": True, "prof_all": False},
        "hybrid3d": {"tensor_parallel_size": tp, "context_parallel_size": cp, "sequence_parallel": sp,
                     "context_parallel_comm": comm, "loss_chunk_tokens": chunk, "data": {"seq_length": SEQ}},
    }


def saved_activation_bytes(forward, params) -> int:
    """Bytes of the distinct storages autograd saves while `forward()` runs, parameters excluded
    (a storage saved by several ops, e.g. a norm's output and the next GEMM's input, counts once)."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    return out, sum(seen.values())


def comm_bytes_by_caller(comms_dict, messages: bool = False) -> dict:
    """{(op, caller): bytes} from the comms logger's records ('op | [Caller Func: f]': {size: [count, ...]}), or
    with `messages` {(op, caller): how many}."""
    from hybrid3d.ds_internals.comms_callers import op_and_caller

    out = {}
    for record, sizes in comms_dict.items():
        key = op_and_caller(record)
        out[key] = out.get(key, 0) + sum((1 if messages else int(size)) * entry[0] for size, entry in sizes.items())
    return out


def measure(run: dict, world: int) -> dict:
    from deepspeed.comm import comms_logger

    from hybrid3d.model import LlamaShape
    from hybrid3d.parallel.context_parallel import sequence_shard
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run

    shape = LlamaShape(**SHAPE, sliding_window=run.get("window"))
    config = ds_config(run["tp"], run["cp"], run["sp"], world, run.get("comm", "a2a"), run.get("chunk", 0))
    trainer = build_trainer(validate_run(config, world, shape))
    generator = torch.Generator().manual_seed(0)

    def batches():
        while True:
            tokens = torch.randint(0, SHAPE["vocab_size"], (MICRO_BATCH, SEQ + 1), generator=generator)
            yield tokens[:, :-1], tokens[:, 1:]

    data = batches()
    ids, targets = (sequence_shard(x, trainer.groups.context_parallel()) for x in next(data))
    inputs = ids
    if run.get("documents"):  # four packed documents per row, masked from each other
        inputs = (ids, torch.arange(SEQ).remainder(SEQ // 4).expand(MICRO_BATCH, -1).contiguous())
    loss, activations = saved_activation_bytes(lambda: trainer.module.loss_fn(trainer.engine(inputs), targets),
                                               list(trainer.module.parameters()))
    trainer.engine.backward(loss)
    trainer.engine.step()
    comms_logger.comms_dict.clear()
    comms_logger.enabled = comms_logger.prof_all = True
    trainer.train_step(data)
    comms_logger.enabled = comms_logger.prof_all = False
    report = {"activations": activations, "comms": comm_bytes_by_caller(comms_logger.comms_dict),
              "messages": comm_bytes_by_caller(comms_logger.comms_dict, messages=True),
              "psi": sum(p.numel() for p in trainer.module.parameters())}
    del trainer
    gc.collect()
    return report


def measure_runs(rank, world_size, runs):
    return each_run(runs, lambda run: measure(run, world_size))
