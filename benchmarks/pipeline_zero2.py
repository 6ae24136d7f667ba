"""ZeRO-2 with pipeline stages (`hybrid3d.pipeline_zero2`) against ZeRO-1: gradient memory per rank,
data-parallel collective bytes per step and step time; bf16 weights, fp32 gradient accumulation.

One spawned world per data-parallel degree (PP2 x DP2 on 4 ranks, PP2 x DP4 on 8) runs, side by side:
- ZeRO-1 (DeepSpeed's BF16_Optimizer: a full-size fp32 gradient buffer, one reduction per step);
- ZeRO-2+PP with each bucket collective DeepSpeed 0.19.8 offers (`average_tensor`,
  `stage_1_and_2.py:1590-1723`): a plain all-reduce (`reduce_scatter: false`), the multi-rank
  bucket all-reduce (DeepSpeed's default) and one `reduce` per owning rank
  (`use_multi_rank_bucket_allreduce: false`, hybrid3d's default for this mode);
- ZeRO-2+PP with `pipeline_zero2_deferred_fraction` f: the memory/traffic curve.

Per configuration and rank, during the second step:
- gradient bytes: the larger "grads" census of `hybrid3d.ds_internals.memory_probe.PeakProbe`'s two snapshots
  (for ZeRO-2+PP the largest at a bucket reduction or epilogue, deferred accumulators included, and
  the optimizer step), against `hybrid3d.memory`; and what stays allocated after the step;
- collective bytes from DeepSpeed's comms logger (message sizes as logged), by caller; wire bytes a
  rank sends for the DP gradient reduction: 2(d-1)/d of an all-reduce's message (ring),
  (d-1)/d of a reduce's (each rank sends its slice towards every other owner);
- step time: median over `--steps` timed steps with the logger off (CPU/gloo, noisy: ratios only).

    python benchmarks/pipeline_zero2.py
    python benchmarks/pipeline_zero2.py --dp 2 --steps 3 --fractions 0.5
"""

import argparse
import csv
import gc
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmarks/ helpers and this checkout's hybrid3d
from common import (  # noqa: E402
    command_line,
    int_list,
    environment,
    environment_markdown,
    measure_second_step,
    op_and_caller,
    median,
    random_batches,
    results_dir,
    run_world,
    timed,
)

# The "S" Llama of benchmarks/zero_compare.py: about 0.9M parameters per stage at PP2.
SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=32)
BUCKET = 50_000  # elements: small against a stage, as a real bucket is against a real stage
from hybrid3d.model.pipe import DEFAULT_PARTITION_METHOD  # noqa: E402
from hybrid3d.ds_internals.comms_callers import GRADIENT_REDUCE_CALLERS as GRAD_CALLERS  # noqa: E402
from hybrid3d.ds_internals.comms_callers import PARAMETER_GATHER_CALLERS as GATHER_CALLERS  # noqa: E402


def configs(fractions) -> list[dict]:
    out = [dict(name="ZeRO-1 BF16_Optimizer", zero=1, zero_keys={}),
           dict(name="ZeRO-2+PP all-reduce (reduce_scatter=false)", zero=2, zero_keys={"reduce_scatter": False}),
           dict(name="ZeRO-2+PP bucket all-reduce (DeepSpeed default)", zero=2,
                zero_keys={"use_multi_rank_bucket_allreduce": True}),
           dict(name="ZeRO-2+PP per-owner reduce", zero=2, zero_keys={})]
    out += [dict(name=f"ZeRO-2+PP per-owner reduce, deferred {f:g}", zero=2, zero_keys={}, fraction=f)
            for f in fractions]
    return out


def ds_config(run: dict, dp: int, args) -> dict:
    hybrid = {"tensor_parallel_size": 1, "pipeline_parallel_size": 2}
    if run["zero"] == 2:
        hybrid.update(pipeline_zero2=True, pipeline_zero2_deferred_fraction=run.get("fraction", 0.0))
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": args.gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"stage": run["zero"], "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
                              **run["zero_keys"]},
        "comms_logger": {"enabled": True, "debug": True, "prof_all": False, "verbose": False},
        "steps_per_print": 10**9,
        "hybrid3d": hybrid,
    }


