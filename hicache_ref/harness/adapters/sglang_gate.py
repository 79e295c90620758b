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
from typing import Any

from hicache_ref.harness.schedule.gate import GatedThread, StepGate
from hicache_ref.harness.schedule.points import PUT, schedule_point

__all__ = ["GateStopEvent", "GatedThread", "ServedQueue", "StepGate"]


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
