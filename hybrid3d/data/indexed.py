"""Megatron's indexed dataset on disk: a `.bin` of tokens and an `.idx` of where each document lies.

The format (megatron-core `megatron/core/datasets/indexed_dataset.py`, version 1), all little-endian:

    P.idx  b"MMIDIDX\\x00\\x00"  9-byte magic
           u64 version = 1
           u8  dtype code        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
           u64 S                 sequences
           u64 D + 1             entries of the document index
           i32[S]                tokens per sequence
           i64[S]                byte offset of each sequence in P.bin
           i64[D + 1]            document index: document d is sequences [doc[d], doc[d + 1]), doc[0] = 0, doc[D] = S
    P.bin  the sequences' tokens, back to back, in the dtype above

Megatron-LM's preprocessing writes one sequence per document unless sentences are split; a document's tokens are
its sequences' tokens concatenated. Nothing is read into memory: both files are memory-mapped and a document is a
view of the `.bin`. Fine-tuning data keeps its loss mask in a sidecar `P.learn.bin` (`learn_path`): one uint8 per
token of `P.bin`, at the same position, 1 where the token is a target the loss counts; megatron-core ignores it.
"""

import os
import struct
from pathlib import Path
from typing import Optional

import numpy as np

from hybrid3d.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document-index entries
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
TOKEN_DTYPES = (np.uint16, np.int32, np.int64, np.uint8, np.int16, np.int8)
CHUNK = 1 << 20  # entries per pass of a scan: a few MiB at a time, whatever the corpus
WRITE_CHUNK = 1 << 16  # lengths per pass of writing the index: under 2 MiB, so the preprocessor's peak stays flat


def idx_path(prefix) -> str:
    return f"{prefix}.idx"


def bin_path(prefix) -> str:
    return f"{prefix}.bin"


def learn_path(prefix) -> str:
    return f"{prefix}.learn.bin"


def is_indexed_prefix(path: str) -> bool:
    """Whether `path` names an indexed dataset: P.idx or P.bin exists (a missing partner is reported on reading)."""
    return os.path.isfile(idx_path(path)) or os.path.isfile(bin_path(path))


def ids_fit(dtype, vocab_size: int) -> bool:
    """Whether every value of `dtype` is a token id of the vocabulary (no id needs checking)."""
    return np.iinfo(dtype).min >= 0 and np.iinfo(dtype).max < vocab_size


