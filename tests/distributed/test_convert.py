"""HF <-> hybrid checkpoint conversion: bit-exact round trips, the trainer loading converted
weights and matching HF, export of trained checkpoints, `hybrid3d.verify`, and bad input.

Conversions need no processes and run in this one; one spawned world of 4 ranks covers the
trainer (TP2xPP2 and TP2xPP1xDP2) and verify.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hybrid3d.checkpoint.resume import plan_resume
from hybrid3d.convert.__main__ import main as convert_main
from hybrid3d.convert.hf_to_hybrid import hf_to_hybrid
from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf
from hybrid3d.errors import CheckpointError, ConversionError
from tests.distributed.reports import read_safetensors_folder
from tests.distributed.worlds import run_world
from tests.distributed.convert_worker import EVAL_STEP, convert_world
from tests.distributed.engine_runs import STEPS, global_batch, hf_reference_run
from tests.tiny_llama import load_hf, make_hf_llama, max_rel_error

REPO = Path(__file__).resolve().parents[2]
FP32_TOL = 1e-5
RUN_TOL = 1e-4  # five training steps, as in test_engine


def add_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer built locally, so tokenizer files have something to carry."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(directory)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """Tiny HF models with 4 decoder layers: GQA + llama3 rope (sharded safetensors), tied MHA, MQA."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for case in ("gqa_llama3", "mha_tied", "mqa"):
        dirs[case] = root / case
        make_hf_llama(dirs[case], case, num_hidden_layers=4)
        add_tokenizer(dirs[case], 203)
    # Re-save one model in several shards with an index, as large models come.
    model = load_hf(dirs["gqa_llama3"])
    (dirs["gqa_llama3"] / "model.safetensors").unlink()
    model.save_pretrained(dirs["gqa_llama3"], max_shard_size="40KB")
    assert (dirs["gqa_llama3"] / "model.safetensors.index.json").is_file()
    return dirs


# (case, tp, pp): kv heads split (gqa tp2) and replicated (gqa tp4 > 2 kv heads, mqa tp2),
# tied embeddings at pp 1 and across 4 stages, one decoder block per stage at pp 4.
ROUND_TRIPS = [("gqa_llama3", 4, 4), ("gqa_llama3", 2, 1), ("mha_tied", 1, 2), ("mha_tied", 4, 4), ("mha_tied", 2, 1),
               ("mqa", 2, 2)]



def test_mixtral_round_trip_is_bit_exact(tmp_path):
    """A tiny HF Mixtral (GQA, 4 experts, top-2): HF -> hybrid -> HF gives its files back bit for bit at each tested
    MoE layout (experts split over TP, blocks over stages), under the per-expert names of HF's checkpoint files,
    and loads as a MixtralForCausalLM; an untested layout is refused with one line."""
    from transformers import MixtralForCausalLM

    from hybrid3d.errors import LayoutError
    from tests.tiny_mixtral import make_mixtral

    source = tmp_path / "mixtral"
    make_mixtral(source)
    original = read_safetensors_folder(source)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in original
    for tp, pp, dtype in [(1, 1, None), (2, 2, None), (2, 1, torch.bfloat16)]:
        checkpoint, exported = tmp_path / f"hybrid{tp}{pp}", tmp_path / f"hf{tp}{pp}"
        hf_to_hybrid(source, checkpoint, tp=tp, pp=pp, dtype=dtype)
        hybrid_to_hf(checkpoint, exported)
        result = read_safetensors_folder(exported)
        assert set(result) == set(original)
        for name, tensor in original.items():
            expected = tensor.to(dtype) if dtype is not None else tensor
            assert result[name].dtype == expected.dtype and torch.equal(result[name], expected), (tp, pp, name)
    assert type(MixtralForCausalLM.from_pretrained(tmp_path / "hf22")).__name__ == "MixtralForCausalLM"
    with pytest.raises(LayoutError, match="not a tested mixture-of-experts layout"):
        hf_to_hybrid(source, tmp_path / "refused", tp=4, pp=1)
    assert not (tmp_path / "refused").exists()

