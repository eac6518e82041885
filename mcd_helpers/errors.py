"""The package's own error classes (the command line's exit code for each: ``experiments.cli``).

Everything else raises Python's own classes with a message that says what is wrong and how to fix
it: ``ValueError``/``TypeError`` for bad arguments, ``FloatingPointError`` for a diverged loss,
``PermissionError`` for a folder that cannot be written.
"""

import signal


class ConfigError(ValueError):
    """A setting that cannot work; ``field`` names it and ``flag`` is its command-line flag."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.flag = field, "--" + field.replace("_", "-")

    def __reduce__(self):  # pickled from rank 0 to the other ranks
        return type(self), (self.field, str(self))


class DataNotFoundError(FileNotFoundError):
    """A data set is missing or damaged; the message names where it looked and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint or cached network that cannot be read or does not fit; the message names the
    file and the fix."""


class TrainingInterrupted(RuntimeError):
    """SIGTERM or SIGINT arrived; the stage was checkpointed after the step in progress.

    ``signal``: the signal's number; the command line exits with ``128 + signal`` (143, 130).
    """

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.signal = int(signum)

    def __reduce__(self):
        return type(self), (str(self), self.signal)
