"""User-facing errors: one clear line and an exit code, no traceback (see ``mtmoe.cli``)."""


class UsageError(ValueError):
    """Bad input from the user (a flag, a file, a data root). The CLI prints ``error: <message>`` and exits 2."""


class TrainingDiverged(RuntimeError):
    """A ``fit`` whose loss turned NaN or infinite: its results are written, then ``error: <message>``, exit 1."""
