"""Before DeepSpeed is imported: its log below ERROR held back unless `--verbose` (always, for a command without it).

`import deepspeed` already logs, once per rank ("Setting accelerator to CPU. If you have GPU or other
accelerator, we were unable to detect it." on a machine without one: the CPU accelerator is what the job
runs on, so the line is harmless), before `console.set_deepspeed_verbosity` can lower its logger's level. A
filter on that logger, attached before DeepSpeed creates it, survives its creation (`logging.getLogger`
returns the same object; DeepSpeed sets the level and adds a handler, not filters). Nothing here imports
DeepSpeed.
"""

import logging
from collections.abc import Sequence

DEEPSPEED_LOGGER = "DeepSpeed"  # deepspeed/utils/logging.py: LoggerFactory.create_logger(name="DeepSpeed")


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def hold_back_deepspeed_log(argv: Sequence[str] = ()) -> None:
    """In a process, before anything imports DeepSpeed: drop its records below ERROR unless `--verbose` is in argv
    (no argv: a command without `--verbose`, such as the planner, which needs no accelerator)."""
    if "--verbose" not in argv:
        logging.getLogger(DEEPSPEED_LOGGER).addFilter(_errors_only)