@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored-fp32", "bf16"])
@pytest.mark.parametrize("case, tp, pp", ROUND_TRIPS, ids=[f"{c}-tp{t}-pp{p}" for c, t, p in ROUND_TRIPS])
def test_round_trip_is_bit_exact(sources, tmp_path, case, tp, pp, dtype):
    source = sources[case]
    checkpoint, exported = tmp_path / "hybrid", tmp_path / "hf"
    hf_to_hybrid(source, checkpoint, tp=tp, pp=pp, dtype=dtype)

    tag_dir = checkpoint / "global_step0"
    assert (checkpoint / "latest").read_text() == "global_step0"
    names = {p.name for p in tag_dir.glob("*.pt")}
    mp_files = {f"mp_rank_{i:02d}_model_states.pt" for i in range(tp * pp)}
    num_layers = 4 + (2 if case == "mha_tied" else 3)  # embedding, blocks, norm (+ untied head)
    layer_files = {f"layer_{i:02d}-model_{r:02d}-model_states.pt" for i in range(num_layers) for r in range(tp)}
    assert names == (mp_files | layer_files if pp > 1 else mp_files)
    assert (checkpoint / "hf" / "tokenizer.json").is_file() and (checkpoint / "hf" / "config.json").is_file()

    # Sharded output with an index for the fp32 runs, one file for bf16.
    hybrid_to_hf(checkpoint, exported, max_shard_size="60KB" if dtype is None else "5GB")
    assert (exported / "model.safetensors.index.json").is_file() == (dtype is None)
    original = read_safetensors_folder(source)
    result = read_safetensors_folder(exported)
    assert set(result) == set(original)
    for name, tensor in original.items():
        expected = tensor.to(dtype) if dtype is not None else tensor
        assert result[name].dtype == expected.dtype and torch.equal(result[name], expected), name
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).read_bytes() == (source / name).read_bytes(), name

    config_in, config_out = LlamaConfig.from_pretrained(source), LlamaConfig.from_pretrained(exported)
    ignored = {"dtype", "architectures", "transformers_version", "_name_or_path"}
    assert {k: v for k, v in config_out.to_dict().items() if k not in ignored} == \
           {k: v for k, v in config_in.to_dict().items() if k not in ignored}
    assert config_out.dtype == (dtype or torch.float32)

    model, info = LlamaForCausalLM.from_pretrained(exported, output_loading_info=True, dtype=dtype or torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    if dtype is None:
        ids, _ = global_batch(0)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, load_hf(source)(ids).logits)


def test_converted_checkpoint_is_accepted_by_the_training_entry_point(sources, tmp_path):
    hf_to_hybrid(sources["gqa_llama3"], tmp_path / "ckpt", tp=2, pp=2)
    structure = {"num_layers": 4, "vocab_size": 203, "hidden_size": 32}
    plan = plan_resume(str(tmp_path / "ckpt"), None, tp=2, pp=2, dp=2, shape_dict=structure)
    assert plan.module_only and not plan.universal and plan.tag == "global_step0"
    # The manifest lets the entry point catch a truncated file before DeepSpeed opens it.
    layer = tmp_path / "ckpt" / "global_step0" / "layer_01-model_00-model_states.pt"
    layer.write_bytes(layer.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="layer_01-model_00-model_states.pt"):
        plan_resume(str(tmp_path / "ckpt"), None, tp=2, pp=2, dp=2, shape_dict=structure)


def test_pickle_weights_need_the_flag(sources, tmp_path):
    source = tmp_path / "pickled"
    shutil.copytree(sources["mqa"], source)
    state = load_file(source / "model.safetensors")
    (source / "model.safetensors").unlink()
    torch.save(state, source / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"pytorch_model\.bin.*--allow-pickle"):
        hf_to_hybrid(source, tmp_path / "refused", tp=2, pp=2)
    assert not (tmp_path / "refused").exists()
    hf_to_hybrid(source, tmp_path / "ckpt", tp=2, pp=2, allow_pickle=True)
    hybrid_to_hf(tmp_path / "ckpt", tmp_path / "back")
    result = load_file(tmp_path / "back" / "model.safetensors")
    assert set(result) == set(state) and all(torch.equal(result[k], v) for k, v in state.items())


def edited_copy(source: Path, target: Path, edit_config=None, drop_file=None) -> Path:
    shutil.copytree(source, target)
    if edit_config is not None:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    if drop_file is not None:
        (target / drop_file).unlink()
    return target


def assert_refused(capsys, tmp_path, argv, *needles):
    """Exit code 2, one `error:` line naming what is wrong, and no output folder (nor leftovers)."""
    out = tmp_path / "out"
    assert convert_main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.*")), list(tmp_path.iterdir())