def token_dtype(vocab_size: int):
    """Megatron's choice: uint16 when every id fits (below 65500), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedCorpus:
    """The documents of P.bin/P.idx, memory-mapped; `where` names the config key in errors."""

    def __init__(self, prefix: str, where: str = "hybrid3d.data.path"):
        self.prefix, self.where = str(prefix), where
        index, data = idx_path(prefix), bin_path(prefix)
        for path in (index, data):
            if not os.path.isfile(path):
                raise ConfigError(f"{where}: {path} is missing (an indexed dataset needs both {Path(data).name} "
                                  f"and {Path(index).name})")
        self.dtype, sequences, entries, offset = _read_header(index, where)
        itemsize = np.dtype(self.dtype).itemsize
        expected = offset + sequences * 12 + entries * 8
        if os.path.getsize(index) < expected:
            raise ConfigError(f"{where}: {index} is truncated ({os.path.getsize(index)} bytes, its header promises "
                              f"{expected})")
        raw = np.memmap(index, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(raw, np.int32, sequences, offset)
        self.sequence_pointers = np.frombuffer(raw, np.int64, sequences, offset + sequences * 4)
        self.document_index = np.frombuffer(raw, np.int64, entries, offset + sequences * 12)
        # True when document d is sequence d (Megatron's preprocessing without sentence splits, and hybrid3d's
        # writer): a document's offset is then its sequence's pointer, found by one search of the pointers
        self.one_sequence_each = _check_document_index(self.document_index, sequences, index, where)
        self.num_tokens = _check_contiguous(self.sequence_lengths, self.sequence_pointers, itemsize, index, where)
        size = os.path.getsize(data)
        if size < self.num_tokens * itemsize:
            raise ConfigError(f"{where}: {data} holds {size} bytes, fewer than the {self.num_tokens * itemsize} "
                              f"({self.num_tokens} tokens of {np.dtype(self.dtype).name}) its index {index} describes")
        # the whole .bin as one token array, zero-copy: documents are stored back to back
        self.tokens = (np.memmap(data, mode="r", dtype=self.dtype, shape=(self.num_tokens,)) if self.num_tokens
                       else np.zeros(0, dtype=self.dtype))

    def __len__(self) -> int:
        return len(self.document_index) - 1

    def document_offsets(self, first: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """(n + 1,) int64 token offsets in `tokens` of documents first..stop-1 and of the end of the last one."""
        stop = len(self) if stop is None else stop
        sequences = np.asarray(self.document_index[first:stop + 1])
        inside = sequences < len(self.sequence_pointers)
        offsets = np.full(len(sequences), self.num_tokens, dtype=np.int64)
        offsets[inside] = self.sequence_pointers[sequences[inside]] // np.dtype(self.dtype).itemsize
        return offsets

    def document(self, d: int) -> np.ndarray:
        start, end = self.document_offsets(d, d + 1)
        return self.tokens[start:end]

    def learn_mask(self) -> Optional[np.ndarray]:
        """The sidecar's (num_tokens,) uint8 mask, memory-mapped; None without one."""
        path = learn_path(self.prefix)
        if not os.path.isfile(path):
            return None
        if os.path.getsize(path) != self.num_tokens:
            raise ConfigError(f"{self.where}: {path} holds {os.path.getsize(path)} bytes, not one per token of "
                              f"{bin_path(self.prefix)} ({self.num_tokens})")
        return np.memmap(path, mode="r", dtype=np.uint8) if self.num_tokens else np.zeros(0, dtype=np.uint8)

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id, scanned in chunks ((0, -1) when there is no token)."""
        low, high = 0, -1
        for start in range(0, self.num_tokens, CHUNK):
            chunk = np.asarray(self.tokens[start:start + CHUNK])
            low, high = (int(chunk.min()), int(chunk.max())) if start == 0 else (min(low, int(chunk.min())),
                                                                                  max(high, int(chunk.max())))
        return low, high

    def check_vocabulary(self, vocab_size: int, token_range: Optional[tuple] = None) -> None:
        """Every id in [0, vocab_size), from `token_range` (else a scan; none when the dtype cannot hold a bad id)."""
        if ids_fit(self.dtype, vocab_size):
            return
        low, high = token_range or self.token_range()
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise ConfigError(f"{self.where}: {bin_path(self.prefix)} holds token id {bad}, outside the model's "
                              f"vocabulary (vocab_size {vocab_size})")


def _read_header(index: str, where: str):
    with open(index, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size or not head.startswith(MAGIC):
        raise ConfigError(f"{where}: {index} is not a Megatron indexed-dataset index (no {MAGIC!r} header)")
    _, version, code, sequences, entries = HEADER.unpack(head)
    if version != VERSION:
        raise ConfigError(f"{where}: {index} has index version {version}; version {VERSION} is read")
    dtype = CODES.get(code)
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"{where}: {index} has dtype code {code}"
                          f"{f' ({np.dtype(dtype).name})' if dtype else ''}, not an integer token type")
    if entries < 1:
        raise ConfigError(f"{where}: {index} has an empty document index")
    return dtype, sequences, entries, HEADER.size


def _check_document_index(documents: np.ndarray, sequences: int, index: str, where: str) -> bool:
    """Whether every document is one sequence, after checking the index runs 0..sequences without decreasing."""
    if documents[0] != 0 or documents[-1] != sequences:
        raise ConfigError(f"{where}: {index}: its document index runs {documents[0]}..{documents[-1]}, not 0.."
                          f"{sequences} (its sequences)")
    one_each = True
    for start in range(0, len(documents) - 1, CHUNK):
        steps = np.diff(documents[start:start + CHUNK + 1])
        if np.any(steps < 0):
            raise ConfigError(f"{where}: {index}: its document index decreases")
        one_each = one_each and bool(np.all(steps == 1))
    return one_each


def _check_contiguous(lengths: np.ndarray, pointers: np.ndarray, itemsize: int, index: str, where: str) -> int:
    """The total token count, after checking that sequence i starts where i - 1 ends (how megatron-core writes);
    in chunks, so the check holds at most CHUNK offsets."""
    total = 0
    for start in range(0, len(lengths), CHUNK):
        chunk = np.asarray(lengths[start:start + CHUNK], dtype=np.int64)
        if np.any(chunk < 0):
            raise ConfigError(f"{where}: {index} holds a negative sequence length")
        if not np.array_equal(_pointers(chunk, total, itemsize), pointers[start:start + CHUNK]):
            raise ConfigError(f"{where}: {index}: its sequences are not stored back to back in the .bin")
        total += int(chunk.sum())
    return total


def _pointers(lengths: np.ndarray, first: int, itemsize: int) -> np.ndarray:
    """The byte offsets of sequences of `lengths` (int64) tokens stored back to back from token `first`."""
    ends = np.cumsum(lengths)
    ends -= lengths  # each sequence's start, in place (no third array)
    ends += first
    ends *= itemsize
    return ends


class IndexedWriter:
    """Writes P.bin/P.idx (and P.learn.bin when `learn` is set) document by document, in constant memory: tokens
    go to the .bin as they come, lengths to a scratch file, and `finalize` streams the index. Everything is
    written under temporary names and renamed into place at the end, so an interrupted write leaves no dataset."""

    def __init__(self, prefix, dtype, learn: bool = False):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        if self.dtype.type not in TOKEN_DTYPES:
            raise ValueError(f"token dtype {self.dtype} is not one of {[np.dtype(d).name for d in TOKEN_DTYPES]}")
        self._tmp = f"{self.prefix}.tmp{os.getpid()}"
        self._bin = open(bin_path(self._tmp), "wb")
        self._lengths = open(f"{self._tmp}.lengths", "wb")
        self._learn = open(learn_path(self._tmp), "wb") if learn else None
        self.documents = self.tokens = 0

    def add_document(self, tokens, learn=None) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < np.iinfo(self.dtype).min or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit {self.dtype.name}")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.write(np.int32(tokens.size).tobytes())
        if (learn is not None) != (self._learn is not None):
            raise ValueError("a loss mask goes with every document of a writer made with learn=True, and only there")
        if self._learn is not None:
            mask = np.asarray(learn, dtype=np.uint8)
            if mask.shape != tokens.shape:
                raise ValueError(f"a loss mask of {mask.size} entries for {tokens.size} tokens")
            self._learn.write(mask.tobytes())
        self.documents += 1
        self.tokens += tokens.size

    def finalize(self) -> None:
        for f in (self._bin, self._lengths, self._learn):
            if f is not None:
                f.close()
        # the index streamed from the scratch file WRITE_CHUNK lengths at a time, read (not mapped: mapped pages would
        # stay resident, and count, until the end) in two passes: the lengths, then the pointers
        with open(idx_path(self._tmp), "wb") as f, open(f"{self._tmp}.lengths", "rb") as scratch:
            f.write(HEADER.pack(MAGIC, VERSION, _code(self.dtype), self.documents, self.documents + 1))
            while (chunk := np.fromfile(scratch, np.int32, WRITE_CHUNK)).size:
                chunk.tofile(f)
            scratch.seek(0)
            offset = 0
            while (chunk := np.fromfile(scratch, np.int32, WRITE_CHUNK).astype(np.int64)).size:
                _pointers(chunk, offset, self.dtype.itemsize).tofile(f)
                offset += int(chunk.sum())
            for start in range(0, self.documents + 1, WRITE_CHUNK):  # one sequence per document
                np.arange(start, min(start + WRITE_CHUNK, self.documents + 1), dtype=np.int64).tofile(f)
        os.remove(f"{self._tmp}.lengths")
        if self._learn is not None:
            os.replace(learn_path(self._tmp), learn_path(self.prefix))
        os.replace(bin_path(self._tmp), bin_path(self.prefix))
        os.replace(idx_path(self._tmp), idx_path(self.prefix))  # last: the prefix counts as written once it exists

    def abort(self) -> None:
        """Close and remove what was written."""
        for f in (self._bin, self._lengths, self._learn):
            if f is not None:
                f.close()
        for path in (bin_path(self._tmp), idx_path(self._tmp), learn_path(self._tmp), f"{self._tmp}.lengths"):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.finalize()
        else:
            self.abort()


def _code(dtype: np.dtype) -> int:
    return next(code for code, d in CODES.items() if np.dtype(d) == dtype)
