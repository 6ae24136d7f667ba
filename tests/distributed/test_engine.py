"""DeepSpeed registration: every layout and ZeRO stage trains exactly like HF LlamaForCausalLM.

One spawned world per world size (1, 2, 4, 8 ranks) runs all of that size's layouts in turn.
"""

from collections import Counter

import pytest
import torch

from tests.distributed.worlds import run_worlds_by_size
from tests.distributed.engine_runs import (GLOBAL_BATCH, MICRO_BATCH, OPTIM, SEQ, STEPS, VOCAB, hf_reference_run,
                                           megatron_documents, windows, write_megatron_prefix)
from tests.distributed.engine_worker import train_runs
from tests.numerics import BF16_LOSS_GAP, BF16_UPDATE_EXCESS, loss_gap, loss_movement, update_excess
from tests.tiny_llama import load_hf, make_hf_llama, make_training_models, max_rel_error
from tests.distributed.reports import merged_weights

FIRST_LOSS_TOL = 1e-5
RUN_TOL = 1e-4

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 4, 1),
           (4, 1, 1)]


# Layouts that also run without ZeRO (DeepSpeed's plain optimizer, and with a pipeline its clipping over stages,
# hybrid3d.ds_internals.pipeline_clip): one of each kind, TP alone x PP, DP with TP, DP with PP, and none.
ZERO0_LAYOUTS = {(1, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)}


def zero_stages(tp: int, pp: int, dp: int) -> tuple:
    """The ZeRO stages a layout runs at: 1 everywhere; 0 at ZERO0_LAYOUTS (and tied-TP1-PP2-DP1-Z0 below); 2
    without a pipeline where d = 2 (ZeRO-2 over one data-parallel rank partitions nothing ZeRO-1 does not; ZeRO-2
    with stages is hybrid3d.pipeline_zero2, tests/distributed/test_pipeline_zero2.py). TP4's subject is the split,
    so it runs at ZeRO-1 only."""
    stages = ((0,) if (tp, pp, dp) in ZERO0_LAYOUTS else ()) + (1,)
    return stages + ((2,) if pp == 1 and dp == 2 else ())


# The matrix case whose batches come from Megatron documents (written by megatron-core's IndexedDatasetBuilder)
# through hybrid3d's data path, against HF trained on windows the test cuts from the same documents
# (engine_runs.windows): DP ranks take shares of each sample range, and the pipeline reads micro-batches on its first
# and last stages only. No other test compares with this case's losses.
MEGATRON_DATA = "TP1-PP2-DP2-Z0"


def matrix_runs():
    runs = []
    for tp, pp, dp in LAYOUTS:
        for zero in zero_stages(tp, pp, dp):
            name = f"TP{tp}-PP{pp}-DP{dp}-Z{zero}"
            runs.append(dict(name=name, case="gqa", tp=tp, pp=pp, zero=zero, world=tp * pp * dp,
                             **({"data": "megatron"} if name == MEGATRON_DATA else {})))
    for tp, pp, dp in [(1, 2, 1), (1, 4, 1), (2, 2, 2)]:
        runs.append(dict(name=f"tied-TP{tp}-PP{pp}-DP{dp}-Z1", case="tied", tp=tp, pp=pp, zero=1, world=tp * pp * dp))
    # fp32 without ZeRO in a pipeline: the clipping of hybrid3d.ds_internals.pipeline_clip (a tied weight on
    # two stages; norms replicated over TP on every stage: TP2-PP2-DP1-Z0 above)
    runs.append(dict(name="tied-TP1-PP2-DP1-Z0", case="tied", tp=1, pp=2, zero=0, world=2))
    return runs


BF16 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
BF16_RUNS = [dict(name=f"bf16-TP{tp}-PP{pp}-DP{dp}", case="gqa", tp=tp, pp=pp, zero=1, world=4, extra=BF16,
                  fp32_twin=f"TP{tp}-PP{pp}-DP{dp}-Z1") for tp, pp, dp in [(1, 2, 2), (2, 1, 2)]]

# Activation checkpointing options that work on the CPU accelerator; all at TP2 so partitioning
# has something to split. Baselines are the matrix runs of the same layout. Options that change no tensor
# (synchronize_checkpoint_boundary, profile) share the partition run: every flag is checked on its own
# (test_activation_checkpointing_takes_effect), and each run still matches its baseline's losses.
AC = "activation_checkpointing"
CKPT_OPTIONS = {
    "interval": {},
    "non_reentrant": {"pipeline": {"use_reentrant": False}},
    "partition+synchronize+profile": {AC: {"partition_activations": True, "synchronize_checkpoint_boundary": True,
                                           "profile": True}},
    "contiguous": {AC: {"partition_activations": True, "contiguous_memory_optimization": True,
                        "number_checkpoints": 4}},
    "cpu_with_partition": {AC: {"partition_activations": True, "cpu_checkpointing": True}},
}


