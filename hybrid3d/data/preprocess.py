"""`python -m hybrid3d.data.preprocess`: tokenize files into a Megatron indexed dataset (P.bin + P.idx), which
`hybrid3d.data.path` and `data.blend` read memory-mapped and megatron-core's `IndexedDataset` reads as well.

    python -m hybrid3d.data.preprocess --input 'corpus/*.jsonl' --output-prefix data/corpus \\
        [--tokenizer DIR] [--format text|chat|prompt_completion] [--text-field text] [--chat-template FILE] \\
        [--append-eos] [--workers N]

Streaming: rows are read, encoded and written a batch at a time, at most two batches per worker in flight, so
memory does not grow with the corpus. With N > 1 workers, N processes encode batches while this one writes them in
input order (the output does not depend on N). Fine-tuning rows (`chat`, `prompt_completion`, `input_ids` with
`labels` or `loss_mask`) keep their loss masks in P.learn.bin (`indexed.py`). An existing P.bin or P.idx is never
overwritten; an interrupted run leaves nothing under P.

Exit codes: 0 done, 2 a user error (one line naming the flag or file; nothing written), 1 anything else.
"""

import argparse
import multiprocessing
import os
import queue
import sys
import time
from dataclasses import dataclass

from hybrid3d.config.sections import DATA_FORMATS
from hybrid3d.data.formats import is_finetuning
from hybrid3d.data.indexed import IndexedWriter, bin_path, idx_path, learn_path, token_dtype
from hybrid3d.data.rows import Encoder, batches, input_files
from hybrid3d.errors import ConfigError, UserError

BATCH_ROWS = 256
IN_FLIGHT_PER_WORKER = 2


