"""The one error type conversion raises for bad input, so the CLI can tell user errors from bugs."""

from hybrid3d.layout import LayoutError
from hybrid3d.model.config import UnsupportedConfigError


class ConversionError(ValueError):
    """Missing or inconsistent input (a file, a tensor, a shape): one line naming it.

    The CLI prints it as `error: ...` and exits with code 2; anything else is a bug and keeps
    its traceback."""


# What the CLI reports as a user error: bad files, configs the model cannot represent, layouts
# that cannot split the model.
USER_ERRORS = (ConversionError, UnsupportedConfigError, LayoutError)