def ckpt_runs():
    runs = []
    for option, extra in CKPT_OPTIONS.items():
        pipeline = {"activation_checkpoint_interval": 1, **extra.get("pipeline", {})}
        runs.append(dict(name=f"ckpt-{option}-TP2-PP2-DP1", case="gqa", tp=2, pp=2, zero=1, world=4,
                         extra={**extra, "pipeline": pipeline}, baseline="TP2-PP2-DP1-Z1", option=option))
    for option in ("partition+synchronize+profile", "non_reentrant"):
        extra = CKPT_OPTIONS[option]
        pipeline = {"activation_checkpoint_interval": 2, **extra.get("pipeline", {})}
        runs.append(dict(name=f"ckpt-{option}-TP2-PP1-DP2", case="gqa", tp=2, pp=1, zero=2, world=4,
                         extra={**extra, "pipeline": pipeline}, baseline="TP2-PP1-DP2-Z2", option=option))
    return runs


# DeepSpeed's default AdamW (FusedAdam, JIT-built for the accelerator) instead of torch's.
FUSED_ADAM = [dict(name="fused-adam-TP2-PP1-DP1", case="gqa", tp=2, pp=1, zero=1, world=2,
                   optimizer={"type": "AdamW", "params": dict(OPTIM)})]

# Sequence parallelism (sp) and context parallelism (cp) against the same HF reference: (name, case, tp, pp,
# dp, cp, zero, hybrid3d keys, top-level keys). gqa has 2 kv heads for 4 query heads, so TP2 x CP2 and CP4
# repeat kv heads for the exchange; tied has tied embeddings.
SP = {"sequence_parallel": True}
# SP at TP2 alone, CP2 alone and TP2 x CP2 alone also train against HF in test_finetune.py (with loss masks and
# documents), test_lora.py and test_ring_attention.py: here their combinations with ZeRO, ties, pipelines and
# checkpointing.
SEQUENCE_RUNS = [
    ("SP-tied-TP2-Z1", "tied", 2, 1, 1, 1, 1, SP, {}),
    ("SP-TP2-PP2-Z1", "gqa", 2, 2, 1, 1, 1, SP, {}),
    ("SP-TP2-DP2-Z2", "gqa", 2, 1, 2, 1, 2, SP, {}),
    ("SP-tied-TP2-PP2-pipeline_zero2", "tied", 2, 2, 1, 1, 2, dict(SP, pipeline_zero2=True), {}),
    ("SP-ckpt-TP2-PP2-Z1", "tied", 2, 2, 1, 1, 1, SP, {"pipeline": {"activation_checkpoint_interval": 1}}),
    ("SP-ckpt-nonreentrant-TP2-DP2-Z2", "gqa", 2, 1, 2, 1, 2, SP,
     {"pipeline": {"activation_checkpoint_interval": 2, "use_reentrant": False}}),
    ("CP2-tied-Z0", "tied", 1, 1, 1, 2, 0, {}, {}),
    ("CP4-Z0", "gqa", 1, 1, 1, 4, 0, {}, {}),
    ("CP2-DP2-Z2", "gqa", 1, 1, 2, 2, 2, {}, {}),
    ("SP-tied-TP2-CP2-Z2", "tied", 2, 1, 1, 2, 2, SP, {}),
    ("CP2-ckpt-TP2-Z1", "gqa", 2, 1, 1, 2, 1, {}, {"pipeline": {"activation_checkpoint_interval": 1}}),
    # context parallelism with a pipeline
    ("CP2-PP2-Z1", "gqa", 1, 2, 1, 2, 1, {}, {}),
    ("CP2-tied-PP2-ckpt-Z1", "tied", 1, 2, 1, 2, 1, {}, {"pipeline": {"activation_checkpoint_interval": 1}}),
    ("CP2-PP2-pipeline_zero2", "gqa", 1, 2, 1, 2, 2, {"pipeline_zero2": True}, {}),
    ("SP-tied-TP2-PP2-CP2-Z1", "tied", 2, 2, 1, 2, 1, SP, {}),
]


def sequence_runs():
    return [dict(name=name, case=case, tp=tp, pp=pp, zero=zero, world=tp * pp * dp * cp, cp=cp,
                 hybrid=dict(hybrid, **({"context_parallel_size": cp} if cp > 1 else {})), extra=extra)
            for name, case, tp, pp, dp, cp, zero, hybrid, extra in SEQUENCE_RUNS]


