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
- ``GateStopEvent``: upstream's ``storage_stop_event``, which wakes every parked thread;
- ``GatedLock`` / ``GatedEvent``: the module's ``threading.Lock`` and ``threading.Event``: an
  acquire, a ``set`` or a ``wait`` by a gated thread is a schedule point (``points.LOCK``,
  ``points.EVENT``), named by the class that made it (``PrefetchOperation._lock``).
"""

from __future__ import annotations

import queue
import sys
import threading
import weakref
from typing import Any

from hicache_ref.harness.schedule.gate import GatedThread, StepGate
from hicache_ref.harness.schedule.points import EVENT, LOCK, PUT, schedule_point

__all__ = ["GateStopEvent", "GatedEvent", "GatedLock", "GatedThread", "ServedQueue", "StepGate"]


def _gated_point(kind: str, detail: str) -> None:
    """Park the calling thread at ``kind`` if it is a gated thread of a world with points."""
    thread = threading.current_thread()
    gate = thread.gate if isinstance(thread, GatedThread) else None
    if gate is not None and gate.points:
        schedule_point(kind, detail)


def _maker(depth: int = 2) -> str:
    """The class whose method created the primitive (``PrefetchOperation``), as its name."""
    code = sys._getframe(depth).f_code
    return code.co_qualname.rsplit(".", 1)[0] if "." in code.co_qualname else code.co_name


class GatedLock:
    """``threading.Lock`` whose acquire by a gated storage thread is a schedule point. The
    thread parks before it asks for the lock, never while holding one of these."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.name = f"{_maker()}._lock"

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        _gated_point(LOCK, self.name)
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class GatedEvent(threading.Event):
    """``threading.Event`` whose ``set`` and ``wait`` by a gated storage thread are schedule
    points (a ``wait`` parks before it blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.name = f"{_maker()}.event"

    def set(self) -> None:
        _gated_point(EVENT, f"{self.name} set")
        super().set()

    def wait(self, timeout: float | None = None) -> bool:
        _gated_point(EVENT, f"{self.name} wait")
        return super().wait(timeout)


class ServedQueue(queue.Queue[Any]):
    """``queue.Queue`` whose blocking ``get`` from a gated storage thread waits for the harness."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        thread = threading.current_thread()
        if not isinstance(thread, GatedThread) or thread.gate is None or not block:
            return super().get(block, timeout)
        return thread.gate.park(self, thread, timeout)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """A put from a gated thread is a schedule point (``points.PUT``) before the item is
        visible, in a world with points; any other put passes at once."""
        thread = threading.current_thread()
        gate = thread.gate if isinstance(thread, GatedThread) else None
        if gate is not None and gate.points and id(self) not in gate.unpointed:
            schedule_point(PUT, gate.queue_names.get(id(self), "queue"))
        super().put(item, block, timeout)
        if gate is not None:
            gate.note_put(thread, item)  # type: ignore[arg-type]


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
