"""A Megatron indexed-dataset prefix as `data.path`: its documents pack into exactly the micro-batches the same
documents give as `input_ids` rows (in order, shuffled, held out for evaluation, with document masks; fine-tuning
examples with their loss masks), and the data cursor resumes the same way."""

import json

import numpy as np
import pytest

from hybrid3d.config.sections import DataSection
from hybrid3d.data import build_training_data, micro_batches
from hybrid3d.data.indexed import IndexedWriter, bin_path, idx_path
from hybrid3d.data.pipeline import TokenizerSource
from hybrid3d.errors import ConfigError
from tests.megatron_oracle import megatron_datasets

EOS, VOCAB, S = 1, 500, 16


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID3D_CACHE", str(tmp_path / "cache"))


def ids_source() -> TokenizerSource:
    def load():
        raise ConfigError("no tokenizer: the data is pre-tokenized")

    return TokenizerSource(load=load, identity="none", config_eos_id=EOS)


def documents(seed: int = 0, count: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, int(rng.integers(3, 30))).tolist() for _ in range(count)]


def megatron_prefix(tmp_path, docs, dtype=np.uint16) -> str:
    """The documents, each followed by EOS (preprocessing's --append-eos), written by megatron-core's builder."""
    prefix = str(tmp_path / "megatron")
    builder = megatron_datasets().indexed.IndexedDatasetBuilder(bin_path(prefix), dtype=dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc + [EOS]), [len(doc) + 1])
    builder.finalize(idx_path(prefix))
    return prefix


def jsonl(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def batches(samples, document_mask, batch=8, dp=2, micro=2):
    out = []
    for k in (0, 2, len(samples) // batch + 1):  # the last one wraps into the next epoch
        for rank in range(dp):
            for one in micro_batches(samples, k * batch, batch, rank, dp, micro, document_mask):
                out.append([one.ids.tolist(), one.targets.tolist(), None if one.positions is None
                            else one.positions.tolist(), one.loss_weight.item()])
    return out


def same_training(a, b, document_mask: bool) -> None:
    assert a.summary == b.summary and len(a.train) == len(b.train)
    assert np.asarray(a.train.tokens).tolist() == np.asarray(b.train.tokens).tolist()
    assert batches(a.train, document_mask) == batches(b.train, document_mask)
    assert (a.eval is None) == (b.eval is None)
    if a.eval is not None:
        assert batches(a.eval, document_mask, batch=2, dp=1, micro=1) == batches(b.eval, document_mask, 2, 1, 1)


@pytest.mark.parametrize("shuffle, eval_fraction, document_mask", [(False, 0.0, False), (True, 0.0, True),
                                                                   (False, 0.1, True), (True, 0.1, False)])
def test_megatron_documents_train_like_the_same_input_ids_rows(tmp_path, shuffle, eval_fraction, document_mask):
    docs = documents()
    section = dict(seq_length=S, shuffle=shuffle, seed=5, eval_fraction=eval_fraction, document_mask=document_mask)
    indexed = build_training_data(DataSection(path=megatron_prefix(tmp_path, docs), **section), ids_source(), VOCAB)
    rows = build_training_data(DataSection(path=jsonl(tmp_path, [{"input_ids": d} for d in docs]), **section),
                               ids_source(), VOCAB)
    same_training(indexed, rows, document_mask)
    assert not indexed.finetuning
    if not shuffle:  # in stored order the tokens are the .bin itself, memory-mapped
        assert isinstance(indexed.train.tokens[0:4], np.ndarray)


def test_fine_tuning_examples_keep_their_loss_masks(tmp_path):
    """Examples and their masks in P.bin + P.learn.bin pack like `input_ids` + `loss_mask` rows: whole, next-fit
    into s-token spans, one longer than s cut (and one with nothing left to learn dropped)."""
    rng = np.random.default_rng(3)
    rows = []
    for i in range(40):
        n = int(rng.integers(3, 12)) if i not in (7, 20) else 24
        prompt = {7: 2, 20: 20}.get(i, int(rng.integers(1, n - 1)))  # example 20: its first S tokens learn nothing
        rows.append({"input_ids": rng.integers(2, VOCAB, n).tolist(), "loss_mask": [0] * prompt + [1] * (n - prompt)})
    prefix = str(tmp_path / "sft")
    with IndexedWriter(prefix, np.uint16, learn=True) as writer:
        for row in rows:
            writer.add_document(row["input_ids"], row["loss_mask"])
    for shuffle in (False, True):
        section = dict(seq_length=S, shuffle=shuffle, seed=2, document_mask=True)
        indexed = build_training_data(DataSection(path=prefix, **section), ids_source(), VOCAB)
        given = build_training_data(DataSection(path=jsonl(tmp_path, rows), **section), ids_source(), VOCAB)
        same_training(indexed, given, document_mask=True)
        assert np.asarray(indexed.train.learn).tolist() == np.asarray(given.train.learn).tolist()
        assert indexed.finetuning and "2 longer than 16 tokens cut to it (1 of them dropped" in indexed.summary


def test_the_cursor_resumes_an_indexed_stream_at_another_batch_and_dp_size(tmp_path):
    from hybrid3d.data import DataCursor

    data = build_training_data(DataSection(path=megatron_prefix(tmp_path, documents()), seq_length=S),
                               ids_source(), VOCAB)

    def read(cursor, batch, dp):
        first = cursor.next_batch(batch)
        return [row for r in range(dp) for b in micro_batches(data.train, first, batch, r, dp, 1) for row in
                b.ids.tolist()]

    before = DataCursor()
    seen = [row for _ in range(3) for row in read(before, 8, 2)]
    after = DataCursor(before.samples_consumed)
    seen += [row for _ in range(2) for row in read(after, 4, 4)]
    assert seen == [data.train.sample(i)[:-1].tolist() for i in range(32)]


def test_int32_files_and_a_prefix_in_eval_path(tmp_path):
    docs = documents(4)
    prefix = megatron_prefix(tmp_path, docs, np.int32)
    data = build_training_data(DataSection(path=prefix, eval_path=prefix, seq_length=S), ids_source(), VOCAB)
    stream = [t for d in docs for t in d + [EOS]]
    assert np.asarray(data.train.tokens).tolist() == stream == np.asarray(data.eval.tokens).tolist()


@pytest.mark.parametrize("damage, says", [
    (lambda p: __import__("os").remove(idx_path(p)), "megatron.idx is missing"),
    (lambda p: open(bin_path(p), "r+b").truncate(10), "megatron.bin holds 10 bytes, fewer than"),
])
def test_bad_indexed_data_is_one_line_naming_the_key_and_file(tmp_path, damage, says):
    prefix = megatron_prefix(tmp_path, documents())
    damage(prefix)
    with pytest.raises(ConfigError) as error:
        build_training_data(DataSection(path=prefix, seq_length=S), ids_source(), VOCAB)
    assert str(error.value).startswith("hybrid3d.data.path: ") and says in str(error.value)


def test_ids_beyond_the_vocabulary_and_a_file_for_a_prefix_are_refused(tmp_path):
    prefix = megatron_prefix(tmp_path, documents(), np.int32)
    with pytest.raises(ConfigError, match=r"hybrid3d\.data\.path: .*megatron\.bin holds token id 49\d, outside the "
                                          r"model's vocabulary \(vocab_size 300\)"):
        build_training_data(DataSection(path=prefix, seq_length=S), ids_source(), 300)
    with pytest.raises(ConfigError, match=r"megatron\.bin is one file of an indexed dataset: give its prefix"):
        build_training_data(DataSection(path=bin_path(prefix), seq_length=S), ids_source(), VOCAB)