@dataclass
class Written:
    prefix: str
    documents: int
    tokens: int
    dtype: str
    learn: bool
    seconds: float


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybrid3d.data.preprocess",
                                     description="Tokenize files into a Megatron indexed dataset (P.bin + P.idx).")
    parser.add_argument("--input", required=True, nargs="+", help="files or globs: .jsonl/.json (JSON lines), "
                                                                  ".txt (a document per line), .parquet")
    parser.add_argument("--output-prefix", required=True, help="P: writes P.bin, P.idx (and P.learn.bin)")
    parser.add_argument("--tokenizer", help="HF tokenizer folder (default: hybrid3d's built-in tokenizer)")
    parser.add_argument("--format", choices=DATA_FORMATS, default="text", help="as hybrid3d.data.format")
    parser.add_argument("--text-field", default="text", help="the column of text for --format text")
    parser.add_argument("--chat-template", help="a Jinja chat-template file for --format chat")
    parser.add_argument("--append-eos", action="store_true", help="end each document with the tokenizer's EOS "
                                                                  "(Megatron's GPT dataset adds nothing between them)")
    parser.add_argument("--workers", type=int, default=1, help="encoding processes (default 1: this one)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def load_tokenizer(directory, chat_template):
    from transformers import AutoTokenizer

    from hybrid3d.data.builtin import builtin_tokenizer_path

    directory = directory or str(builtin_tokenizer_path())
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # transformers raises OSError/ValueError/... for unreadable folders
        raise ConfigError(f"--tokenizer: cannot load a tokenizer from {directory}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if chat_template:
        if not os.path.isfile(chat_template):
            raise ConfigError(f"--chat-template: {chat_template} is not a file")
        with open(chat_template, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"--tokenizer: {directory} has no EOS token")
    return tokenizer


def preprocess(inputs: list[str], prefix: str, tokenizer_dir=None, data_format: str = "text", text_field: str = "text",
               chat_template=None, append_eos: bool = False, workers: int = 1, progress: bool = True) -> Written:
    started = time.perf_counter()
    for path in (bin_path(prefix), idx_path(prefix), learn_path(prefix)):
        if os.path.exists(path):
            raise ConfigError(f"--output-prefix: {path} exists; remove it or choose another prefix")
    if not os.path.isdir(os.path.dirname(os.path.abspath(prefix))):
        raise ConfigError(f"--output-prefix: the folder of {prefix} does not exist")
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if append_eos and data_format != "text":
        raise ConfigError(f"--append-eos: format {data_format!r} ends its examples itself (the completion's EOS, the "
                          "chat template's end of turn)")
    files = input_files(inputs)
    tokenizer = load_tokenizer(tokenizer_dir, chat_template)
    encoder = Encoder(tokenizer, data_format, text_field, append_eos)
    stream = batches(files, text_field, BATCH_ROWS)
    head = next(stream, None)
    if head is None or not head[2]:
        raise ConfigError(f"--input: {', '.join(inputs)} holds no rows")
    learn = is_finetuning(list(head[2][0]), data_format)
    total = sum(os.path.getsize(f) for f in files)
    pool = Workers(encoder, workers)
    try:
        with IndexedWriter(prefix, token_dtype(len(tokenizer)), learn=learn) as writer, \
                _progress(total, progress) as bar:
            _write(pool.encoded(_chain(head, stream)), writer, bar, learn, started)
    finally:
        pool.close()
    return Written(prefix, writer.documents, writer.tokens, writer.dtype.name, learn, time.perf_counter() - started)


def _write(encoded, writer: IndexedWriter, bar, learn: bool, started: float) -> None:
    for (path, first, _, consumed), documents in encoded:
        for ids, mask in documents:
            if (mask is not None) != learn:
                raise ConfigError(f"--input: {path} near row {first} is {'' if mask is not None else 'not '}"
                                  f"fine-tuning data (a loss mask) unlike the rows before it")
            writer.add_document(ids, mask)
        bar.update(consumed)
        bar.set_postfix_str(f"{writer.tokens / (time.perf_counter() - started):,.0f} tokens/s", refresh=False)


def _chain(head, stream):
    yield head
    yield from stream


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="preprocessing", disable=not enabled, file=sys.stderr)


class Workers:
    """`count` processes encoding batches (none when count is 1: this process encodes); started before anything
    else runs threads (a progress bar), since they are forked."""

    def __init__(self, encoder: Encoder, count: int):
        self.encoder, self.processes = encoder, []
        if count > 1:
            context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                                  else "spawn")
            self.tasks, self.results = context.Queue(), context.Queue()
            self.processes = [context.Process(target=_work, args=(encoder, self.tasks, self.results), daemon=True)
                              for _ in range(count)]
            for p in self.processes:
                p.start()

    def encoded(self, stream):
        """(batch, its documents) in input order, at most IN_FLIGHT_PER_WORKER batches per worker outstanding."""
        if not self.processes:
            for path, first, rows, consumed in stream:
                yield (path, first, rows, consumed), self.encoder(path, first, rows)
            return
        pending, done, next_out = {}, {}, 0
        for number, batch in enumerate(stream):
            pending[number] = batch
            self.tasks.put((number, batch[0], batch[1], batch[2]))
            while len(pending) >= IN_FLIGHT_PER_WORKER * len(self.processes):
                next_out = yield from self._ready(pending, done, next_out)
        while pending:
            next_out = yield from self._ready(pending, done, next_out)

    def _ready(self, pending: dict, done: dict, next_out: int):
        """Wait for one result, then yield every batch next in order; returns the next batch number to yield."""
        while True:
            try:
                number, documents, error = self.results.get(timeout=1.0)
                break
            except queue.Empty:
                if not all(p.is_alive() for p in self.processes):
                    raise RuntimeError("a preprocessing worker died") from None
        if error is not None:
            raise ConfigError(error)
        done[number] = documents
        while next_out in done:
            yield pending.pop(next_out), done.pop(next_out)
            next_out += 1
        return next_out

    def close(self) -> None:
        for p in self.processes:
            p.terminate()
            p.join()


def _work(encoder: Encoder, tasks, results) -> None:
    """A worker: encode batches until the parent ends it; a user error goes back as its message."""
    while True:
        number, path, first, rows = tasks.get()
        try:
            results.put((number, encoder(path, first, rows), None))
        except UserError as e:
            results.put((number, None, str(e)))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = preprocess(args.input, args.output_prefix, args.tokenizer, args.format, args.text_field,
                             args.chat_template, args.append_eos, args.workers, progress=not args.quiet)
    except UserError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    files = f"{bin_path(written.prefix)}, {idx_path(written.prefix)}" + (
        f", {learn_path(written.prefix)}" if written.learn else "")
    print(f"wrote {files}: {written.documents:,} documents, {written.tokens:,} tokens ({written.dtype}) in "
          f"{written.seconds:.1f} s ({written.tokens / max(written.seconds, 1e-9):,.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
