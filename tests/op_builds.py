"""Build the DeepSpeed ops the test suite loads, before pytest starts: `python -m tests.op_builds [--tier full]`.

DeepSpeed JIT-builds its CPU ops on first use (torch's cpp_extension, cached under TORCH_EXTENSIONS_DIR), so on a
fresh machine the first test to load an op paid its build inside its own timing. Built here, through the builders
the runtime itself asks for (`deepspeed.ops.op_builder` resolves them for the accelerator), each build is a phase of
its own that `launch/test.sh` reports, and the tests then load the cached ops:

- the shared-memory collectives (`deepspeed.comm` loads them when a CPU world starts);
- CPU Adam (DeepSpeedCPUAdam: ZeRO-Offload, `offload_optimizer`);
- fused Adam (the JSON's AdamW without `torch_adam` on the CPU: the CPU recipes, the README's commands);
- `--tier full`: async I/O, with the pinned-memory op it loads (NVMe offload, ZeRO-Infinity: needs libaio), the
  longest build (100-170 s on 2 cores), which only the full tier (`pytest --full`) loads.

Measured alone on the 2-core VM (2026-12-07, a fresh TORCH_EXTENSIONS_DIR): shared-memory collectives 16.9 s, CPU
Adam 26.8 s, fused Adam 26.6 s (72 s with the start-up); async I/O with pinned memory 107.6 s.

Prints one line per op with its wall time; exit 1 if an op cannot be built (its error on stderr).
"""

import argparse
import sys
import time

DEFAULT_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder")
FULL_OPS = ("AsyncIOBuilder",)  # its load builds DeepSpeed's pinned-memory op (pin_memory) with it


def build(names) -> int:
    """One op after another: each build's ninja already runs a compile per core (measured: the three default ops
    at once took 86 s against 72 s one after another, the cores oversubscribed)."""
    from deepspeed.accelerator import get_accelerator

    from hybrid3d.ds_internals.cpu_info import share_cpu_info

    share_cpu_info()  # one CPU probe for all the builds (ds_internals/cpu_info.py)
    accelerator = get_accelerator()
    failed = 0
    for name in names:
        started = time.monotonic()
        builder = accelerator.create_op_builder(name)
        try:
            builder.load(verbose=False)
        except Exception as error:  # noqa: BLE001 - reported, and the exit code says so
            print(f"op build {builder.name}: failed: {error}", file=sys.stderr, flush=True)
            failed = 1
            continue
        print(f"op build {builder.name}: {time.monotonic() - started:.1f} s", flush=True)
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.op_builds", description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=("default", "full"), default="default",
                        help="the ops the default tier loads, or those only the full tier adds (NVMe offload)")
    args = parser.parse_args(argv)
    return build(FULL_OPS if args.tier == "full" else DEFAULT_OPS)


if __name__ == "__main__":
    sys.exit(main())
