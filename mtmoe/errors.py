"""User-facing errors: one clear line and an exit code, no traceback (see ``mtmoe.cli``)."""
from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable


class UsageError(ValueError):
    """Bad input from the user (a flag, a file, a data root). The CLI prints ``error: <message>`` and exits 2."""


class SettingError(UsageError):
    """A setting's value outside what it allows: ``setting`` names it as its class's argument (``k``; ``gate.k`` for
    the model's gate, :meth:`within`), ``allowed`` says what it allows (``must satisfy 1 <= k <= n_experts = 16``),
    ``related`` the other settings of the same class that bound it (``n_experts``). The command line names the flags
    (:meth:`flagged`); the Python API shows the message as it is."""

    def __init__(self, setting: str, value: object, allowed: str, related: tuple[str, ...] = ()) -> None:
        self.setting, self.value, self.allowed, self.related = setting, value, allowed, related
        super().__init__(f"{self.requirement}, got {value}")

    @property
    def requirement(self) -> str:
        """What the setting allows, in words: ``k must satisfy 1 <= k <= n_experts = 16``."""
        return f"{self.setting.rpartition('.')[2]} {self.allowed}"

    def within(self, group: str) -> SettingError:
        """The same error of a setting of ``group`` (the model's ``gate``), bounded by the same related settings."""
        return SettingError(f"{group}.{self.setting}", self.value, self.allowed, self.related)

    def flagged(self, prefix: str) -> UsageError:
        """The error as the command line gives the setting: ``--model.gate.k 20 is not allowed: k must satisfy
        ...; pass another --model.gate.k, or change --model.n_experts`` for ``prefix`` ``--model.``."""
        flag = f"{prefix}{self.setting}"
        change = "".join(f", or change {prefix}{name}" for name in self.related)
        return UsageError(f"{flag} {self.value} is not allowed: {self.requirement}; pass another {flag}{change}")


class TrainingDiverged(RuntimeError):
    """A ``fit`` whose loss turned NaN or infinite: its results are written, then ``error: <message>``, exit 1."""


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser of the command line's argparse commands: every parse error (a missing required flag too,
    which ``exit_on_error=False`` does not cover before Python 3.12) is a one-line :class:`UsageError`, an
    abbreviated option (``--max`` for ``--max-budget``) is refused, not expanded, and ``--max_budget`` is
    ``--max-budget``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{"exit_on_error": False, "allow_abbrev": False, **kwargs})

    def parse_known_args(self, args=None, namespace=None):
        """Both spellings of an option: ``--study_name`` (the style of ``fit``'s ``--trainer.max_epochs``) is
        ``--study-name``; help shows the hyphen. A bad value (``--draws many``) is a UsageError as :meth:`error`'s."""
        args = sys.argv[1:] if args is None else args
        try:
            return super().parse_known_args([self._canonical(arg) for arg in args], namespace)
        except argparse.ArgumentError as error:
            self.error(str(error))

    def _canonical(self, arg: str) -> str:
        flag, eq, value = arg.partition("=")
        hyphens = "--" + flag[2:].replace("_", "-")
        if flag.startswith("--") and flag not in self._option_string_actions and hyphens in self._option_string_actions:
            return hyphens + eq + value
        return arg

    def error(self, message: str):
        raise UsageError(f"{self.prog.removeprefix('python -m mtmoe ')}: {message}")


def did_you_mean(given: str, options: Iterable[str]) -> str:
    """``: did you mean --OPTION?`` for an unknown option ``given`` close to one of ``options`` (flags such as
    ``--trainer.max_epochs``), else ``""``; never the group of a dotted one (``--trainer`` for ``--trainer.foo``)."""
    given = given.partition("=")[0]
    options = [option for option in options if option.startswith("--") and not given.startswith(option + ".")]
    longer = [option for option in options if option.startswith(given)]
    close = longer if len(longer) == 1 else difflib.get_close_matches(given, options, n=1)
    if not close:
        return ""
    return f": did you mean {close[0]}?" + (" (options are not abbreviated)" if close[0].startswith(given) else "")


def suggestion(given: str, names: Iterable[str], suffix: str = "") -> str:
    """``; did you mean NAME?`` for a mistyped name ``given`` close to one of ``names`` (gates, datasets), else
    ``""``; ``suffix`` is appended to the name (a gate's "+")."""
    close = difflib.get_close_matches(given, list(names), n=1)
    return f"; did you mean {close[0]}{suffix}?" if close else ""
