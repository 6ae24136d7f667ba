"""A Megatron indexed dataset (`indexed.py`) as packed training data, without reading the corpus into memory.

Pre-training data (no loss-mask sidecar) is the documents concatenated as stored: Megatron's GPT dataset adds
nothing between documents (its preprocessing appends EOS when asked), so neither does this. Fine-tuning data (a
`P.learn.bin` sidecar) is packed as examples: whole, in order, next-fit into s-token spans padded with EOS, an
example longer than s cut to it (`_examples`). The training path's own tokenization cache is such a dataset too
(pipeline.py), so both pack by this code. `data.shuffle` permutes documents with the permutation
the `datasets` library's `Dataset.shuffle(seed)` draws (`np.random.default_rng(seed).permutation`), so the same
documents given as `input_ids` rows pack identically; `eval_fraction` holds out the last documents of that order.

In stored order the stream is the `.bin` itself (`streams.CorpusStream`); otherwise a placement of three int64 per
document is built once into the data cache and memory-mapped (`streams.PlacedStream`).
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from hybrid3d.data.builtin import cache_dir
from hybrid3d.data.indexed import IndexedCorpus, ids_fit, bin_path, idx_path, learn_path
from hybrid3d.data.streams import CorpusStream, PlacedStream
from hybrid3d.errors import ConfigError


def indexed_data(prefix: str, where: str, section, vocab_size: int, eos: Callable[[], Optional[int]],
                 held_out_fraction: float):
    """(train arrays, held-out arrays or None, account line, finetuning) of the dataset at `prefix`; the arrays are
    `PackedSamples`' {tokens, starts[, learn]}; `eos()` gives the id that pads fine-tuning examples."""
    corpus = IndexedCorpus(prefix, where)
    count = len(corpus)
    if count == 0:
        raise ConfigError(f"{where}: {idx_path(prefix)} holds no documents")
    _check_vocabulary(corpus, vocab_size)
    finetuning = os.path.isfile(learn_path(prefix))
    held = 0
    if held_out_fraction:
        held = max(1, int(round(count * held_out_fraction)))
        if held >= count:
            raise ConfigError(f"hybrid3d.data.eval_fraction: {held_out_fraction} of {count} documents leaves none "
                              "for training")
    eos_id = eos() if finetuning else None
    if finetuning and eos_id is None:
        raise ConfigError(f"{where}: padding fine-tuning examples needs an EOS id, and neither the model config nor a "
                          "tokenizer gives one")
    if not finetuning and not section.shuffle:  # the .bin as it is
        train, evaluation = CorpusStream(corpus, 0, count - held), (CorpusStream(corpus, count - held, count)
                                                                    if held else None)
        return _arrays(train), _arrays(evaluation), f"{count - held:,} documents, {train.total:,} tokens", False
    order = np.random.default_rng(section.seed).permutation(count) if section.shuffle else None
    parts = [("train", 0, count - held)] + ([("eval", count - held, count)] if held else [])
    key = _key(prefix, section, held, finetuning, eos_id)
    folder = cache_dir() / "indexed" / key
    if not (folder / "record.json").exists():
        _write_placements(folder, corpus, order, parts, section.seq_length if finetuning else None)
    record = json.loads((folder / "record.json").read_text())
    mask = corpus.learn_mask()
    streams = {name: PlacedStream(corpus.tokens, *(np.load(folder / f"{name}.{a}.npy", mmap_mode="r")
                                                   for a in ("src", "length", "dest")),
                                  record[name]["total"], eos_id if eos_id is not None else 0, mask)
               for name, _, _ in parts}
    return (_arrays(streams["train"]), _arrays(streams.get("eval")), record["train"]["account"], finetuning)


def _arrays(stream) -> Optional[dict]:
    if stream is None:
        return None
    arrays = {"tokens": stream.tokens, "starts": stream.starts}
    if stream.learn is not None:
        arrays["learn"] = stream.learn
    return arrays


