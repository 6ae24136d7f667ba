"""Where a training step waits for the device: host syncs over two steps, by the hybrid3d line that caused them.

A dense Llama and a Mixtral (experts, top-2) take two training steps each through `build_trainer` and
`Trainer.train_step` (GAS 2) in a world of one. Every host sync is attributed to the innermost hybrid3d frame on
its stack (a sync inside DeepSpeed's `engine.step` counts at the trainer line that called it):

- on a GPU, CUDA's own detector: `torch.cuda.set_sync_debug_mode("warn")` warns at every synchronizing call;
- on the CPU (`--smoke`), nothing synchronizes, so the torch calls that would read a tensor on the host on a GPU
  (`.item()`, `.tolist()`, `bool()`, `nonzero`, ...) are counted instead, which checks the code and the counts'
  sources but not CUDA's view.

    python benchmarks/sync_audit.py             # on a GPU: results/<date>-<machine>/sync_audit.md
    python benchmarks/sync_audit.py --smoke     # the CPU accelerator, tiny shapes
"""

import argparse
import collections
import json
import os
import sys
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import environment, environment_markdown, results_dir, run_world  # noqa: E402

PACKAGE = os.sep + "hybrid3d" + os.sep
DENSE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
MOE = dict(DENSE, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
              "bincount", "equal", "allclose"}
STEPS, GAS, MICRO, SEQ = 2, 2, 1, 128


def hybrid3d_site(stack) -> str:
    """'file:line function' of the innermost hybrid3d frame, or 'outside hybrid3d'."""
    for frame in reversed(stack):
        if PACKAGE in frame.filename:
            path = frame.filename[frame.filename.rindex(PACKAGE) + 1:]
            return f"{path}:{frame.lineno} {frame.name}"
    return "outside hybrid3d"


class HostReadSites(TorchFunctionMode):
    """CPU stand-in for CUDA's sync detector: counts host-reading torch calls by hybrid3d site."""

    def __init__(self, sites: collections.Counter):
        super().__init__()
        self.sites = sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name == "where" and len(args) == 1):  # torch.where(cond) is nonzero
            self.sites[hybrid3d_site(traceback.extract_stack()[:-1])] += 1
        return func(*args, **(kwargs or {}))


class CudaSyncSites:
    """CUDA's sync debug mode, its warnings counted by hybrid3d site."""

    def __init__(self, sites: collections.Counter):
        self.sites = sites

    def __enter__(self):
        self.catcher = warnings.catch_warnings()
        self.catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = lambda *_, **__: self.sites.update([hybrid3d_site(traceback.extract_stack()[:-1])])
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self.catcher.__exit__(*exc)


def audit_model(name: str, hf_shape: dict, bf16: bool) -> dict:
    import deepspeed.comm as dist
    from transformers import LlamaConfig, MixtralConfig

    from common import build_trainer_from_json
    from hybrid3d.model import LlamaShape

    config = (MixtralConfig if "num_local_experts" in hf_shape else LlamaConfig)(**hf_shape)
    raw = {"train_batch_size": MICRO * GAS * dist.get_world_size(), "train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 1}, "steps_per_print": 10**6, "hybrid3d": {"tensor_parallel_size": 1}}
    if bf16:
        raw["bf16"] = {"enabled": True}
        raw["data_types"] = {"grad_accum_dtype": "fp32"}
    trainer = build_trainer_from_json(raw, LlamaShape.from_hf(config))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf_shape["vocab_size"], (GAS, MICRO, SEQ + 1), generator=generator)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]  # (m, s) ids and targets per micro-batch
    trainer.train_step(iter(batches))  # warm-up: first-call allocations and lazy set-up are not the steady state
    sites = collections.Counter()
    cuda = torch.cuda.is_available()
    with (CudaSyncSites(sites) if cuda else HostReadSites(sites)):
        for _ in range(STEPS):
            trainer.train_step(iter(batches))
    trainer.engine.destroy()
    return {"model": name, "detector": "cuda sync debug mode" if cuda else "host-reading torch calls (CPU)",
            "total": sum(sites.values()), "sites": sites.most_common()}


def rank_main(rank: int, world: int, bf16: bool) -> list:
    return [audit_model("dense Llama", DENSE, bf16), audit_model("Mixtral, 4 experts, top-2", MOE, bf16)]


def markdown(reports: list, env: dict, command: str) -> str:
    lines = ["# Host syncs per training step, by hybrid3d line", "", environment_markdown(env, command),
             f"- {STEPS} steps of GAS {GAS}, micro-batch {MICRO}, sequence {SEQ}, ZeRO-1, one rank", ""]
    for report in reports:
        lines += [f"## {report['model']}: {report['total']} over {STEPS} steps ({report['detector']})", "",
                  "| site | syncs |", "|---|---:|"]
        lines += [f"| {site} | {count} |" for site, count in report["sites"]]
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the CPU accelerator (checks the code)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("error: benchmarks/sync_audit.py needs a CUDA device (use --smoke to check it on the CPU)")
    out = args.out if args.smoke else results_dir(args.out)
    reports = run_world(rank_main, 1, out, not args.smoke)[0]
    env = environment()
    command = "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sync_audit.md"), "w") as f:
        f.write(markdown(reports, env, command))
    with open(os.path.join(out, "sync_audit.json"), "w") as f:
        json.dump({"environment": env, "reports": reports}, f, indent=1)
    for report in reports:
        print(f"{report['model']}: {report['total']} syncs over {STEPS} steps; top: {report['sites'][:3]}")
    print(f"written: {out}/sync_audit.md")


if __name__ == "__main__":
    main()