# DeepSpeed's DualPipeV schedule (`pipeline_schedule: "dualpipev"`): GAS >= 2p, so some runs use micro-batch 1.
MICRO1 = {"train_micro_batch_size_per_gpu": 1}
DUALPIPEV = {"pipeline_schedule": "dualpipev"}
SCHEDULE_RUNS = [
    dict(name="DualPipeV-PP2-Z1", case="gqa", tp=1, pp=2, zero=1, world=2, hybrid=DUALPIPEV),
    dict(name="DualPipeV-PP2-DP2-Z1", case="gqa", tp=1, pp=2, zero=1, world=4, hybrid=DUALPIPEV, extra=MICRO1),
    # saved both ways after its steps (async_saves.save_both_ways): V-placed stages' files written in the background
    dict(name="DualPipeV-tied-TP2-PP2-Z1", case="tied", tp=2, pp=2, zero=1, world=4, hybrid=DUALPIPEV,
         async_save=True),
    dict(name="DualPipeV-tied-PP2-Z0", case="tied", tp=1, pp=2, zero=0, world=2, hybrid=DUALPIPEV),
    dict(name="DualPipeV-CP2-PP2-Z1", case="gqa", tp=1, pp=2, zero=1, world=4, hybrid=dict(DUALPIPEV, context_parallel_size=2),
         extra=MICRO1),
]
# Interleaved 1F1B (`pipeline_schedule: "interleaved"`, v = 2): GAS a multiple of p; the 4 blocks in 4 stages.
INTERLEAVED = {"pipeline_schedule": "interleaved", "virtual_pipeline_size": 2}
INTERLEAVED_RUNS = [
    dict(name="Interleaved-PP2-Z1", case="gqa", tp=1, pp=2, zero=1, world=2, hybrid=INTERLEAVED),
    dict(name="Interleaved-tied-PP2-Z0", case="tied", tp=1, pp=2, zero=0, world=2, hybrid=INTERLEAVED),
    dict(name="Interleaved-PP2-DP2-Z1", case="gqa", tp=1, pp=2, zero=1, world=4, hybrid=INTERLEAVED, extra=MICRO1),
    dict(name="Interleaved-tied-TP2-PP2-Z1", case="tied", tp=2, pp=2, zero=1, world=4, hybrid=INTERLEAVED),
    dict(name="Interleaved-ckpt-CP2-PP2-Z1", case="gqa", tp=1, pp=2, zero=1, world=4,
         hybrid=dict(INTERLEAVED, context_parallel_size=2), extra={"pipeline": {"activation_checkpoint_interval": 1}}),
]

# `partition_method: "cost"` (stages balanced by training FLOPs, the head's included: model/pipe.stage_bounds) on
# "wide", the gqa model with a 1024-token vocabulary, whose LM head costs 3.6 decoder blocks: at PP2 the first
# stage takes 3 of the 4 blocks (count-balanced: 2 and 2). With the interleaved and DualPipeV schedules (4 stages
# of one block either way) the bounds reach DeepSpeed's other module classes (ds_internals/pipeline_bounds.py).
COST = {"partition_method": "cost"}
COST_RUNS = [
    dict(name="cost-TP1-PP2-Z1", case="wide", tp=1, pp=2, zero=1, world=2, hybrid=COST, blocks=[3, 1]),
    dict(name="cost-TP2-PP2-Z0", case="wide", tp=2, pp=2, zero=0, world=4, hybrid=COST, blocks=[3, 1]),
    dict(name="cost-Interleaved-PP2", case="wide", tp=1, pp=2, zero=1, world=2, hybrid=dict(INTERLEAVED, **COST),
         blocks=[2, 2]),
    dict(name="cost-DualPipeV-PP2", case="wide", tp=1, pp=2, zero=1, world=2, hybrid=dict(DUALPIPEV, **COST),
         blocks=[2, 2]),
]

# Compiled decoder blocks (`hybrid3d.compile`, one torch.compile per block): the "aot_eager" backend traces them
# through Dynamo and AOT autograd (graph breaks at the TP collectives and DeepSpeed's checkpoint) as
# inductor does, without generating kernels, which would take ~30 s a process on 2 cores; numerics equal eager.
COMPILED = {"compile": {"enabled": True, "backend": "aot_eager"}}
COMPILED_RUNS = [
    dict(name="compiled-SP-TP2-Z1", case="gqa", tp=2, pp=1, zero=1, world=2, hybrid=dict(COMPILED, sequence_parallel=True)),
    # TP2 over the whole world: its all-reduces take DeepSpeed's shared-memory op inside the compiled blocks
    dict(name="compiled-TP2-Z1", case="gqa", tp=2, pp=1, zero=1, world=2, hybrid=COMPILED),
    dict(name="compiled-tied-PP2-ckpt-Z1", case="tied", tp=1, pp=2, zero=1, world=2, hybrid=COMPILED,
         extra={"pipeline": {"activation_checkpoint_interval": 1}}),
]