def _files_key(prefix: str, with_learn: bool = False) -> list:
    """The dataset's files by path, size and modification time: a rewritten file makes a new cache entry."""
    paths = [idx_path(prefix), bin_path(prefix)] + ([learn_path(prefix)] if with_learn else [])
    return [[os.path.realpath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in paths]


def _hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def _key(prefix: str, section, held: int, finetuning: bool, eos_id) -> str:
    return _hash("v1", _files_key(prefix, finetuning), section.shuffle, section.seed, held,
                 section.seq_length if finetuning else None, eos_id if finetuning else None)


def _check_vocabulary(corpus: IndexedCorpus, vocab_size: int) -> None:
    """`IndexedCorpus.check_vocabulary` with the token range cached: its scan reads the whole .bin, once."""
    if ids_fit(corpus.dtype, vocab_size):
        return
    record = cache_dir() / "indexed" / "token-ranges" / f"{_hash(_files_key(corpus.prefix))}.json"
    token_range = tuple(json.loads(record.read_text())) if record.exists() else None
    if token_range is None:
        token_range = corpus.token_range()
        record.parent.mkdir(parents=True, exist_ok=True)
        scratch = record.with_name(f".{record.name}.{os.getpid()}")
        scratch.write_text(json.dumps(token_range))
        os.replace(scratch, record)  # atomic: the node leaders may share the cache
    corpus.check_vocabulary(vocab_size, token_range)


def _write_placements(folder: Path, corpus: IndexedCorpus, order, parts, seq_length: Optional[int]) -> None:
    """src/length/dest arrays of each part (and its account) into a temporary folder, renamed into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    record = {}
    for name, first, stop in parts:
        documents = np.arange(first, stop) if order is None else order[first:stop]
        src, length = _document_spans(corpus, documents)
        if seq_length is None:
            dest = np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64)
            total = int(length.sum())
            account = f"{len(documents):,} documents, {total:,} tokens"
        else:
            src, length, dest, total, account = _examples(corpus, src, length, seq_length)
        for array_name, array in (("src", src), ("length", length), ("dest", dest)):
            np.save(tmp / f"{name}.{array_name}.npy", array)
        record[name] = {"total": total, "account": account}
    (tmp / "record.json").write_text(json.dumps(record))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)


def _document_spans(corpus: IndexedCorpus, documents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token offset, length) of each listed document, int64."""
    src, length = np.empty(len(documents), np.int64), np.empty(len(documents), np.int64)
    offsets = corpus.document_offsets()  # (D + 1,) int64: index-sized, like the placement itself
    src[:] = offsets[documents]
    length[:] = offsets[documents + 1] - src
    return src, length


def _examples(corpus: IndexedCorpus, src, length, s: int):
    """Fine-tuning examples placed whole, in order, next-fit into s-token spans, each span's rest padded with EOS that
    nothing learns: an example that does not fit in the span's rest starts the next span; one longer than s keeps its
    first s tokens and is dropped when they hold no target; one padding token ends the stream (the last sample's
    (s+1)-th token). Decided from the lengths (and a long example's mask) alone: the tokens stay on disk."""
    mask = corpus.learn_mask()
    kept_src, kept_length, dest = [], [], []
    fill = position = truncated = dropped = learned = 0
    for start, n in zip(src.tolist(), length.tolist()):
        if n > s:
            truncated += 1
            n = s
            if not np.asarray(mask[start + 1:start + n]).any():
                dropped += 1
                continue
        if fill + n > s:
            position += s - fill
            fill = 0
        kept_src.append(start), kept_length.append(n), dest.append(position)
        learned += int(np.asarray(mask[start + 1:start + n], dtype=np.int64).sum())
        position += n
        fill += n
    if not kept_src:
        raise ConfigError(f"hybrid3d.data.seq_length: every example is longer than seq_length {s} with nothing to "
                          "learn in its first tokens")
    total = position + s - fill + 1
    account = (f"{len(kept_src):,} examples in {(total - 1) // s:,} samples of {s} tokens, "
               f"{learned:,} targets learned ({learned / (total - 1):.0%} of the tokens)")
    if truncated:
        account += f"; {truncated:,} longer than {s} tokens cut to it ({dropped:,} of them dropped: nothing to learn)"
    return (np.asarray(kept_src, np.int64), np.asarray(kept_length, np.int64), np.asarray(dest, np.int64), total,
            account)
