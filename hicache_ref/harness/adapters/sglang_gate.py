"""The thread gate: where upstream's storage threads park, and the harness lets one run.

The gate runs upstream's real storage thread functions on real threads, but every blocking
``get`` of theirs on a control queue is *served* by the harness: a thread parks at its ``get``
until the machine's ``storage_step`` grants it one item, runs one loop body of upstream's code,
and parks again at its next ``get``. In the order a thread meets them:

- ``GatedThread``: the module's ``threading.Thread`` (a thread's exception is kept for the step
  that ran it, so an ``InvariantViolation`` raised in upstream's collective reaches the
  machine; a parked thread sees a stop only once upstream joins it, so a thread its stopper
  forgets sleeps through the stop, as with an unlucky ``get(timeout=1)``);
- ``ServedQueue``: the module's ``Queue``, whose blocking ``get`` from a gated thread parks;
- ``StepGate``: the parked threads of one controller, ``serve`` (one grant), ``settle``;
- ``GateStopEvent``: upstream's ``storage_stop_event``, which wakes every parked thread.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from hicache_ref.controller.storage.collectives import StorageInterrupted
from hicache_ref.errors import HiCacheSetupError, InvariantViolation

STEP_TIMEOUT_S = 20.0
"""How long a served step may run (a collective's own timeout, 5 s, fires well before)."""
PARK_TIMEOUT_S = 10.0
"""How long a step waits for its thread to reach its ``get`` (right after attach or reset)."""
PARK_POLL_S = 1.0
"""A parked thread re-checks its stop this often even unwoken (a grant or a stop wakes it)."""


class GatedThread(threading.Thread):
    """A storage thread of upstream's controller: its ``get``s are served by its gate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        target = kwargs.get("target")
        owner = getattr(target, "__self__", None)
        self.gate: StepGate | None = getattr(owner, "_harness_gate", None)
        self.function = str(getattr(target, "__name__", ""))

    def start(self) -> None:
        """Started, then known to its gate: a thread created but not started yet is not alive,
        and one upstream starts from another storage thread (0.5.10's IO thread) registers
        under the gate's lock, so ``forget_dead`` never drops it."""
        super().start()
        if self.gate is not None:
            self.gate.register(self)

    def run(self) -> None:
        try:
            super().run()
        except BaseException as exc:  # kept for the step that ran this iteration
            if self.gate is not None:
                self.gate.record_error(self, exc)

    def join(self, timeout: float | None = None) -> None:
        """Upstream joins a thread it stopped: only now does the parked thread see the stop."""
        if self.gate is not None:
            self.gate.release(self)
        super().join(timeout)


class ServedQueue(queue.Queue[Any]):
    """``queue.Queue`` whose blocking ``get`` from a gated storage thread waits for the harness."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        thread = threading.current_thread()
        if not isinstance(thread, GatedThread) or thread.gate is None or not block:
            return super().get(block, timeout)
        return thread.gate.park(self, thread, timeout)


class StepGate:
    """Where one controller's storage threads park, and the harness grants one iteration."""

    def __init__(self, stop_event: Callable[[], bool]) -> None:
        self._stopping = stop_event
        self._cond = threading.Condition()
        self.threads: list[GatedThread] = []
        self._parked: dict[GatedThread, ServedQueue] = {}
        self._granted: set[GatedThread] = set()
        self._errors: dict[GatedThread, BaseException] = {}
        self._released: set[GatedThread] = set()  # joined by upstream while stopping
        self._closing = False
        self.deaths: list[str] = []  # storage threads upstream's code let die, and of what

    def park(self, source: ServedQueue, thread: GatedThread, timeout: float | None) -> Any:
        """Wait for a grant. A stop ends the wait only for a thread upstream joins (or when the
        world goes): upstream's ``get(timeout=1)`` poll is taken as not firing within the stop,
        so a thread its stopper never joins sleeps through it, the schedule that exposes a
        missing join (F23); every thread a stopper joins sees the stop at once, as before."""
        with self._cond:
            self._parked[thread] = source
            self._cond.notify_all()
            while thread not in self._granted:
                if self._stopping() and (thread in self._released or self._closing):
                    self._parked.pop(thread, None)
                    self._cond.notify_all()
                    break
                self._cond.wait(PARK_POLL_S)  # woken by a grant or a stop (GateStopEvent)
            else:
                self._granted.discard(thread)
                self._parked.pop(thread, None)
                return source.get_nowait()
        # stopping: take what is queued (a wake-up sentinel, or work upstream drains on stop),
        # else Empty at once, as its get would after its timeout (the thread then sees the stop)
        return queue.Queue.get(source, False)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def register(self, thread: GatedThread) -> None:
        with self._cond:
            self.threads.append(thread)
            self._cond.notify_all()

    def release(self, thread: GatedThread) -> None:
        """``thread`` is being joined: once stopped, it leaves its park."""
        with self._cond:
            self._released.add(thread)
            self._cond.notify_all()

    def close(self) -> None:
        """The world is gone: every parked thread sees the stop (no step follows)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def record_error(self, thread: GatedThread, exc: BaseException) -> None:
        with self._cond:
            self._errors[thread] = exc
            self._cond.notify_all()

    def serves(self, function: str) -> bool:
        """Whether a live thread runs upstream's ``function`` (its queue can still be served)."""
        with self._cond:
            return any(t.function == function and t.is_alive() for t in self.threads)

    def settle(self) -> None:
        """Wait until every live thread upstream started waits at its queue (or exited): a
        thread that starts another (0.5.10's prefetch thread starts its IO thread) registers it
        before it parks, so the next step meets every thread at its ``get``, whatever the host's
        load. Without it a reset right after attach raced the IO thread's start: started after
        the stop, it exited at once instead of parking, and F23 replayed one time in three."""
        with self._cond:
            self._cond.wait_for(
                lambda: all(t in self._parked or not t.is_alive() for t in self.threads),
                timeout=PARK_TIMEOUT_S,
            )

    def alive(self) -> list[str]:
        with self._cond:
            return [t.name for t in self.threads if t.is_alive()]

    def forget_dead(self) -> None:
        with self._cond:
            self.threads = [t for t in self.threads if t.is_alive()]
            self._released = {t for t in self._released if t.is_alive()}

    def serve(self, source: ServedQueue, what: str, rank: int = 0) -> None:
        """Grant one item of ``source`` to the thread parked on it; return once that thread
        finished the loop body (parked again, or exited). Its exception, if any, is raised."""
        with self._cond:
            thread = self._wait_parked(source, what)
            self._granted.add(thread)
            self._cond.notify_all()
            ended = self._cond.wait_for(
                lambda: (
                    (thread not in self._granted and thread in self._parked)
                    or not thread.is_alive()
                    or thread in self._errors
                ),
                timeout=STEP_TIMEOUT_S,
            )
            error = self._errors.pop(thread, None)
            state = (
                f"{thread.name}: alive={thread.is_alive()} granted={thread in self._granted} "
                f"parked={thread in self._parked}"
            )
        if isinstance(error, InvariantViolation):
            raise error  # a harness check inside the iteration (the rank group's collectives)
        if error is not None and not isinstance(error, StorageInterrupted):
            # upstream's thread died of it, as it would in production: nothing serves its queue
            # again (has_work), so the op it held and every one queued after it never acks
            self.deaths.append(f"{thread.function}: {type(error).__name__}: {error}")
            raise InvariantViolation(
                "INV-25",
                f"rank {rank}: upstream's {thread.function} died of {type(error).__name__} "
                f"({error}) in one {what} iteration; nothing serves its queue again, so its "
                "operation and every one queued after it are never acked (exactly one ack per "
                "operation, whatever the backend does; sglang#38427)",
            )
        # Verify the iteration ended: a thread stuck inside upstream's loop body is a hang
        if not ended:
            raise InvariantViolation(
                "INV-20",
                f"upstream's {what} thread did not finish one loop iteration within "
                f"{STEP_TIMEOUT_S:g} s (a wait inside its loop body that no rank answers; {state})",
            )

    def _wait_parked(self, source: ServedQueue, what: str) -> GatedThread:
        def parked() -> GatedThread | None:
            return next((t for t, q in self._parked.items() if q is source), None)

        self._cond.wait_for(lambda: parked() is not None, timeout=PARK_TIMEOUT_S)
        thread = parked()
        if thread is None:
            raise HiCacheSetupError(
                f"no upstream {what} thread waits on its queue (it exited or never started); "
                "the gate can only step a live storage thread"
            )
        return thread


class GateStopEvent(threading.Event):
    """Upstream's ``storage_stop_event``: setting it also wakes every parked thread at once."""

    def __init__(self, gate: StepGate) -> None:
        super().__init__()
        self._gate = weakref.ref(gate)

    def set(self) -> None:
        super().set()
        gate = self._gate()
        if gate is not None:
            gate.wake()
