"""DeepSpeed's `ds_to_universal` converter, run in this process.

`python -m deepspeed.checkpoint.ds_to_universal` is a CLI around `ds_to_universal.main(args)`. Run as a
subprocess it imports torch and DeepSpeed again (1.7 s of its 3.3 s on the demo checkpoint, measured on the
2-core CI machine) while the rank that started it, which has both imported already, waits. The arguments below
are that CLI's (DeepSpeed 0.19.8 `checkpoint/ds_to_universal.py:parse_arguments`) with its defaults, one worker
each, as the job always ran it (with more, the converter starts a process pool that imports both again).
"""

import argparse
import contextlib
import io
from pathlib import Path


def run_ds_to_universal(source: Path, output: Path) -> None:
    """Convert the DeepSpeed checkpoint tag folder `source` into a universal checkpoint in `output`; its progress
    lines are kept out of the job's output."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(source), output_folder=str(output), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)
