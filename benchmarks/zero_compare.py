"""ZeRO 0/1/2/3 and offload across layouts and model sizes: measured per-rank memory, time and traffic next to
`hybrid3d.planning.memory` (`zero3_memory` for ZeRO-3 and offload) and `hybrid3d.planning.traffic`.

One spawned world runs every configuration in turn, `--repeats` times round-robin, so the
throughput figures of all configurations come from the same minutes of the same machine. Per
configuration and rank:
- model-state bytes counted from the optimizer's own tensors (`hybrid3d.ds_internals.memory_probe.PeakProbe`)
  during the second step, against `hybrid3d.planning.memory.rank_model_states` (ZeRO-3 and offload:
  `hybrid3d.planning.zero3_memory`);
- peak RSS of the configuration (the kernel's high-water mark, reset before it is built);
- collective bytes of one step from DeepSpeed's comms logger, split by caller into TP, DP and
  pipeline traffic, against `hybrid3d.planning.traffic` (ZeRO-3's DP traffic: `planning.zero3_fetch`);
- step time (median over `--steps` timed steps of every repeat) and tokens/s of the world.

    python benchmarks/zero_compare.py --quick
    python benchmarks/zero_compare.py     # the full run: + ZeRO-3 (pp = 1 layouts) and optimizer offload
    python benchmarks/zero_compare.py --sizes S,M --layouts DP4,TP2xDP2,PP2xDP2,TP2xPP2 --zero 0,1,2 --offload none
"""

import argparse
import gc
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from hybrid3d.ds_internals.quiet_start import hold_back_deepspeed_log  # noqa: E402

hold_back_deepspeed_log(sys.argv)  # before DeepSpeed is imported, here and in the spawned ranks (same argv)
from common import (  # noqa: E402
    classify_comms,
    command_line,
    int_list,
    environment,
    measure_second_step,
    median,
    peak_rss,
    random_batches,
    require_matplotlib,
    reset_peak_rss,
    results_dir,
    run_world,
    timed,
)

from hybrid3d.model import LlamaShape  # noqa: E402
from hybrid3d.planning.offload_plan import offload_options  # noqa: E402

SIZES = {  # small Llamas that train in well under a second per step on 2 CPU cores
    "S": dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2,
              head_dim=32),
    "M": dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4,
              head_dim=32),
}
LAYOUTS = {"DP4": (1, 1, 4), "TP2xDP2": (2, 1, 2), "PP2xDP2": (1, 2, 2), "TP2xPP2": (2, 2, 1), "TP4": (4, 1, 1),
           "PP4": (1, 4, 1), "DP2": (1, 1, 2), "DP8": (1, 1, 8), "TP2xPP2xDP2": (2, 2, 2)}
OFFLOAD_SUFFIX = {"none": "", "optimizer": "-off", "optimizer+params": "-offp"}  # of the configuration's name
# The full run's work per configuration, and --quick's: every row kept, each step an eighth of the tokens (the model
# states and the DP traffic do not depend on them, the TP and pipeline messages scale with them), fewer timed steps.
# The full run also measures ZeRO-3 (its pp = 1 layouts) and optimizer offload; --quick keeps to ZeRO 0/1/2.
FULL = dict(seq_length=128, micro_batch=2, global_batch=8, steps=5, repeats=3, zero="0,1,2,3", offload="none,optimizer")
QUICK = dict(seq_length=32, micro_batch=1, global_batch=4, steps=2, repeats=2, zero="0,1,2", offload="none")
# reduce_bucket_size (elements): ZeRO-1/2 keep one bucket alive, so it is part of the model states;
# DeepSpeed's default (5e8, 1 GB in bf16) would dwarf these models.
DEFAULT_BUCKET = 4_000_000