def test_hf2hybrid_refuses_bad_input(sources, tmp_path, capsys):
    gqa = str(sources["gqa_llama3"])
    assert_refused(capsys, tmp_path, ["hf2hybrid", "--hf-model", str(tmp_path / "nowhere")], "nowhere")
    assert_refused(capsys, tmp_path, ["hf2hybrid", "--hf-model", gqa, "--tp", "3"],
                   "num_attention_heads (4) is not divisible by tensor_parallel_size (3)")
    assert_refused(capsys, tmp_path, ["hf2hybrid", "--hf-model", gqa, "--pp", "5"],
                   "pipeline_parallel_size (5) exceeds num_hidden_layers (4)")
    biased = edited_copy(sources["gqa_llama3"], tmp_path / "biased", lambda c: c.update(attention_bias=True))
    assert_refused(capsys, tmp_path, ["hf2hybrid", "--hf-model", str(biased)], "attention_bias")
    rope = edited_copy(sources["mqa"], tmp_path / "rope",
                       lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    assert_refused(capsys, tmp_path, ["hf2hybrid", "--hf-model", str(rope)], "rope_type 'dynamic'")
    wider = edited_copy(sources["mqa"], tmp_path / "wider", lambda c: c.update(intermediate_size=96))
    assert_refused(capsys, tmp_path, ["hf2hybrid", "--hf-model", str(wider)], "model.safetensors",
                   "model.layers.0.mlp.gate_proj.weight", "(64, 32)", "(96, 32)")
    index = json.loads((sources["gqa_llama3"] / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[1]
    partial = edited_copy(sources["gqa_llama3"], tmp_path / "partial", drop_file=lost)
    assert_refused(capsys, tmp_path, ["hf2hybrid", "--hf-model", str(partial), "--tp", "2"], lost)
    extra = edited_copy(sources["mqa"], tmp_path / "extra")
    state = load_file(extra / "model.safetensors")
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}, extra / "model.safetensors",
              metadata={"format": "pt"})
    assert_refused(capsys, tmp_path, ["hf2hybrid", "--hf-model", str(extra)], "q_proj.bias")
    taken = tmp_path / "out"
    taken.mkdir()
    (taken / "keep.txt").write_text("x")
    assert convert_main(["hf2hybrid", "--hf-model", gqa, "--out", str(taken)]) == 2
    assert "already exists" in capsys.readouterr().err and [p.name for p in taken.iterdir()] == ["keep.txt"]


def test_hybrid2hf_refuses_bad_input(sources, tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    hf_to_hybrid(sources["mqa"], checkpoint, tp=2, pp=2)
    tag = checkpoint / "global_step0"
    missing = tmp_path / "missing"
    shutil.copytree(checkpoint, missing)
    (missing / "global_step0" / "layer_03-model_01-model_states.pt").unlink()
    assert_refused(capsys, tmp_path, ["hybrid2hf", "--checkpoint", str(missing)], "layer_03-model_01-model_states.pt")
    drifted = tmp_path / "drifted"
    shutil.copytree(checkpoint, drifted)
    layer = torch.load(tag / "layer_02-model_01-model_states.pt")
    layer["input_layernorm.weight"][0] += 1.0  # a replicated tensor that differs between TP ranks
    torch.save(layer, drifted / "global_step0" / "layer_02-model_01-model_states.pt")
    assert_refused(capsys, tmp_path, ["hybrid2hf", "--checkpoint", str(drifted)],
                   "model.layers.1.input_layernorm.weight", "differs between tensor-parallel ranks")
    orphan = tmp_path / "orphan"
    shutil.copytree(checkpoint, orphan)
    shutil.rmtree(orphan / "hf")
    record_path = orphan / "global_step0" / "mp_rank_00_model_states.pt"
    record = torch.load(record_path)
    del record["hybrid3d"]
    torch.save(record, record_path)
    (orphan / "global_step0" / "hybrid3d.json").unlink()
    assert_refused(capsys, tmp_path, ["hybrid2hf", "--checkpoint", str(orphan)], "--hf-config")
    assert_refused(capsys, tmp_path, ["hybrid2hf", "--checkpoint", str(tmp_path / "nowhere")], "nowhere")


def test_cli_user_error_in_a_real_process(sources, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hybrid3d.convert", "hf2hybrid", "--hf-model",
                           str(sources["mqa"]), "--out", str(out), "--tp", "8"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: num_attention_heads (4) is not divisible by tensor_parallel_size (8)"], proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


# --- The trainer, in one spawned world of 4 ranks --------------------------------------------------


@pytest.fixture(scope="module")
def world(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    hf_dir = sources["gqa_llama3"]
    for name, tp, pp in (("tp2pp2", 2, 2), ("tp2pp1", 2, 1)):
        hf_to_hybrid(hf_dir, root / f"converted-{name}", tp=tp, pp=pp)
    corrupted = root / "corrupted-tp2pp2"
    shutil.copytree(root / "converted-tp2pp2", corrupted)
    path = corrupted / "global_step0" / "layer_02-model_01-model_states.pt"
    layer = torch.load(path)
    layer["self_attn.o_proj.weight"][0, 0] += 1e-2  # one weight of one TP shard
    torch.save(layer, path)
    jobs = [dict(name="TP2-PP2-DP1", tp=2, pp=2, zero=1, keep_client_state=True),
            dict(name="TP2-PP1-DP2", tp=2, pp=1, zero=2, keep_client_state=False),
            # the same TP2xPP2 conversion under the interleaved schedule: its ranks read other layer files
            dict(name="TP2-PP2-DP1-interleaved", tp=2, pp=2, zero=1, keep_client_state=True,
                 hybrid={"pipeline_schedule": "interleaved", "virtual_pipeline_size": 2})]
    for job, converted in zip(jobs, ("tp2pp2", "tp2pp1", "tp2pp2")):
        job.update(hf_dir=str(hf_dir), checkpoint=str(root / f"converted-{converted}"),
                   save_dir=str(root / f"trained-{job['name']}"))
    verify = {name: ["--hf-model", str(hf_dir), "--checkpoint", str(root / name)]
              for name in ("converted-tp2pp2", "converted-tp2pp1", "corrupted-tp2pp2")}
    ranks = run_world(convert_world, 4, str(root / "results"), jobs, verify)
    return {"root": root, "hf_dir": hf_dir, "ranks": ranks, "jobs": jobs, "ref": hf_reference_run(hf_dir)}


def hf_eval_loss(model_dir) -> float:
    ids, targets = global_batch(EVAL_STEP)
    with torch.no_grad():
        return F.cross_entropy(load_hf(model_dir)(ids).logits.flatten(0, 1), targets.flatten()).item()


@pytest.mark.parametrize("name", ["TP2-PP2-DP1", "TP2-PP1-DP2", "TP2-PP2-DP1-interleaved"])
def test_trainer_loads_converted_weights_and_trains_like_hf(world, name):
    ref_loss = hf_eval_loss(world["hf_dir"])
    ref_losses = world["ref"]["losses"]
    for rank in world["ranks"]:
        report = rank[name]
        assert report["steps_after_load"] == 0
        assert {"hybrid3d", "universal_checkpoint_info"} <= set(report["client_keys"])
        assert max_rel_error(torch.tensor(report["first_eval"]), torch.tensor(ref_loss)) <= FP32_TOL
        # Training from the loaded weights follows HF's own run: the optimizer started from them too.
        assert len(report["losses"]) == STEPS
        assert max_rel_error(torch.tensor(report["losses"]), torch.tensor(ref_losses)) <= RUN_TOL
    assert ref_losses[-1] < ref_losses[0] - 0.05


@pytest.mark.parametrize("name", ["TP2-PP2-DP1", "TP2-PP1-DP2", "TP2-PP2-DP1-interleaved"])
def test_trained_checkpoint_exports_to_hf(world, name, tmp_path):
    job = next(j for j in world["jobs"] if j["name"] == name)
    out = tmp_path / "exported"
    if job["keep_client_state"]:
        hybrid_to_hf(job["save_dir"], out)  # the HF config travels in the client state
    else:
        with pytest.raises(ConversionError, match="--hf-config"):
            hybrid_to_hf(job["save_dir"], tmp_path / "no-config")
        hybrid_to_hf(job["save_dir"], out, hf_config_dir=world["hf_dir"])
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    last_eval = world["ranks"][0][name]["last_eval"]
    assert max_rel_error(torch.tensor(hf_eval_loss(out)), torch.tensor(last_eval)) <= FP32_TOL
    weights = dict(model.named_parameters())
    bad = {n: e for n, w in world["ref"]["weights"].items() if not (e := max_rel_error(weights[n], w)) <= RUN_TOL}
    assert not bad, bad


@pytest.mark.parametrize("converted, trained", [("converted-tp2pp2", "trained-TP2-PP2-DP1"),
                                                ("converted-tp2pp1", "trained-TP2-PP1-DP2")])
def test_converted_layout_is_what_the_trainer_writes(world, converted, trained):
    """Same model-state files, the same keys in them, and the same tensor names and shapes."""
    root = world["root"]
    ours, theirs = root / converted / "global_step0", root / trained / f"global_step{STEPS}"
    names = sorted(p.name for p in theirs.glob("*model_states.pt"))
    assert names == sorted(p.name for p in ours.glob("*model_states.pt"))
    client = {"hybrid3d", "universal_checkpoint_info", "rng"}
    for name in names:
        a, b = torch.load(ours / name, weights_only=False), torch.load(theirs / name, weights_only=False)
        if name.startswith("layer_"):
            assert [(k, v.shape) for k, v in a.items()] == [(k, v.shape) for k, v in b.items()], name
            continue
        assert set(a) - client == set(b) - client, name
        for key in ("param_shapes", "checkpoint_parallel_dimensions", "mp_world_size", "buffer_names"):
            assert a[key] == b[key], (name, key)
        if b["module"] is None:
            assert a["module"] is None
        else:
            assert [(k, v.shape, v.dtype) for k, v in a["module"].items()] == \
                   [(k, v.shape, v.dtype) for k, v in b["module"].items()], name


def test_verify_passes_good_checkpoints_and_fails_a_corrupted_one(world):
    for rank in world["ranks"]:
        assert rank["verify"] == {"converted-tp2pp2": 0, "converted-tp2pp1": 0, "corrupted-tp2pp2": 1}
