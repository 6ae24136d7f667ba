"""Conversion of Qwen2, Qwen3 and Mistral both ways: bit-exact round trips at several layouts, exports that
transformers loads as the family's class, the CLI both ways, and a family hybrid3d does not support (Gemma)
refused with one line and exit code 2. Conversions need no process group; the CLI runs in real processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GemmaConfig, GemmaForCausalLM

from hybrid3d.convert.hf_to_hybrid import hf_to_hybrid
from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf
from tests.distributed.engine_runs import global_batch
from tests.distributed.reports import read_safetensors_folder
from tests.tiny_families import FAMILIES, HF_CLASSES, make_hf_family
from tests.tiny_llama import BASE, load_hf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families_hf")
    dirs = {family: root / family for family in FAMILIES}
    for family, directory in dirs.items():
        make_hf_family(directory, family)
    return dirs


# (family, tp, pp, dtype): k/v heads (and Qwen2's k/v biases) split at tp2, replicated at tp4 (qwen2: 2 kv heads,
# mistral: 1); Qwen3's q/k norms replicated; pipelines split the 4 blocks.
ROUND_TRIPS = [("qwen2", 2, 2, None), ("qwen2", 4, 1, None), ("qwen3", 2, 2, None), ("qwen3", 1, 1, torch.bfloat16),
               ("mistral", 4, 2, None), ("mistral", 2, 1, torch.bfloat16)]


@pytest.mark.parametrize("family, tp, pp, dtype", ROUND_TRIPS,
                         ids=[f"{f}-tp{t}-pp{p}-{'bf16' if d else 'stored'}" for f, t, p, d in ROUND_TRIPS])
def test_round_trip_is_bit_exact_and_loads_as_the_family(sources, tmp_path, family, tp, pp, dtype):
    source = sources[family]
    checkpoint, exported = tmp_path / "hybrid", tmp_path / "hf"
    hf_to_hybrid(source, checkpoint, tp=tp, pp=pp, dtype=dtype)
    hybrid_to_hf(checkpoint, exported)
    original, result = read_safetensors_folder(source), read_safetensors_folder(exported)
    assert set(result) == set(original)
    for name, tensor in original.items():
        expected = tensor.to(dtype) if dtype is not None else tensor
        assert result[name].dtype == expected.dtype and torch.equal(result[name], expected), name
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == [HF_CLASSES[family]] and config["model_type"] == family
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True, dtype=dtype or torch.float32)
    assert type(model).__name__ == HF_CLASSES[family]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    if dtype is None:
        ids, _ = global_batch(0)
        with torch.no_grad():
            assert torch.equal(model.eval()(ids).logits, load_hf(source)(ids).logits)


def convert_cli(*argv):
    return subprocess.run([sys.executable, "-m", "hybrid3d.convert", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_cli_converts_both_ways_and_refuses_gemma_in_one_line(sources, tmp_path):
    """Both directions through the command line's main (in this process: a real process's start-up, ~4 s each on
    2 cores, is the refusal's below), then the refusal of an unsupported family in a real process."""
    from hybrid3d.convert.__main__ import main

    checkpoint, exported = tmp_path / "qwen3-tp2-pp2", tmp_path / "qwen3-hf"
    assert main(["hf2hybrid", "--hf-model", str(sources["qwen3"]), "--out", str(checkpoint), "--tp", "2",
                 "--pp", "2"]) == 0
    assert main(["hybrid2hf", "--checkpoint", str(checkpoint), "--out", str(exported)]) == 0
    original, result = read_safetensors_folder(sources["qwen3"]), read_safetensors_folder(exported)
    assert set(result) == set(original) and all(torch.equal(result[n], t) for n, t in original.items())

    gemma = tmp_path / "gemma"
    GemmaForCausalLM(GemmaConfig(**BASE, num_attention_heads=4, num_key_value_heads=1, head_dim=8)).save_pretrained(gemma)
    refused = convert_cli("hf2hybrid", "--hf-model", gemma, "--out", tmp_path / "out", "--tp", 2)
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: model_type 'gemma' is not supported "
                     "(supported: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v3)"], \
        refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "out").exists()
