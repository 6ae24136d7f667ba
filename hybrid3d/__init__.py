"""hybrid3d: Llama training with tensor, pipeline and data (ZeRO) parallelism on DeepSpeed."""

import sys

__version__ = "0.1.0"

# Every command of the package (`python -m hybrid3d.<command>`, also as a launched rank) starts quiet: while
# `python -m` imports a command's packages, sys.argv[0] is "-m", and those packages import DeepSpeed, whose import
# logs its accelerator detection. Its records below ERROR are held back unless the command line has --verbose
# (ds_internals/quiet_start.py); an import of the package from other code changes nothing.
if sys.argv[:1] == ["-m"]:
    from hybrid3d.ds_internals.quiet_start import hold_back_deepspeed_log

    hold_back_deepspeed_log(sys.argv)
