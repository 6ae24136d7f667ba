"""`python -m hybrid3d.plan`: rank (tp, pp, dp, ZeRO, checkpointing, micro-batch) layouts for a model
on a cluster, by the memory model (`hybrid3d.memory`) and a step-time estimate.

Memory per GPU = peak model states (DeepSpeed's wrappers, incl. its reduce bucket) + activations of
the worst stage (1F1B in-flight micro-batches) + a fixed reserve (CUDA context, NCCL, fragmentation).

Relative step time (lower is better), per GPU, for the same global batch (`estimate_step_time`):
    compute  = tokens/GPU · (6N + 12·L·h·s) / (t·p) · (4/3 with full recomputation) / (peak · efficiency)
    bubble   = compute · (p - 1)/m        (1F1B: the bubble fraction (p-1)/(m+p-1) of the total step)
    tp comm  = logged TP all-reduce bytes · 2(t-1)/t / intra-node bandwidth (not overlapped)
    dp comm  = logged DP bytes · 2(d-1)/d / inter-node bandwidth (or intra-node when one node holds it)
    pp comm  = (m + p - 1) · max over stages of one micro-batch's
               [send/recv bytes / link bandwidth + pipeline all-gather bytes · (t - 1) / intra-node bandwidth]
pp comm: DeepSpeed's TrainSchedule runs 2(m + p - 1) lock-step slots (`runtime/pipe/schedule.py:
TrainSchedule.steps`) whose sends and receives block (`runtime/pipe/p2p.py: send/recv`), so a stage's
transfers lengthen each of the m + p - 1 forward-backward slots of the slowest stage; the bytes are
`traffic.pp_boundary_bytes` (activation and gradient, 1/t each when partitioned) and
`traffic.pp_gather_bytes_per_step` (an all-gather of input M moves (t - 1)·M per rank, the bus bytes of
`utils/comms_logging.py: calc_bw_log`), and a stage boundary uses the inter-node link when it crosses
nodes (`Cluster.pipe_link_gbps`). These paths are DeepSpeed 0.19.8's.
The absolute numbers are rough; the ranking is what the estimate is for.
Precision: ZeRO-0 plans bf16 (bf16 gradient accumulation); ZeRO-1/2 plan bf16 with fp32 gradient
accumulation (`data_types.grad_accum_dtype: fp32`), the project's default.
ZeRO-2 with p > 1 is `hybrid3d.pipeline_zero2`: a 4Ψ/Nd fp32 gradient partition instead of ZeRO-1's
full buffer, for m times the DP gradient bytes (`traffic.dp_bytes_per_step`), not overlapped.
"""

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional

from hybrid3d.errors import LayoutError, UserError
from hybrid3d.model.config import LlamaShape
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.planning.flops import peak_tflops, training_flops_per_token
from hybrid3d.planning.memory import DEFAULT_REDUCE_BUCKET, GB, activation_bytes, rank_model_states
from hybrid3d.planning.traffic import (
    dp_bytes_per_step,
    pp_boundary_bytes,
    pp_gather_bytes_per_step,
    tp_bytes_per_step,
)
from hybrid3d.model.tp_plan import check_split


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gb: float
    gpus_per_node: int = 8
    reserve_gb: float = 3.0
    peak_tflops: float = 989.4
    efficiency: float = 0.5
    intra_node_gbps: float = 200.0  # GB/s per GPU of all-reduce bus bandwidth inside a node
    inter_node_gbps: float = 25.0  # GB/s per GPU across nodes

    def pipe_link_gbps(self, stage: int, tp: int, dp: int) -> float:
        """Bandwidth between `stage` and `stage + 1`. DeepSpeed numbers ranks pipe·d·t + data·t + model
        (`runtime/pipe/topology.py: PipeModelDataParallelTopology`) and its launcher fills each node with
        consecutive ranks (`launcher/launch.py: main`), so rank r of `stage` sends to r + d·t; the
        boundary is inter-node when any such pair sits on two nodes (the slowest pair sets the pace)."""
        width = tp * dp
        first = stage * width
        crosses = any(r // self.gpus_per_node != (r + width) // self.gpus_per_node
                      for r in range(first, first + width))
        return self.inter_node_gbps if crosses else self.intra_node_gbps