def traffic(comms_dict: dict, dp: int) -> dict:
    """Per-step bytes: DP gradient reduction (messages and wire), parameter all-gather, everything else."""
    out = {"grad_msg": 0, "grad_wire": 0, "gather_msg": 0, "other_msg": 0, "grad_calls": 0, "ops": {}}
    for record, sizes in comms_dict.items():
        op, caller = op_and_caller(record)
        count = sum(entry[0] for entry in sizes.values())
        total = sum(int(size) * entry[0] for size, entry in sizes.items())
        out["ops"][f"{op} ({caller})"] = (count, total)
        if caller in GRAD_CALLERS and op in ("all_reduce", "reduce"):
            out["grad_msg"] += total
            out["grad_calls"] += count
            out["grad_wire"] += total * (2 if op == "all_reduce" else 1) * (dp - 1) / dp
        elif caller in GATHER_CALLERS:
            out["gather_msg"] += total
        else:
            out["other_msg"] += total
    return out


def run_config(run: dict, dp: int, args) -> dict:
    import deepspeed.comm as dist

    from hybrid3d.ds_internals.memory_probe import PeakProbe, census
    from hybrid3d.model import LlamaShape
    from common import build_trainer_from_json

    shape = LlamaShape(**SHAPE)
    trainer = build_trainer_from_json(ds_config(run, dp, args), shape)
    probe = PeakProbe(trainer.engine)
    data = random_batches(shape.vocab_size, 1, args.seq, trainer.groups.get_data_parallel_rank())
    comms = measure_second_step(trainer, data, probe)
    after = census(trainer.module, trainer.engine.optimizer).by_category["grads"]
    result = {"stage": trainer.groups.stage_id, "dp_rank": trainer.groups.get_data_parallel_rank(),
              "psi": sum(p.numel() for p in trainer.module.parameters()),
              "wrapper": type(trainer.engine.optimizer).__name__, "engine": type(trainer.engine).__name__,
              "deferred_numel": sum(p.numel() for p, _ in getattr(getattr(trainer.engine, "deferred", None),
                                                                  "entries", [])),
              "grads_peak": max(snapshot.by_category["grads"] for snapshot in probe.snapshots.values()),
              "grads_after_step": after,
              "traffic": traffic(comms, dp),
              "step_times": [timed(lambda: trainer.train_step(data), dist.barrier) for _ in range(args.steps)]}
    dist.barrier()
    del trainer, probe, data
    gc.collect()
    return result


def world_main(rank, world_size, runs, args):
    dp = world_size // 2
    return {run["name"]: run_config(run, dp, args) for run in runs}


def predicted(run: dict, dp: int, stage: int, args) -> tuple[float, float]:
    """(peak gradient bytes of the stage's worst DP rank by `hybrid3d.memory`, logged DP gradient-reduction
    bytes: 2Ψ once for ZeRO-1, 2·(m·Ψ_eager + Ψ_def) for ZeRO-2+PP)."""
    from hybrid3d.model import LlamaShape
    from hybrid3d.ds_internals.pipeline_zero2 import deferred_indices
    from hybrid3d.planning.memory import rank_model_states, stage_parameter_numels

    shape = LlamaShape(**SHAPE)
    fraction = run.get("fraction", 0.0)
    grads = max(rank_model_states(shape, 1, 2, dp, run["zero"], "bf16+fp32acc", stage, r, args.gas, BUCKET,
                                  pipeline_zero2=run["zero"] == 2, deferred_fraction=fraction).peak.grads
                for r in range(dp))
    numels = stage_parameter_numels(shape, 1, 2, stage)
    deferred = sum(numels[i] for i in deferred_indices(numels, fraction))
    messages = 2 * sum(numels) if run["zero"] == 1 else 2 * (args.gas * (sum(numels) - deferred) + deferred)
    return grads, messages


