"""`python -m hybrid3d.convert {hf2hybrid,hybrid2hf} ...`: argument parsing and one call each.

Exit codes: 0 done, 2 user error (one line `error: ...` naming the file, tensor or config field;
nothing is written), 1 anything else (a bug: the traceback is kept).
"""

import argparse
import sys

DTYPES = ("bf16", "fp32")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybrid3d.convert",
                                     description="Convert Llama checkpoints between Hugging Face and hybrid3d form.")
    commands = parser.add_subparsers(dest="command", required=True)

    to_hybrid = commands.add_parser("hf2hybrid", help="HF folder -> module-only DeepSpeed checkpoint at a TP/PP layout")
    to_hybrid.add_argument("--hf-model", required=True, help="folder with config.json and *.safetensors")
    to_hybrid.add_argument("--out", required=True, help="checkpoint folder to create (must not exist or be empty)")
    to_hybrid.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    to_hybrid.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    to_hybrid.add_argument("--dtype", choices=DTYPES, help="weight dtype to store (default: as in the HF files)")
    to_hybrid.add_argument("--vocab-pad-multiple", type=positive_int, default=128,
                           help="pad the vocabulary to a multiple of tp * this "
                                "(the trainer's hybrid3d.vocab_pad_multiple)")
    to_hybrid.add_argument("--allow-pickle", action="store_true",
                           help="read pytorch_model.bin files (pickles: only for checkpoints you trust)")

    to_hf = commands.add_parser("hybrid2hf", help="hybrid3d/DeepSpeed checkpoint -> HF folder")
    to_hf.add_argument("--checkpoint", required=True, help="checkpoint folder (holding `latest`) or a tag folder")
    to_hf.add_argument("--out", required=True, help="HF folder to create (must not exist or be empty)")
    to_hf.add_argument("--tag", help="checkpoint tag (default: the one in `latest`)")
    to_hf.add_argument("--dtype", choices=DTYPES, help="weight dtype to write (default: as stored)")
    to_hf.add_argument("--hf-config", help="HF folder to take config.json and tokenizer files from "
                                           "(default: stored in the checkpoint or its hf/ folder)")
    to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    to_hf.add_argument("--lora", choices=["adapter", "merged"],
                       help="a LoRA checkpoint: write a PEFT adapter folder, or the HF model with the adapters merged "
                            "into the base of --hf-config")
    to_hf.add_argument("--allow-pickle", action="store_true",
                       help="load model-state files holding arbitrary objects (only for checkpoints you trust)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # Imported after parsing so `--help` and argument errors answer without loading torch.
    import torch

    from hybrid3d.convert.hf_to_hybrid import hf_to_hybrid
    from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf
    from hybrid3d.errors import UserError

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype)
    try:
        if args.command == "hf2hybrid":
            result = hf_to_hybrid(args.hf_model, args.out, tp=args.tp, pp=args.pp, dtype=dtype,
                                  allow_pickle=args.allow_pickle, vocab_pad_multiple=args.vocab_pad_multiple)
            if result.skipped:
                layers = sorted({int(name.split(".")[2]) for name in result.skipped})  # model.layers.<i>.
                print(f"skipped layer {', '.join(map(str, layers))} ({len(result.skipped)} tensors): DeepSeek-V3's "
                      "multi-token prediction, not part of the causal LM (transformers skips it too)")
            print(f"wrote {result.out_dir}: {result.files} files at tp={result.layout.tp} pp={result.layout.pp} "
                  f"in {result.seconds:.1f} s")
        else:
            result = hybrid_to_hf(args.checkpoint, args.out, dtype=dtype, tag=args.tag, hf_config_dir=args.hf_config,
                                  max_shard_size=args.max_shard_size, allow_pickle=args.allow_pickle, lora=args.lora)
            print(f"wrote {result.out_dir}: {len(result.files)} weight files ({result.dtype}) from a "
                  f"tp={result.layout.tp} pp={result.layout.pp} checkpoint in {result.seconds:.1f} s")
    except UserError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