# ZeRO-3 (pipeline_parallel_size 1): every parameter partitioned over the d·c data-parallel ranks from the build on
# (deepspeed.zero.Init over the layout's group, ds_internals/zero3.py). A persistence threshold of 0, since DeepSpeed
# keeps tensors below 1e5 elements whole by default, which would be every tensor of these models.
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
CPU = {"device": "cpu"}
ZERO3_RUNS = [
    dict(name="Z3-DP2", case="gqa", tp=1, pp=1, zero=3, world=2, extra={"zero_optimization": Z3}),
    dict(name="Z3-tied-DP2", case="tied", tp=1, pp=1, zero=3, world=2, extra={"zero_optimization": Z3}),
    dict(name="Z3-TP2-DP2", case="gqa", tp=2, pp=1, zero=3, world=4, extra={"zero_optimization": Z3}, save=True),
    dict(name="Z3-SP-tied-TP2-DP2", case="tied", tp=2, pp=1, zero=3, world=4, extra={"zero_optimization": Z3},
         hybrid=SP),
    dict(name="Z3-CP2-DP2", case="gqa", tp=1, pp=1, zero=3, world=4, extra={"zero_optimization": Z3},
         hybrid={"context_parallel_size": 2}),
]
# ZeRO-Offload (Ren et al. 2021): DeepSpeed's CPU Adam op (the JSON's AdamW without torch_adam) steps the fp32
# masters on the host; on the CPU accelerator nothing crosses a bus, but the offload code path runs.
CPU_ADAM = {"type": "AdamW", "params": dict(OPTIM)}
OFFLOAD_RUNS = [
    dict(name="offload-Z1-PP2-DP2", case="gqa", tp=1, pp=2, zero=1, world=4, optimizer=CPU_ADAM,
         extra={"zero_optimization": {"stage": 1, "offload_optimizer": CPU}}),
    dict(name="offload-Z2-TP2-DP2", case="gqa", tp=2, pp=1, zero=2, world=4, optimizer=CPU_ADAM,
         extra={"zero_optimization": {"stage": 2, "offload_optimizer": CPU}}),
    dict(name="offload-Z3-params-DP2", case="gqa", tp=1, pp=1, zero=3, world=2, optimizer=CPU_ADAM,
         extra={"zero_optimization": dict(Z3, offload_optimizer=CPU, offload_param=CPU)}, save=True),
    # ZeRO-Infinity (Rajbhandari et al. 2021): the optimizer states and the weight partitions swapped to files through
    # DeepSpeed's async I/O op (libaio; its nvme_path set per run by engine_worker); buffers of 2e4 elements, above
    # the largest parameter of the tiny model, instead of DeepSpeed's 1e8. The full tier only (`--full`): that op is
    # the longest build of the suite (100-170 s on 2 cores) and serves this run alone; without libaio the refusal is
    # tests/unit/test_run_config_refusals.py::test_nvme_offload_without_libaio_is_one_line.
    dict(name="offload-Z3-nvme-DP2", case="gqa", tp=1, pp=1, zero=3, world=2, optimizer=CPU_ADAM, full=True,
         extra={"zero_optimization": dict(Z3, offload_optimizer={"device": "nvme"},
                                          offload_param={"device": "nvme", "buffer_size": 20_000,
                                                         "buffer_count": 5})}),
]

# "auto" (planning/auto_layout.py): the keys left open decided as launch/train.py decides them, then validated and
# built like any written-out config. TP is given (a constraint); the pipeline, CP, SP, the ZeRO stage, checkpointing
# and the micro-batch are the planner's, under a budget every option fits (the choice is the estimate's fastest).
AUTO_RUNS = [dict(name="auto-TP2", case="gqa", tp=2, pp=1, zero=1, world=4,
                  auto={"layout": "auto", "tensor_parallel_size": 2, "device_memory_gb": 4.0})]
ALL_RUNS = (matrix_runs() + ckpt_runs() + FUSED_ADAM + sequence_runs() + SCHEDULE_RUNS + INTERLEAVED_RUNS
            + COST_RUNS + COMPILED_RUNS + ZERO3_RUNS + OFFLOAD_RUNS + AUTO_RUNS)
# The bf16 runs and their fp32 twins in a world of their own, so the bf16 tests can run alone
# (under other CPU kernels: test_cpu_kernels.py) without the whole matrix.
# bf16 + fp32 masters with the optimizer offloaded, in a pipeline: DeepSpeed then takes DeepSpeedZeroOptimizer (CPU
# Adam on fp32 partitions) instead of BF16_Optimizer.
BF16_OFFLOAD = dict(name="bf16-offload-TP1-PP2-DP2", case="gqa", tp=1, pp=2, zero=1, world=4, optimizer=CPU_ADAM,
                    extra=dict(BF16, zero_optimization={"stage": 1, "offload_optimizer": CPU}),
                    fp32_twin="offload-Z1-PP2-DP2")
BF16_WORLD = BF16_RUNS + [BF16_OFFLOAD] + [dict(run, name=r["fp32_twin"]) for r in BF16_RUNS + [BF16_OFFLOAD]
                                           for run in matrix_runs() + OFFLOAD_RUNS if run["name"] == r["fp32_twin"]]


