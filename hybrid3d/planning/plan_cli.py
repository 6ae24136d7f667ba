"""`python -m hybrid3d.plan`'s command line: the planner's table (planning/planner.py, whose docstring it shows as
its description), the longest sequences, and `--write-config`, the chosen row as a ready config (the row "auto"
would choose: planning/auto_layout.py)."""

import argparse
import json
import os
import sys

from hybrid3d.errors import ConfigError, UserError
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.tp_plan import LORA_TARGETS
from hybrid3d.planning import planner
from hybrid3d.config.auto_values import ZERO3_KNOB_KEYS, config_for_row
from hybrid3d.planning.auto_layout import choose, row_label
from hybrid3d.planning.gpus import GPUS, INTER_NODE_GBPS, gpu_model, machine_line
from hybrid3d.planning.machines import DEFAULT_GPU, gpu_cluster
from hybrid3d.planning.hints import no_fit_hints, parse_gigabytes
from hybrid3d.planning.lora_plan import lora_line, lora_targets, non_negative_int, with_lora
from hybrid3d.planning.memory import DEFAULT_REDUCE_BUCKET
from hybrid3d.planning.plan_format import format_longest, format_plan
from hybrid3d.planning.planner import Choice, longest_sequence, plan
from hybrid3d.planning.step_time import Cluster
from hybrid3d.planning.zero3_fetch import Zero3Knobs


