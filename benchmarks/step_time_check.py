"""The planner's step-time estimate (`hybrid3d.planning.planner.estimate_step_time`) against the step
times `vs_peers.py` measured for hybrid3d at each layout.

The estimate needs a machine: its compute rate and its all-reduce bandwidth. Both are measured here,
not assumed:
- compute: the FLOP rate of vs_peers' plain single-process PyTorch row (6N + 12·L·h·s per token x
  tokens/s) on all cores; a rank of a world of n ranks on those cores gets 1/n of it (n >= cores);
- TP collectives: the latency α and bus bandwidth B (2(g - 1)/g · bytes / time, the planner's convention) of the
  TP layers' all-reduce (DeepSpeed's shared-memory kernel where the group is the world, gloo otherwise) over
  groups of g = t ranks in a spawned world of each size, every group at once, 20 back to
  back as a step issues them, median of 10: Hockney's t(n) = α + 2(g-1)/g · n/B through the layout's TP message
  (b·s·h activations in the precision's bytes) and one 16x larger. They give the planner's TP bandwidth (the
  pipeline's sends use it too) and, for the layouts without TP, its `latency_us`;
- TP latency inside a step: at each TP layout, what one of its messages adds to a loop that computes between
  messages as much as the step does per TP message (fp32 GEMMs, minus the same loop without messages); the
  α this implies at the fitted bandwidth is the row's `latency_us`. With more ranks than cores it is larger
  than back to back: a collective also waits for a partner the OS has descheduled to run another rank.
- DP: the bus bandwidth of one DP reduce bucket over groups of g = d ranks, through gloo as ZeRO reduces it.
- memory bandwidth: each rank of a spawned world of each size copies a 64 MiB fp32 tensor while the others do
  (read + write bytes / time, median of 10), for the optimizer part.
- framework (`--machine`): one rank on one core times its step at micro-batches of 1 and 4 sequences and 1 and 8
  micro-batches a step (`framework_line`); the line through what one more micro-batch costs gives a core's compute
  rate and the seconds a micro-batch costs whatever its size (Python, autograd, DeepSpeed's hooks), at ZeRO 0-3.
The planner's own parts (compute, bubble, TP, DP, pipeline traffic, the optimizer's memory traffic) are then
summed; the framework part is left out of the comparison with vs_peers (its rows predate it). With more ranks than
cores, ranks share cores, so a rank that waits in a pipeline bubble lends its core to the others: the planner's
shared-core bubble (`step_time.shared_core_bubble`).

    python benchmarks/step_time_check.py benchmarks/results/2026-12-01-vm/vs_peers.json
    python benchmarks/step_time_check.py --machine      # the figures planning/machines.py takes, on this machine
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import environment, environment_markdown, random_batches, run_world  # noqa: E402
from vs_peers import LAYOUTS, MODEL, REDUCE_BUCKET  # noqa: E402

from hybrid3d.model import LlamaShape  # noqa: E402
from hybrid3d.planning.flops import training_flops_per_token  # noqa: E402
from hybrid3d.planning.memory import GB  # noqa: E402
from hybrid3d.planning.planner import Cluster, estimate_step_time  # noqa: E402
from hybrid3d.planning.traffic import tp_messages  # noqa: E402


def consecutive_group(rank: int, world_size: int, group_size: int, as_tp: bool):
    """This rank's group of `group_size` consecutive ranks (a collective call: every group is made on every rank),
    as the TP layers see it; `as_tp` lets its sums take the shared-memory kernel where the TP layers would."""
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.shm_all_reduce import shm_all_reduce_spans
    from hybrid3d.parallel.rank_groups import TensorParallelGroup

    groups = [dist.new_group(list(range(first, first + group_size))) for first in range(0, world_size, group_size)]
    group = groups[rank // group_size]
    return TensorParallelGroup(group, rank % group_size, group_size,
                               shm_all_reduce=as_tp and shm_all_reduce_spans(group))


def all_reduce_seconds(rank, world_size, group_size: int, sizes: list, repeats: int, as_tp: bool) -> list:
    """Seconds per fp32 all-reduce of each of `sizes` elements over groups of `group_size` consecutive ranks, every
    group at once (as TP and DP groups run side by side): 20 back to back, as a step issues them, median of
    `repeats`. `as_tp`: through the TP layers' own call (`tp_all_reduce`: DeepSpeed's shared-memory kernel where
    the group is the whole world on one host), else through gloo as DeepSpeed's ZeRO reduces buckets."""
    import deepspeed.comm as dist

    from hybrid3d.parallel.tensor_parallel.mappings import tp_all_reduce

    tp = consecutive_group(rank, world_size, group_size, as_tp)
    seconds = []
    for numel in sizes:
        x = torch.ones(numel)
        for _ in range(3):
            tp_all_reduce(x, tp)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(20):
                tp_all_reduce(x, tp)
            times.append((time.perf_counter() - start) / 20)
        seconds.append(statistics.median(times))
    return seconds


