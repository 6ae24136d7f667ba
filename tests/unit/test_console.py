"""DeepSpeed's output behind --verbose: held back by default, written out when start-up fails."""

import logging

import pytest
from deepspeed.utils import logger as deepspeed_logger

from hybrid3d.training.console import deepspeed_prints, set_deepspeed_verbosity


def test_prints_are_held_back_unless_verbose(capsys):
    with deepspeed_prints(verbose=False):
        print("Using topology: ...")
    assert capsys.readouterr().out == ""
    with deepspeed_prints(verbose=True):
        print("Using topology: ...")
    assert capsys.readouterr().out == "Using topology: ...\n"


def test_held_back_prints_come_out_when_the_block_fails(capsys):
    with pytest.raises(RuntimeError, match="start-up failed"):
        with deepspeed_prints(verbose=False):
            print("op build log")
            raise RuntimeError("start-up failed")
    assert capsys.readouterr().out == "op build log\n"


def test_logger_level():
    before = deepspeed_logger.level, [h.level for h in deepspeed_logger.handlers]
    try:
        set_deepspeed_verbosity(False)
        assert not deepspeed_logger.isEnabledFor(logging.WARNING) and deepspeed_logger.isEnabledFor(logging.ERROR)
        set_deepspeed_verbosity(True)
        assert deepspeed_logger.isEnabledFor(logging.INFO)
    finally:
        deepspeed_logger.setLevel(before[0])
        for handler, level in zip(deepspeed_logger.handlers, before[1]):
            handler.setLevel(level)


def test_deepspeed_import_log_is_held_back_in_a_rank_unless_verbose():
    """launch/train.py attaches the filter before DeepSpeed's import, which logs once per rank on a machine without
    a GPU ("Setting accelerator to CPU ..."); with --verbose the line stays."""
    import subprocess
    import sys

    code = ("import sys; from hybrid3d.ds_internals.quiet_start import hold_back_deepspeed_log; "
            "hold_back_deepspeed_log(sys.argv[1:]); import deepspeed; from deepspeed.utils import logger; "
            "logger.warning('a warning'); logger.error('an error')")
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "WARNING" not in quiet.stdout + quiet.stderr and "an error" in quiet.stdout + quiet.stderr
