"""ZeRO-2 with pipeline stages (hybrid3d.pipeline_zero2): HF, stock ZeRO-1, checkpoints, tied weights.

Two spawned worlds: 4 ranks (PP2xDP2: fp32, tied, bf16, activation checkpointing, save/resume,
the deferred-reduction knob) and 8 ranks (TP2xPP2xDP2, and the 4-rank checkpoint resumed there
through DeepSpeed's universal checkpoint).
"""

import pytest
import torch

from hybrid3d.ds_internals.universal_convert import run_ds_to_universal
from tests.distributed.worlds import run_world
from tests.distributed.engine_runs import STEPS, hf_reference_run
from tests.distributed.pipeline_zero2_worker import train_runs
from tests.numerics import BF16_LOSS_GAP, BF16_UPDATE_EXCESS, loss_gap, loss_movement, update_excess
from tests.tiny_llama import load_hf, make_training_models, max_rel_error
from tests.distributed.reports import merged_weights

TOL = 1e-5
SAVE_AT = 3
Z2 = {"pipeline_zero2": True}
BF16_FP32_ACCUM = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
BF16_GRADS = {"bf16": {"enabled": True}}
AC = {"pipeline": {"activation_checkpoint_interval": 1}}
SMALL_BUCKETS = {"stage": 2, "reduce_bucket_size": 3000}  # elements; the tied weight has 256 x 32


def run(name, case, tp, zero, **kw):
    return dict(name=name, case=case, tp=tp, pp=2, zero=zero, **kw)


