"""Who runs the storage steps: real threads (``thread``, production) or the caller (``manual``).

- ``ThreadExecutor`` starts four threads per epoch, one per step kind, each looping "wait for
  work, run one step" until its epoch's stop event is set. Every epoch gets a *new* stop event,
  so a thread of an old epoch can never see its stop cleared and resume (sglang#36882); a thread
  whose epoch is no longer the tier's stops before acting (INV-24). ``stop`` joins every thread
  with a bound and raises if one survives. A step that raises is kept in ``tier.thread_errors``
  (``check_storage_threads`` re-raises it); a broken invariant ends its thread, anything else is
  logged and the thread goes on, so one bad batch never stops the tier (sglang#27501).
- ``ManualExecutor`` starts nothing: ``tier.run_step(kind)`` runs one step when the caller says
  (tests, the harness; ``lockstep.py`` runs one step on every rank at once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from hicache_ref.controller.storage.collectives import StorageInterrupted
from hicache_ref.controller.storage.records import STEP_KINDS, THREAD_NAMES, StorageStepKind
from hicache_ref.errors import InvariantViolation

if TYPE_CHECKING:
    from hicache_ref.controller.storage.ports import ExecutorTier

logger = logging.getLogger("hicache_ref.controller.storage")

STORAGE_EXECUTORS = ("thread", "manual")
STORAGE_POLL_S = 0.05
"""How long an idle storage thread waits for work before re-checking its stop event."""
STORAGE_JOIN_TIMEOUT_S = 10.0
START_WAIT_S = 0.2
"""How long ``stop`` gives a thread whose ``start`` was interrupted to show it runs."""
STORAGE_ERRORS_MAX = 64


class StorageExecutor(Protocol):
    name: str

    def start(self, epoch: int) -> None: ...

    def stop(self) -> None: ...

    def alive_threads(self) -> list[str]: ...


class ManualExecutor:
    """No threads: steps run when the caller runs them."""

    name = "manual"

    def __init__(self, tier: ExecutorTier) -> None:
        self.tier = tier

    def start(self, epoch: int) -> None:
        return None

    def stop(self) -> None:
        return None

    def alive_threads(self) -> list[str]:
        return []


class ThreadExecutor:
    """Four threads per epoch, each running one step kind."""

    name = "thread"

    def __init__(self, tier: ExecutorTier) -> None:
        self.tier = tier
        self._threads: list[threading.Thread] = []
        self._stop_event = threading.Event()

    def start(self, epoch: int) -> None:
        # Verify the previous epoch's threads are gone before new ones start (INV-24)
        if self.alive_threads():
            raise InvariantViolation(
                "INV-24",
                f"storage threads {self.alive_threads()} still alive when epoch {epoch} starts "
                "(stop and join every thread before starting new ones)",
            )
        self._stop_event = threading.Event()
        self._threads = [self.make_thread(kind, epoch, self._stop_event) for kind in STEP_KINDS]
        for thread in self._threads:
            thread.start()

    def make_thread(
        self, kind: StorageStepKind, epoch: int, stop: threading.Event
    ) -> threading.Thread:
        """The ``kind`` thread of ``epoch`` (a harness's executor makes threads it can park)."""
        return threading.Thread(
            target=self.run_loop,
            args=(kind, epoch, stop),
            name=f"{THREAD_NAMES[kind]}-r{self.tier.collectives.rank}-e{epoch}",
            daemon=True,
        )

    def run_loop(self, kind: StorageStepKind, epoch: int, stop: threading.Event) -> None:
        """One storage thread: run ``kind`` steps of ``epoch`` until stopped."""
        tier = self.tier
        while not stop.is_set():
            if tier.epoch != epoch:
                return  # an old-epoch thread never acts (INV-24)
            if not tier.steps.has_work(kind):
                tier.steps.wait_for_work(kind, STORAGE_POLL_S)
                continue
            try:
                tier.steps.run_of_epoch(kind, epoch)
            except StorageInterrupted:
                return
            except BaseException as exc:  # kept for check_storage_threads
                logger.exception("storage thread %s failed", threading.current_thread().name)
                tier.steps.record_thread_error(exc)
                if isinstance(exc, InvariantViolation):
                    return

    def stop(self) -> None:
        """Stop and join this epoch's threads; raise if one survives the bound (no thread of
        this epoch, parked anywhere, runs in the next: INV-24, INV-35)."""
        self._stop_event.set()
        self.tier.queues.wake_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                _join_started(thread, STORAGE_JOIN_TIMEOUT_S)
        alive = self.alive_threads()
        if alive:
            raise RuntimeError(f"Failed to stop HiCache storage threads cleanly: {alive}")
        self._threads = []

    def alive_threads(self) -> list[str]:
        return [thread.name for thread in self._threads if thread.is_alive()]


def _join_started(thread: threading.Thread, timeout: float) -> None:
    """Join ``thread``, if it ever started: a Ctrl-C inside ``start`` (an attach interrupted
    while its threads start) leaves one created but never run, or one running whose ``start``
    did not see it begin; the rollback's stop must end the others, not raise that it cannot
    join this one."""
    try:
        thread.join(timeout=timeout)
        return
    except RuntimeError:  # "cannot join thread before it is started"
        pass
    deadline = time.monotonic() + START_WAIT_S
    while thread.ident is None or not thread.is_alive():
        if time.monotonic() >= deadline:
            return  # never started: nothing runs to join
        time.sleep(0.001)
    thread.join(timeout=timeout)


ExecutorFactory = Callable[["ExecutorTier"], "StorageExecutor"]
"""An executor built for a tier by its caller (the harness's gated executor)."""


def make_executor(name: str | ExecutorFactory, tier: ExecutorTier) -> StorageExecutor:
    """A named executor, or the one a factory builds for ``tier`` (the harness's gated one)."""
    from hicache_ref.errors import UnknownOptionError

    if callable(name):
        return name(tier)
    if name == "thread":
        return ThreadExecutor(tier)
    if name == "manual":
        return ManualExecutor(tier)
    raise UnknownOptionError(
        f"unknown storage_executor {name!r}; legal values: {', '.join(STORAGE_EXECUTORS)}"
    )
