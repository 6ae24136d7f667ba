"""`python -m hybrid3d.data.preprocess`: what it writes megatron-core reads, and it trains exactly as the same files
given to `data.path`; fine-tuning rows keep their loss masks; the output does not depend on the worker count; bad
input is one line, exit 2, nothing written."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from hybrid3d.config.sections import DataSection
from hybrid3d.data import build_training_data, micro_batches
from hybrid3d.data.builtin import builtin_tokenizer_path
from hybrid3d.data.indexed import bin_path, idx_path, learn_path
from hybrid3d.data.pipeline import TokenizerSource
from hybrid3d.data.preprocess import main
from tests.megatron_oracle import megatron_datasets

TEXTS = [f"Line {i}: " + "pack my box with five dozen liquor jugs " * (i % 4 + 1) for i in range(50)]


@pytest.fixture(scope="module")
def tokenizer_dir():
    return str(builtin_tokenizer_path())


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["--quiet", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def batches(samples, document_mask):
    return [[b.ids.tolist(), b.targets.tolist(), b.loss_weight.item()]
            for k in range(3) for b in micro_batches(samples, 4 * k, 4, 0, 1, 2, document_mask)]


def test_text_is_read_by_megatron_core_and_trains_like_the_jsonl(tmp_path, capsys, tokenizer_dir, tokenizer,
                                                                 monkeypatch):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    prefix = tmp_path / "out" / "corpus"
    prefix.parent.mkdir()
    code, out, _ = run(capsys, "--input", docs, "--output-prefix", prefix, "--tokenizer", tokenizer_dir,
                       "--append-eos")
    assert code == 0 and f"wrote {prefix}.bin, {prefix}.idx: 50 documents, " in out and "(uint16)" in out
    read = megatron_datasets().indexed.IndexedDataset(str(prefix))
    expected = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in TEXTS]
    assert [read[d].tolist() for d in range(len(read))] == expected

    monkeypatch.setenv("HYBRID3D_CACHE", str(tmp_path / "cache"))
    source = TokenizerSource(load=lambda: tokenizer, identity="builtin", config_eos_id=None)
    from_prefix = build_training_data(DataSection(path=str(prefix), seq_length=16), source, 4096)
    from_file = build_training_data(DataSection(path=docs, seq_length=16), source, 4096)
    assert from_prefix.summary == from_file.summary
    assert batches(from_prefix.train, True) == batches(from_file.train, True)


def test_two_workers_write_the_same_bytes_as_one(tmp_path, capsys, tokenizer_dir):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS * 12])  # 600 rows: 3 batches
    text = tmp_path / "more.txt"
    text.write_text("".join(t + "\n" for t in TEXTS))
    outputs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        code, _, err = run(capsys, "--input", docs, text, "--output-prefix", prefix, "--tokenizer", tokenizer_dir,
                           "--workers", workers)
        assert code == 0, err
        outputs.append([open(path(str(prefix)), "rb").read() for path in (bin_path, idx_path)])
    assert outputs[0] == outputs[1]


def test_fine_tuning_rows_keep_their_loss_masks(tmp_path, capsys, tokenizer_dir, tokenizer, monkeypatch):
    rows = [{"prompt": f"What is {i} + {i}?", "completion": f" It is {2 * i}."} for i in range(30)]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    prefix = tmp_path / "sft"
    code, out, _ = run(capsys, "--input", path, "--output-prefix", prefix, "--tokenizer", tokenizer_dir, "--format",
                       "prompt_completion")
    assert code == 0 and f"{prefix}.learn.bin" in out
    monkeypatch.setenv("HYBRID3D_CACHE", str(tmp_path / "cache"))
    source = TokenizerSource(load=lambda: tokenizer, identity="builtin", config_eos_id=None)
    section = dict(seq_length=24, format="prompt_completion")
    from_prefix = build_training_data(DataSection(path=str(prefix), **section), source, 4096)
    from_file = build_training_data(DataSection(path=path, **section), source, 4096)
    assert from_prefix.finetuning and from_prefix.summary == from_file.summary
    assert np.asarray(from_prefix.train.learn).tolist() == np.asarray(from_file.train.learn).tolist()
    assert batches(from_prefix.train, True) == batches(from_file.train, True)


@pytest.mark.parametrize("case, says", [
    ("exists", "--output-prefix: {prefix}.bin exists; remove it or choose another prefix"),
    ("bad json", "--input: {input} line 3 is not JSON"),
    ("eos with chat", "--append-eos: format 'chat' ends its examples itself"),
    ("no file", "--input: no file matches"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, tokenizer_dir, case, says):
    rows = [{"text": t} for t in TEXTS]
    source = tmp_path / "in.jsonl"
    write_jsonl(source, rows)
    prefix = tmp_path / "p"
    argv = ["--input", source, "--output-prefix", prefix, "--tokenizer", tokenizer_dir]
    if case == "exists":
        (tmp_path / "p.bin").write_bytes(b"")
    elif case == "bad json":
        source.write_text(source.read_text().replace('{"text": "Line 2', '{"text": Line 2'))
    elif case == "eos with chat":
        argv += ["--format", "chat", "--append-eos"]
    else:
        argv[1] = tmp_path / "missing*.jsonl"
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: " + says.format(prefix=prefix, input=source))
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not (tmp_path / "p.idx").exists() and not (tmp_path / learn_path("p")).exists()