def load_shape(model: str) -> LlamaShape:
    """A preset name or a Hugging Face model directory (its config.json)."""
    from hybrid3d.model.presets import PRESETS, preset_config

    if model in PRESETS:
        return LlamaShape.from_hf(preset_config(model))
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise UserError(f"{model}: no config.json in this directory")
        from hybrid3d.model.hf_source import read_hf_config

        return LlamaShape.from_hf(read_hf_config(model))  # the family's own config class (AutoConfig)
    raise UserError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def main(argv=None) -> int:
    summary = " ".join(planner.__doc__.split("\n\n")[0].split())  # the planner docstring's first paragraph
    parser = _Parser(prog="python -m hybrid3d.plan", description=summary)
    parser.add_argument("--model", required=True, help="preset name or Hugging Face model directory")
    parser.add_argument("--gpus", type=_positive(int), required=True)
    parser.add_argument("--gpu", metavar="MODEL", default=None,
                        help=f"the GPU, for its datasheet's memory, peak, memory bandwidth and links ({', '.join(GPUS)}; "
                             f"default {DEFAULT_GPU}'s figures, with --gpu-memory)")
    parser.add_argument("--gpu-memory", type=parse_gigabytes, default=None,
                        help="GB per GPU: 80, 80GB or 80GiB (default: --gpu's)")
    parser.add_argument("--seq-length", type=_positive(int), default=None, help="tokens per sequence (default 4096)")
    parser.add_argument("--global-batch", type=_positive(int), default=512, help="sequences per step")
    parser.add_argument("--gpus-per-node", type=_positive(int), default=8)
    parser.add_argument("--reserve", type=float, default=3.0, help="GB per GPU kept for context/NCCL/fragmentation")
    parser.add_argument("--peak-tflops", type=_positive(float), default=None,
                        help="peak bf16 TFLOP/s per GPU (default: --gpu's)")
    parser.add_argument("--intra-node-gbps", type=_positive(float), default=None,
                        help="GB/s of collective bus bandwidth a GPU inside a node (default: --gpu's link, "
                             "planning/gpus.py)")
    parser.add_argument("--inter-node-gbps", type=_positive(float), default=None,
                        help=f"GB/s a GPU across nodes (default {INTER_NODE_GBPS:g})")
    parser.add_argument("--reduce-bucket-size", type=_positive(int), default=DEFAULT_REDUCE_BUCKET)
    for field, key in ZERO3_KNOB_KEYS.items():
        default = getattr(Zero3Knobs(), field)
        parser.add_argument("--" + key.replace("_", "-"), dest=field, type=non_negative_int, default=default,
                            metavar="ELEMENTS", help=f"ZeRO-3 rows: DeepSpeed's zero_optimization.{key} "
                                                     f"(default {default:.0e}; --write-config writes it)")
    parser.add_argument("--host-memory", type=parse_gigabytes, default=None,
                        help="GB of host memory per node for offloaded states (default: not checked)")
    parser.add_argument("--async-checkpoint", action="store_true",
                        help="count the host copy of asynchronous checkpoint saves (hybrid3d.checkpoint.async) in "
                             "host GB")
    parser.add_argument("--host-adam-rate", type=_positive(float), default=Cluster.host_adam_gelems,
                        help="billion parameters/s DeepSpeedCPUAdam steps per GPU (default "
                             f"{Cluster.host_adam_gelems:g}: 2 cores of the CPU test machine)")
    parser.add_argument("--top", type=_positive(int), default=15)
    parser.add_argument("--longest-sequence", action="store_true",
                        help="per layout (micro-batch 1), the longest sequence that fits --gpu-memory; context "
                             "parallelism by Ulysses and ring attention")
    parser.add_argument("--max-seq-length", type=_positive(int), default=None,
                        help="with --longest-sequence: search up to this many tokens "
                             "(default: the model's max_position_embeddings)")
    parser.add_argument("--lora-rank", type=non_negative_int, default=0,
                        help="LoRA adapters of this rank, the base frozen (default 0: full fine-tuning)")
    parser.add_argument("--lora-targets", type=lora_targets, default=None,
                        help=f"with --lora-rank: comma-separated modules (default: all, {','.join(LORA_TARGETS)})")
    parser.add_argument("--untested-moe-layouts", action="store_true",
                        help="a mixture of experts also at the (tp, pp, ep) the support table does not run yet: "
                             "what their memory and step time would be (not configs a run accepts)")
    parser.add_argument("--write-config", metavar="OUT.json", default=None,
                        help="write the chosen row (the fastest, or within 5%% of it the one with the most headroom, "
                             "as \"auto\" chooses) as a ready DeepSpeed config")
    parser.add_argument("--from", dest="base", metavar="BASE.json", default=None,
                        help="with --write-config: start from this config (optimizer, data, train ...)")
    args = parser.parse_args(argv)
    if args.base is not None and args.write_config is None:
        parser.error("--from needs --write-config")
    if args.write_config is not None and args.longest_sequence:
        parser.error("--write-config and --longest-sequence exclude each other")
    if args.write_config is not None and os.path.exists(args.write_config):
        parser.error(f"--write-config: {args.write_config} exists (not overwritten)")
    if args.longest_sequence and args.seq_length is not None:
        parser.error("--seq-length and --longest-sequence exclude each other")
    if args.max_seq_length is not None and not args.longest_sequence:
        parser.error("--max-seq-length needs --longest-sequence")
    if args.lora_targets is not None and not args.lora_rank:
        parser.error("--lora-targets needs --lora-rank")
    if args.untested_moe_layouts and (args.write_config is not None or args.longest_sequence):
        parser.error("--untested-moe-layouts plans layouts a run refuses: not with --write-config or "
                     "--longest-sequence")
    try:
        gpu = gpu_model(args.gpu or DEFAULT_GPU)
    except ConfigError as e:
        parser.error(str(e))
    if args.gpu is None and args.gpu_memory is None:
        parser.error("--gpu-memory (or --gpu) is required")
    args.gpu_memory = args.gpu_memory or gpu.memory_gb
    try:
        shape = with_lora(load_shape(args.model), args.lora_rank, args.lora_targets or tuple(LORA_TARGETS))
    except (UserError, ConfigError, OSError) as e:
        parser.error(str(e).splitlines()[0])
    seq = args.seq_length or 4096
    if not args.longest_sequence and seq > shape.max_position_embeddings:
        parser.error(f"--seq-length {seq} exceeds the model's max_position_embeddings "
                     f"({shape.max_position_embeddings})")
    cluster = gpu_cluster(args.gpus, args.gpu_memory, args.gpus_per_node, gpu, args.host_memory,
                          peak_tflops=args.peak_tflops, intra_node_gbps=args.intra_node_gbps,
                          inter_node_gbps=args.inter_node_gbps, reserve_gb=args.reserve,
                          host_adam_gelems=args.host_adam_rate)
    given = {name for name, value in (("peak", args.peak_tflops), ("intra", args.intra_node_gbps),
                                      ("inter", args.inter_node_gbps)) if value is not None}
    machine = machine_line(gpu, cluster.intra_node_gbps, cluster.inter_node_gbps, cluster.peak_tflops, given)
    if args.gpu is None:
        machine += f" (no --gpu: {gpu.label}'s figures)"
    lora = f", LoRA rank {args.lora_rank}" if args.lora_rank else ""
    if args.longest_sequence:
        cap = args.max_seq_length or shape.max_position_embeddings
        rows, refused = longest_sequence(shape, cluster, args.global_batch, cap, args.reduce_bucket_size,
                                         schedules=True)
        print(f"{args.model}: {args.gpus} x {args.gpu_memory:g} GB, longest sequence up to {cap} tokens, "
              f"global batch {args.global_batch} sequences{lora}")
        print(machine)
        if args.lora_rank:
            print(lora_line(shape))
        print(format_longest(rows, refused, args.top, cap))
        return 0
    least = []
    feasible, refused = plan(shape, cluster, seq, args.global_batch, args.reduce_bucket_size,
                             sequence_parallel=True, context_parallel=True, schedules=True, least=least,
                             async_checkpoint=args.async_checkpoint, zero3=_zero3_knobs(args),
                             untested_experts=args.untested_moe_layouts)
    print(f"{args.model}: {args.gpus} x {args.gpu_memory:g} GB, seq {seq}, "
          f"global batch {args.global_batch} sequences{lora}")
    print(machine)
    if shape.is_moe:
        print(moe_line(shape, args.untested_moe_layouts))
    if args.lora_rank:
        print(lora_line(shape))
    hints = no_fit_hints(least[0] if least else None, args.gpus, args.gpu_memory, args.reserve,
                         shape.is_moe and not args.untested_moe_layouts)
    print(format_plan(feasible, refused, args.top, hints))
    if args.write_config is not None:
        if not feasible:
            print(f"error: --write-config: no layout fits, nothing written to {args.write_config}", file=sys.stderr)
            return 2
        try:
            write_config(args, shape, feasible, seq)
        except (UserError, OSError) as e:
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
    return 0