WORLD4 = [
    run("Z1-PP2-DP2", "gqa", 1, 1),
    run("Z2-PP2-DP2", "gqa", 1, 2, hybrid=Z2, save_at=SAVE_AT),
    run("Z2-PP2-DP2-ckpt", "gqa", 1, 2, hybrid=Z2, extra=AC),
    run("tied-Z1-PP2-DP2", "tied", 1, 1),
    # buckets smaller than the tied weight: it bypasses them, and the cross-stage sum runs in chunks
    run("tied-Z2-PP2-DP2", "tied", 1, 2, hybrid=Z2, extra={"zero_optimization": SMALL_BUCKETS}),
    run("tied-Z2-PP2-DP2-deferred", "tied", 1, 2, hybrid={**Z2, "pipeline_zero2_deferred_fraction": 0.5}),
    # bf16 + fp32 accumulation: the tied slices live in the fp32 partition buffer
    run("tied-bf16-Z2-PP2-DP2", "tied", 1, 2, hybrid=Z2, extra={**BF16_FP32_ACCUM, "zero_optimization": SMALL_BUCKETS}),
]
# bf16 runs and their fp32 twin in a world of their own (the bf16 tests can run alone: test_cpu_kernels.py)
BF16_WORLD4 = [
    run("Z1-PP2-DP2", "gqa", 1, 1),
    run("bf16-BF16_Optimizer", "gqa", 1, 1, extra=BF16_FP32_ACCUM),
    run("bf16-Z1-bf16-grads", "gqa", 1, 1, extra=BF16_GRADS),
    run("bf16-Z2", "gqa", 1, 2, hybrid=Z2, extra={**BF16_FP32_ACCUM, "zero_optimization": SMALL_BUCKETS},
        probe=True),
]
UNIVERSAL_TAG = "Z2-PP2-DP2_universal"
WORLD8 = [
    run("Z1-TP2-PP2-DP2", "gqa", 2, 1),
    run("Z2-TP2-PP2-DP2", "gqa", 2, 2, hybrid=Z2),
    run("universal-TP2-PP2-DP2", "gqa", 2, 2, hybrid=Z2, extra={"checkpoint": {"load_universal": True}},
        start=SAVE_AT),
]
# (ZeRO-2 run, its stock ZeRO-1 twin) in fp32
FP32_PAIRS = [("Z2-PP2-DP2", "Z1-PP2-DP2"), ("tied-Z2-PP2-DP2", "tied-Z1-PP2-DP2"),
              ("tied-Z2-PP2-DP2-deferred", "tied-Z1-PP2-DP2"), ("Z2-TP2-PP2-DP2", "Z1-TP2-PP2-DP2")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_zero2")
    model_dirs = make_training_models(root)
    ckpt = root / "checkpoints"
    by_rank = {}
    ranks = run_world(train_runs, 4, str(root / "world4"), WORLD4, model_dirs, str(ckpt))
    by_rank.update({r["name"]: [rank[r["name"]] for rank in ranks] for r in WORLD4})
    run_ds_to_universal(ckpt / "Z2-PP2-DP2", ckpt / UNIVERSAL_TAG)
    world8 = [dict(r, load=(str(ckpt), UNIVERSAL_TAG)) if "start" in r else r for r in WORLD8]
    ranks = run_world(train_runs, 8, str(root / "world8"), world8, model_dirs, str(ckpt))
    by_rank.update({r["name"]: [rank[r["name"]] for rank in ranks] for r in WORLD8})
    refs = {case: hf_reference_run(d) for case, d in model_dirs.items()}
    return {"ref": refs, "runs": by_rank, "model_dirs": model_dirs}


@pytest.fixture(scope="module")
def bf16_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_zero2_bf16")
    model_dirs = make_training_models(root)
    ranks = run_world(train_runs, 4, str(root / "world4"), BF16_WORLD4, model_dirs, str(root / "checkpoints"))
    initial = {case: {n: p.detach().clone() for n, p in load_hf(d).named_parameters()} for case, d in model_dirs.items()}
    return {"runs": {r["name"]: [rank[r["name"]] for rank in ranks] for r in BF16_WORLD4}, "initial": initial,
            "model_dirs": model_dirs}


def worst(weights, reference) -> float:
    assert set(weights) == set(reference)
    return max(max_rel_error(weights[n], reference[n]) for n in reference)


@pytest.mark.parametrize("pair", FP32_PAIRS, ids=lambda p: p[0])
def test_fp32_equals_stock_zero1_and_hf(results, pair):
    zero2, zero1 = (results["runs"][name] for name in pair)
    case = "tied" if pair[0].startswith("tied") else "gqa"
    ref = results["ref"][case]
    for report in zero2:
        assert report["engine"] == "ZeRO2PipelineEngine" and report["partition_gradients"]
    for report, twin in zip(zero2, zero1):
        assert twin["engine"] == "PipelineEngine" and not twin["partition_gradients"]
        assert len(report["losses"]) == STEPS
        assert max_rel_error(torch.tensor(report["losses"]), torch.tensor(twin["losses"])) <= TOL
        assert max_rel_error(torch.tensor(report["losses"]), torch.tensor(ref["losses"])) <= TOL
    weights = merged_weights(zero2)
    assert worst(weights, merged_weights(zero1)) <= TOL
    assert worst(weights, ref["weights"]) <= TOL
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # five steps that changed nothing would also match


@pytest.mark.parametrize("name", ["tied-Z2-PP2-DP2", "tied-Z2-PP2-DP2-deferred", "tied-bf16-Z2-PP2-DP2"])
def test_tied_copies_stay_bit_identical(results, name):
    """The embedding (first stage) and the head's copy (last stage) after five steps; that they train
    like HF is checked with the fp32 runs above."""
    copies = {}
    for report in results["runs"][name]:
        assert report["engine"] == "ZeRO2PipelineEngine"
        copies.setdefault(report["tp_rank"], []).append((report["stage"], report["tied_copy"]["embed"]))
    initial = load_hf(results["model_dirs"]["tied"]).model.embed_tokens.weight.detach()
    for per_tp in copies.values():
        assert {stage for stage, _ in per_tp} == {0, 1}
        first = per_tp[0][1]
        assert all(torch.equal(first, copy) for _, copy in per_tp)
        assert max_rel_error(first[:initial.shape[0]], initial) > 1e-3  # they moved (rows past the vocabulary pad)


@pytest.mark.bf16
@pytest.mark.parametrize("name", ["bf16-Z2", "bf16-BF16_Optimizer", "bf16-Z1-bf16-grads"])
def test_bf16_tracks_the_fp32_run(bf16_results, name):
    """bf16 with fp32 masters against the fp32 run of the same layout (stock ZeRO-1; ZeRO-2 equals it
    in fp32, test above), on the loss curve and each weight's update (tests/numerics.py). ZeRO-2 rounds
    each micro-batch's reduced gradient to bf16 (the communication dtype) before adding it to its fp32
    partition; BF16_Optimizer accumulates in fp32; stock ZeRO-1 without fp32 accumulation in bf16: all
    three must stay within the same bf16 tolerances."""
    results = bf16_results
    runs = results["runs"]
    engines = {"bf16-Z2": "ZeRO2PipelineEngine", "bf16-BF16_Optimizer": "PipelineEngine",
               "bf16-Z1-bf16-grads": "PipelineEngine"}
    optimizers = {"bf16-Z2": "DeepSpeedZeroOptimizer", "bf16-BF16_Optimizer": "BF16_Optimizer",
                  "bf16-Z1-bf16-grads": "DeepSpeedZeroOptimizer"}
    reports, fp32 = runs[name], runs["Z1-PP2-DP2"]
    assert {r["optimizer"] for r in reports} == {optimizers[name]}
    assert {r["engine"] for r in reports} == {engines[name]}
    for report, twin in zip(reports, fp32):
        assert loss_movement(twin["losses"]) >= 10 * BF16_LOSS_GAP
        assert loss_gap(report["losses"], twin["losses"]) <= BF16_LOSS_GAP
    gaps = update_excess(merged_weights(reports), merged_weights(fp32), results["initial"]["gqa"])
    bad = {n: g for n, g in gaps.items() if not g <= BF16_UPDATE_EXCESS}
    assert not bad, f"bf16 updates differ from fp32: {bad}"


def test_gradient_memory_matches_the_memory_model(bf16_results):
    results = bf16_results
    """bf16 + fp32 accumulation with buckets smaller than the embedding and the head: the gradient
    bytes counted from the optimizer's tensors at their largest (a bucket reduction) and at the step,
    against `hybrid3d.memory` (4Ψ/d fp32 partition + bucket + gradients outside it)."""
    from transformers import LlamaConfig

    from hybrid3d.model import LlamaShape
    from hybrid3d.planning.memory import rank_model_states

    shape = LlamaShape.from_hf(LlamaConfig.from_pretrained(results["model_dirs"]["gqa"]))
    for report in results["runs"]["bf16-Z2"]:
        model = rank_model_states(shape, 1, 2, 2, 2, "bf16+fp32acc", report["stage"], report["dp_rank"], gas=2,
                                  reduce_bucket_size=SMALL_BUCKETS["reduce_bucket_size"], pipeline_zero2=True)
        assert report["grads"]["boundary"] == pytest.approx(model.boundary.grads, rel=0.02)
        assert report["grads"]["step"] == pytest.approx(model.step.grads, rel=0.02)
        assert model.boundary.grads > model.step.grads  # the bucket and the oversized gradients count


def test_resume_in_the_same_layout_is_exact(results):
    """From the asynchronously written checkpoint (async_saves.save_both_ways): every file the synchronous save's
    byte for byte, and the resumed run the uninterrupted one bit for bit."""
    for report in results["runs"]["Z2-PP2-DP2"]:
        assert report["async_files"]["same"] and report["async_files"]["mine"]
        assert report["resumed_losses"] == report["losses"][SAVE_AT:]
        for name, tensor in report["weights"].items():
            assert torch.equal(report["resumed_weights"][name], tensor), name


def test_universal_checkpoint_resumes_at_another_layout(results):
    saved = merged_weights(results["runs"]["Z2-PP2-DP2"], "saved_weights")
    source = results["runs"]["Z2-PP2-DP2"][0]
    reports = results["runs"]["universal-TP2-PP2-DP2"]
    loaded = merged_weights(reports, "loaded_weights")
    assert set(loaded) == set(saved)
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)  # fp32 masters resharded exactly
    for report in reports:
        assert report["engine"] == "ZeRO2PipelineEngine"
        expected = torch.tensor(source["losses"][SAVE_AT:])
        assert max_rel_error(torch.tensor(report["losses"]), expected) <= TOL
    assert worst(merged_weights(reports), merged_weights(results["runs"]["Z2-PP2-DP2"])) <= TOL


def test_activation_checkpointing_keeps_the_losses(results):
    plain, ckpt = results["runs"]["Z2-PP2-DP2"], results["runs"]["Z2-PP2-DP2-ckpt"]
    gas = 2
    for report, base in zip(ckpt, plain):
        assert max_rel_error(torch.tensor(report["losses"]), torch.tensor(base["losses"])) <= 1e-6
        assert report["forwards_per_step"] == [2 * report["blocks_on_rank"] * gas] * STEPS  # recomputed
