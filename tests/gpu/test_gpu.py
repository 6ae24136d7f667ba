"""GPU tests (CUDA + NCCL), `python -m pytest -m gpu tests/gpu`: the layout matrix against HF on the GPUs the
machine has, a GPU recipe shrunk to fit, `hybrid3d.verify` on a converted checkpoint, save and
resume. Skipped with a reason where there is no CUDA device. HYBRID3D_GPU_TESTS_ON_CPU=1 runs the
same code on the CPU accelerator (gloo), to check the tests themselves on a machine without GPUs.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.worlds import run_world
from tests.distributed.engine_runs import STEPS, hf_reference_run
from tests.distributed.engine_worker import train_runs
from tests.launcher.harness import REPO, deepspeed_launcher, launch_env, read_metrics
from tests.numerics import BF16_LOSS_GAP, BF16_UPDATE_EXCESS, loss_gap, update_excess
from tests.tiny_llama import load_hf, make_hf_llama, make_training_models, max_rel_error
from tests.distributed.reports import merged_weights

ON_CPU = os.environ.get("HYBRID3D_GPU_TESTS_ON_CPU") == "1"
DEVICES = 2 if ON_CPU else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
ACCELERATOR = "cpu" if ON_CPU else "cuda"
pytestmark = pytest.mark.skipif(DEVICES == 0, reason="no CUDA device (HYBRID3D_GPU_TESTS_ON_CPU=1 runs these on CPU)")

RUN_TOL = 1e-4  # fp32, as tests/distributed/test_engine.py
BF16 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
CANDIDATES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]


def gpu_layouts():
    return [(t, p, d) for t, p, d in CANDIDATES if t * p * d <= DEVICES]


def gpu_runs():
    runs = []
    for t, p, d in gpu_layouts():
        for zero in (1, 2) if p == 1 else (1,):
            base = dict(case="gqa", tp=t, pp=p, zero=zero, world=t * p * d)
            runs.append(dict(base, name=f"TP{t}-PP{p}-DP{d}-Z{zero}"))
            runs.append(dict(base, name=f"bf16-TP{t}-PP{p}-DP{d}-Z{zero}", extra=BF16))
    # sequence parallelism (NCCL's all-gather / reduce-scatter), Ulysses context parallelism (all-to-all) and ring
    # attention (NCCL's batched p2p; its blocks as explicit fp32 tiles on GPUs)
    sequence = [("SP-TP2-Z1", 2, 1, {"sequence_parallel": True}), ("CP2-Z1", 1, 2, {"context_parallel_size": 2}),
                ("SP-TP2-CP2-Z2", 2, 2, {"sequence_parallel": True, "context_parallel_size": 2}),
                ("ring-CP2-Z1", 1, 2, {"context_parallel_comm": "p2p", "context_parallel_size": 2})]
    for name, t, c, hybrid in sequence:
        if t * c <= DEVICES:
            runs.append(dict(case="gqa", tp=t, pp=1, zero=2 if "Z2" in name else 1, world=t * c, name=name,
                             hybrid=hybrid))
    return runs


def accelerator_env():
    """The launched processes' environment: the accelerator, and this checkout importable from any folder (the
    verify test runs `--module hybrid3d.verify` from a temporary one; a GPU machine's copy may not be installed)."""
    env = launch_env()
    env["DS_ACCELERATOR"] = ACCELERATOR
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_matrix")
    model_dirs = make_training_models(root)
    ref = hf_reference_run(model_dirs["gqa"])
    initial = {n: p.detach().clone() for n, p in load_hf(model_dirs["gqa"]).named_parameters()}
    previous = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = ACCELERATOR
    try:
        by_rank = {}
        for world in sorted({r["world"] for r in gpu_runs()}):
            runs = [r for r in gpu_runs() if r["world"] == world]
            ranks = run_world(train_runs, world, str(root / f"world{world}"), runs, model_dirs)
            by_rank.update({r["name"]: [rank[r["name"]] for rank in ranks] for r in runs})
    finally:
        os.environ.pop("DS_ACCELERATOR") if previous is None else os.environ.update(DS_ACCELERATOR=previous)
    return {"ref": ref, "initial": initial, "runs": by_rank}


@pytest.mark.parametrize("run", [r for r in gpu_runs() if "extra" not in r], ids=lambda r: r["name"])
def test_fp32_layout_matches_hf(matrix, run):
    ref, reports = matrix["ref"], matrix["runs"][run["name"]]
    for report in reports:
        assert max_rel_error(torch.tensor(report["losses"]), torch.tensor(ref["losses"])) <= RUN_TOL
    weights = merged_weights(reports)
    bad = {n: e for n, w in ref["weights"].items() if not (e := max_rel_error(weights[n], w)) <= RUN_TOL}
    assert not bad, bad