def ds_config(tp, pp, dp, zero, precision, global_batch, micro_batch, bucket, offload="none"):
    zero_optimization = {"stage": zero, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if offload != "none":
        zero_optimization["offload_optimizer"] = {"device": "cpu"}
    if offload == "optimizer+params":
        zero_optimization["offload_param"] = {"device": "cpu"}
    config = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        # with offload DeepSpeed steps the host partition with its CPU Adam (torch_adam would refuse it)
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, **({"torch_adam": True} if offload == "none" else {})}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero_optimization,
        "comms_logger": {"enabled": True, "debug": True, "prof_all": False, "verbose": False},
        "steps_per_print": 10**9,
        "hybrid3d": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                     "pipeline_zero2": zero == 2 and pp > 1},  # ZeRO-2 under a pipeline: hybrid3d.pipeline_zero2
    }
    if precision != "fp32":
        config["bf16"] = {"enabled": True}
    if precision == "bf16+fp32acc":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def run_config(run: dict, steps: int, verbose: bool = False, measure: bool = True) -> dict:
    """Build, warm up, measure one step (`measure`: the memory probe and the comms logger; the first repeat only, the
    others keep nothing else of theirs than step times), time `steps` steps; this rank's figures, and the seconds
    each phase took (`phases`: what the benchmark's own run time goes to)."""
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.memory_probe import PeakProbe
    from hybrid3d.model import LlamaShape
    from hybrid3d.parallel.spawn import end_run
    from hybrid3d.training.console import deepspeed_prints
    from common import build_trainer_from_json

    start = time.perf_counter()
    gc.collect()
    rss_base = reset_peak_rss()
    shape = LlamaShape(**SIZES[run["size"]])
    tp, pp, dp = run["tp"], run["pp"], run["dp"]
    with deepspeed_prints(verbose):  # the pipeline's layer listing and topology, as the job holds them back
        trainer = build_trainer_from_json(ds_config(tp, pp, dp, run["zero"], run["precision"], run["global_batch"],
                                          run["micro_batch"], run["bucket"], run["offload"]), shape)
    built = time.perf_counter()
    data = random_batches(shape.vocab_size, run["micro_batch"], run["seq"], trainer.groups.get_data_parallel_rank())
    result = {"stage": trainer.groups.stage_id, "tp_rank": trainer.groups.get_tensor_model_parallel_rank(),
              "dp_rank": trainer.groups.get_data_parallel_rank(), "wrapper": type(trainer.engine.optimizer).__name__,
              "rss_base": rss_base}
    if measure:
        probe = PeakProbe(trainer.engine)
        comms = measure_second_step(trainer, data, probe)
        traffic, callers = classify_comms(comms)
        peak = probe.peak()
        result.update(states=dict(peak.by_category), states_boundary=probe.snapshots["boundary"].by_category,
                      states_step=probe.snapshots["step"].by_category, traffic=traffic, callers=callers)
        del probe
    else:
        trainer.train_step(data)  # the warm-up: Adam's moments are created at the first step
    warmed = time.perf_counter()
    result["step_times"] = [timed(lambda: trainer.train_step(data), dist.barrier) for _ in range(steps)]
    dist.barrier()
    timed_end = time.perf_counter()
    del trainer, data
    end_run()  # the engine, its process groups and threads freed, what survives frozen out of later collections
    result["rss_peak"] = peak_rss()
    result["phases"] = {"build": built - start, "warm-up" + (" and probed step" if measure else ""): warmed - built,
                        "timed steps": timed_end - warmed, "teardown": time.perf_counter() - timed_end}
    return result


def world_main(rank, world_size, runs, repeats, steps, verbose=False):
    from hybrid3d.training.console import hold_back_deprecated_alias_warnings, set_deepspeed_verbosity

    if not verbose:
        set_deepspeed_verbosity(False)
        hold_back_deprecated_alias_warnings()
    out = {}
    began, total = time.perf_counter(), repeats * len(runs)
    for repeat in range(repeats):
        for index, run in enumerate(runs):
            result = run_config(run, steps, verbose, measure=repeat == 0)
            if rank == 0:
                done = repeat * len(runs) + index + 1
                elapsed = time.perf_counter() - began
                phases = ", ".join(f"{k} {v:.1f} s" for k, v in result["phases"].items())
                print(f"[{done}/{total}] {run['name']} (repeat {repeat + 1}/{repeats}): {phases}; elapsed "
                      f"{elapsed / 60:.1f} min, ETA {elapsed / done * (total - done) / 60:.1f} min", flush=True)
            if repeat == 0:
                out[run["name"]] = result
            else:
                out[run["name"]]["step_times"] += result["step_times"]
                out[run["name"]]["rss_peak"] = max(out[run["name"]]["rss_peak"], result["rss_peak"])
            out[run["name"]].setdefault("repeat_medians", []).append(median(result["step_times"]))
    return out


