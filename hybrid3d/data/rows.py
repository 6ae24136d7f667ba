"""Rows streamed from input files in batches, and their encoding into documents, for `preprocess.py`.

Files are read a batch of rows at a time, never whole: JSON lines (`.jsonl`, `.json`: one object per line), plain
text (`.txt`, `.text`: each line a document in `text_field`, as the `datasets` text builder reads it) and parquet
(row groups through pyarrow). Rows are encoded by the same rules as the training path (`formats.row_encoder`), so
a preprocessed corpus holds what `data.path` would have tokenized from the same files.
"""

import glob
import json
import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from hybrid3d.data.formats import row_encoder
from hybrid3d.errors import ConfigError

READERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}


def input_files(patterns: list[str]) -> list[str]:
    """The files the --input patterns name, each pattern's matches sorted, in the order given."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise ConfigError(f"--input: no file matches {pattern}")
        for path in matches:
            if Path(path).suffix.lower() not in READERS:
                raise ConfigError(f"--input: cannot read {path} (supported: {', '.join(READERS)})")
        files += matches
    return files


def batches(files: list[str], text_field: str, size: int) -> Iterator[tuple[str, int, list, int]]:
    """(file, number of its first row, rows, bytes of input they account for), at most `size` rows each."""
    for path in files:
        kind = READERS[Path(path).suffix.lower()]
        if kind == "parquet":
            yield from _parquet(path, size)
            continue
        rows, first, consumed = [], 0, 0
        with open(path, "rb") as f:
            for number, line in enumerate(f):
                consumed += len(line)
                rows.append(_json_row(line, path, number) if kind == "json" else
                            {text_field: line.decode("utf-8").rstrip("\r\n")})
                if len(rows) == size:
                    yield path, first, rows, consumed
                    rows, first, consumed = [], number + 1, 0
        if rows or consumed:
            yield path, first, rows, consumed


def _json_row(line: bytes, path: str, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--input: {path} line {number + 1} is not JSON ({e.msg}); JSON input is one object per "
                          "line") from None
    if not isinstance(row, dict):
        raise ConfigError(f"--input: {path} line {number + 1} is not a JSON object")
    return row


def _parquet(path: str, size: int):
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    total, first = max(table.metadata.num_rows, 1), 0
    for batch in table.iter_batches(batch_size=size):
        rows = batch.to_pylist()
        yield path, first, rows, int(os.path.getsize(path) * len(rows) / total)
        first += len(rows)


class Encoder:
    """Rows -> [(input_ids int64, learn uint8 or None)], by `formats.row_encoder`; EOS appended with `append_eos`.
    Picklable with its tokenizer, so worker processes take it whole."""

    def __init__(self, tokenizer, data_format: str, text_field: str, append_eos: bool):
        self.tokenizer, self.format, self.text_field, self.append_eos = tokenizer, data_format, text_field, append_eos
        self.eos_id, self.vocab_size = tokenizer.eos_token_id, len(tokenizer)

    def __call__(self, path: str, first: int, rows: list) -> list[tuple[np.ndarray, Optional[np.ndarray]]]:
        encoders, out = {}, []
        for number, row in enumerate(rows, start=first):
            columns = tuple(row)
            if columns not in encoders:
                encoders[columns] = row_encoder(list(columns), self.format, self.text_field, self.tokenizer,
                                                self.eos_id, path)
            try:
                encoded = encoders[columns](row, number)
            except KeyError as e:
                raise ConfigError(f"--input: {path} row {number} has no {e.args[0]!r}") from None
            ids = np.asarray(encoded["input_ids"], dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise ConfigError(f"--input: {path} row {number} holds token id {int(ids.max())}, outside the "
                                  f"tokenizer's vocabulary ({self.vocab_size}): give --tokenizer of the model")
            if self.append_eos:
                ids = np.append(ids, self.eos_id)
            learn = encoded.get("learn")
            out.append((ids, None if learn is None else np.asarray(learn, dtype=np.uint8)))
        return out
