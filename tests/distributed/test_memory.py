"""The memory model against the tensors DeepSpeed really allocates (one spawned world of 4 ranks)."""

import dataclasses

import pytest

from hybrid3d.ds_internals.memory_probe import ENGINE_SCALARS
from hybrid3d.model import LlamaShape
from hybrid3d.planning.memory import rank_model_states, rank_parameter_numels
from tests.distributed.worlds import run_world
from tests.distributed.memory_worker import BUCKET, GAS, SHAPES, measure_runs

# (name, shape, tp, pp, zero, precision, ep): every wrapper DeepSpeed picks, every stage position,
# tied copies, replicated kv heads, ZeRO-2's rank-dependent gradient partition and the experts' own group.
RUNS = [
    ("DP4-Z2-bf16", "gqa", 1, 1, 2, "bf16", 1),
    ("DP4-Z2-fp32acc-tied", "tied", 1, 1, 2, "bf16+fp32acc", 1),
    ("TP2DP2-Z1-fp32acc", "gqa", 2, 1, 1, "bf16+fp32acc", 1),
    ("TP2DP2-Z0-bf16", "gqa", 2, 1, 0, "bf16", 1),
    ("PP2DP2-Z1-bf16-tied", "tied", 1, 2, 1, "bf16", 1),
    ("TP2PP2-Z0-bf16", "gqa", 2, 2, 0, "bf16", 1),
    ("TP4-Z0-fp32-mqa", "mqa", 4, 1, 0, "fp32", 1),
    ("DP4-Z1-fp32", "gqa", 1, 1, 1, "fp32", 1),
    ("EP2DP4-Z2-fp32-moe", "moe", 1, 1, 2, "fp32", 2),
    ("TP2EP2DP2-Z1-fp32-moe", "moe", 2, 1, 1, "fp32", 2),
    ("EP2DP4-Z1-fp32-moe", "moe", 1, 1, 1, "fp32", 2),
    ("DP4-Z2-fp32acc-moe", "moe", 1, 1, 2, "bf16+fp32acc", 1),
    ("EP2DP4-Z1-fp32acc-moe", "moe", 1, 1, 1, "bf16+fp32acc", 2),
    ("EP2DP4-Z2-fp32acc-moe", "moe", 1, 1, 2, "bf16+fp32acc", 2),
]
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    runs = [dict(name=n, shape=s, tp=t, pp=p, zero=z, precision=prec, ep=e) for n, s, t, p, z, prec, e in RUNS]
    return run_world(measure_runs, 4, str(tmp_path_factory.mktemp("memory")), runs)


@pytest.mark.parametrize("run", RUNS, ids=[r[0] for r in RUNS])
def test_model_states_match_deepspeed(measured, run):
    name, shape_name, tp, pp, zero, precision, ep = run
    shape = LlamaShape(**SHAPES[shape_name])
    for rank, reports in enumerate(measured):
        report = reports[name]
        assert report["numels"] == rank_parameter_numels(shape, tp, pp, report["stage"], ep=ep), (name, rank)
        predicted = rank_model_states(shape, tp, pp, 4 // (tp * pp), zero, precision, stage=report["stage"],
                                      dp_rank=report["dp_rank"], gas=GAS, reduce_bucket_size=BUCKET, ep=ep)
        assert report["wrapper"] == predicted.wrapper.replace("torch", "AdamW"), (name, rank)
        for label in ("boundary", "step"):
            got = report["measured"][label]
            want = dataclasses.asdict(getattr(predicted, label))
            assert set(report["other"][label]) <= ENGINE_SCALARS, report["other"]
            total = sum(got[k] for k in want)
            assert abs(sum(want.values()) - total) <= TOLERANCE * total, (name, rank, label, got, want)
            for key, value in want.items():  # each category too, so errors cannot cancel out
                assert abs(value - got[key]) <= TOLERANCE * total, (name, rank, label, key, got, want)


