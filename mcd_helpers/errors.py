"""Every error class of the package, and the command line's exit code for each (:func:`exit_code`).

Each message says what is wrong and how to fix it. One module for all of them, imported by the
modules that raise them, so that no two modules import each other for an exception.
"""
from __future__ import annotations

import signal

__all__ = ["DataNotFoundError", "CorruptDataError", "ChecksumError", "NotWritableError", "DiskFullError",
           "OutputLockedError", "UnfinishedRunError", "ConfigError", "PartialResultsError", "CorruptCheckpointError",
           "CheckpointMismatchError", "NonFiniteLossError", "TrainingInterrupted", "GraphTooLargeError",
           "GraphvizMissingWarning", "exit_code"]


class DataNotFoundError(FileNotFoundError):
    """A data set was not found in any of the places looked in; the message names them."""


class CorruptDataError(DataNotFoundError):
    """A data file exists but cannot be used (cut short, wrong format); the message names the file and the fix."""


class ChecksumError(DataNotFoundError):
    """A data file exists but its MD5 sum is not the published one (cut short or another file)."""


class NotWritableError(PermissionError):
    """A folder the run must write to cannot be written (read-only, not a folder, no permission)."""


class DiskFullError(OSError):
    """No space left on the device while writing a file; nothing half-written was left behind."""


class OutputLockedError(RuntimeError):
    """Another running process holds the output folder's lock file (``<out>/.lock``)."""


class UnfinishedRunError(RuntimeError):
    """The output folder holds checkpoints of an unfinished run and neither resume nor fresh was asked for."""


class ConfigError(ValueError):
    """A setting that cannot work; ``field`` names the :class:`~mcd_helpers.experiments.config.MCDConfig` field.

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


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be read (cut short, or not a checkpoint)."""


class CheckpointMismatchError(ValueError):
    """Resuming found a checkpoint written by another stage or with other settings."""


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the message names the step and the loss parts."""


class TrainingInterrupted(RuntimeError):
    """SIGTERM or SIGINT (Ctrl-C) arrived; the stage was checkpointed after the step in progress.

    ``signal`` is the signal's number: the command line exits with ``128 + signal`` (143 for
    SIGTERM, 130 for SIGINT), as a shell reports a process killed by it.
    """

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.signal = int(signum)

    def __reduce__(self):
        return (type(self), (str(self), self.signal))


class GraphTooLargeError(ValueError):
    """The autograd graph has more nodes than a readable drawing can show; the message says how many."""


class GraphvizMissingWarning(UserWarning):
    """Graphviz's ``dot`` program is not installed: DOT source returned instead of a picture (a warning)."""


def exit_code(err: BaseException) -> int:
    """The command line's exit status for ``err``: the one mapping from errors to exit codes.

    * ``128 + signal`` for :class:`TrainingInterrupted` and ``KeyboardInterrupt`` (130 for SIGINT,
      143 for SIGTERM), as a shell reports a process killed by the signal;
    * 2 for a usage error the user can fix before running again: a bad setting, missing data,
      an unwritable or locked output folder, an unfinished run, settings that changed on resume;
    * 1 for a failure during the run: divergence, a corrupt checkpoint, a full disk, failed OOD
      sets, another file-system error.
    """
    if isinstance(err, TrainingInterrupted):
        return 128 + err.signal
    if isinstance(err, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(err, (PartialResultsError, NonFiniteLossError, CorruptCheckpointError, DiskFullError)):
        return 1
    if isinstance(err, (ConfigError, CheckpointMismatchError, DataNotFoundError, NotWritableError, OutputLockedError,
                        UnfinishedRunError, ValueError, KeyError)):
        return 2
    return 1