@pytest.mark.parametrize("run", [r for r in gpu_runs() if "extra" in r], ids=lambda r: r["name"])
def test_bf16_layout_tracks_fp32(matrix, run):
    reports, fp32 = matrix["runs"][run["name"]], matrix["runs"][run["name"].removeprefix("bf16-")]
    assert {r["param_dtypes"][0] for r in reports} == {"torch.bfloat16"}
    for report, twin in zip(reports, fp32):
        assert len(report["losses"]) == STEPS
        assert loss_gap(report["losses"], twin["losses"]) <= BF16_LOSS_GAP
    gaps = update_excess(merged_weights(reports), merged_weights(fp32), matrix["initial"])
    assert not {n: g for n, g in gaps.items() if not g <= BF16_UPDATE_EXCESS}


def shrunk_recipe(tmp: Path, steps: int, asynchronous: bool = False, **train) -> Path:
    """ds_configs/gpu_llama2-7b_8gpu.json with a 4-layer model, 256-token sequences, local data and
    the layout cut to the devices present (bf16, fp32 masters, ZeRO-1, the LR schedule's shape kept); saves every 2
    steps, `asynchronous` ones if asked."""
    raw = json.loads((REPO / "ds_configs" / "gpu_llama2-7b_8gpu.json").read_text())
    tp, pp = min(2, DEVICES), 2 if DEVICES >= 4 else 1
    tmp.mkdir(parents=True, exist_ok=True)
    docs = tmp / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Document {i}. " + "the quick brown fox jumps " * (5 + i % 7)}) + "\n"
                            for i in range(400)))
    raw.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    raw["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=2)
    section = raw["hybrid3d"]
    section.update(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    section["model"]["config_overrides"] = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
                                            "num_attention_heads": 8, "num_key_value_heads": 8}
    section["data"] = {"path": str(docs), "seq_length": 256}
    section["train"].update(steps=steps, log_interval=1, eval_interval=0, output_dir=str(tmp / "run"), **train)
    section["checkpoint"] = {"save_interval": 2, "keep_last": 0, "async": asynchronous}
    path = tmp / "recipe.json"
    path.write_text(json.dumps(raw))
    return path


def deepspeed(*args, cwd: Path):
    return subprocess.run([*deepspeed_launcher(), "--num_gpus", str(DEVICES), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=accelerator_env(), timeout=900)


def test_shrunk_gpu_recipe_trains_and_resumes(tmp_path):
    full = deepspeed(REPO / "launch" / "train.py", "--deepspeed_config", shrunk_recipe(tmp_path / "full", 6),
                     cwd=tmp_path)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path / "full" / "run")]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    # Stop after step 4 (its saves asynchronous: the states copied into pinned host buffers, written in the
    # background), resume from `latest` to step 6: the same losses as the uninterrupted run.
    config = shrunk_recipe(tmp_path / "part", 6, asynchronous=True)
    first = deepspeed(REPO / "launch" / "train.py", "--deepspeed_config", config, "--train.steps", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saves = read_metrics(tmp_path / "part" / "run", "saves")
    assert [m["checkpoint"] for m in saves] == ["global_step2", "global_step4"], saves
    resumed = deepspeed(REPO / "launch" / "train.py", "--deepspeed_config", config, "--checkpoint.load",
                        str(tmp_path / "part" / "run" / "checkpoints"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    metrics = read_metrics(tmp_path / "part" / "run", "steps")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert loss_gap([m["loss"] for m in metrics[4:]], losses[4:]) <= BF16_LOSS_GAP  # bf16; kernels may differ run to run


def test_verify_passes_a_converted_checkpoint(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "hybrid"
    make_hf_llama(hf_dir, "gqa_llama3", num_hidden_layers=4)
    tp = min(2, DEVICES)
    subprocess.run([sys.executable, "-m", "hybrid3d.convert", "hf2hybrid", "--hf-model", hf_dir, "--out", out,
                    "--tp", str(tp), "--pp", "1"], check=True, capture_output=True, env=accelerator_env())
    result = deepspeed("--module", "hybrid3d.verify", "--hf-model", hf_dir, "--checkpoint", out, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS" in result.stdout


@pytest.mark.skipif(ON_CPU, reason="pinned memory needs a GPU; tests/unit/test_host_copy.py checks the host copy")
def test_asynchronous_save_copies_device_states_into_pinned_memory(tmp_path):
    """checkpoint/host_copy.py on the device: bf16 and fp32 states (views of one flat buffer, as ZeRO keeps them)
    are copied into pinned buffers (registered with the driver at their exact size), the copy holds the values of
    the save after the device tensors change, and the file written from it loads to those values, every tensor on
    the host."""
    from hybrid3d.checkpoint.host_copy import HostBuffers, Snapshot

    flat = torch.randn(1 << 20, device="cuda")
    state = {"module": {"w": torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)},
             "partitions": [flat[: 1 << 19], flat[1 << 19:].view(512, -1)], "step": 4}
    expected = {"w": state["module"]["w"].cpu(), "flat": flat.cpu()}
    snapshot = Snapshot(HostBuffers())
    snapshot.add(tmp_path / "states.pt", state)
    snapshot.wait_for_copies()
    flat.add_(1)
    state["module"]["w"].mul_(2)
    [(copied, _)] = snapshot.files.values()
    assert copied["module"]["w"].is_pinned() and copied["partitions"][0].is_pinned()
    assert snapshot.copied_bytes == 256 * 256 * 2 + (1 << 20) * 4  # the flat buffer once
    torch.save(copied, tmp_path / "states.pt")
    loaded = torch.load(tmp_path / "states.pt", weights_only=True)
    assert torch.equal(loaded["module"]["w"], expected["w"]) and loaded["module"]["w"].device.type == "cpu"
    assert torch.equal(torch.cat([loaded["partitions"][0], loaded["partitions"][1].flatten()]), expected["flat"])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "documents", "window"])
def test_attention_reaches_a_fused_kernel(monkeypatch, case):
    """The kernel SDPA picks for exactly the arguments hybrid3d's attention passes, at Llama-3.2-1B's head shape in
    bf16 (fp32 on the CPU check): never the math kernel, which upcasts to fp32 and keeps the (b, heads, s, s) scores.
    Before kv heads were repeated under a mask, the document and window cases took it on GPUs."""
    import torch.nn.functional as F

    from hybrid3d.model import LlamaShape
    from hybrid3d.model.attention import CoreAttention

    device = torch.device("cpu" if ON_CPU else "cuda")
    dtype = torch.float32 if ON_CPU else torch.bfloat16
    b, s, heads, kv, d = 1, 256, 32, 8, 64
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, **kw):
        seen.append(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    attention = CoreAttention(LlamaShape(vocab_size=128, hidden_size=heads * d, intermediate_size=128, num_layers=1,
                                         num_heads=heads, num_kv_heads=kv, head_dim=d,
                                         sliding_window=64 if case == "window" else None)).to(device)
    q, k, v = (torch.randn(b, s, n, d, device=device, dtype=dtype) for n in (heads, kv, kv))
    positions = torch.arange(s, device=device).remainder(s // 4).unsqueeze(0) if case == "documents" else None
    attention(q, k, v, positions=positions)
    assert len(seen) == 1 and seen[0] != int(torch.nn.attention.SDPBackend.MATH), seen


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "documents"])
def test_ring_blocks_match_sdpa_on_the_device(monkeypatch, case):
    """The kernel a ring's blocks run on this device (`attention_blocks.block_kernel`: on GPUs torch's memory-
    efficient kernel for the causal block, explicit fp32 tiles for the masked one), forward and backward given the
    output and log-sum-exp, against SDPA's autograd at Llama-3.2-1B's head shape, fp32, the explicit rows cut into
    several tiles; on a GPU the fused kernel must pass its own first-use check in fp32 and bf16. One GPU runs no
    ring (NCCL takes one rank a device): the ring's merge and hops around these blocks are tested on CPU
    (tests/distributed/test_ring_attention.py)."""
    import torch.nn.functional as F

    from hybrid3d.parallel import attention_blocks

    device = torch.device(ACCELERATOR)
    kernel = attention_blocks.block_kernel(device)
    b, heads, s, d = 1, 32, 512, 64
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(b, heads, s, d, device=device, generator=generator) for _ in range(4))
    causal = case == "causal"
    bias = None
    if not causal:
        documents = (torch.arange(s, device=device) >= s // 3).long()  # two documents
        allowed = (torch.arange(s, device=device)[:, None] >= torch.arange(s, device=device)[None, :]) & (
            documents[:, None] == documents[None, :])
        bias = torch.zeros(1, 1, s, s, device=device).masked_fill(~allowed, float("-inf"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=bias, is_causal=causal)
    ref.backward(dout)
    monkeypatch.setattr(attention_blocks, "TILE_BYTES", 4 * b * heads * s * 100)  # tiles of 100 query rows
    if not ON_CPU:
        assert all(attention_blocks.fused_blocks_verified(str(device), dtype, d)
                   for dtype in (torch.float32, torch.bfloat16))
    out, lse = kernel.forward(q, k, v, causal, bias)
    grads = kernel.backward(dout, q, k, v, ref.detach(), lse, causal, bias)
    torch.testing.assert_close(out.float(), ref.detach(), rtol=1e-4, atol=1e-5)
    for name, got, leaf in zip("qkv", grads, leaves):
        torch.testing.assert_close(got.float(), leaf.grad, rtol=1e-4, atol=1e-5, msg=name)