def train_worlds(root, all_runs) -> dict:
    model_dirs = make_training_models(root)
    if any(run["case"] == "wide" for run in all_runs):
        model_dirs["wide"] = str(root / "wide")
        make_hf_llama(model_dirs["wide"], "gqa_llama3", num_hidden_layers=4, vocab_size=1024)
    refs = {case: hf_reference_run(d) for case, d in model_dirs.items()}
    for case, d in model_dirs.items():
        refs[case]["initial"] = {n: p.detach().clone() for n, p in load_hf(d).named_parameters()}
    writer = None
    if any(run.get("data") == "megatron" for run in all_runs):
        docs = megatron_documents()
        writer = write_megatron_prefix(str(root / "megatron"), docs)
        all_runs = [dict(run, data_prefix=str(root / "megatron")) if run.get("data") == "megatron" else run
                    for run in all_runs]
        refs["gqa-megatron"] = hf_reference_run(model_dirs["gqa"], batches=windows(docs))
    return {"ref": refs, "runs": run_worlds_by_size(train_runs, all_runs, root, model_dirs, str(root / "saved")),
            "saved": root / "saved", "model_dirs": model_dirs, "megatron_writer": writer}


def reference(results, run) -> dict:
    """The HF run a matrix case compares with: on `engine_runs.global_batch`, or on the Megatron documents' windows
    (`engine_runs.windows`)."""
    return results["ref"][run["case"] + ("-megatron" if run.get("data") == "megatron" else "")]


def in_tier(runs: list[dict], config) -> list[dict]:
    """`runs` without those of the full tier (`full=True`) unless pytest runs with --full."""
    return [run for run in runs if config.getoption("--full") or not run.get("full")]


def cases(runs: list[dict]) -> list:
    """`runs` as test parameters named by run, those of the full tier marked `full` (tests/conftest.py)."""
    return [pytest.param(run, id=run["name"], marks=[pytest.mark.full] if run.get("full") else []) for run in runs]


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    return train_worlds(tmp_path_factory.mktemp("engine"), in_tier(ALL_RUNS, request.config))


@pytest.fixture(scope="module")
def bf16_results(tmp_path_factory):
    return train_worlds(tmp_path_factory.mktemp("engine_bf16"), BF16_WORLD)


@pytest.mark.parametrize("run", matrix_runs(), ids=lambda r: r["name"])
def test_layout_matches_hf_over_five_steps(results, run):
    ref = reference(results, run)
    reports = results["runs"][run["name"]]
    for report in reports:
        assert report["build_draws"] == 0  # HF weights overwrite every parameter: no initial weight is drawn
        assert report["autograd_warnings"] == []  # tied weights over stages: broadcast without autograd
        assert len(report["losses"]) == STEPS
        assert max_rel_error(torch.tensor(report["losses"][0]), torch.tensor(ref["losses"][0])) <= FIRST_LOSS_TOL
        assert max_rel_error(torch.tensor(report["losses"]), torch.tensor(ref["losses"])) <= RUN_TOL
        assert_grad_norms_match(report, ref, RUN_TOL, run)
    weights = merged_weights(reports)
    assert set(weights) == set(ref["weights"])
    bad = {n: e for n, w in ref["weights"].items() if not (e := max_rel_error(weights[n], w)) <= RUN_TOL}
    assert not bad, bad
    # The loss moved: five steps that changed nothing would also "match".
    assert ref["losses"][-1] < ref["losses"][0] - 0.05


def test_megatron_documents_train_like_their_windows_in_hf(results):
    """The Megatron case (MEGATRON_DATA) read every document megatron-core wrote, through `build_training_data`, and
    matched HF on the windows cut from them (test_layout_matches_hf_over_five_steps). That comparison tells the data
    apart: one token of the last step's batch changed in the documents makes HF's run end with other weights, far
    outside RUN_TOL (measured: 0.20 for this change, 0.49 for one in the first batch; 8e-6 for the same documents)."""
    if results["megatron_writer"] != "megatron-core":
        pytest.skip("megatron-core is not installed (launch/test.sh installs it: the indexed-data oracle)")
    reports = results["runs"][MEGATRON_DATA]
    docs = megatron_documents()
    assert {r["data_summary"] for r in reports} == {f"{len(docs)} documents, {sum(map(len, docs))} tokens"}
    stream = [t for doc in docs for t in doc]
    at = (STEPS * GLOBAL_BATCH - 1) * SEQ + 5  # in the last sample the run reads
    stream[at] = (stream[at] + 1) % VOCAB
    cuts = [0] + torch.tensor([len(d) for d in docs]).cumsum(0).tolist()
    changed = [stream[a:b] for a, b in zip(cuts, cuts[1:])]
    other = hf_reference_run(results["model_dirs"]["gqa"], batches=windows(changed))
    weights = merged_weights(reports)
    assert max(max_rel_error(weights[n], w) for n, w in other["weights"].items()) > 100 * RUN_TOL


SEQUENCE_TOL = 1e-5  # measured: below 7e-6 for every run (fp32, 5 steps)


