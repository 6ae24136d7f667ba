"""ZeRO-3 and offload through the training job (`run_job`: the job in the pooled worlds): the shortened demo at
ZeRO-3 with the optimizer and the parameters offloaded trains, saving asynchronously (checkpoint/async_save.py: the
partitions copied to host memory, written in the background), its step-4 checkpoint resumed continues bit for bit
(fp32), the checkpoint reshards to other data-parallel sizes through DeepSpeed's universal checkpoint and is refused
in one line at another TP size, and DeepSpeed's own zero_to_fp32.py reads it as hybrid2hf exports it. Equivalence with
HF step by step, and the export of a TP2 ZeRO-3 checkpoint bit-exact with the trained weights:
tests/distributed/test_engine.py."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from tests.launcher.harness import demo_config, read_metrics, resume_copy
from tests.launcher.in_world import run_job

CPU = {"device": "cpu"}
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every tensor partitioned, even the tiny model's
OFFLOADED = dict(ZERO3, offload_optimizer=CPU, offload_param=CPU)


def zero_config(tmp_path, zero: dict, tp: int):
    """The shortened demo without a pipeline at `zero`, its saves asynchronous; with offload_optimizer, DeepSpeed's
    CPU Adam (not torch's)."""
    config = demo_config(tmp_path, tensor_parallel_size=tp, pipeline_parallel_size=1,
                         checkpoint={"save_interval": 4, "keep_last": 0, "async": True})
    raw = json.loads(config.read_text())
    raw["zero_optimization"] = zero
    if "offload_optimizer" in zero:
        raw["optimizer"]["params"].pop("torch_adam")
    config.write_text(json.dumps(raw))
    return config


def trained_and_resumed(tmp_path, zero: dict, tp: int, ranks: int) -> dict:
    config = zero_config(tmp_path, zero, tp)
    trained = run_job(ranks, config)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    run = tmp_path / "run"
    resumed = resume_copy(ranks, config, tmp_path / "run", "global_step4", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return dict(config=config, trained=trained, metrics=read_metrics(run, "steps"), saves=read_metrics(run, "saves"),
                resumed=read_metrics(tmp_path / "resumed", "steps"), checkpoints=run / "checkpoints")


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """TP1 x DP2, ZeRO-3 with the optimizer and the parameters offloaded, its saves asynchronous."""
    return trained_and_resumed(tmp_path_factory.mktemp("zero3_offload"), OFFLOADED, tp=1, ranks=2)


def test_zero3_with_offload_trains_and_resumes_exactly(offloaded):
    stdout = offloaded["trained"].stdout
    assert "ZeRO stage 3" in stdout
    per_tp_rank = float(re.search(r"([\d.]+)M params per TP rank", stdout).group(1))  # whole tensors, not partitions
    assert per_tp_rank > 1.7, stdout[:2000]
    losses = [m["loss"] for m in offloaded["metrics"]]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5
    saves = offloaded["saves"]  # each rank's partitions written in the background
    assert [m["checkpoint"] for m in saves] == ["global_step4", "global_step8"] and all(m["write_s"] > 0 for m in saves)
    # fp32: the step-4 checkpoint resumed is the uninterrupted run, bit for bit
    assert [m["loss"] for m in offloaded["resumed"]] == losses[4:]
    files = sorted(p.name for p in (offloaded["checkpoints"] / "global_step4").glob("*.pt"))
    assert files == sorted(f"zero_pp_rank_{d}_mp_rank_00_{kind}_states.pt" for d in range(2) for kind in ("model", "optim"))
    meta = json.loads((offloaded["checkpoints"] / "global_step4" / "hybrid3d.json").read_text())
    assert meta["layout"]["zero"] == 3


@pytest.mark.parametrize("ranks, gas", [(1, 8), (4, 2)])
def test_tp1_zero3_reshards_over_data_parallel_sizes(offloaded, ranks, gas):
    """DP2 -> DP1 and DP4 through the universal checkpoint, the global batch kept (GAS x DP = 8 micro-batches), so
    the evaluation sees the same sequences: the eval loss is the trained run's last."""
    result = run_job(ranks, offloaded["config"], "--gradient_accumulation_steps", str(gas), "--checkpoint.load",
                     str(offloaded["checkpoints"]), "--eval-only")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "through DeepSpeed's universal checkpoint" in result.stdout
    eval_loss = float(re.search(r"eval_loss (\S+) perplexity", result.stdout).group(1))
    last_eval = [m["eval_loss"] for m in offloaded["metrics"] if "eval_loss" in m][-1]
    assert math.isclose(eval_loss, last_eval, rel_tol=1e-5)


def test_zero3_refuses_to_reshard_to_another_tensor_parallel_size_in_one_line(offloaded):
    result = run_job(2, offloaded["config"], "--tensor_parallel_size", "2", "--checkpoint.load",
                     str(offloaded["checkpoints"]), "--eval-only")
    assert result.returncode == 2
    line = next(x for x in result.stdout.splitlines() + result.stderr.splitlines() if x.startswith("error:"))
    assert "with ZeRO-3 on either side a checkpoint reshards only at tensor_parallel_size 1" in line, line


def test_zero_to_fp32_and_hybrid2hf_agree_on_a_tp1_zero3_checkpoint(offloaded, tmp_path):
    """DeepSpeed's own consolidation script, as DeepSpeed wrote it into the checkpoint folder, reads the checkpoint;
    its tensors (hybrid3d's names, the vocabulary padded) equal hybrid2hf's export bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf
    from hybrid3d.model import LlamaShape
    from hybrid3d.model.hf_weights import param_specs, shard_hf_tensor

    script = offloaded["checkpoints"] / "zero_to_fp32.py"
    subprocess.run([sys.executable, str(script), str(offloaded["checkpoints"]), str(tmp_path / "fp32"), "--tag",
                    "global_step8", "--safe_serialization"], check=True, capture_output=True, text=True, timeout=300)
    theirs = {k: v for f in sorted((tmp_path / "fp32").glob("*.safetensors")) for k, v in load_file(f).items()}
    hybrid_to_hf(offloaded["checkpoints"], tmp_path / "hf", tag="global_step8")
    ours = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    shape = LlamaShape.from_hf(AutoConfig.from_pretrained(offloaded["checkpoints"] / "hf"))
    specs = param_specs(shape, 1)
    assert set(theirs) == {s.local_name for s in specs} and set(ours) == {s.hf_name for s in specs}
    for spec in specs:
        assert torch.equal(shard_hf_tensor(spec, ours[spec.hf_name], shape, 0, 1), theirs[spec.local_name]), spec