def plan_runs(args) -> list:
    runs = []
    for size in args.sizes:
        for layout in args.layouts:
            tp, pp, dp = LAYOUTS[layout]
            if tp * pp * dp != args.world:
                raise SystemExit(f"error: layout {layout} needs {tp * pp * dp} ranks, --world is {args.world}")
            if args.global_batch % (dp * args.micro_batch):
                raise SystemExit(f"error: --global-batch {args.global_batch} is not divisible by "
                                 f"dp x micro-batch = {dp} x {args.micro_batch}")
            for zero, offload in [(z, o) for z in args.zero for o in args.offload]:
                if (zero == 3 and pp > 1) or offload not in offload_options(LlamaShape(**SIZES[size]), pp, zero):
                    continue  # ZeRO-3 runs without a pipeline; offload as the trainer takes it (offload_plan.py)
                precision = args.precision
                if precision == "bf16+fp32acc" and zero == 0:
                    precision = "bf16"  # fp32 accumulation needs ZeRO >= 1 (BF16_Optimizer)
                runs.append(dict(name=f"{size}-{layout}-Z{zero}{OFFLOAD_SUFFIX[offload]}", size=size, layout=layout,
                                 tp=tp, pp=pp, dp=dp, zero=zero, precision=precision, seq=args.seq_length,
                                 micro_batch=args.micro_batch, global_batch=args.global_batch,
                                 bucket=args.reduce_bucket_size, offload=offload))
    return runs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"every size, layout and ZeRO stage of the defaults with less work per step and fewer "
                             f"steps ({', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in QUICK.items())}): "
                             f"a few minutes on 2 cores")
    parser.add_argument("--sizes", default="S,M")
    parser.add_argument("--layouts", default="DP4,TP2xDP2,PP2xDP2,TP2xPP2")
    parser.add_argument("--zero", default=None, help="ZeRO stages (3: without a pipeline)")
    parser.add_argument("--offload", default=None,
                        help="comma-separated: none, optimizer (offload_optimizer, ZeRO-1/2/3), optimizer+params "
                             "(and offload_param, ZeRO-3)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "bf16+fp32acc", "fp32"))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step, equal for all layouts")
    parser.add_argument("--reduce-bucket-size", type=int, default=DEFAULT_BUCKET,
                        help="zero_optimization.reduce_bucket_size in elements (part of the model states)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration and repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--verbose", action="store_true", help="DeepSpeed's own log lines and prints too")
    args = parser.parse_args(argv)
    require_matplotlib(parser)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:  # an option given explicitly wins over --quick's choice
            setattr(args, key, value)
    args.sizes = [s for s in args.sizes.split(",") if s]
    args.layouts = [s for s in args.layouts.split(",") if s]
    try:
        args.zero = int_list(args.zero)
    except ValueError:
        parser.error(f"--zero takes comma-separated stages (0,1,2,3), got {args.zero!r}")
    args.offload = [s for s in args.offload.split(",") if s]
    for name in args.offload:
        if name not in OFFLOAD_SUFFIX:
            parser.error(f"unknown offload {name} (known: {', '.join(OFFLOAD_SUFFIX)})")
    for name in args.sizes:
        if name not in SIZES:
            parser.error(f"unknown size {name} (known: {', '.join(SIZES)})")
    for name in args.layouts:
        if name not in LAYOUTS:
            parser.error(f"unknown layout {name} (known: {', '.join(LAYOUTS)})")
    return args


def main(argv=None):
    from report import write_results

    args = parse_args(argv)
    runs = plan_runs(args)
    command = command_line("zero_compare.py", argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(world_main, args.world, tmp, runs, args.repeats, args.steps, args.verbose)
    out_dir = results_dir(args.out)
    write_results(out_dir, runs, results, SIZES, environment(), command)
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