GEMM_SIDE = 256  # the compute between in-step messages: fp32 GEMMs of 256 x 256 x 256 (33.6 MFLOP each)


def in_step_all_reduce_seconds(rank, world_size, requests: list, repeats: int) -> list:
    """What one TP all-reduce adds to a step where ranks compute between messages: for each (group size, fp32
    elements, GEMMs between messages), 20 x (GEMMs, all-reduce) minus 20 x GEMMs alone, per message, median of
    `repeats`; through `tp_all_reduce` as the TP layers call it. With more ranks than cores a collective also
    waits for a partner the OS has descheduled, which back-to-back all-reduces do not show."""
    import deepspeed.comm as dist

    from hybrid3d.parallel.tensor_parallel.mappings import tp_all_reduce

    a, b = torch.randn(GEMM_SIDE, GEMM_SIDE), torch.randn(GEMM_SIDE, GEMM_SIDE)
    out = []
    for group_size, numel, gemms in requests:
        tp = consecutive_group(rank, world_size, group_size, True)
        x = torch.ones(numel)
        costs = []
        for _ in range(repeats):
            seconds = []
            for communicate in (False, True):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(20):
                    for _ in range(gemms):
                        a @ b
                    if communicate:
                        tp_all_reduce(x, tp)
                seconds.append(time.perf_counter() - start)
            costs.append((seconds[1] - seconds[0]) / 20)
        out.append(statistics.median(costs))
    return out


def latency_and_bandwidth(group_size: int, small: tuple, large: tuple) -> tuple[float, float]:
    """Hockney's t(n) = α + 2(g-1)/g · n / B through two (bytes, seconds) points: (α s, B bus bytes/s); α >= 0."""
    (n1, t1), (n2, t2) = small, large
    bus = 2 * (group_size - 1) / group_size
    bandwidth = bus * (n2 - n1) / max(t2 - t1, 1e-12)
    return max(t1 - bus * n1 / bandwidth, 0.0), bandwidth


def copy_bandwidth(rank, world_size, numel: int, repeats: int) -> float:
    """Bytes/s of one rank's fp32 copy (read + write) while every rank of the world copies."""
    import deepspeed.comm as dist

    source, target = torch.ones(numel), torch.empty(numel)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return 2 * numel * 4 / statistics.median(times)


FRAMEWORK_MODEL = dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=32)  # the dense GQA shape of benchmarks/auto_layout.py
FRAMEWORK_SEQ = 128


FRAMEWORK_SIZES = ((1, 1), (1, 8), (4, 1), (4, 8))  # (micro-batch, gas) of framework_line


