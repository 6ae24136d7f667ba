"""From a `hybrid3d.data` config section to packed train/eval samples.

A Megatron indexed-dataset prefix (P.bin + P.idx) is read memory-mapped by `indexed_source.py`. Other local files
are read with the `datasets` library (`documents.py`: text, json/jsonl, parquet, arrow, a `save_to_disk` folder),
encoded per `hybrid3d.data.format` (`formats.py`: raw text, chat, prompt/completion, or pre-tokenized ids with
optional labels) with `Dataset.map` (cached by `datasets`), written once into hybrid3d's cache as an indexed
dataset (the one on-disk format: what `python -m hybrid3d.data.preprocess` writes) and read like one, memory-mapped,
so every rank reads the same tokens without holding its own copy, and packed (`packing.py`).
A tokenizer is loaded only when there is text to tokenize.
"""

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from hybrid3d.config.sections import DataSection
from hybrid3d.data.blended import BlendedSamples, BlendPart, part_names
from hybrid3d.data.builtin import builtin_chat_path, builtin_corpus_path, cache_dir
from hybrid3d.data.documents import ordered_documents
from hybrid3d.data.formats import encode_rows, is_finetuning, max_token_id, needs_tokenizer
from hybrid3d.data.indexed import IndexedCorpus, IndexedWriter, is_indexed_prefix
from hybrid3d.data.indexed_source import indexed_data
from hybrid3d.data.packing import PackedSamples
from hybrid3d.errors import ConfigError

KEY = "hybrid3d.data"


@dataclass
class TrainingData:
    train: Union[PackedSamples, BlendedSamples]
    eval: Optional[PackedSamples]  # data.eval_path, or a single dataset's held-out documents
    eos_id: Optional[int]  # None: pre-tokenized data that needs none (a Megatron indexed dataset's documents)
    summary: str  # one line: what the training data holds
    finetuning: bool  # examples packed whole with a loss mask (else an EOS-joined stream)
    evals: dict = field(default_factory=dict)  # a blend's per-dataset evaluation samples, by dataset name


@dataclass(frozen=True)
class TokenizerSource:
    """Where the data path gets a tokenizer if it needs one: `load()` returns it or raises a ConfigError;
    `identity` names it in the cache key; `config_eos_id` is the model config's EOS, used for pre-tokenized data."""
    load: Callable[[], object]
    identity: str
    config_eos_id: Optional[int]


def _cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _tokenizer_eos(tokenizers: TokenizerSource) -> Optional[int]:
    try:
        return tokenizers.load().eos_token_id
    except ConfigError:  # no tokenizer to ask
        return None


def _encoded(documents, where: str, section: DataSection, tokenizers: TokenizerSource):
    """(encoded rows, EOS id) of a dataset: the tokenizer's EOS for text, the model config's for ids."""
    if needs_tokenizer(documents.column_names):
        tokenizer = tokenizers.load()
        eos_id = tokenizer.eos_token_id
    else:
        tokenizer, eos_id = None, tokenizers.config_eos_id
        if eos_id is None and not is_finetuning(documents.column_names, section.format):
            eos_id = _tokenizer_eos(tokenizers)  # a model folder's tokenizer may name one its config does not
            if eos_id is None:
                raise ConfigError(f"{where}: the data is pre-tokenized, and neither the model config nor a tokenizer "
                                  "gives an eos_token_id to join its documents with")
    return encode_rows(documents, section.format, section.text_field, tokenizer, eos_id, where), eos_id


def _packed(documents, where: str, section: DataSection, tokenizers: TokenizerSource, vocab_size: int):
    """(arrays {tokens, starts[, learn]}, account line, EOS id) of one dataset. Its encoded rows are written once
    into the cache as an indexed dataset (pre-training documents each followed by the EOS that joins them), which
    is then read like any other (`indexed_source.py`)."""
    pretokenized = not needs_tokenizer(documents.column_names)
    key = _cache_key("v3", documents._fingerprint, "pre-tokenized" if pretokenized else tokenizers.identity,
                     section.format, section.text_field,
                     (tokenizers.config_eos_id if tokenizers.config_eos_id is not None else tokenizers.identity)
                     if pretokenized else None)  # the EOS joining pre-tokenized documents, or where it comes from
    folder = cache_dir() / "packed" / key
    if not (folder / "record.json").exists():
        encoded, eos_id = _encoded(documents, where, section, tokenizers)
        largest = max_token_id(encoded)
        if largest is not None and largest >= vocab_size:
            raise ConfigError(f"{KEY}: {where} holds token id {largest}, beyond the model's vocab_size {vocab_size}")
        _write_documents(folder, encoded, eos_id, is_finetuning(documents.column_names, section.format),
                         max(largest or 0, eos_id or 0))
    eos_id = json.loads((folder / "record.json").read_text())["eos_id"]
    # the documents are cached in the order already drawn: no second shuffle
    arrays, _, account, _ = indexed_data(str(folder / "documents"), where, dataclasses.replace(section, shuffle=False),
                                         vocab_size, lambda: eos_id, 0.0)
    return arrays, account, eos_id


