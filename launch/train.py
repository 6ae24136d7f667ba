"""Entry point: deepspeed [--num_gpus N | --hostfile H] launch/train.py --deepspeed_config CFG.json [...]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hybrid3d.ds_internals.quiet_start import hold_back_deepspeed_log  # noqa: E402

hold_back_deepspeed_log(sys.argv)  # before DeepSpeed's import logs once per rank

from hybrid3d.training.entry import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