def assert_grad_norms_match(report, ref, tol, run):
    """The global gradient norm before clipping, every step, against HF's: a gradient scaled by the same factor
    everywhere (a wrong CP, DP or GAS divisor) leaves AdamW's update, and so losses and weights, nearly unchanged.
    DeepSpeedEngine's fp32 path without ZeRO clips through `clip_fp32_gradients`, which keeps no norm
    (deepspeed 0.19.8 runtime/engine.py:3502): only those runs report none."""
    if run["pp"] == 1 and run["zero"] == 0:
        assert report["grad_norms"] == [None] * STEPS, report["grad_norms"]
        return
    assert max_rel_error(torch.tensor(report["grad_norms"]), torch.tensor(ref["grad_norms"])) <= tol, (
        report["grad_norms"], ref["grad_norms"])


def assert_losses_and_weights_match(ref, reports, run):
    """Every rank's five losses and the weights merged over ranks within SEQUENCE_TOL of the HF reference run."""
    for report in reports:
        assert max_rel_error(torch.tensor(report["losses"]), torch.tensor(ref["losses"])) <= SEQUENCE_TOL
        assert_grad_norms_match(report, ref, SEQUENCE_TOL, run)
    weights = merged_weights(reports)
    bad = {n: e for n, w in ref["weights"].items() if not (e := max_rel_error(weights[n], w)) <= SEQUENCE_TOL}
    assert not bad, bad