def framework_line(rank, world_size, zero: int, repeats: int) -> dict:
    """One rank on one core (a world of 1): the training step of hybrid3d's plain engine (fp32, ZeRO `zero`) at
    micro-batches of b = 1 and 4 sequences and gas g = 1 and 8, the four in turn for `repeats` rounds, medians. A
    micro-batch costs tau(b) = (t(b, 8) - t(b, 1)) / 7 (the step's fixed part, the optimizer's included, cancels)
    = alpha + beta * b: alpha the framework's seconds per micro-batch whatever its size (Python, autograd and
    DeepSpeed's hooks: what the planner's FLOP count leaves out), beta a sequence's compute."""
    from common import build_trainer_from_json

    from hybrid3d.training.console import deepspeed_prints, set_deepspeed_verbosity

    set_deepspeed_verbosity(False)
    torch.set_num_threads(1)
    shape = LlamaShape(**FRAMEWORK_MODEL)
    trainers, times = {}, {size: [] for size in FRAMEWORK_SIZES}
    for micro, gas in FRAMEWORK_SIZES:
        raw = {"train_batch_size": micro * gas, "train_micro_batch_size_per_gpu": micro,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
               "zero_optimization": {"stage": zero}, "steps_per_print": 10**9,
               "hybrid3d": {"data": {"seq_length": FRAMEWORK_SEQ}}}
        with deepspeed_prints(False):
            trainer = build_trainer_from_json(raw, shape)
        data = random_batches(shape.vocab_size, micro, FRAMEWORK_SEQ, 0)
        trainer.train_step(data)  # the warm-up: Adam's moments are created at the first step
        trainers[micro, gas] = (trainer, data)
    for _ in range(repeats):
        for size, (trainer, data) in trainers.items():
            start = time.perf_counter()
            trainer.train_step(data)
            times[size].append(time.perf_counter() - start)
    step = {size: statistics.median(t) for size, t in times.items()}
    tau = {b: (step[b, 8] - step[b, 1]) / 7 for b in (1, 4)}
    beta = (tau[4] - tau[1]) / 3
    return {"alpha_s": tau[1] - beta, "beta_s": beta, "step_s": {f"{b}x{g}": t for (b, g), t in step.items()}}


MACHINE_WORLDS = ((2, 2), (4, 2), (4, 4))  # (world, group size) of the machine's all-reduce figures
MACHINE_TP_NUMEL = 2 * 128 * 256  # fp32 elements of vs_peers' TP message (micro-batch 2, 128 tokens, hidden 256)


