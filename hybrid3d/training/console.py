"""What the training job prints: hybrid3d's own lines, and DeepSpeed's only when asked (`--verbose`).

Start-up through DeepSpeed prints per rank: its INFO/WARNING log lines (op builds, the LR scheduler's
"Attempting to get learning rate from scheduler before it has started"), and plain prints from the
pipeline module and its topology (the layer listing hybrid3d prints per stage anyway). Without
`--verbose` the DeepSpeed logger shows errors only and those prints are held back; if start-up fails,
what was held back is written out, so nothing needed for a diagnosis is lost.
"""

import contextlib
import io
import logging
import sys

from deepspeed.utils import logger as deepspeed_logger


def hold_back_deprecated_alias_warnings() -> None:
    """DeepSpeed's ZeRO-1 all-gather and its reduce-scatter (sequence parallelism) call deprecated torch aliases,
    which warn once per rank (torch 2.13): nothing a user can act on."""
    import warnings

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*", category=FutureWarning)


def set_deepspeed_verbosity(verbose: bool) -> None:
    """DeepSpeed's logger (and its handlers) at INFO with `verbose`, else at ERROR."""
    level = logging.INFO if verbose else logging.ERROR
    deepspeed_logger.setLevel(level)
    for handler in deepspeed_logger.handlers:
        handler.setLevel(level)


@contextlib.contextmanager
def deepspeed_prints(verbose: bool):
    """Hold back what DeepSpeed prints to stdout inside the block unless `verbose`; on an exception,
    write it out before the exception goes on."""
    if verbose:
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    except BaseException:
        sys.stdout.write(held.getvalue())
        sys.stdout.flush()
        raise
