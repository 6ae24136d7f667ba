"""A Qwen2 folder (q/k/v biases, tied embeddings) through the launcher: `model.hf_model` + `init_from_hf` at
TP2 x PP2 starts from HF's loss, and its checkpoint reshards to one rank through DeepSpeed's universal checkpoint
(the biases' column-parallel pattern from the TP plan) and evaluates to the run's own last eval loss."""

import json
import math
import re

import torch
import torch.nn.functional as F

from tests.launcher.harness import demo_config, read_metrics
from tests.launcher.in_world import run_job


def test_qwen2_trains_from_hf_and_reshards_through_the_universal_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybrid3d.config.sections import DataSection
    from hybrid3d.data import build_training_data, micro_batches
    from hybrid3d.data.pipeline import TokenizerSource
    from hybrid3d.data.builtin import builtin_tokenizer_path
    from tests.tiny_families import make_hf_family

    tokenizer = AutoTokenizer.from_pretrained(builtin_tokenizer_path())
    model_dir = tmp_path / "qwen2"
    make_hf_family(str(model_dir), "qwen2", vocab_size=len(tokenizer), max_position_embeddings=256)
    tokenizer.save_pretrained(model_dir)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Example {i}: " + "the quick brown fox " * (i % 5 + 3)}) + "\n"
                            for i in range(200)))
    config = demo_config(tmp_path, model={"hf_model": str(model_dir), "init_from_hf": True})  # TP2 x PP2
    raw = json.loads(config.read_text())
    raw["hybrid3d"]["data"] = {"path": str(docs), "seq_length": 64, "eval_fraction": 0.05}
    config.write_text(json.dumps(raw))
    trained = run_job(4, config)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "layout TP2-PP2-DP1" in trained.stdout
    metrics = read_metrics(tmp_path / "run")

    # the job's tokenizer: AutoTokenizer reads the folder's config.json and picks Qwen2Tokenizer, whose
    # pre-tokenizer splits digits apart, so the same files tokenize differently from the built-in tokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizers = TokenizerSource(load=lambda: tokenizer, identity="qwen2", config_eos_id=None)
    data = build_training_data(DataSection(path=str(docs), seq_length=64, eval_fraction=0.05), tokenizers,
                               len(tokenizer))
    ids, targets = next(micro_batches(data.train, 0, 16, 0, 1, 16))[:2]
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        expected = F.cross_entropy(hf(ids).logits.flatten(0, 1), targets.flatten()).item()
    assert math.isclose(metrics[0]["loss"], expected, rel_tol=1e-5), (metrics[0]["loss"], expected)
    assert metrics[-1]["loss"] < metrics[0]["loss"], [m["loss"] for m in metrics]

    resharded = run_job(1, config, "--tensor_parallel_size", "1", "--pipeline_parallel_size", "1",
                       "--checkpoint.load", str(tmp_path / "run" / "checkpoints"), "--eval-only")
    assert resharded.returncode == 0, resharded.stdout[-3000:] + resharded.stderr[-3000:]
    assert "through DeepSpeed's universal checkpoint" in resharded.stdout
    eval_loss = float(re.search(r"eval_loss (\S+) perplexity", resharded.stdout).group(1))
    assert math.isclose(eval_loss, metrics[-1]["eval_loss"], rel_tol=1e-5), (eval_loss, metrics[-1]["eval_loss"])