def machine_main(out_root: str, repeats: int) -> None:
    """--machine: the figures `hybrid3d.planning.machines` takes for the CPU, measured on this machine alone (no
    vs_peers rows): the TP all-reduce's Hockney fit (shared memory where the group is the world, gloo otherwise),
    DP's bucket bandwidth through gloo, a rank's copy bandwidth, and the framework line of ZeRO-0 and ZeRO-3
    (`framework_line`): a core's fp32 rate (FLOPs of a sequence / beta), the framework's seconds per decoder layer
    and micro-batch (alpha / layers) at each ZeRO stage, whose excess over ZeRO-0's is its hooks'."""
    from common import start_results

    command, out_dir, env = start_results("step_time_check.py", None, out_root)
    sizes = [MACHINE_TP_NUMEL // 2, MACHINE_TP_NUMEL, 16 * MACHINE_TP_NUMEL // 2, 16 * MACHINE_TP_NUMEL]
    figures = {"tp": {}, "dp_bucket_gbps": {}, "copy_gbps": {}, "framework": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for world, g in MACHINE_WORLDS:
            t = run_world(all_reduce_seconds, world, os.path.join(tmp, f"tp{world}-{g}"), g, sizes, repeats, True)[0]
            for k, precision in enumerate(("bf16", "fp32")):
                alpha, bus = latency_and_bandwidth(g, (sizes[k] * 4, t[k]), (sizes[k + 2] * 4, t[k + 2]))
                figures["tp"][f"{precision} {g} of {world}"] = {"latency_us": alpha * 1e6, "gbps": bus / GB}
            bucket = run_world(all_reduce_seconds, world, os.path.join(tmp, f"dp{world}-{g}"), g, [4_000_000],
                               repeats, False)[0][0]
            figures["dp_bucket_gbps"][f"{g} of {world}"] = 2 * (g - 1) / g * 4_000_000 * 4 / bucket / GB
        for world in sorted({w for w, _ in MACHINE_WORLDS}):
            figures["copy_gbps"][world] = statistics.median(
                run_world(copy_bandwidth, world, os.path.join(tmp, f"mem{world}"), 16 * 2**20, repeats)) / GB
        shape = LlamaShape(**FRAMEWORK_MODEL)
        sequence_flops = FRAMEWORK_SEQ * training_flops_per_token(shape, FRAMEWORK_SEQ)
        for zero in (0, 1, 2, 3):
            line = run_world(framework_line, 1, os.path.join(tmp, f"framework{zero}"), zero, repeats)[0]
            figures["framework"][f"zero{zero}"] = dict(line, alpha_s_per_layer=line["alpha_s"] / shape.num_layers,
                                                       core_gflops=sequence_flops / line["beta_s"] / 1e9)
    lines = ["| figure | value |", "|---|---|"]
    for name, fit in figures["tp"].items():
        lines.append(f"| TP all-reduce, {name} ranks | {fit['latency_us'] / 1e3:.2f} ms + bytes at {fit['gbps']:.2f} GB/s |")
    lines += [f"| DP bucket all-reduce (gloo), {k} ranks | {v:.2f} GB/s |" for k, v in figures["dp_bucket_gbps"].items()]
    lines += [f"| copy bandwidth a rank, {k} ranks copying | {v:.1f} GB/s |" for k, v in figures["copy_gbps"].items()]
    for zero, f in figures["framework"].items():
        lines.append(f"| {zero}: framework per decoder layer and micro-batch (one core) | "
                     f"{f['alpha_s_per_layer'] * 1e3:.2f} ms |")
        lines.append(f"| {zero}: fp32 compute rate of a core (hybrid3d's engine) | {f['core_gflops']:.1f} GFLOP/s |")
    text = "\n".join(["# The CPU figures of the planner's machine (planning/machines.py)", "",
                       environment_markdown(env, command), "", *lines, ""])
    with open(os.path.join(out_dir, "machine.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "machine.json"), "w") as f:
        json.dump({"command": command, "environment": env, "figures": figures}, f, indent=1)
    print(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vs_peers_json", nargs="?", help="vs_peers.json written by benchmarks/vs_peers.py")
    parser.add_argument("--machine", action="store_true",
                        help="measure only the CPU figures planning/machines.py takes (machine.md, machine.json)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="results root for --machine")
    parser.add_argument("--repeats", type=int, default=10, help="repeats of each --machine measurement")
    args = parser.parse_args(argv)
    if args.machine:
        return machine_main(args.out, args.repeats)
    if args.vs_peers_json is None:
        parser.exit(2, "error: give vs_peers.json, or --machine\n")
    if not os.path.isfile(args.vs_peers_json):
        parser.exit(2, f"error: {args.vs_peers_json} does not exist\n")
    with open(args.vs_peers_json) as f:
        measured = json.load(f)
    command = measured["command"].split()
    flag = {k: int(command[command.index(k) + 1]) for k in ("--seq-length", "--micro-batch", "--global-batch")
            if k in command}
    seq, micro, global_batch = flag.get("--seq-length", 128), flag.get("--micro-batch", 2), flag.get("--global-batch", 8)
    from transformers import LlamaConfig

    shape = LlamaShape.from_hf(LlamaConfig(**MODEL))
    flops_per_token = training_flops_per_token(shape, seq)
    cores = os.cpu_count() or 1
    env = environment()
    tp_numel = micro * seq * shape.hidden_size
    # fp32 elements of each message: a bf16 TP message is as many bytes as tp_numel / 2 fp32 ones
    sizes = [tp_numel // 2, tp_numel, 16 * tp_numel // 2, 16 * tp_numel]
    tp_groups = sorted({(w, t) for w, t, p, _ in LAYOUTS.values() if t > 1} | {(w, 2) for w, *_ in LAYOUTS.values()})
    dp_groups = sorted({(w, w // (t * p)) for w, t, p, _ in LAYOUTS.values() if w > t * p})
    seconds, bucket_seconds, memory = {}, {}, {}  # (world, group size) -> seconds; world -> copy bytes/s a rank
    with tempfile.TemporaryDirectory() as tmp:
        for world, g in tp_groups:
            seconds[world, g] = run_world(all_reduce_seconds, world, os.path.join(tmp, f"tp{world}-{g}"), g, sizes, 10,
                                          True)[0]
        for world, g in dp_groups:
            bucket_seconds[world, g] = run_world(all_reduce_seconds, world, os.path.join(tmp, f"dp{world}-{g}"), g,
                                                 [REDUCE_BUCKET], 10, False)[0][0]
        for world in sorted({w for w, _ in tp_groups + dp_groups}):
            memory[world] = statistics.median(run_world(copy_bandwidth, world, os.path.join(tmp, f"mem{world}"),
                                                        16 * 2**20, 10))
    fits = {}  # (world, g, precision) -> (α s, B bus bytes/s) of the TP message
    for (world, g), t in seconds.items():
        for k, precision in enumerate(("bf16", "fp32")):
            fits[world, g, precision] = latency_and_bandwidth(g, (sizes[k] * 4, t[k]), (sizes[k + 2] * 4, t[k + 2]))
    bucket = {(w, g): 2 * (g - 1) / g * REDUCE_BUCKET * 4 / t for (w, g), t in bucket_seconds.items()}
    rows, plain = measured["rows"], {}
    for r in rows:
        if r["system"].startswith("plain"):
            plain[r["precision"]] = r["tokens_per_s"] * flops_per_token  # FLOP/s on all cores
    ours = [r for r in rows if r["system"] == "hybrid3d"]

    def estimate(r, tp_latency=None):
        """The planner's parts for row `r`: TP and pipeline at the TP fit (its α, or `tp_latency`), DP at the
        bucket's bandwidth, the bubble as cores shared by the ranks make it."""
        world, tp, pp, _ = LAYOUTS[r["for_layout"]]
        dp = world // (tp * pp)
        rank_rate = plain[r["precision"]] / max(world, cores)
        precision = "fp32" if r["precision"] == "fp32" else "bf16"
        latency, tp_bandwidth = fits.get((world, tp, precision), fits.get((world, 2, precision)))  # PP2xDP2: no TP
        latency = latency if tp_latency is None else tp_latency
        parts = {}
        for kind, gbps, alpha in (("tp", tp_bandwidth / GB, latency * 1e6),
                                  ("dp", bucket.get((world, dp), 1e30) / GB, 0.0)):
            cluster = Cluster(gpus=world, gpu_memory_gb=24, gpus_per_node=world, peak_tflops=rank_rate / 1e12,
                              efficiency=1.0, intra_node_gbps=gbps, inter_node_gbps=gbps,
                              memory_gbps=memory[world] / GB, latency_us=alpha,
                              shared_cores=cores if world > cores else None)
            parts[kind] = estimate_step_time(shape, cluster, tp, pp, dp, 1, micro, global_batch // (micro * dp), seq,
                                             precision)
        small, reduce = parts["tp"], parts["dp"]
        return dataclasses.replace(small, dp=reduce.dp)

    # TP latency as a step meets it: the layout's message after as much compute as the step does per TP message
    requests = {}  # world -> [(row index, (group size, fp32 elements, GEMMs between messages))]
    for i, r in enumerate(ours):
        world, tp, pp, _ = LAYOUTS[r["for_layout"]]
        if tp == 1:
            continue
        act_bytes = 4 if r["precision"] == "fp32" else 2
        gas = global_batch // (micro * (world // (tp * pp)))
        count = sum(c for _, c, _ in tp_messages(shape, micro, seq, tp, pp, pp - 1, gas, act_bytes))
        between = estimate(r).compute / count  # seconds of compute a rank does per TP message
        gemms = max(1, round(between * plain["fp32"] / max(world, cores) / (2 * GEMM_SIDE**3)))
        requests.setdefault(world, []).append((i, (tp, micro * seq * shape.hidden_size * act_bytes // 4, gemms)))
    in_step = {}  # row index -> (seconds a message adds to the step, α those imply)
    with tempfile.TemporaryDirectory() as tmp:
        for world, asks in requests.items():
            costs = run_world(in_step_all_reduce_seconds, world, os.path.join(tmp, f"step{world}"),
                              [a for _, a in asks], 5)[0]
            for (i, (g, numel, _)), cost in zip(asks, costs):
                r = ours[i]
                _, bandwidth = fits[world, g, "fp32" if r["precision"] == "fp32" else "bf16"]
                in_step[i] = (cost, max(cost - 2 * (g - 1) / g * numel * 4 / bandwidth, 0.0))
    out = []
    for i, r in enumerate(ours):
        est = estimate(r, in_step[i][1] if i in in_step else None)
        out.append({"layout": r["for_layout"], "precision": r["precision"], "measured_s": r["step_s"],
                    "estimate_s": est.seconds, "compute": est.compute, "bubble": est.bubble, "tp": est.tp,
                    "dp": est.dp, "pipe": est.pipe, "optimizer": est.optimizer, "error": est.seconds / r["step_s"] - 1,
                    "tp_message_in_step_s": in_step[i][0] if i in in_step else None})
    lines = ["| precision | layout | measured s | estimate s | compute | bubble | TP | DP | pipeline | optimizer | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in out:
        lines.append(f"| {o['precision']} | {o['layout']} | {o['measured_s']:.3f} | {o['estimate_s']:.3f} | "
                     f"{o['compute']:.3f} | {o['bubble']:.3f} | {o['tp']:.4f} | {o['dp']:.4f} | {o['pipe']:.4f} | "
                     f"{o['optimizer']:.4f} | {o['error']:+.0%} |")
    table = "\n".join(lines)
    errors = [abs(o["error"]) for o in out]
    summary = ("Measured all-reduces, TP message fits (α, B; shared memory where the TP group is the world): "
               + ", ".join(f"{p} over {g} of {w} ranks α {a * 1e3:.2f} ms, B {b / 1e9:.2f} GB/s"
                           for (w, g, p), (a, b) in sorted(fits.items()))
               + "; one TP message inside a step (α it implies): "
               + ", ".join(f"{o['precision']} {o['layout']} {o['tp_message_in_step_s'] * 1e3:.2f} ms"
                           f" ({in_step[i][1] * 1e3:.2f} ms)" for i, o in enumerate(out) if i in in_step)
               + "; DP bucket bus bandwidth: " + ", ".join(f"{g} of {w} ranks {b / 1e9:.2f} GB/s"
                                                          for (w, g), b in sorted(bucket.items()))
               + "; copy bandwidth a rank: " + ", ".join(f"{w} ranks {b / 1e9:.1f} GB/s" for w, b in memory.items())
               + "; compute rate from plain PyTorch: " + ", ".join(f"{p} {v / 1e9:.1f} GFLOP/s" for p, v in plain.items())
               + f" on {cores} cores. Median |error| {statistics.median(errors):.0%}, largest {max(errors):.0%}.")
    out_dir = os.path.dirname(os.path.abspath(args.vs_peers_json))
    with open(os.path.join(out_dir, "step_time.md"), "w") as f:
        f.write("\n".join(["# The planner's step-time estimate against measured step times", "",
                           environment_markdown(env, f"python benchmarks/step_time_check.py {args.vs_peers_json}"),
                           f"- measured rows: `{measured['command']}` (commit {measured['environment']['commit']})",
                           "", summary, "", table, ""]))
    with open(os.path.join(out_dir, "step_time.json"), "w") as f:
        json.dump({"environment": env, "rows": out, "tp_fits_seconds_and_bus_bytes_per_s": {f"{p}@{g}of{w}": f
                                                                         for (w, g, p), f in fits.items()},
                   "dp_bucket_bus_bytes_per_s": {f"{g}of{w}": b for (w, g), b in bucket.items()},
                   "copy_bytes_per_s_a_rank": memory,
                   "plain_flops_per_s": plain}, f, indent=1)
    print(summary)
    print(table)


if __name__ == "__main__":
    main()
