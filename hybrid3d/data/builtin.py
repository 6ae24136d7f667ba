"""The built-in corpus, conversations and tokenizer: the demos need no download.

The corpus is the docstrings of the running Python's standard library (every installation has
them); the tokenizer is a byte-level BPE trained on that corpus. The conversations (for the chat
fine-tuning demo) ask what a standard-library function does and answer with its docstring's first
paragraph. All are built once and cached under $HYBRID3D_CACHE (default ~/.cache/hybrid3d), keyed by
the Python version.
"""

import ast
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
BUILTIN_VOCAB_SIZE = 4096
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "__pycache__",
                "ensurepip", "pydoc_data", "dist-packages"}
MIN_DOC_CHARS = 40


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRID3D_CACHE", Path.home() / ".cache" / "hybrid3d"))


def _version_tag() -> str:
    return f"py{sys.version_info.major}.{sys.version_info.minor}"


def _stdlib_docstrings():
    """Docstrings of modules, classes and functions, in a fixed (sorted) file order."""
    root = sysconfig.get_paths()["stdlib"]
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(directory, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= MIN_DOC_CHARS:
                        yield doc


def _stdlib_functions():
    """(dotted name, first docstring paragraph) of public module-level functions, in a fixed file order."""
    root = sysconfig.get_paths()["stdlib"]
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py") or name.startswith("_"):
                continue
            module = os.path.relpath(Path(directory, name[:-3]), root).replace(os.sep, ".")
            try:
                tree = ast.parse(Path(directory, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                    doc = (ast.get_docstring(node) or "").split("\n\n")[0].strip()
                    if len(doc) >= MIN_DOC_CHARS:
                        yield f"{module}.{node.name}", " ".join(doc.split())


def builtin_chat_path() -> Path:
    """A JSON-lines file of {"messages": [...]}: a user asks what a standard-library function does, the assistant
    answers with its docstring's first paragraph; every third conversation opens with a system turn."""
    path = cache_dir() / f"stdlib-chat-{_version_tag()}.jsonl"
    if not path.exists():
        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                for index, (name, answer) in enumerate(_stdlib_functions()):
                    turns = [{"role": "user", "content": f"What does `{name}` do?"},
                             {"role": "assistant", "content": answer}]
                    if index % 3 == 0:
                        turns.insert(0, {"role": "system", "content": "You answer questions about Python."})
                    f.write(json.dumps({"messages": turns}) + "\n")

        _atomic_write(path, write)
    return path


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def builtin_corpus_path() -> Path:
    """A JSON-lines file of {"text": docstring}, built on first use (about 1.5 MB, 3 s)."""
    path = cache_dir() / f"stdlib-docstrings-{_version_tag()}.jsonl"
    if not path.exists():
        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                for doc in _stdlib_docstrings():
                    f.write(json.dumps({"text": doc}) + "\n")

        _atomic_write(path, write)
    return path


def builtin_tokenizer_path() -> Path:
    """A byte-level BPE tokenizer (PreTrainedTokenizerFast folder) trained on the corpus."""
    path = cache_dir() / f"tokenizer-bpe{BUILTIN_VOCAB_SIZE}-{_version_tag()}"
    if not (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        texts = [json.loads(line)["text"] for line in builtin_corpus_path().read_text(encoding="utf-8").splitlines()]
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=BUILTIN_VOCAB_SIZE, special_tokens=[EOS_TOKEN],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tokenizer.train_from_iterator(texts, trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
        fast.save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return path
