"""The ZeRO-3 and offload memory model (planning/zero3_memory.py) against the bytes DeepSpeed's optimizer really
holds at the optimizer step, counted from its own tensors (ds_internals/memory_probe.py) on every rank of a world of 4:
ZeRO-3 at DP4 and TP2 x DP2 in bf16, bf16 with fp32 accumulation and fp32, with persistent parameters, with
optimizer offload and with optimizer + parameter offload, LoRA at TP2 x DP2 (its frozen base partitioned too), and
ZeRO-1/2 with optimizer offload. On the same runs, ZeRO-3's collectives (DeepSpeed's comms logger) and the most elements its parameter coordinator held gathered against the
replay of planning/zero3_fetch.py, with DeepSpeed's stage3_* defaults and with knobs that make it release, prefetch
in small pieces and stop prefetching at the live-parameter cap."""

import contextlib

import pytest
from transformers import LlamaConfig

from tests.distributed.worlds import run_world

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
BUCKET = 50_000  # reduce_bucket_size: far below DeepSpeed's default, whose 5e8 elements would dwarf the model
# the fetching knobs of two runs (elements; the model's weights on a TP rank: 32768 or 16384 for the embedding and
# the head, 2048 to 11264 for the layers' matrices): prefetches of a few matrices, a live cap the prefetcher runs
# into and a reuse distance shorter than the backward's way back to most layers, so that some layers are released
# after their forward and gathered again, and fewer elements than the model's are gathered at once
SOME_KEPT = {"stage3_prefetch_bucket_size": 12000, "stage3_max_live_parameters": 40000,
             "stage3_max_reuse_distance": 30000}
FEW_KEPT = {"stage3_prefetch_bucket_size": 5000, "stage3_max_live_parameters": 20000,
            "stage3_max_reuse_distance": 15000}
LORA_RANK, LORA_TARGETS = 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RUNS = [  # name, tp, zero, precision, offload, persistence threshold[, other stage3_* knobs[, LoRA rank]]
    ("Z3-DP4-bf16", 1, 3, "bf16", "none", 0),
    ("Z3-LoRA-TP2xDP2-bf16", 2, 3, "bf16", "none", 0, {}, LORA_RANK),  # the frozen base partitioned too
    ("Z3-DP4-bf16+fp32acc", 1, 3, "bf16+fp32acc", "none", 0),
    ("Z3-DP4-fp32", 1, 3, "fp32", "none", 0, SOME_KEPT),
    ("Z3-TP2xDP2-bf16", 2, 3, "bf16", "none", 0, FEW_KEPT),
    ("Z3-DP4-bf16-persistent", 1, 3, "bf16", "none", 10_000),
    ("Z3-DP4-bf16-offload", 1, 3, "bf16", "optimizer", 0),
    ("Z3-TP2xDP2-bf16-offload-params", 2, 3, "bf16", "optimizer+params", 0),
    ("Z1-DP4-bf16-offload", 1, 1, "bf16", "optimizer", 0),
    ("Z2-TP2xDP2-bf16-offload", 2, 2, "bf16", "optimizer", 0),
]