@dataclass(frozen=True)
class Choice:
    tp: int
    pp: int
    dp: int
    zero: int
    checkpointing: bool
    micro_batch: int
    gas: int
    states_gb: float
    activations_gb: float
    memory_gb: float
    step_seconds: float
    bubble: float
    pipe_seconds: float  # pipeline send/recv and all-gathers within step_seconds

    @property
    def precision(self) -> str:
        return "bf16" if self.zero == 0 else "bf16+fp32acc"


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layout_refusal(shape: LlamaShape, tp: int, pp: int, cluster: Cluster) -> Optional[str]:
    if tp > cluster.gpus_per_node:
        return f"tp={tp} > {cluster.gpus_per_node} GPUs per node: TP all-reduces would cross nodes"
    try:
        ParallelLayout(tp, pp, cluster.gpus // (tp * pp))
        check_split(shape, tp, pp)
    except LayoutError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step by part; the parts are not overlapped, `seconds` is their sum."""

    compute: float  # one GPU's forward + backward (+ recomputation) FLOPs at peak · efficiency
    bubble: float  # 1F1B fill and drain: compute · (p - 1)/m
    tp: float  # TP all-reduces
    dp: float  # gradient reduction and ZeRO's all-gather
    pipe: float  # pipeline send/recv and the all-gathers re-assembling partitioned messages

    @property
    def seconds(self) -> float:
        return self.compute + self.bubble + self.tp + self.dp + self.pipe


def pipe_seconds(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, dp: int, micro_batch: int, gas: int,
                 seq: int, act_bytes: int = 2, pipe_partitioned: bool = True, grad_partitioned: bool = True) -> float:
    """(m + p - 1) · the slowest stage's pipeline traffic per micro-batch (module docstring, pp comm)."""
    if pp == 1:
        return 0.0
    boundary = pp_boundary_bytes(shape, micro_batch, seq, tp, act_bytes, pipe_partitioned, grad_partitioned)
    links = [cluster.pipe_link_gbps(st, tp, dp) * GB for st in range(pp - 1)]  # links[i]: stage i -> i + 1
    slowest = 0.0
    for st in range(pp):
        p2p = sum(boundary / links[i] for i in (st - 1, st) if 0 <= i < pp - 1)
        gather = pp_gather_bytes_per_step(shape, micro_batch, seq, tp, pp, st, 1, act_bytes, pipe_partitioned,
                                          grad_partitioned) * (tp - 1) / (cluster.intra_node_gbps * GB)
        slowest = max(slowest, p2p + gather)
    return (gas + pp - 1) * slowest


def estimate_step_time(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, dp: int, zero: int,
                       micro_batch: int, gas: int, seq: int, precision: str = "bf16+fp32acc",
                       checkpointing: bool = False, pipe_partitioned: bool = True,
                       grad_partitioned: bool = True) -> StepTime:
    """Estimated seconds of one training step (the planner's model, module docstring) of `shape` on
    `cluster` (peak, efficiency, intra/inter-node bandwidth, GPUs per node) with layout tp x pp x dp,
    ZeRO stage `zero`, `micro_batch` sequences of `seq` tokens per micro-batch, `gas` micro-batches per
    step (global batch = dp · micro_batch · gas), `precision` one of memory.PRECISIONS (activations and
    messages are 4 bytes for "fp32", else 2), full activation `checkpointing`, and DeepSpeed's
    `"pipeline": {"pipe_partitioned", "grad_partitioned"}` (both on by default; they act only when tp > 1).
    `.seconds` is the total; it is meant for comparing with measured step times."""
    act_bytes = 4 if precision == "fp32" else 2
    compute = micro_batch * gas * seq * training_flops_per_token(shape, seq) / (tp * pp)  # tokens/GPU · FLOPs
    compute *= 4 / 3 if checkpointing else 1
    compute /= cluster.peak_tflops * 1e12 * cluster.efficiency
    tp_seconds = max(tp_bytes_per_step(shape, micro_batch, seq, tp, pp, st, gas, act_bytes, recompute=checkpointing)
                     for st in range(pp)) * 2 * (tp - 1) / tp / (cluster.intra_node_gbps * GB)
    dp_bandwidth = cluster.intra_node_gbps if tp * pp * dp <= cluster.gpus_per_node else cluster.inter_node_gbps
    dp_seconds = max(dp_bytes_per_step(shape, tp, pp, dp, st, zero, gas, precision) for st in range(pp)) \
        * 2 * (dp - 1) / dp / (dp_bandwidth * GB)
    pipe = pipe_seconds(shape, cluster, tp, pp, dp, micro_batch, gas, seq, act_bytes, pipe_partitioned,
                        grad_partitioned)
    return StepTime(compute, compute * (pp - 1) / gas, tp_seconds, dp_seconds, pipe)


def evaluate(shape: LlamaShape, cluster: Cluster, tp: int, pp: int, zero: int, checkpointing: bool,
             micro_batch: int, seq: int, global_batch: int, bucket: int) -> Choice:
    dp = cluster.gpus // (tp * pp)
    gas = global_batch // (dp * micro_batch)
    precision = "bf16" if zero == 0 else "bf16+fp32acc"
    states = acts = 0.0
    for stage in range(pp):
        ranks = {0, dp - 1} if zero == 2 else {0}
        stage_states = max(rank_model_states(shape, tp, pp, dp, zero, precision, stage, r, gas, bucket,
                                             pipeline_zero2=zero == 2 and pp > 1).peak.total for r in ranks)
        stage_acts = activation_bytes(shape, micro_batch, seq, tp, pp, stage, gas, checkpointing=checkpointing)
        if stage_states + stage_acts > states + acts:
            states, acts = stage_states, stage_acts
    step = estimate_step_time(shape, cluster, tp, pp, dp, zero, micro_batch, gas, seq, precision, checkpointing)
    bubble = (pp - 1) / (gas + pp - 1)
    memory = states + acts + cluster.reserve_gb * GB
    return Choice(tp, pp, dp, zero, checkpointing, micro_batch, gas, states / GB, acts / GB, memory / GB,
                  step.seconds, bubble, step.pipe)


def plan(shape: LlamaShape, cluster: Cluster, seq: int, global_batch: int,
         bucket: int = DEFAULT_REDUCE_BUCKET) -> tuple[list[Choice], list[str]]:
    """(feasible choices best first, one refusal line per (tp, pp[, zero]) that has no feasible option)."""
    feasible, refused = [], []
    for tp in divisors(cluster.gpus):
        for pp in divisors(cluster.gpus // tp):
            dp = cluster.gpus // (tp * pp)
            name = f"TP{tp} PP{pp} DP{dp}"
            reason = layout_refusal(shape, tp, pp, cluster)
            if reason is None and global_batch % dp:
                reason = f"global batch {global_batch} is not divisible by dp={dp}"
            if reason:
                refused.append(f"{name}: {reason}")
                continue
            for zero in (0, 1, 2) if pp == 1 or dp > 1 else (0, 1):  # ZeRO-2 with pp > 1: pipeline_zero2
                options = [evaluate(shape, cluster, tp, pp, zero, ckpt, mb, seq, global_batch, bucket)
                           for ckpt in (False, True) for mb in divisors(global_batch // dp) if mb <= 16]
                fits = [c for c in options if c.memory_gb <= cluster.gpu_memory_gb]
                if fits:
                    feasible.append(min(fits, key=lambda c: (c.step_seconds, c.checkpointing, -c.micro_batch)))
                else:
                    least = min(options, key=lambda c: c.memory_gb)
                    refused.append(f"{name} ZeRO-{zero}: needs >= {least.memory_gb:.1f} GB per GPU "
                                   f"({least.states_gb:.1f} model states + {least.activations_gb:.1f} activations "
                                   f"+ {cluster.reserve_gb:g} reserve at micro-batch {least.micro_batch}, "
                                   f"checkpointing) > {cluster.gpu_memory_gb:g} GB")
    feasible.sort(key=lambda c: c.step_seconds)
    return feasible, refused


def format_plan(feasible: list[Choice], refused: list[str], top: int) -> str:
    lines = []
    if feasible:
        best = feasible[0].step_seconds
        lines.append(f"{'tp':>3} {'pp':>3} {'dp':>4} {'zero':>4} {'ckpt':>4} {'mb':>3} {'gas':>4} "
                     f"{'GB/GPU':>7} {'states':>7} {'acts':>6} {'bubble':>6} {'pp comm':>7} {'rel.time':>8}")
        for c in feasible[:top]:
            lines.append(f"{c.tp:>3} {c.pp:>3} {c.dp:>4} {c.zero:>4} {'yes' if c.checkpointing else 'no':>4} "
                         f"{c.micro_batch:>3} {c.gas:>4} {c.memory_gb:>7.1f} {c.states_gb:>7.1f} "
                         f"{c.activations_gb:>6.1f} {c.bubble:>6.1%} {c.pipe_seconds / c.step_seconds:>7.1%} "
                         f"{c.step_seconds / best:>8.2f}")
        if len(feasible) > top:
            lines.append(f"... {len(feasible) - top} more feasible layouts (--top)")
        lines.append("rel.time: step-time estimate / the first row's: compute, 1F1B bubble, TP, DP and pipeline")
        lines.append("traffic (send/recv and its TP all-gathers), not overlapped; pp comm: pipeline traffic's share")
    else:
        lines.append("no layout fits")
    if refused:
        lines.append("")
        lines.append("refused:")
        lines.extend(f"  {r}" for r in refused)
    return "\n".join(lines)


def load_shape(model: str) -> LlamaShape:
    """A preset name or a Hugging Face model directory (its config.json)."""
    from hybrid3d.model.presets import PRESETS, preset_config

    if model in PRESETS:
        return LlamaShape.from_hf(preset_config(model))
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise UserError(f"{model}: no config.json in this directory")
        from transformers import LlamaConfig

        return LlamaShape.from_hf(LlamaConfig.from_pretrained(model))
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
    parser = _Parser(prog="python -m hybrid3d.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="preset name or Hugging Face model directory")
    parser.add_argument("--gpus", type=_positive(int), required=True)
    parser.add_argument("--gpu-memory", type=_positive(float), required=True, help="GB per GPU")
    parser.add_argument("--seq-length", type=_positive(int), default=4096)
    parser.add_argument("--global-batch", type=_positive(int), default=512, help="sequences per step")
    parser.add_argument("--gpus-per-node", type=_positive(int), default=8)
    parser.add_argument("--reserve", type=float, default=3.0, help="GB per GPU kept for context/NCCL/fragmentation")
    parser.add_argument("--peak-tflops", type=_positive(float), default=None,
                        help="peak bf16 TFLOP/s per GPU (default: H100's 989.4)")
    parser.add_argument("--reduce-bucket-size", type=_positive(int), default=DEFAULT_REDUCE_BUCKET)
    parser.add_argument("--top", type=_positive(int), default=15)
    args = parser.parse_args(argv)
    try:
        shape = load_shape(args.model)
    except (UserError, OSError) as e:
        parser.error(str(e).splitlines()[0])
    if args.seq_length > shape.max_position_embeddings:
        parser.error(f"--seq-length {args.seq_length} exceeds the model's max_position_embeddings "
                     f"({shape.max_position_embeddings})")
    cluster = Cluster(gpus=args.gpus, gpu_memory_gb=args.gpu_memory, gpus_per_node=args.gpus_per_node,
                      reserve_gb=args.reserve, peak_tflops=peak_tflops("H100", override=args.peak_tflops))
    feasible, refused = plan(shape, cluster, args.seq_length, args.global_batch, args.reduce_bucket_size)
    print(f"{args.model}: {args.gpus} x {args.gpu_memory:g} GB, seq {args.seq_length}, "
          f"global batch {args.global_batch} sequences")
    print(format_plan(feasible, refused, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