def _write_documents(folder: Path, encoded, eos_id: Optional[int], finetuning: bool, largest: int) -> None:
    """The encoded rows (and their loss masks) as `documents.bin/.idx[.learn.bin]` in a temporary folder, streamed a
    batch at a time, then renamed into place (atomic: the node leaders may share the cache)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    dtype = np.uint16 if largest < 2**16 else np.int32 if largest < 2**31 else np.int64
    with IndexedWriter(tmp / "documents", dtype, learn=finetuning) as writer:
        for batch in encoded.with_format("numpy").iter(batch_size=1024):
            for j, ids in enumerate(batch["input_ids"]):
                if finetuning:
                    writer.add_document(ids, batch["learn"][j])
                else:
                    writer.add_document(np.append(np.asarray(ids, dtype=np.int64), eos_id))
    (tmp / "record.json").write_text(json.dumps({"eos_id": eos_id}))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)


def _samples(arrays: dict, key: str, what: str, seq_length: int) -> PackedSamples:
    samples = PackedSamples(arrays["tokens"], seq_length, learn=arrays.get("learn"), starts=arrays.get("starts"))
    if len(samples) == 0:
        raise ConfigError(f"{key}: the {what} data has {len(samples.tokens)} tokens, fewer than "
                          f"seq_length + 1 = {seq_length + 1}")
    return samples


def _is_indexed(path: str, key: str) -> bool:
    """Whether `path` is a Megatron indexed-dataset prefix (P.bin and P.idx beside it), not a file, folder or glob."""
    if os.path.exists(path) and Path(path).suffix in (".bin", ".idx") and is_indexed_prefix(path[:-4]):
        raise ConfigError(f"{key}: {path} is one file of an indexed dataset: give its prefix {path[:-4]} "
                          "(without .bin/.idx)")
    return not os.path.exists(path) and is_indexed_prefix(path)


def _dataset(path: str, key: str, section: DataSection, tokenizers: TokenizerSource, vocab_size: int,
             held_out_fraction: float):
    """(train arrays, held-out arrays or None, account line, EOS id, finetuning) of one data path: the held-out
    part is the last `held_out_fraction` of its documents (after the optional shuffle)."""
    if _is_indexed(path, key):
        def eos_id():  # only fine-tuning examples need one (their padding)
            return tokenizers.config_eos_id if tokenizers.config_eos_id is not None else _tokenizer_eos(tokenizers)

        train, held, account, finetuning = indexed_data(path, key, section, vocab_size, eos_id, held_out_fraction)
        return train, held, account, tokenizers.config_eos_id, finetuning
    documents = ordered_documents(path, key, section.shuffle, section.seed)
    held = None
    if held_out_fraction:
        count = len(documents)
        held_out = max(1, int(round(count * held_out_fraction)))
        if held_out >= count:
            raise ConfigError(f"{KEY}.eval_fraction: {held_out_fraction} of {count} documents leaves none "
                              "for training")
        held = _packed(documents.select(range(count - held_out, count)), key, section, tokenizers, vocab_size)[0]
        documents = documents.select(range(count - held_out))
    arrays, account, eos_id = _packed(documents, key, section, tokenizers, vocab_size)
    return arrays, held, account, eos_id, is_finetuning(documents.column_names, section.format)


def data_paths(section: DataSection) -> list[tuple[str, str]]:
    """(key, path) of every data path the section names."""
    paths = [(f"{KEY}.{name}", getattr(section, name)) for name in ("path", "eval_path")]
    for i, entry in enumerate(section.blend or []):
        paths += [(f"{KEY}.blend[{i}].{name}", entry.get(name)) for name in ("path", "eval_path")]
    return [(key, path) for key, path in paths if path is not None]


def check_data_paths(section: DataSection) -> None:
    """Every data path the section names exists (a file, a glob's match, a folder or an indexed prefix)."""
    for key, path in data_paths(section):
        if not (glob.glob(path) or is_indexed_prefix(path)):
            raise ConfigError(f"{key}: {path} does not exist")


def build_training_data(section: DataSection, tokenizers: TokenizerSource, vocab_size: int) -> TrainingData:
    """Packed train (and eval) samples; the built-in corpus (or, for format 'chat', the built-in conversations)
    when no path is given."""
    if section.blend:
        return _blend(section, tokenizers, vocab_size)
    path = section.path or str(builtin_chat_path() if section.format == "chat" else builtin_corpus_path())
    train, evaluation, account, eos_id, finetuning = _dataset(
        path, f"{KEY}.path", section, tokenizers, vocab_size, 0.0 if section.eval_path else section.eval_fraction)
    eval_key = f"{KEY}.path"
    if section.eval_path:
        eval_key = f"{KEY}.eval_path"
        evaluation = _dataset(section.eval_path, eval_key, section, tokenizers, vocab_size, 0.0)[0]
    train = _samples(train, f"{KEY}.seq_length", "training", section.seq_length)
    if evaluation is not None:
        evaluation = _samples(evaluation, eval_key, "evaluation", section.seq_length)
    return TrainingData(train=train, eval=evaluation, eos_id=eos_id, summary=account, finetuning=finetuning)


def _blend(section: DataSection, tokenizers: TokenizerSource, vocab_size: int) -> TrainingData:
    """Each entry packed as a dataset of its own, with its evaluation samples (its eval_path, else its held-out
    `eval_fraction`), then blended."""
    _check_token_types(section)
    parts, evals, eos_ids, finetuning = [], {}, [], False
    names = part_names([entry["path"] for entry in section.blend])
    for i, (entry, name) in enumerate(zip(section.blend, names)):
        key = f"{KEY}.blend[{i}]"
        train, held, account, eos_id, tuning = _dataset(entry["path"], f"{key}.path", section, tokenizers,
                                                        vocab_size, 0.0 if entry.get("eval_path") else
                                                        section.eval_fraction)
        if entry.get("eval_path"):
            held = _dataset(entry["eval_path"], f"{key}.eval_path", section, tokenizers, vocab_size, 0.0)[0]
        parts.append(BlendPart(name, _samples(train, f"{key}.path", "training", section.seq_length), entry["weight"],
                               account))
        if held is not None:
            evals[name] = _samples(held, f"{key}.eval_path" if entry.get("eval_path") else f"{key}.path",
                                   "evaluation", section.seq_length)
        eos_ids.append(eos_id)
        finetuning |= tuning
    evaluation = None
    if section.eval_path:
        evaluation = _samples(_dataset(section.eval_path, f"{KEY}.eval_path", section, tokenizers, vocab_size,
                                       0.0)[0], f"{KEY}.eval_path", "evaluation", section.seq_length)
    return TrainingData(train=BlendedSamples(parts), eval=evaluation,
                        eos_id=next((e for e in eos_ids if e is not None), None),
                        summary=f"a blend of {len(parts)} datasets", finetuning=finetuning, evals=evals)


def _check_token_types(section: DataSection) -> None:
    """Megatron's preprocessing stores ids as uint16 below a 65,500-token vocabulary and int32 above: indexed datasets
    of different token types were made with different tokenizers, whose ids mean different tokens."""
    typed = [(i, entry["path"], IndexedCorpus(entry["path"]).dtype) for i, entry in enumerate(section.blend)
             if _is_indexed(entry["path"], f"{KEY}.blend[{i}].path")]
    for i, path, dtype in typed[1:]:
        if dtype != typed[0][2]:
            raise ConfigError(f"{KEY}.blend[{i}].path: {path} stores {np.dtype(dtype).name} token ids and "
                              f"{typed[0][1]} (blend[{typed[0][0]}]) {np.dtype(typed[0][2]).name}: indexed datasets "
                              "made with different tokenizers cannot be blended")
