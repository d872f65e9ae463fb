"""User-facing errors: one clear line, exit code 2, no traceback (see ``mtmoe.cli``)."""


class UsageError(ValueError):
    """Bad input from the user (a flag, a file, a data root). The CLI prints ``error: <message>`` and exits 2."""
