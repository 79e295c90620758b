"""How a campaign stops on Ctrl-C, SIGINT or SIGTERM: promptly, with what ran, and no false finding.

A terminal's Ctrl-C sends SIGINT to the whole process group; a CI runner that cancels a job or
times it out sends SIGTERM, often to the group too. Both end a campaign the same way:
``catching_stop_signals`` records the first signal in an ``Interrupt`` and raises
``KeyboardInterrupt`` in the main thread, which the rounds (``rounds.py``) take as the end of
the campaign: the report is written, marked interrupted, and the process exits 130 (SIGINT) or
143 (SIGTERM, ``get_exit_status``).

A signal can land in the middle of a step, leaving the world half-changed, and what the case
does next (its teardown's quiescence checks, Hypothesis' replay of the case) can raise an error
that the controller never caused. So an error that a round raises after this process (or its
fleet) was interrupted is never recorded as a failure: ``Interrupt`` is set by the handler
*before* the ``KeyboardInterrupt``, and the round checks it first.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_INTERRUPTED = 130
EXIT_BY_SIGNAL = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: 128 + signal.SIGTERM}
"""The exit status of a run a signal stopped: 128 + its number, as a shell reports it."""


class Interrupt:
    """The first stop signal this process received; an ``EventLike`` (``is_set``, ``set``).

    Set from a signal handler, so it takes no lock: a handler that waited on a lock the
    interrupted code holds would never return."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        """How many stop signals arrived (a second one: stop waiting)."""
        self.raised = False
        """Whether a ``KeyboardInterrupt`` is on its way (``catching_stop_signals`` raises one,
        not one per signal: a second could land in the first one's ``except`` block)."""

    def is_set(self) -> bool:
        return self.signum is not None

    def set(self, signum: int = signal.SIGINT) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum

    @property
    def label(self) -> str:
        """``SIGINT`` or ``SIGTERM`` (what stopped the run), or empty."""
        return "" if self.signum is None else signal.Signals(self.signum).name


@dataclass(frozen=True)
class EitherSet:
    """Set when either event is: a worker's view of its fleet's ``interrupt`` and its own
    ``Interrupt``. ``set`` sets only ``local`` (safe inside a signal handler)."""

    shared: Any
    local: Interrupt

    def is_set(self) -> bool:
        return self.local.is_set() or bool(self.shared.is_set())

    def set(self) -> None:
        self.local.set()


@contextmanager
def catching_stop_signals(interrupt: Interrupt) -> Iterator[Interrupt]:
    """SIGINT and SIGTERM set ``interrupt`` and raise ``KeyboardInterrupt`` (once: later ones
    are only counted, unless the first was lost) while inside; the previous handlers come back
    after, except where one was replaced inside (a worker that took to ``ignore_stop_signals``
    for its wrap-up keeps ignoring them while its process exits: a signal resent meanwhile
    would otherwise land in the join of its queue's feeder thread, a traceback on stderr)."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        interrupt.set(signum)
        if not interrupt.raised:
            interrupt.raised = True
            raise KeyboardInterrupt

    def drop_interrupts(unraisable: Any) -> None:
        """A ``KeyboardInterrupt`` that lands in a garbage-collector callback cannot stop
        anything there (Python prints and drops it): stay quiet, and let the next signal raise
        again. The ``Interrupt`` is set already, so the campaign stops at its next round (and
        a fleet sends its workers another signal)."""
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            interrupt.raised = False
        else:
            hook(unraisable)

    if threading.current_thread() is not threading.main_thread():
        yield interrupt  # only the main thread takes signals (a test calling main in a thread)
        return
    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    hook = sys.unraisablehook
    sys.unraisablehook = drop_interrupts
    try:
        yield interrupt
    finally:
        sys.unraisablehook = hook
        for signum, handler in previous.items():
            if signal.getsignal(signum) is on_signal:
                signal.signal(signum, handler)


@contextmanager
def noting_stop_signals(interrupt: Interrupt) -> Iterator[Interrupt]:
    """SIGINT and SIGTERM set ``interrupt`` and raise nothing while inside: for a loop that polls
    it (the fleet's parent waiting on its workers), where an exception could land inside a
    queue's lock and leave it held."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        interrupt.set(signum)

    if threading.current_thread() is not threading.main_thread():
        yield interrupt
        return
    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    try:
        yield interrupt
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def ignore_stop_signals() -> None:
    """From here on SIGINT and SIGTERM do nothing (a worker wrapping up its report)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM held back while inside, and delivered on the way out (the handler's
    ``KeyboardInterrupt`` then comes from here). A process started inside inherits the mask
    through exec, so a signal to the group can neither kill it half-started nor be lost: it
    stays pending until the process has its own handlers (``unblock_stop_signals``)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def unblock_stop_signals() -> None:
    """Take the stop signals held back since this process started (the handlers are in place)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def get_exit_status(interrupt: Interrupt) -> int:
    """130 after SIGINT (or a Ctrl-C), 143 after SIGTERM."""
    return EXIT_BY_SIGNAL.get(signal.Signals(interrupt.signum or signal.SIGINT), EXIT_INTERRUPTED)
