"""`deepspeed --module hybrid3d.verify`: the HF-equivalence check of a checkpoint (hybrid3d/convert/verify.py)."""

import sys

from hybrid3d.convert.verify import main

if __name__ == "__main__":
    sys.exit(main())
