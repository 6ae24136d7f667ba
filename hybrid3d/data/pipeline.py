"""From a `hybrid3d.data` config section to packed train/eval token streams.

Local files are read with the `datasets` library (text, json/jsonl, parquet, arrow, or a
`save_to_disk` folder) and tokenized with `Dataset.map` (cached by `datasets`). A dataset that
already has an `input_ids` column is used as is. The packed stream is cached as a .npy file and
memory-mapped, so every rank reads the same tokens without holding its own copy.
"""

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from hybrid3d.config.sections import DataSection
from hybrid3d.data.builtin import builtin_corpus_path, cache_dir
from hybrid3d.data.packing import PackedSamples
from hybrid3d.errors import ConfigError

BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
            ".arrow": "arrow"}
KEY = "hybrid3d.data"


@dataclass
class TrainingData:
    train: PackedSamples
    eval: Optional[PackedSamples]
    eos_id: int


def _load_documents(path: str, key: str):
    import datasets

    if os.path.isdir(path):
        if not (Path(path, "dataset_info.json").exists() or Path(path, "dataset_dict.json").exists()
                or Path(path, "state.json").exists()):
            raise ConfigError(f"{key}: {path} is a folder but not a datasets save_to_disk folder")
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ConfigError(f"{key}: {path} has splits {sorted(loaded)} but no 'train'")
            loaded = loaded["train"]
        return loaded
    files = sorted(glob.glob(path))
    if not files:
        raise ConfigError(f"{key}: no file matches {path}")
    if all(os.path.getsize(f) == 0 for f in files):
        raise ConfigError(f"{key}: {path} holds no documents (empty file)")
    suffixes = {Path(f).suffix.lower() for f in files}
    builders = {BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) != 1:
        raise ConfigError(f"{key}: cannot read {', '.join(sorted(suffixes))} files "
                          f"(supported: {', '.join(sorted(BUILDERS))}, one kind at a time)")
    try:
        return datasets.load_dataset(builders.pop(), data_files=files, split="train")
    except Exception as e:  # datasets raises many types for malformed files
        raise ConfigError(f"{key}: cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None


def _tokenize(documents, text_field: str, tokenizer, key: str):
    if "input_ids" in documents.column_names:
        return documents
    if text_field not in documents.column_names:
        raise ConfigError(f"{KEY}.text_field: column '{text_field}' is not in {key} "
                          f"(columns: {', '.join(documents.column_names)})")
    if tokenizer is None:
        raise ConfigError(f"{KEY}.tokenizer: {key} has text but no tokenizer is available")

    def encode(batch):
        return {"input_ids": tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]}

    return documents.map(encode, batched=True, remove_columns=documents.column_names, desc="tokenizing")


def _pack(documents, eos_id: int) -> np.ndarray:
    """Concatenate documents in order, EOS after each: (N,) int32 or int64."""
    parts = []
    for ids in documents.with_format("numpy")["input_ids"]:
        parts.append(np.asarray(ids))
        parts.append(np.asarray([eos_id]))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return tokens.astype(np.int32 if tokens.size == 0 or tokens.max() < 2**31 - 1 else np.int64)


def _cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _ordered_documents(path: str, key: str, section: DataSection):
    """The documents of `path`, after the optional seeded shuffle."""
    documents = _load_documents(path, key)
    if len(documents) == 0:
        raise ConfigError(f"{key}: {path} holds no documents")
    return documents.shuffle(seed=section.seed) if section.shuffle else documents


def _packed_stream(documents, key: str, section: DataSection, tokenizer, tokenizer_id: str,
                   eos_id: int) -> np.ndarray:
    cache = cache_dir() / "packed" / (_cache_key(documents._fingerprint, tokenizer_id, section.text_field, eos_id)
                                      + ".npy")
    if not cache.exists():
        tokens = _pack(_tokenize(documents, section.text_field, tokenizer, key), eos_id)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, tokens)
        os.replace(tmp, cache)
    return np.load(cache, mmap_mode="r")


def _samples(tokens: np.ndarray, key: str, what: str, seq_length: int) -> PackedSamples:
    samples = PackedSamples(tokens, seq_length)
    if len(samples) == 0:
        raise ConfigError(f"{key}: the {what} data has {len(tokens)} tokens, fewer than "
                          f"seq_length + 1 = {seq_length + 1}")
    return samples


def build_training_data(section: DataSection, tokenizer, tokenizer_id: str, eos_id: int) -> TrainingData:
    """Packed train (and eval) samples. `tokenizer` may be None when the data has `input_ids`."""
    path = section.path or str(builtin_corpus_path())
    documents = _ordered_documents(path, f"{KEY}.path", section)

    def pack(docs, key):
        return _packed_stream(docs, key, section, tokenizer, tokenizer_id, eos_id)

    evaluation = None
    if section.eval_path:
        eval_key = f"{KEY}.eval_path"
        evaluation = pack(_ordered_documents(section.eval_path, eval_key, section), eval_key)
    elif section.eval_fraction:
        count = len(documents)
        held_out = max(1, int(round(count * section.eval_fraction)))
        if held_out >= count:
            raise ConfigError(f"{KEY}.eval_fraction: {section.eval_fraction} of {count} documents leaves none "
                              "for training")
        eval_key = f"{KEY}.path"
        evaluation = pack(documents.select(range(count - held_out, count)), eval_key)
        documents = documents.select(range(count - held_out))
    train = _samples(pack(documents, f"{KEY}.path"), f"{KEY}.seq_length", "training", section.seq_length)
    if evaluation is not None:
        evaluation = _samples(evaluation, eval_key, "evaluation", section.seq_length)
    return TrainingData(train=train, eval=evaluation, eos_id=eos_id)
