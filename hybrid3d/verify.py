"""`deepspeed --module hybrid3d.verify`: the HF-equivalence check of a checkpoint (hybrid3d/convert/verify.py)."""

import sys

from hybrid3d.training.quiet_start import hold_back_deepspeed_log

hold_back_deepspeed_log(sys.argv)  # before DeepSpeed's import logs once per rank

from hybrid3d.convert.verify import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