@pytest.mark.parametrize("run", sequence_runs(), ids=lambda r: r["name"])
def test_sequence_and_context_parallel_match_hf_over_five_steps(results, run):
    ref = results["ref"][run["case"]]
    reports = results["runs"][run["name"]]
    for report in reports:
        # the blocks really run on sequence shards: (b, s/c, h), and (b, s/(c·t), h) with SP
        split = run["cp"] * (run["tp"] if run["hybrid"].get("sequence_parallel") else 1)
        assert report["block_inputs"] == [(MICRO_BATCH, SEQ // split, 32)]
    assert_losses_and_weights_match(ref, reports, run)
    assert ref["losses"][-1] < ref["losses"][0] - 0.05


@pytest.mark.parametrize("run", SCHEDULE_RUNS, ids=lambda r: r["name"])
def test_dualpipev_matches_hf_over_five_steps(results, run):
    ref = results["ref"][run["case"]]
    reports = results["runs"][run["name"]]
    for report in reports:
        assert report["engine"] == "DualPipeVEngine"
    assert_losses_and_weights_match(ref, reports, run)
    # each rank holds stages r and 2p-1-r: the 4 blocks spread over 2p stages
    assert {r["blocks_on_rank"] for r in reports} == {4 // run["pp"]}
    if run.get("async_save"):  # every file written in the background is the synchronous save's, byte for byte
        assert all(r["async_files"]["same"] and r["async_files"]["mine"] for r in reports)


@pytest.mark.parametrize("run", INTERLEAVED_RUNS, ids=lambda r: r["name"])
def test_interleaved_matches_hf_over_five_steps(results, run):
    ref = results["ref"][run["case"]]
    reports = results["runs"][run["name"]]
    for report in reports:
        assert report["engine"] == "InterleavedPipelineEngine"
        # Megatron's placement: rank 0 holds stages 0 and 2 (embedding + block 0, block 2), rank 1 stages 1 and
        # 3 (block 1, block 3 + norm + head); layer indices are global, the tied head is spec 6
        assert report["stage_layers"] == ([(0, 1), (3, 3)] if report["stage"] == 0 else [(2, 2), (4, 6)])
        # 2 blocks x 4 micro-batches per step, each block run again in backward under checkpointing
        recompute = 2 if "ckpt" in run["name"] else 1
        assert report["forwards_per_step"] == [2 * 4 * recompute] * STEPS
        # every (chunk, micro-batch) forward and backward once per step, and nothing held after it
        passes = Counter(report["passes"])
        assert set(passes) == {(kind, chunk, chunk * 4 + i) for kind in ("ForwardPass", "BackwardPass")
                               for chunk in (0, 1) for i in range(4)} and set(passes.values()) == {STEPS}
        assert report["saved_peak"] > 0 and report["saved_after_step"] == 0
    assert_losses_and_weights_match(ref, reports, run)


def test_json_optimizer_default_adamw_matches_hf(results):
    ref = results["ref"]["gqa"]
    for report in results["runs"]["fused-adam-TP2-PP1-DP1"]:
        assert report["optimizer"] == "DeepSpeedZeroOptimizer"
        assert max_rel_error(torch.tensor(report["losses"]), torch.tensor(ref["losses"])) <= RUN_TOL


def test_pipeline_balances_decoder_blocks(results):
    """The default cut ("cost") of the 4-block "gqa" model: its 203-token head weighs less than a block, so the blocks
    split evenly, as by count (a head that moves a block: COST_RUNS on "wide")."""
    for name, per_stage in [("TP1-PP2-DP1-Z1", 2), ("TP1-PP4-DP1-Z1", 1), ("TP2-PP2-DP2-Z1", 2)]:
        assert {r["blocks_on_rank"] for r in results["runs"][name]} == {per_stage}, name


def test_engines_share_the_layouts_process_groups(results):
    for name, reports in results["runs"].items():
        assert all(r["shared_grid"] for r in reports), name


@pytest.mark.bf16
@pytest.mark.parametrize("run", BF16_RUNS, ids=lambda r: r["name"])
def test_bf16_masters_are_fp32_and_sharded(bf16_results, run):
    results = bf16_results
    reports = results["runs"][run["name"]]
    twin = results["runs"][run["fp32_twin"]]
    dp = 2
    for report, fp32 in zip(reports, twin):
        assert report["optimizer"] == "BF16_Optimizer"
        assert report["param_dtypes"] == ["torch.bfloat16"]
        assert report["master_dtypes"] == ["torch.float32"]
        # Each DP rank holds 1/dp of its stage's parameters (plus alignment padding).
        share = report["local_numel"] / dp
        assert share <= report["master_numel"] < share + 64, (report["master_numel"], report["local_numel"])
        assert loss_movement(fp32["losses"]) >= 10 * BF16_LOSS_GAP
        assert loss_gap(report["losses"], fp32["losses"]) <= BF16_LOSS_GAP
    gaps = update_excess(merged_weights(reports), merged_weights(twin), results["ref"][run["case"]]["initial"])
    bad = {n: g for n, g in gaps.items() if not g <= BF16_UPDATE_EXCESS}
    assert not bad, f"bf16 updates differ from fp32: {bad}"


@pytest.mark.parametrize("run", ckpt_runs(), ids=lambda r: r["name"])
def test_activation_checkpointing_takes_effect(results, run):
    reports = results["runs"][run["name"]]
    baseline = results["runs"][run["baseline"]]
    extra = run["extra"].get(AC, {})
    gas = 8 // (2 * (4 // (run["tp"] * run["pp"])))  # global batch / (micro * dp)
    for report, base in zip(reports, baseline):
        assert max_rel_error(torch.tensor(report["losses"]), torch.tensor(base["losses"])) <= 1e-6
        # Every block runs forward twice per micro-batch: once, then again when recomputed.
        assert base["forwards_per_step"] == [report["blocks_on_rank"] * gas] * STEPS
        assert report["forwards_per_step"] == [2 * report["blocks_on_rank"] * gas] * STEPS
        flags = report["ckpt_flags"]
        assert flags["partition"] == extra.get("partition_activations", False)
        assert flags["contiguous"] == extra.get("contiguous_memory_optimization", False)
        assert flags["cpu"] == extra.get("cpu_checkpointing", False)
        assert flags["synchronize"] == extra.get("synchronize_checkpoint_boundary", False)
        assert flags["profile"] == extra.get("profile", False)


@pytest.mark.parametrize("run", COST_RUNS, ids=lambda r: r["name"])
def test_cost_balanced_stages_match_hf_over_five_steps(results, run):
    """The "cost" partition: each rank holds the blocks `stage_bounds` gives it, and trains exactly like HF."""
    reports = results["runs"][run["name"]]
    assert [r["blocks_on_rank"] for r in sorted(reports, key=lambda r: r["stage"])][::run["tp"]] == run["blocks"]
    assert_losses_and_weights_match(results["ref"][run["case"]], reports, run)


@pytest.mark.parametrize("run", COMPILED_RUNS, ids=lambda r: r["name"])
def test_compiled_blocks_match_hf_over_five_steps(results, run):
    reports = results["runs"][run["name"]]
    for report in reports:
        assert report["compiled_blocks"] == report["blocks_on_rank"] > 0  # every block compiled, none left eager
    assert_losses_and_weights_match(results["ref"][run["case"]], reports, run)


@pytest.mark.parametrize("run", cases(ZERO3_RUNS + OFFLOAD_RUNS))
def test_zero3_and_offload_match_hf_over_five_steps(results, run):
    """Losses, per-step gradient norms and weights within 1e-5 of HF + torch AdamW; ZeRO-3 holds 1/Nd of every
    parameter (Nd = d·c; padded to DeepSpeed's alignment) from the build on, and offload runs DeepSpeed's host path."""
    reports = results["runs"][run["name"]]
    zero = run["extra"]["zero_optimization"]
    nd = run["world"] // run["tp"]
    for report in reports:
        assert report["optimizer"] == ("DeepSpeedZeroOptimizer_Stage3" if run["zero"] == 3 else "DeepSpeedZeroOptimizer")
        held, whole = report["partitioned"]
        if run["zero"] == 3:
            assert whole == report["local_full_numel"] and whole / nd <= held < whole / nd + 64 * nd, (held, whole)
        else:
            assert (held, whole) == (0, 0)
        assert report["offloaded"] == {"optimizer": "offload_optimizer" in zero, "param": "offload_param" in zero}
        assert report["inner_optimizer"] == ("DeepSpeedCPUAdam" if "offload_optimizer" in zero else "AdamW")
    assert_losses_and_weights_match(results["ref"][run["case"]], reports, run)
    assert results["ref"][run["case"]]["losses"][-1] < results["ref"][run["case"]]["losses"][0] - 0.05


@pytest.mark.bf16
def test_bf16_with_offload_tracks_its_fp32_run(bf16_results):
    """bf16 compute, fp32 masters and Adam on the host through CPU Adam, in a pipeline (the combination DeepSpeed#3866
    reports failing at initialize on GPUs): every parameter bf16, and losses and updates within bf16's rounding of
    the same run in fp32."""
    reports = bf16_results["runs"][BF16_OFFLOAD["name"]]
    twin = bf16_results["runs"][BF16_OFFLOAD["fp32_twin"]]
    for report, fp32 in zip(reports, twin):
        assert report["optimizer"] == "DeepSpeedZeroOptimizer" and report["inner_optimizer"] == "DeepSpeedCPUAdam"
        assert report["offloaded"]["optimizer"] and report["param_dtypes"] == ["torch.bfloat16"]
        assert loss_movement(fp32["losses"]) >= 10 * BF16_LOSS_GAP
        assert loss_gap(report["losses"], fp32["losses"]) <= BF16_LOSS_GAP
    gaps = update_excess(merged_weights(reports), merged_weights(twin), bf16_results["ref"]["gqa"]["initial"])
    bad = {n: g for n, g in gaps.items() if not g <= BF16_UPDATE_EXCESS}
    assert not bad, f"bf16 updates differ from fp32: {bad}"


@pytest.mark.parametrize("name", [r["name"] for r in ZERO3_RUNS + OFFLOAD_RUNS if r.get("save")])
def test_zero3_checkpoint_exports_bit_exact(results, name, tmp_path):
    """hybrid2hf on a ZeRO-3 checkpoint (its weights only in the optimizer files' fp32 partitions, consolidated per TP
    rank by DeepSpeed's zero_to_fp32): every HF tensor equals the trained weights gathered from the ranks, bit for
    bit."""
    from safetensors.torch import load_file

    from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf

    run = next(r for r in ZERO3_RUNS + OFFLOAD_RUNS if r["name"] == name)
    hybrid_to_hf(results["saved"] / name, tmp_path, hf_config_dir=results["model_dirs"][run["case"]])
    exported = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    trained = merged_weights(results["runs"][name])
    assert set(exported) == set(trained)
    assert all(torch.equal(exported[n], trained[n]) for n in trained), [n for n in trained
                                                                         if not torch.equal(exported[n], trained[n])]


@pytest.mark.parametrize("run", AUTO_RUNS, ids=lambda r: r["name"])
def test_auto_layout_matches_hf_over_five_steps(results, run):
    """The layout "auto" wrote out trains like HF: losses, per-step gradient norms and weights after 5 steps."""
    ref = results["ref"][run["case"]]
    reports = results["runs"][run["name"]]
    tp, pp, cp, dp, zero, micro = reports[0]["layout"]
    assert tp == 2 and tp * pp * cp * dp == run["world"]  # the given key held; the others decided
    assert all(r["layout"] == reports[0]["layout"] for r in reports)  # every rank decided alike, alone
    assert reports[0]["auto_lines"][0].startswith(f"auto: TP{tp} PP{pp} CP{cp} DP{dp}")
    assert_losses_and_weights_match(ref, reports, dict(run, pp=pp, zero=zero))
    assert ref["losses"][-1] < ref["losses"][0] - 0.05


@pytest.mark.parametrize("run", [r for r in matrix_runs() if r["zero"] == 1 and r["case"] == "gqa"],
                         ids=lambda r: r["name"])
def test_fp32_activations_match_the_memory_model(results, run):
    """The activations autograd held at once in a step (every rank, fp32: the memory model's `lp` = 4) against
    `planning.activations.activation_bytes`, the bf16 model's tensors at 4 bytes (test_sequence_parallel.py checks
    bf16 term by term). The bound: the scalars autograd saves, which the model leaves out; at TP1 the last stage's
    loss keeps 1,548 bytes more in fp32 than the model counts (0.5-1.4% of these steps; not yet explained), so the
    TP1 rows hold to 1.5%."""
    from hybrid3d.model import LlamaShape
    from hybrid3d.planning.activations import activation_bytes

    shape = LlamaShape.from_hf(load_hf(results["model_dirs"][run["case"]]).config)
    dp = run["world"] // (run["tp"] * run["pp"])
    gas = 8 // (MICRO_BATCH * dp)  # engine_runs.GLOBAL_BATCH sequences a step
    for report in results["runs"][run["name"]]:
        model = activation_bytes(shape, MICRO_BATCH, SEQ, run["tp"], run["pp"], report["stage"], gas, lp=4)
        bound = 64 if run["tp"] > 1 else 0.015 * model
        assert abs(report["saved_peak"] - model) <= bound, (report["stage"], report["saved_peak"], model)
