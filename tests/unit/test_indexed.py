"""Megatron's indexed dataset: what megatron-core writes hybrid3d reads, and the other way round (megatron-core is
the oracle); damaged or foreign files are one-line errors naming the file."""

import numpy as np
import pytest

from hybrid3d.data.indexed import IndexedCorpus, IndexedWriter, bin_path, idx_path, is_indexed_prefix, learn_path
from hybrid3d.data.streams import CorpusStream
from hybrid3d.errors import ConfigError
from tests.megatron_oracle import megatron_datasets


def documents(seed: int, count: int = 30, high: int = 60000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, int(rng.integers(0, 40))) for _ in range(count)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_files_read_as_written(tmp_path, dtype):
    indexed = megatron_datasets().indexed
    docs = documents(1)
    prefix = str(tmp_path / "corpus")
    builder = indexed.IndexedDatasetBuilder(bin_path(prefix), dtype=dtype)
    for doc in docs[:-1]:
        builder.add_document(doc, [len(doc)])
    last = docs[-1]  # a document of three sequences (Megatron's split sentences): its tokens concatenated
    builder.add_document(last, [len(last) // 3, len(last) // 3, len(last) - 2 * (len(last) // 3)])
    builder.finalize(idx_path(prefix))

    corpus = IndexedCorpus(prefix)
    assert is_indexed_prefix(prefix) and corpus.dtype == dtype and len(corpus) == len(docs)
    assert isinstance(corpus.tokens, np.memmap)  # zero-copy
    for d, doc in enumerate(docs):
        assert corpus.document(d).tolist() == doc.tolist()
    assert np.asarray(corpus.tokens).tolist() == np.concatenate(docs).tolist()
    assert corpus.learn_mask() is None
    # the document starts of the stream (documents 3.. as stored), found by bisection (one document has three sequences)
    stream = CorpusStream(corpus, 3)
    lengths = [len(d) for d in docs[3:]]
    expected = np.zeros(sum(lengths), dtype=np.uint8)
    expected[np.cumsum([0] + lengths[:-1])[np.asarray(lengths) > 0]] = 1
    assert not corpus.one_sequence_each and np.asarray(stream.starts).tolist() == expected.tolist()
    assert stream.starts[5:40].tolist() == expected[5:40].tolist()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_what_hybrid3d_writes_megatron_core_reads(tmp_path, dtype):
    indexed = megatron_datasets().indexed
    docs = documents(2)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    with IndexedWriter(ours, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    read = indexed.IndexedDataset(ours)
    assert read.index.dtype == dtype and len(read) == len(docs)
    assert [read[d].tolist() for d in range(len(docs))] == [doc.tolist() for doc in docs]
    builder = indexed.IndexedDatasetBuilder(bin_path(theirs), dtype=dtype)
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(idx_path(theirs))
    for path in (bin_path, idx_path):  # the same bytes as megatron-core's builder
        assert open(path(ours), "rb").read() == open(path(theirs), "rb").read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.bin", "ours.idx", "theirs.bin", "theirs.idx"]


def test_the_loss_mask_sidecar_lies_beside_the_tokens(tmp_path):
    prefix = tmp_path / "sft"
    with IndexedWriter(prefix, np.uint16, learn=True) as writer:
        writer.add_document([5, 6, 7], [0, 1, 1])
        writer.add_document([8, 9], [0, 1])
    corpus = IndexedCorpus(str(prefix))
    assert np.asarray(corpus.learn_mask()).tolist() == [0, 1, 1, 0, 1]
    assert np.asarray(corpus.tokens).tolist() == [5, 6, 7, 8, 9]


def test_an_interrupted_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedWriter(tmp_path / "half", np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def written(tmp_path, docs=((1, 2, 3), (4, 5))) -> str:
    prefix = str(tmp_path / "c")
    with IndexedWriter(prefix, np.int32) as writer:
        for doc in docs:
            writer.add_document(np.asarray(doc))
    return prefix


def damage(prefix, what):
    if what == "no idx":
        return idx_path(prefix), __import__("os").remove(idx_path(prefix))
    if what == "no bin":
        return bin_path(prefix), __import__("os").remove(bin_path(prefix))
    if what == "short bin":
        data = open(bin_path(prefix), "rb").read()
        open(bin_path(prefix), "wb").write(data[:-4])
        return bin_path(prefix), None
    index = bytearray(open(idx_path(prefix), "rb").read())
    if what == "magic":
        index[:4] = b"NOPE"
    elif what == "version":
        index[9] = 2
    elif what == "float dtype":
        index[17] = 6
    elif what == "truncated idx":
        index = index[:-8]
    open(idx_path(prefix), "wb").write(bytes(index))
    return idx_path(prefix), None


@pytest.mark.parametrize("what, says", [("no idx", "is missing"), ("no bin", "is missing"),
                                        ("short bin", "fewer than the 20"), ("magic", "not a Megatron"),
                                        ("version", "index version 2"), ("float dtype", "not an integer token"),
                                        ("truncated idx", "truncated")])
def test_damaged_files_are_one_line_errors_naming_the_file(tmp_path, what, says):
    prefix = written(tmp_path)
    path, _ = damage(prefix, what)
    with pytest.raises(ConfigError) as error:
        IndexedCorpus(prefix, "hybrid3d.data.path")
    message = str(error.value)
    assert "\n" not in message and message.startswith("hybrid3d.data.path: ") and path in message and says in message


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    corpus = IndexedCorpus(written(tmp_path, ((1, 2, 3), (4, 99))))
    corpus.check_vocabulary(100)
    with pytest.raises(ConfigError, match=r"c\.bin holds token id 99, outside the model's vocabulary \(vocab_size 99"):
        corpus.check_vocabulary(99)


def test_a_sidecar_of_another_length_is_refused(tmp_path):
    prefix = written(tmp_path)
    open(learn_path(prefix), "wb").write(b"\x01" * 4)
    with pytest.raises(ConfigError, match=r"c\.learn\.bin holds 4 bytes, not one per token"):
        IndexedCorpus(prefix).learn_mask()


def test_scans_and_the_index_writer_agree_across_chunk_boundaries(tmp_path, monkeypatch):
    """Writing the index and every scan of it go in chunks (constant memory); with chunks of 5 and 7 entries over 30
    documents the bytes still equal megatron-core's and each scan still sees every chunk, the last one partial."""
    from hybrid3d.data import indexed

    monkeypatch.setattr(indexed, "WRITE_CHUNK", 5)
    monkeypatch.setattr(indexed, "CHUNK", 7)
    docs = documents(3, high=70000)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    with IndexedWriter(ours, np.int32) as writer:
        for doc in docs:
            writer.add_document(doc)
    builder = megatron_datasets().indexed.IndexedDatasetBuilder(bin_path(theirs), dtype=np.int32)
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(idx_path(theirs))
    assert open(idx_path(ours), "rb").read() == open(idx_path(theirs), "rb").read()
    corpus = IndexedCorpus(ours)
    tokens = np.concatenate(docs)
    assert corpus.num_tokens == len(tokens) and corpus.one_sequence_each
    assert corpus.token_range() == (int(tokens.min()), int(tokens.max()))
    assert [corpus.document(d).tolist() for d in range(len(docs))] == [doc.tolist() for doc in docs]
    with pytest.raises(ConfigError, match="holds token id"):
        corpus.check_vocabulary(int(tokens.max()))
    # a pointer broken in the fourth chunk of the scan is still found
    index = bytearray(open(idx_path(ours), "rb").read())
    pointer = indexed.HEADER.size + len(docs) * 4 + 22 * 8
    index[pointer:pointer + 8] = (int.from_bytes(index[pointer:pointer + 8], "little") + 4).to_bytes(8, "little")
    open(idx_path(ours), "wb").write(bytes(index))
    with pytest.raises(ConfigError, match="not stored back to back"):
        IndexedCorpus(ours)