def moe_line(shape: LlamaShape, untested: bool) -> str:
    """What the table of a mixture of experts holds: its total and active parameters, and which layouts."""
    from hybrid3d.planning.flops import matmul_parameters
    from hybrid3d.planning.memory import model_parameters

    active = matmul_parameters(shape) + shape.vocab_size * shape.hidden_size  # with the embedding, as model cards
    layouts = ("every (tp, pp, ep) the arithmetic allows: NOT layouts a run accepts yet (config/support.py)"
               if untested else "the (tp, pp, ep) the support table runs (config/support.py; "
               "--untested-moe-layouts shows the others)")
    return (f"mixture of experts: {model_parameters(shape) / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per "
            f"token ({shape.num_experts} experts, top-{shape.experts_per_token}); layouts: {layouts}")


def _zero3_knobs(args) -> Zero3Knobs:
    return Zero3Knobs(**{field: getattr(args, field) for field in ZERO3_KNOB_KEYS})


def write_config(args, shape: LlamaShape, feasible: list[Choice], seq: int) -> None:
    """--write-config: the chosen row as a config (`config.auto_values.config_for_row`), written whole or not at all."""
    from hybrid3d.config.sections import read_json

    base = read_json(args.base) if args.base else dict(STARTER_CONFIG)
    if os.path.isdir(args.model):
        weights = any(f.endswith(".safetensors") for f in os.listdir(args.model))
        model = {"hf_model": args.model, "init_from_hf": weights}
    else:
        model = {"preset": args.model}
    chosen = choose(feasible, args.gpu_memory)
    lora = {"rank": args.lora_rank, "target_modules": list(shape.lora_targets)} if args.lora_rank else None
    config = config_for_row(base, chosen, model, seq, args.global_batch, _zero3_knobs(args).changed(), lora)
    temporary = f"{args.write_config}.tmp"
    with open(temporary, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.replace(temporary, args.write_config)
    print(f"wrote {args.write_config}: {row_label(chosen)}")


# What --write-config starts from without --from: AdamW as the recipes set it, clipping, no other choices
STARTER_CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                            "weight_decay": 0.1}},
                  "gradient_clipping": 1.0, "steps_per_print": 1000000}


if __name__ == "__main__":
    raise SystemExit(main())