def rows(dp: int, runs: list, ranks: list, args) -> list[dict]:
    """One row per configuration and stage: gradient bytes of the stage's worst DP rank, traffic of DP
    rank 0 (every DP rank of a stage issues the same collectives), step time of the world."""
    out = []
    baseline = None
    for run in runs:
        per_rank = [r[run["name"]] for r in ranks]
        step = median([max(times) for times in zip(*(r["step_times"] for r in per_rank))])
        baseline = baseline or step
        for stage in (0, 1):
            stage_ranks = [x for x in per_rank if x["stage"] == stage]
            r = next(x for x in stage_ranks if x["dp_rank"] == 0)
            t = r["traffic"]
            grads_model, messages_model = predicted(run, dp, stage, args)
            peak = max(x["grads_peak"] for x in stage_ranks)
            out.append({
                "dp": dp, "config": run["name"], "stage": stage, "wrapper": r["wrapper"], "engine": r["engine"],
                "psi": r["psi"], "deferred_share": round(r["deferred_numel"] / r["psi"], 3),
                "grad_peak_B_per_param": round(peak / r["psi"], 3),
                "model_B_per_param": round(grads_model / r["psi"], 3),
                "model_error": f"{grads_model / peak - 1:+.2%}",
                "grad_after_step_B_per_param": round(max(x["grads_after_step"] for x in stage_ranks) / r["psi"], 3),
                "dp_grad_calls": t["grad_calls"], "dp_grad_msg_MB": round(t["grad_msg"] / 1e6, 3),
                "msg_model_MB": round(messages_model / 1e6, 3),
                "dp_grad_wire_MB": round(t["grad_wire"] / 1e6, 3),
                "dp_gather_msg_MB": round(t["gather_msg"] / 1e6, 3),
                "other_msg_MB": round(t["other_msg"] / 1e6, 3),
                "grad_msg_over_2psi": round(t["grad_msg"] / (2 * r["psi"]), 2),
                "step_s_median": round(step, 4), "step_vs_zero1": round(step / baseline, 2),
                "ops": "; ".join(f"{k}: {c}x {b / 1e6:.3f} MB" for k, (c, b) in sorted(t["ops"].items())),
            })
    return out


def write(out_dir: str, table: list[dict], env: dict, command: str, args) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "pipeline_zero2.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    columns = ["dp", "config", "stage", "deferred_share", "grad_peak_B_per_param", "model_B_per_param",
               "model_error", "grad_after_step_B_per_param", "dp_grad_calls", "dp_grad_msg_MB", "msg_model_MB",
               "dp_grad_wire_MB", "grad_msg_over_2psi", "dp_gather_msg_MB", "step_s_median", "step_vs_zero1"]
    lines = [
        "# ZeRO-2 with pipeline stages vs ZeRO-1 (bf16 weights, fp32 gradient accumulation)", "",
        environment_markdown(env, command),
        f"- model: Llama {SHAPE}, PP2 (partition_method `{DEFAULT_PARTITION_METHOD}`), micro-batch 1 x seq {args.seq}, "
        f"GAS {args.gas}, reduce_bucket_size {BUCKET} elements, AdamW, clip 1.0",
        f"- second step; gradient bytes of each stage's worst DP rank, traffic of its DP rank 0; step time: "
        f"median of {args.steps} steps (slowest rank) measured side by side in one world", "",
        "Gradient bytes per stage parameter (`grad_peak`: largest census over the step; `after step`: held "
        "between steps). Messages as DeepSpeed's comms logger records them; wire = bytes a rank sends "
        "for the DP gradient reduction (all-reduce 2(d-1)/d, reduce (d-1)/d of the message).", "",
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in table]
    lines += ["", "Collectives per configuration (stage 0, DP rank 0): op (caller): calls x bytes", ""]
    lines += [f"- DP{row['dp']} {row['config']}: {row['ops']}" for row in table if row["stage"] == 0]
    with open(os.path.join(out_dir, "pipeline_zero2.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int_list, default="2,4", help="data-parallel degrees; the world is 2 x dp ranks")
    parser.add_argument("--fractions", default="0.25,0.5,0.75,1", help="pipeline_zero2_deferred_fraction values")
    parser.add_argument("--gas", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    args.fractions = [float(x) for x in args.fractions.split(",") if x]
    return args


def main(argv=None):
    args = parse_args(argv)
    runs = configs(args.fractions)
    command = command_line("pipeline_zero2.py", argv)
    table = []
    for dp in args.dp:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_world(world_main, 2 * dp, tmp, runs, args)
        table += rows(dp, runs, ranks, args)
    out_dir = results_dir(args.out)
    write(out_dir, table, environment(), command, args)
    print(f"results in {out_dir}")


if __name__ == "__main__":
    main()