def _config(tp, zero, precision, offload, threshold, knobs=None, lora_rank=0, model_dir=None):
    from tests.distributed.engine_runs import ds_config

    zero_optimization = {"stage": zero, "reduce_bucket_size": BUCKET, "stage3_param_persistence_threshold": threshold,
                         **(knobs or {})}
    if offload != "none":
        zero_optimization["offload_optimizer"] = {"device": "cpu"}
    if offload == "optimizer+params":
        zero_optimization["offload_param"] = {"device": "cpu"}
    extra = {"zero_optimization": zero_optimization, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
             "comms_logger": {"enabled": True, "debug": True, "prof_all": False}}
    if offload != "none":
        extra["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}  # DeepSpeedCPUAdam
    if precision != "fp32":
        extra["bf16"] = {"enabled": True}
    if precision == "bf16+fp32acc":
        extra["data_types"] = {"grad_accum_dtype": "fp32"}
    config = ds_config(tp, 1, zero, **extra)
    if lora_rank:  # adapters train on a pretrained base
        config["hybrid3d"].update(model={"hf_model": model_dir, "init_from_hf": True},
                                  lora={"rank": lora_rank, "target_modules": LORA_TARGETS})
    return config


def measure(rank, world_size, model_dir):
    """{run name: the probe's snapshots by category, ZeRO-3's collectives and the coordinator's largest count of
    available elements} of this rank, the probe and the comms logger enabled on the second step."""
    import torch
    from deepspeed.comm import comms_logger

    from hybrid3d.ds_internals.memory_probe import PeakProbe
    from hybrid3d.ds_internals.zero3 import track_available_parameters
    from hybrid3d.model import LlamaShape
    from hybrid3d.parallel.spawn import end_run
    from hybrid3d.training.trainer import build_trainer
    from hybrid3d.config.validation import validate_run

    shape = LlamaShape.from_hf(LlamaConfig(**CONFIG))
    out = {}
    for name, tp, zero, precision, offload, threshold, *more in RUNS:
        config = _config(tp, zero, precision, offload, threshold, *more, model_dir=model_dir)
        trainer = build_trainer(validate_run(config, world_size, shape))
        generator = torch.Generator().manual_seed(trainer.groups.get_data_parallel_rank())

        def batches():
            while True:
                tokens = torch.randint(0, shape.vocab_size, (2, 17), generator=generator)
                yield tokens[:, :-1], tokens[:, 1:]

        data = batches()
        trainer.train_step(data)  # Adam's moments are created by the first step
        probe = PeakProbe(trainer.engine)
        probe.enabled = True
        comms_logger.comms_dict.clear()
        comms_logger.prof_all = True
        with track_available_parameters(trainer.engine) if zero == 3 else contextlib.nullcontext() as available:
            trainer.train_step(data)
        comms_logger.prof_all = False
        out[name] = {label: dict(snapshot.by_category, other_names=[(where, n) for kind, where, n in snapshot.storages
                                                                     if kind == "other" and n >= 1024])
                     for label, snapshot in probe.snapshots.items()}
        if zero == 3:
            out[name]["zero3"] = dict(zero3_collectives(comms_logger.comms_dict), peak_available=available.peak)
        trainer.close()
        del trainer, probe
        end_run()
    return out


def zero3_collectives(comms_dict: dict) -> dict:
    """ZeRO-3's parameter all-gathers and gradient reduce-scatters in the comms logger's records: bytes and calls."""
    from hybrid3d.ds_internals.comms_callers import ZERO3_GATHER_CALLERS, ZERO3_REDUCE_SCATTER_CALLERS, op_and_caller

    out = {"gather_bytes": 0, "gather_calls": 0, "reduce_scatter_bytes": 0}
    for record, sizes in comms_dict.items():
        caller = op_and_caller(record)[1]
        if caller in ZERO3_GATHER_CALLERS:
            out["gather_bytes"] += sum(int(size) * entry[0] for size, entry in sizes.items())
            out["gather_calls"] += sum(entry[0] for entry in sizes.values())
        elif caller in ZERO3_REDUCE_SCATTER_CALLERS:
            out["reduce_scatter_bytes"] += sum(int(size) * entry[0] for size, entry in sizes.items())
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from tests.tiny_llama import make_hf_llama

    root = tmp_path_factory.mktemp("zero3_memory")
    make_hf_llama(root / "hf", "mqa", **CONFIG)  # the LoRA run's base
    return run_world(measure, 4, str(root), str(root / "hf"))


def _predicted(tp, zero, precision, offload, threshold, knobs=None, lora_rank=0):
    from hybrid3d.model import LlamaShape
    from hybrid3d.model.adapters import with_adapters
    from hybrid3d.planning.memory import model_states_from_numels, rank_parameter_numels
    from hybrid3d.planning.parameters import rank_adapter_numels
    from hybrid3d.planning.zero3_memory import lora_zero3_model_states, offload_states, zero3_model_states

    shape = LlamaShape.from_hf(LlamaConfig(**CONFIG))
    numels = rank_parameter_numels(shape, tp, 1, 0)
    nd = 4 // tp
    if zero == 3:
        embedding = numels[0]  # the first layer, still gathered when the gradient reduction starts
        if lora_rank:
            adapters = rank_adapter_numels(with_adapters(shape, lora_rank, LORA_TARGETS), tp, 1, 0)
            return lora_zero3_model_states(numels, adapters, nd, precision, BUCKET, threshold, embedding)
        return zero3_model_states(numels, nd, precision, BUCKET, threshold, offload, gathered_numel=embedding)
    gas, dp_rank = 8 // (2 * nd), 0  # every DP rank's partition overlaps as many elements here (checked by rank)
    states = model_states_from_numels(numels, nd, zero, precision, 1, dp_rank, gas, reduce_bucket_size=BUCKET)
    return offload_states(states, numels, nd, zero, precision, dp_rank, gas, BUCKET)


@pytest.mark.parametrize("run", RUNS, ids=[r[0] for r in RUNS])
def test_model_states_match_the_optimizers_tensors(measured, run):
    """At both moments the probe snapshots, the accumulation boundary and the optimizer step, exactly (ZeRO-2 offload
    at gas 2 with its gradients in several buckets: the host accumulators at the boundary, no fp32 gradient, up to one
    norm's accumulator)."""
    name, *options = run
    placed = _predicted(*options)
    for label, states in (("boundary", placed.states.boundary), ("step", placed.states.step)):
        predicted = vars(states)
        for rank, result in enumerate(measured):
            got = {k: result[name][label][k] for k in predicted}
            print(f"{name} {label} rank {rank}: measured {got}, predicted {predicted}, host {vars(placed.host)}")
            if label == "boundary" and name == "Z2-TP2xDP2-bf16-offload":
                # several buckets: one norm's host accumulator (h bf16 elements) may not exist yet (measured: 128 B
                # short on rank 0); the model counts it
                slack = {"grads": 2 * CONFIG["hidden_size"]}
                assert all(0 <= predicted[k] - got[k] <= slack.get(k, 0) for k in got), (label, rank, got, predicted)
            else:
                assert got == predicted, (label, rank, got, predicted)
            assert not result[name][label]["other_names"]  # scalars only: no tensor of the wrapper uncounted


def test_offload_moves_the_optimizer_states_to_the_host():
    """What the model calls host memory is the fp32 master, its gradient and Adam's moments (ZeRO-3's gradient
    partitions too, and with parameter offload the lp partitions): ZeRO-3 keeps the reduce bucket on the device, and
    the embedding gathered when the reduction starts."""
    placed = _predicted(1, 3, "bf16", "optimizer+params", 0)
    assert placed.device_bytes == 2 * BUCKET + 2 * CONFIG["vocab_size"] * CONFIG["hidden_size"]
    assert _predicted(1, 3, "bf16", "none", 0).host_bytes == 0


@pytest.mark.parametrize("run", [r for r in RUNS if r[2] == 3], ids=[r[0] for r in RUNS if r[2] == 3])
def test_zero3_collectives_and_live_parameters_follow_the_coordinator_replay(measured, run):
    """Every rank's ZeRO-3 all-gathers (bytes and calls: the coordinator's per micro-batch, the persistent parameters'
    after the step), gradient reduce-scatter bytes and largest count of gathered elements are the replay's
    (planning/zero3_fetch.py) exactly: with DeepSpeed's defaults the small model is gathered whole by the first
    module's prefetch and held to the end of the backward; with SOME_KEPT (1.8x the model's partitions gathered per
    micro-batch, at most 42% of its elements at once) and FEW_KEPT (1.8x, 42%) layers are gathered again."""
    from hybrid3d.model import LlamaShape
    from hybrid3d.model.adapters import with_adapters
    from hybrid3d.planning.memory import compute_bytes
    from hybrid3d.planning.zero3_fetch import Zero3Knobs, zero3_step_traffic

    name, tp, _, precision, _, threshold, *more = run
    knobs = Zero3Knobs.from_zero_config({"stage3_param_persistence_threshold": threshold, **(more[0] if more else {})})
    gas = 8 // (2 * (4 // tp))
    shape = LlamaShape.from_hf(LlamaConfig(**CONFIG))
    if len(more) > 1:  # only the adapters' gradients are reduced
        shape = with_adapters(shape, more[1], LORA_TARGETS)
    predicted = zero3_step_traffic(shape, tp, 4 // tp, gas, compute_bytes(precision), knobs)
    expected = dict(gather_bytes=predicted.gather_bytes, gather_calls=predicted.gather_calls,
                    reduce_scatter_bytes=predicted.reduce_scatter_bytes, peak_available=predicted.peak_live_numel)
    for rank, result in enumerate(measured):
        assert result[name]["zero3"] == expected, (rank, result[name]["zero3"], expected)
