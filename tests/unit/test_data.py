"""Packing and sharding follow the documented convention, computed here independently."""

import json

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from hybrid3d.config.sections import DataSection
from hybrid3d.data import build_training_data, micro_batches
from hybrid3d.data.builtin import builtin_tokenizer_path
from hybrid3d.data.pipeline import TokenizerSource
from hybrid3d.errors import ConfigError

DOCS = [f"Document number {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(builtin_tokenizer_path())


def source(tokenizer, config_eos_id=None) -> TokenizerSource:
    def load():
        if tokenizer is None:
            raise AssertionError("pre-tokenized data must not load a tokenizer")
        return tokenizer

    return TokenizerSource(load=load, identity="builtin", config_eos_id=config_eos_id)


@pytest.fixture()
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": d, "other": 1}) + "\n" for d in DOCS))
    return path


def expected_stream(texts, tokenizer):
    stream = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return stream


def expected_micro_batches(stream, s, k, batch, dp_rank, dp, micro):
    n = (len(stream) - 1) // s
    share = batch // dp
    rows = [stream[(i % n) * s:(i % n) * s + s + 1] for i in range(k * batch + dp_rank * share,
                                                                    k * batch + (dp_rank + 1) * share)]
    return [(np.array([r[:-1] for r in rows[j:j + micro]]), np.array([r[1:] for r in rows[j:j + micro]]))
            for j in range(0, share, micro)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_packing_and_sharding_follow_the_convention(jsonl, tokenizer, shuffle):
    section = DataSection(path=str(jsonl), text_field="body", seq_length=16, shuffle=shuffle, seed=7)
    data = build_training_data(section, source(tokenizer), 4096)
    texts = DOCS
    if shuffle:  # the seeded shuffle is the datasets library's
        texts = datasets.Dataset.from_list([{"body": d} for d in DOCS]).shuffle(seed=7)["body"]
    stream = expected_stream(texts, tokenizer)
    assert list(np.asarray(data.train.tokens)) == stream
    assert len(data.train) == (len(stream) - 1) // 16
    batch, dp, micro = 8, 2, 2
    for k in (0, 3, len(data.train) // batch + 1):  # the last one wraps into the next epoch
        for dp_rank in range(dp):
            got = list(micro_batches(data.train, k * batch, batch, dp_rank, dp, micro))
            want = expected_micro_batches(stream, 16, k, batch, dp_rank, dp, micro)
            assert len(got) == len(want) == batch // dp // micro
            for one, (want_ids, want_targets) in zip(got, want):
                assert one.ids.tolist() == want_ids.tolist() and one.targets.tolist() == want_targets.tolist()
                assert one.positions is None and one.loss_weight.item() == pytest.approx(1 / (micro * 16))


def test_eval_fraction_holds_out_the_last_documents(jsonl, tokenizer):
    section = DataSection(path=str(jsonl), text_field="body", seq_length=16, eval_fraction=0.1)
    data = build_training_data(section, source(tokenizer), 4096)
    assert list(np.asarray(data.train.tokens)) == expected_stream(DOCS[:36], tokenizer)
    assert list(np.asarray(data.eval.tokens)) == expected_stream(DOCS[36:], tokenizer)


def test_pretokenized_dataset_is_used_as_is(tmp_path, tokenizer):
    rows = [{"input_ids": list(range(i, i + 5 + i % 3))} for i in range(30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    data = build_training_data(DataSection(path=str(tmp_path / "saved"), seq_length=8), source(None, 0), 64)
    stream = []
    for row in rows:
        stream += row["input_ids"] + [0]
    assert list(np.asarray(data.train.tokens)) == stream


@pytest.mark.parametrize("make, needle", [
    (lambda p: p.write_text(""), "holds no documents"),
    (lambda p: p.write_text(json.dumps({"body": "short"}) + "\n"), "fewer than seq_length + 1"),
    (lambda p: p.write_text(json.dumps({"text": "x " * 100}) + "\n"), "hybrid3d.data.text_field: column 'body'"),
])
def test_bad_data_is_refused_naming_the_key(tmp_path, tokenizer, make, needle):
    path = tmp_path / "bad.jsonl"
    make(path)
    with pytest.raises(ConfigError) as err:
        build_training_data(DataSection(path=str(path), text_field="body", seq_length=64), source(tokenizer), 4096)
    assert needle in str(err.value)


def test_a_changed_global_batch_continues_at_the_next_unseen_sample(jsonl, tokenizer):
    """Megatron's consumed_samples: 3 steps of 8 sequences, then (resumed with a global batch of 4, on another
    DP size) the next steps read samples 24-27 and 28-31: no sample skipped or read twice."""
    from hybrid3d.data import DataCursor

    section = DataSection(path=str(jsonl), text_field="body", seq_length=16)
    data = build_training_data(section, source(tokenizer), 4096)
    stream = expected_stream(DOCS, tokenizer)
    n = (len(stream) - 1) // 16

    def read(cursor, batch, dp):
        first = cursor.next_batch(batch)
        rows = [b.ids.tolist() for r in range(dp) for b in micro_batches(data.train, first, batch, r, dp, 1)]
        return [row for chunk in rows for row in chunk]

    before = DataCursor()
    seen = [row for _ in range(3) for row in read(before, 8, 2)]
    after = DataCursor(before.samples_consumed)  # what the checkpoint stores
    seen += [row for _ in range(2) for row in read(after, 4, 4)]
    assert after.samples_consumed == 32
    assert seen == [stream[(i % n) * 16:(i % n) * 16 + 16] for i in range(32)]
