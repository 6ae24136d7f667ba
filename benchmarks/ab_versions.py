"""hybrid3d at two commits side by side in one spawned world, with the peer as a common yardstick.

The package at `--before` (a git revision) is exported into a temporary folder under the name
`hybrid3d_before` (its imports rewritten), so both versions train in the same processes: repeats run
round-robin over before, after (this checkout) and the peer, and the reported speed-up is the median of
per-repeat ratios, which cancels most of a shared machine's drift. Same model and batch as vs_peers.py.

    python benchmarks/ab_versions.py --before 38d1789 --tp 2                       # TP2, peer AutoTP
    python benchmarks/ab_versions.py --before 66ca695 --tp 1 --peer hf-deepspeed   # DP2
"""

import argparse
import importlib
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
from common import environment, random_batches, run_world  # noqa: E402
from vs_peers import MODEL, build, ds_config  # noqa: E402

BEFORE = "hybrid3d_before"


def export_package(revision: str, into: str) -> None:
    """`hybrid3d/` at `revision` as package `hybrid3d_before` under `into`."""
    archive = os.path.join(into, "pkg.tar")
    subprocess.run(["git", "archive", "-o", archive, revision, "hybrid3d"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    os.rename(os.path.join(into, "hybrid3d"), os.path.join(into, BEFORE))
    for folder, _, files in os.walk(os.path.join(into, BEFORE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(re.sub(r"\bhybrid3d(?=[.\s])", BEFORE, text))


def build_version(package: str, tp: int, precision: str, args, model_dir: str):
    from deepspeed.utils import groups
    from transformers import LlamaForCausalLM

    groups.mpu = None  # DeepSpeed keeps the last engine's mpu in a module global
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shape = importlib.import_module(package + ".model").LlamaShape.from_hf(hf.config)
    build_trainer = importlib.import_module(package + ".training.trainer").build_trainer
    config = ds_config(args, precision, {"hybrid3d": {"tensor_parallel_size": tp}})
    validate_run = None  # a version with one validation pass takes only its result (config/, earlier training/)
    for owner in (".config.validation", ".training.validation"):
        try:
            validate_run = importlib.import_module(package + owner).validate_run
            break
        except ModuleNotFoundError:
            pass
    if validate_run is None:  # an earlier version validates the JSON inside build_trainer
        trainer = build_trainer(config, shape, hf_state_dict=hf.state_dict())
    else:
        import deepspeed.comm as dist

        trainer = build_trainer(validate_run(config, dist.get_world_size(), shape), hf_state_dict=hf.state_dict())
    return trainer.engine, trainer.train_step, trainer.groups.get_data_parallel_rank()


def world_main(rank, world_size, args, model_dir, export_dir):
    import deepspeed.comm as dist

    sys.path.insert(0, export_dir)
    out = {}
    for _ in range(args.repeats):
        for system in ("before", "after", args.peer):
            for precision in args.precisions:
                if system == args.peer:
                    engine, step, dp_rank = build(system, args.tp, 1, precision, args, model_dir)
                else:
                    engine, step, dp_rank = build_version(BEFORE if system == "before" else "hybrid3d", args.tp,
                                                          precision, args, model_dir)
                batches = random_batches(MODEL["vocab_size"], args.micro_batch, args.seq_length, seed=dp_rank)
                step(batches)
                times = []
                for _ in range(args.steps):
                    dist.barrier()
                    start = time.perf_counter()
                    step(batches)
                    dist.barrier()
                    times.append(time.perf_counter() - start)
                out.setdefault(f"{system}@{precision}", []).append(statistics.median(times))
                del engine, step
    return out


def ratio(numerators, denominators) -> str:
    r = [n / d for n, d in zip(numerators, denominators)]
    return f"{statistics.median(r):.3f} (range {min(r):.3f}-{max(r):.3f})"


def main(argv=None):
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the docstring's whole first paragraph
    parser = argparse.ArgumentParser(description=summary)
    parser.add_argument("--before", required=True, help="git revision of the version to compare against")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--peer", default="hf-autotp", choices=("hf-autotp", "hf-deepspeed"))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(argv)
    args.micro_batch, args.seq_length, args.global_batch, args.zero = 2, 128, 8, 1
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        try:
            export_package(args.before, tmp)
        except subprocess.CalledProcessError:
            parser.exit(2, f"error: --before {args.before}: not a revision of this repository\n")
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(os.path.join(tmp, "model"))
        result = run_world(world_main, args.world, os.path.join(tmp, "ranks"), args, os.path.join(tmp, "model"), tmp)[0]
    env = environment()
    print(f"python benchmarks/ab_versions.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{env['cpu']}, {env['cores']} cores; after = {env['commit']}{' (dirty)' if env['dirty'] else ''}; "
          f"world {args.world}, tp {args.tp}; step seconds per repeat; speed-up = before / after step time")
    for precision in args.precisions:
        before, after, peer = (result[f"{s}@{precision}"] for s in ("before", "after", args.peer))
        print(f"{precision}: speed-up {ratio(before, after)}; after vs {args.peer} {ratio(peer, after)}; "
              f"before vs {args.peer} {ratio(peer, before)}")


if __name__ == "__main__":
    main()
