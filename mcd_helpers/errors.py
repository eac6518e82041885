"""The package's error classes for files, data and runs; each message says what is wrong and how to fix it.

Kept in a module of their own (imported by :mod:`mcd_helpers.data`, :mod:`mcd_helpers.cifar`,
:mod:`mcd_helpers.checkpoint` and :mod:`mcd_helpers.reproduce`), so that no two of those import
each other for them. ``mcd_helpers.data.DataNotFoundError`` and the other old import paths still work.
"""
from __future__ import annotations

__all__ = ["DataNotFoundError", "CorruptDataError", "NotWritableError", "DiskFullError", "OutputLockedError",
           "UnfinishedRunError", "ConfigError", "PartialResultsError"]


class DataNotFoundError(FileNotFoundError):
    """A data set was not found in any of the places looked in; the message names them."""


class CorruptDataError(DataNotFoundError):
    """A data file exists but cannot be used (cut short, wrong format); the message names the file and the fix."""


class NotWritableError(PermissionError):
    """A folder the run must write to cannot be written (read-only, not a folder, no permission)."""


class DiskFullError(OSError):
    """No space left on the device while writing a file; nothing half-written was left behind."""


class OutputLockedError(RuntimeError):
    """Another running process holds the output folder's lock file (``<out>/.lock``)."""


class UnfinishedRunError(RuntimeError):
    """The output folder holds checkpoints of an unfinished run and neither resume nor fresh was asked for."""


class ConfigError(ValueError):
    """A setting that cannot work; ``field`` names the :class:`~mcd_helpers.config.MCDConfig` field.

    The command line shows it with the flag's name (``n_val`` -> ``--n-val``).
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return (type(self), (self.field, str(self)))

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


class PartialResultsError(RuntimeError):
    """Some OOD sets failed; the rows of the others were written. ``failures`` maps set name -> reason."""

    def __init__(self, message: str, failures: dict[str, str]):
        super().__init__(message)
        self.failures = failures

    def __reduce__(self):
        return (type(self), (str(self), self.failures))
