"""Every error hybrid3d reports to its user, and the exit codes they end a process with.

A `UserError` is bad input (a config key, a file, a layout, a model the code cannot represent, a
damaged checkpoint): one line that names it, `error: ...` on stderr, exit code 2, no traceback.
Each CLI catches `UserError` in one place; anything else is a bug and keeps its traceback.
"""

EXIT_USER_ERROR = 2
EXIT_NONFINITE = 1
EXIT_HANG = 3


class UserError(ValueError):
    """Bad input, reported as one line naming the key, file or number (exit code 2)."""

    exit_code = EXIT_USER_ERROR


class ConfigError(UserError):
    """A key of the DeepSpeed JSON, its "hybrid3d" section or a command-line override."""


class ReportedError(UserError):
    """A user error that rank 0 reports; the other ranks exit 2 without repeating the line."""


class LayoutError(UserError):
    """A layout that cannot work for this world size or model; the message names the numbers."""


class UnsupportedConfigError(UserError):
    """A Hugging Face config the model cannot represent exactly; the message names the field."""


class ConversionError(UserError):
    """Missing or inconsistent conversion input (a file, a tensor, a shape)."""


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged or belongs to another model; the message names the file."""


class NonFiniteError(RuntimeError):
    """A NaN/inf loss, gradient norm or weight under `train.on_nonfinite = stop` (exit code 1)."""

    exit_code = EXIT_NONFINITE


class PeerLostError(RuntimeError):
    """A collective failed because another rank went away (its process or its node died): the job ends with
    one line per rank naming the phase, not a communication library's traceback."""

    exit_code = EXIT_HANG
