"""Ctrl-C and SIGTERM stop a command alike. SIGTERM is what schedulers send to stop a job (Slurm at its time limit
or on ``scancel``, Kubernetes when it evicts a pod), SIGKILL following after a grace period.

:func:`handle_interrupts` turns SIGTERM into the ``KeyboardInterrupt`` Ctrl-C raises, so every place that handles
Ctrl-C (a fit's run folder, a tune worker's trials) handles it, and keeps either from being lost: Python raises a
signal's ``KeyboardInterrupt`` wherever the main thread is, and one raised inside a finalizer (a ``weakref.finalize``
callback, a ``__del__``: torch, Lightning and Optuna run many) is printed as "Exception ignored" and dropped, the
command running on as if no signal had come. :func:`_redeliver` delivers it again once the finalizer is done.
While a Lightning ``Trainer`` runs, its signal connector holds SIGTERM and calls this handler after its own:
Lightning sets ``trainer.received_sigterm`` and raises ``SIGTERMException`` (a ``SystemExit``) once the current batch
is done, and the handler here only records the signal. The command ends with :class:`Interrupted` and exits with
:func:`exit_code`, ``128 +`` the signal's number as a shell reports a process it stopped: 143 for SIGTERM, 130 for
Ctrl-C; once it has caught the stop, :func:`stopping` keeps a later Ctrl-C, or a dropped one delivered again, from
cutting that exit short. :func:`deferred` holds a stop for the few statements that must not be parted by one (a
trial claimed in the storage and recorded as this worker's).
"""
from __future__ import annotations

import _thread
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

REDELIVERY_DELAY = 0.05  # seconds from a dropped stop to its second delivery
_received: int | None = None  # SIGTERM once it arrived (Ctrl-C raises KeyboardInterrupt by Python's own handler)
_stopping = False  # the command reports its stop and exits (stopping())


class Interrupted(KeyboardInterrupt):
    """A command stopped by Ctrl-C or SIGTERM; the message says what was kept and how to go on."""


def handle_interrupts() -> None:
    """From now on SIGTERM stops this process as Ctrl-C does (main thread only, as every signal handler), and a stop
    raised inside a finalizer is delivered again after it."""
    global _received, _stopping
    _received, _stopping = None, False
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    if sys.unraisablehook is not _redeliver:
        _redeliver.previous = sys.unraisablehook
        sys.unraisablehook = _redeliver


def _redeliver(unraisable: "sys.UnraisableHookArgs") -> None:
    """``sys.unraisablehook``: a ``KeyboardInterrupt`` that a finalizer could not raise arrives again as SIGINT
    :data:`REDELIVERY_DELAY` later (``_thread.interrupt_main`` from a timer thread: called here, the signal would be
    raised at once, inside this hook, and dropped again), whose handler raises it in the main thread, by then
    outside the finalizer (a SIGTERM's stop too: :func:`signal_name` still names SIGTERM). Anything else goes to the
    hook that was there before."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        if not _stopping:
            timer = threading.Timer(REDELIVERY_DELAY, _deliver_again)
            timer.daemon = True
            timer.start()
    else:
        _redeliver.previous(unraisable)


_redeliver.previous = sys.unraisablehook


def _deliver_again() -> None:
    if not _stopping:  # the command may have begun its exit since the stop was dropped
        _thread.interrupt_main()


def stopping() -> None:
    """The command has caught its stop and now reports it and exits: from here on Ctrl-C is ignored (main thread) and
    no dropped stop is delivered again, so that nothing turns the exit (and its code, :func:`exit_code`) into an
    unhandled ``KeyboardInterrupt`` half-way (as Lightning ignores Ctrl-C while it shuts down)."""
    global _stopping
    _stopping = True
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM held while the block runs (in the main thread; elsewhere no signal lands), then delivered
    to the handlers there were, in the order they came: for statements that a stop must not part, such as a storage
    write and this process's record of it. A handler set outside Python (``signal.getsignal`` gives ``None``) is
    left in place: that signal is not held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    held = [signum for signum, handler in before.items() if handler is not None]
    for signum in held:
        signal.signal(signum, lambda number, frame: came.append(number))
    try:
        yield
    finally:
        for signum in held:
            signal.signal(signum, before[signum])
        for signum in dict.fromkeys(came):
            signal.raise_signal(signum)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _received
    first = _received is None
    _received = signum
    if first and signal.getsignal(signal.SIGTERM) is _on_sigterm:  # no Trainer's connector in front of this handler
        raise KeyboardInterrupt  # a second SIGTERM, while the first one's stop runs, does not cut it short


def signal_name() -> str:
    """The signal that stopped the command, as people name it."""
    return "SIGTERM" if _received is not None else "Ctrl-C"


def exit_code() -> int:
    """``128 +`` the stopping signal's number: 143 for SIGTERM, 130 for Ctrl-C (SIGINT)."""
    return 128 + (_received if _received is not None else signal.SIGINT)
