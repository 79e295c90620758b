"""The step gate: where one controller's storage threads park, and the harness lets one run.

Every storage thread of a gated controller is a ``GatedThread``. It parks at its loop's wait
for work (upstream's served ``queue.get``, the reference executor's wait) and, in a world with
points (``StepGate.points``), at every schedule point of ``points.py`` inside the loop body: a
backend call, a collective, a put on a control queue. The harness grants one parked thread at a
time (``serve`` a thread waiting on a queue, ``resume`` one parked anywhere) and waits until it
parks again, exits or raises, so what runs between two grants is one thread's code from one
point to the next, and the same grants give the same run on any host. In the order a case meets
them:

- ``GatedThread``: a thread that knows its gate (``gate=``, or its target's owner's
  ``_harness_gate``: upstream's controller); it parks through ``park_at_point``, keeps its
  exception for the grant that ran it, and sees a stop only once it is joined;
- ``StepGate``: ``park`` / ``park_point`` (the thread's side; ``points_only`` narrows the points
  to some thread functions: a PP world's command threads), ``serve`` / ``resume`` (the
  harness's), ``positions`` / ``position`` (who is parked where), ``settle``, ``release`` /
  ``close``, and ``grants``: the harness's own record of every grant (which thread, of which
  epoch, at which point), which the window checks read (INV-35);
- ``close_gates_at_exit``: at interpreter exit every parked gated thread unwinds
  (``GateClosed``) and is joined, so none runs torch code while the interpreter finalizes.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hicache_ref.controller.storage.collectives import StorageInterrupted
from hicache_ref.errors import HiCacheSetupError, InvariantViolation
from hicache_ref.harness.schedule.points import LOCK, PAGE_WRITE, WAIT, Grant, Point

STEP_TIMEOUT_S = 20.0
"""How long a served step may run (a collective's own timeout, 5 s, fires well before)."""
PARK_TIMEOUT_S = 10.0
"""How long a step waits for its thread to reach its ``get`` (right after attach or reset)."""
PARK_POLL_S = 1.0
"""A parked thread re-checks its stop this often even unwoken (a grant or a stop wakes it)."""
EXIT_JOIN_S = 2.0
"""How long interpreter exit waits, in all, for the gated threads to unwind."""
GRANTS_MAX = 100_000
"""Bound on the grant record (TigerStyle); the oldest entries go first."""


def _holds_work(point: Point) -> bool:
    """A wait on a queue that is not empty now."""
    empty = getattr(point.source, "empty", None)
    return point.kind == WAIT and callable(empty) and not empty()


class GateClosed(BaseException):
    """The interpreter is exiting: a parked gated thread unwinds instead of waiting on (a
    ``BaseException``, so no ``except Exception`` of the thread's own code keeps it)."""


def close_gates_at_exit() -> None:
    """Unwind and join every gated thread of this process (registered with ``atexit``).

    A daemon thread still running when the interpreter finalizes is ended by ``pthread_exit``
    the moment it next takes the GIL; inside torch's C++ (a tensor freed, say) that unwind
    aborts the whole process ("terminate called without an active exception"), after every
    test passed. So a thread parked at a gate raises ``GateClosed`` and ends, and exit waits
    for each (``EXIT_JOIN_S`` in all). The gates are found through their live threads."""
    gates = {
        thread.gate
        for thread in threading.enumerate()
        if isinstance(thread, GatedThread) and thread.gate is not None
    }
    for gate in gates:
        gate.unwind()
    deadline = time.monotonic() + EXIT_JOIN_S
    for gate in gates:
        for thread in list(gate.threads):
            if thread is not threading.current_thread() and thread.is_alive():
                threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))


atexit.register(close_gates_at_exit)


@dataclass(frozen=True)
class GrantRecord:
    """One grant the harness gave: the thread, the epoch it was started in, the gate's epoch
    at the grant, and the point it was parked at."""

    thread: str
    function: str
    thread_epoch: int
    epoch: int
    point: str


class GatedThread(threading.Thread):
    """A storage thread whose waits and schedule points are served by its gate."""

    def __init__(
        self, *args: Any, gate: StepGate | None = None, function: str = "", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        target = getattr(self, "_target", None)  # threading.Thread keeps its target there
        owner = getattr(target, "__self__", None)
        self.gate: StepGate | None = gate or getattr(owner, "_harness_gate", None)
        self.function = function or str(getattr(target, "__name__", ""))
        self.epoch = 0

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
        finally:
            if self.gate is not None:
                self.gate.exited(self)  # a grant waiting for this thread sees it end at once

    def join(self, timeout: float | None = None) -> None:
        """Joined by its stopper: only now does the parked thread see the stop."""
        if self.gate is not None:
            self.gate.release(self)
        super().join(timeout)

    def note_put(self, item: Any) -> None:
        """A queue this thread put ``item`` on made it visible (the reference's queues)."""
        if self.gate is not None:
            self.gate.note_visible(self, item)

    def park_at_point(self, kind: str, detail: str = "") -> Grant:
        """Park here until granted (``points.schedule_point``); a gate without points, or no
        gate, lets the thread pass."""
        if self.gate is None:
            return Grant()
        return self.gate.park_point(self, kind, detail)


class StepGate:
    """Where one controller's storage threads park, and the harness grants one of them."""

    def __init__(
        self,
        stop_event: Callable[[], bool],
        *,
        points: bool = False,
        page_points: bool = False,
        lock_points: bool = True,
    ) -> None:
        self._stopping = stop_event
        self.points = points  # park at every schedule point, not only at the wait for work
        self.page_points = points and page_points  # also before each host page write
        # also before each operation-lock acquire (upstream's gates always; the reference's
        # with ``storage_lock_points``)
        self.lock_points = points and lock_points
        # only these thread functions park at points inside their loop bodies (None: all); a
        # PP world without storage points parks its command thread alone (``driver/pp_tree.py``)
        self.points_only: frozenset[str] | None = None
        self.epoch = 0  # the tier's storage epoch: a thread keeps the one it was started in
        self._lock = threading.RLock()
        # the harness's side waits on ``_cond`` (a thread parked, exited or raised); each parked
        # thread waits on its own condition of the same lock, so a grant wakes only the thread
        # granted, and a park wakes only the harness (one shared condition woke every parked
        # thread of the gate at each grant and each park, and each went back to sleep)
        self._cond = threading.Condition(self._lock)
        self._wakeups: dict[GatedThread, threading.Condition] = {}
        # ``positions`` per function, kept until a thread parks, leaves its park or registers
        # (the driver asks each kind's position several times per step, between two grants)
        self._positions: dict[str, tuple[tuple[GatedThread, Point], ...]] = {}
        self._position: dict[str, tuple[GatedThread, Point] | None] = {}
        self.threads: list[GatedThread] = []
        self._parked: dict[GatedThread, Point] = {}
        self._granted: dict[GatedThread, Grant] = {}
        self._errors: dict[GatedThread, BaseException] = {}
        self._released: set[GatedThread] = set()  # joined by upstream while stopping
        self._exited: set[GatedThread] = set()  # left run(): no grant waits for them
        self._closing = False
        self._closed_seen: set[GatedThread] = set()  # left a park since the world went
        self.deaths: list[str] = []  # storage threads upstream's code let die, and of what
        self.grants: list[GrantRecord] = []
        self.queue_names: dict[int, str] = {}  # id(queue) -> its attribute name (the trace's)
        self.unpointed: set[int] = set()  # id(queue) whose puts are no schedule point
        self.puts: dict[str, list[Any]] = {}  # function -> what its current loop body put
        self._unwinding = False  # the interpreter exits: a parked thread ends (GateClosed)
        self.visible: list[tuple[str, Any]] = []  # (function, item) put since the last take

    # -- the thread's side -------------------------------------------------------------------------
    def park(self, source: Any, thread: GatedThread, timeout: float | None) -> Any:
        """A served ``get``: wait for a grant, then take the head of ``source``. A stop ends
        the wait only for a thread its stopper joins (or when the world goes): upstream's
        ``get(timeout=1)`` poll is taken as not firing within the stop, so a thread its stopper
        never joins sleeps through it, the schedule that exposes a missing join (F23); every
        thread a stopper joins sees the stop at once."""
        name = self.queue_names.get(id(source), "queue")
        if self._wait(thread, Point(WAIT, name, source)) is not None:
            return source.get_nowait()
        # stopping: take what is queued (a wake-up sentinel, or work upstream drains on stop),
        # else Empty at once, as its get would after its timeout (the thread then sees the stop)
        return queue.Queue.get(source, False)

    def park_wait(self, thread: GatedThread, name: str) -> bool:
        """A loop's wait for work that is not a served queue (the reference's executor): wait
        for a grant; False when stopping (the loop then sees its stop)."""
        return self._wait(thread, Point(WAIT, name)) is not None

    def park_point(self, thread: GatedThread, kind: str, detail: str) -> Grant:
        """A schedule point inside a loop body (only in a world with points): wait for a grant;
        a stopping thread that is joined runs on (``ok``)."""
        if not self.points or (kind == PAGE_WRITE and not self.page_points):
            return Grant()
        if kind == LOCK and not self.lock_points:
            return Grant()
        if self.points_only is not None and thread.function not in self.points_only:
            return Grant()
        return self._wait(thread, Point(kind, detail)) or Grant()

    def _wait(self, thread: GatedThread, point: Point) -> Grant | None:
        with self._cond:
            wakeup = self._wakeups.get(thread)
            if wakeup is None:
                wakeup = self._wakeups[thread] = threading.Condition(self._lock)
            self._parked[thread] = point
            self._forget_positions()
            self._cond.notify_all()
            while thread not in self._granted:
                if self._unwinding:
                    self._unpark(thread)
                    self._cond.notify_all()
                    raise GateClosed(thread.name)
                if self._closing and thread in self._closed_seen:
                    # the world is gone and the thread parks again: a loop that exits only on
                    # an item (0.5.23's PP ticket thread) would spin on empty gets; it unwinds
                    self._unpark(thread)
                    self._cond.notify_all()
                    raise GateClosed(thread.name)
                if self._stopping() and (thread in self._released or self._closing):
                    if self._closing:
                        self._closed_seen.add(thread)
                    self._unpark(thread)
                    self._cond.notify_all()
                    return None
                if thread in self._released and (point.kind != WAIT or _holds_work(point)):
                    # joined mid-body: it runs on (its stopper waits for it), as with a stop
                    # event; at its wait, joined by a stopper that signals through the queue
                    # (0.5.23's PP ticket thread: a None put before the join): it takes it
                    self._unpark(thread)
                    self._cond.notify_all()
                    return None
                wakeup.wait(PARK_POLL_S)  # woken by its grant or a stop (GateStopEvent)
            self._unpark(thread)
            return self._granted.pop(thread)

    def _forget_positions(self) -> None:
        """A thread parked, left its park, registered or was forgotten (the caller holds the
        lock): ``positions`` and ``position`` are computed afresh."""
        self._positions.clear()
        self._position.clear()

    def _unpark(self, thread: GatedThread) -> None:
        """``thread`` leaves its park (the caller holds the lock)."""
        self._parked.pop(thread, None)
        self._forget_positions()

    def _wake_parked(self) -> None:
        """Wake every parked thread (a stop, a close, an unwind: each looks at its own stop);
        the caller holds the lock."""
        for wakeup in self._wakeups.values():
            wakeup.notify()
        self._cond.notify_all()

    def register(self, thread: GatedThread) -> None:
        with self._cond:
            thread.epoch = self.epoch
            self.threads.append(thread)
            self._forget_positions()
            self._cond.notify_all()

    def note_put(self, thread: GatedThread, item: Any) -> None:
        """What ``thread``'s loop body put on a control queue (its iteration's result)."""
        with self._cond:
            self.puts.setdefault(thread.function, []).append(item)
        self.note_visible(thread, item)

    def note_visible(self, thread: GatedThread, item: Any) -> None:
        """``item`` is on a control queue now (with points: the driver judges it at once)."""
        if not self.points:
            return
        with self._cond:
            if len(self.visible) >= GRANTS_MAX:
                del self.visible[0]
            self.visible.append((thread.function, item))

    def take_visible(self) -> list[tuple[str, Any]]:
        """What gated threads put since the last call, oldest first."""
        with self._cond:
            taken, self.visible = self.visible, []
        return taken

    def exited(self, thread: GatedThread) -> None:
        """``thread`` is leaving ``run``: a grant waiting for it to park again stops waiting."""
        with self._cond:
            self._exited.add(thread)
            self._wakeups.pop(thread, None)  # it never parks again
            self._cond.notify_all()

    def record_error(self, thread: GatedThread, exc: BaseException) -> None:
        with self._cond:
            self._errors[thread] = exc
            self._cond.notify_all()

    # -- stopping ----------------------------------------------------------------------------------
    def wake(self) -> None:
        with self._cond:
            self._wake_parked()

    def release(self, thread: GatedThread) -> None:
        """``thread`` is being joined: once stopped, it leaves its park."""
        with self._cond:
            self._released.add(thread)
            self._wake_parked()

    def close(self) -> None:
        """The world is gone: every parked thread sees the stop (no step follows)."""
        with self._cond:
            self._closing = True
            self._wake_parked()

    def unwind(self) -> None:
        """The interpreter exits: every parked thread, and each that parks from now on, ends
        by ``GateClosed`` instead of waiting or running on."""
        with self._cond:
            self._unwinding = self._closing = True
            self._wake_parked()

    # -- the harness's side ------------------------------------------------------------------------
    def serves(self, function: str) -> bool:
        """Whether a live thread runs ``function`` (its queue can still be served)."""
        with self._cond:
            return any(t.function == function and t.is_alive() for t in self.threads)

    def positions(self, function: str) -> tuple[tuple[GatedThread, Point], ...]:
        """The live threads of ``function`` and where each is parked, newest first (a thread
        not parked right now, i.e. exiting, is left out). Kept until the next park, unpark or
        registration: a parked thread is alive (it leaves ``_parked`` before it can end)."""
        with self._cond:
            at = self._positions.get(function)
            if at is None:
                at = self._positions[function] = tuple(
                    (t, self._parked[t])
                    for t in reversed(self.threads)
                    if t.function == function and t in self._parked and t.is_alive()
                )
            return at

    def position(self, function: str) -> tuple[GatedThread, Point] | None:
        """Where the ``function`` thread parks: one parked inside its loop body first (of any
        epoch: a thread a reset left behind is granted, and INV-35 names it), else the newest;
        None when none is parked. Kept as ``positions`` is."""
        with self._cond:
            if function not in self._position:
                at = self.positions(function)
                self._position[function] = next(
                    (a for a in at if a[1].kind != WAIT), at[0] if at else None
                )
            return self._position[function]

    def settle(self) -> None:
        """Wait until every live thread waits at a point (or exited): a thread that starts
        another (0.5.10's prefetch thread starts its IO thread) registers it before it parks,
        so the next step meets every thread parked, whatever the host's load. Without it a reset
        right after attach raced the IO thread's start: started after the stop, it exited at
        once instead of parking, and F23 replayed one time in three."""
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
            self._forget_positions()
            self._released = {t for t in self._released if t.is_alive()}
            self._exited = {t for t in self._exited if t.is_alive()}

    def serve(self, source: Any, what: str, rank: int = 0) -> None:
        """Grant one item of ``source`` to the thread parked on it; return once that thread
        reached its next point (parked again, or exited). Its exception, if any, is raised."""
        with self._cond:
            thread = self._wait_parked(source, what)
        self.resume(thread, Grant(), what, rank)

    def resume(self, thread: GatedThread, grant: Grant, what: str, rank: int = 0) -> None:
        """Let ``thread`` (parked anywhere) run to its next point with ``grant``; its exception,
        if any, is raised."""
        with self._cond:
            point = self._parked.get(thread)
            if len(self.grants) >= GRANTS_MAX:
                del self.grants[0]
            self.grants.append(
                GrantRecord(
                    thread.name,
                    thread.function,
                    thread.epoch,
                    self.epoch,
                    "" if point is None else point.describe(),
                )
            )
            self._granted[thread] = grant
            wakeup = self._wakeups.get(thread)
            if wakeup is not None:  # None: it has not reached its first park yet
                wakeup.notify()
            ended = self._cond.wait_for(
                lambda: (
                    (thread not in self._granted and thread in self._parked)
                    or not thread.is_alive()
                    or thread in self._exited
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

    def _wait_parked(self, source: Any, what: str) -> GatedThread:
        def parked() -> GatedThread | None:
            return next(
                (t for t, p in self._parked.items() if p.kind == WAIT and p.source is source),
                None,
            )

        self._cond.wait_for(lambda: parked() is not None, timeout=PARK_TIMEOUT_S)
        thread = parked()
        if thread is None:
            raise HiCacheSetupError(
                f"no upstream {what} thread waits on its queue (it exited or never started); "
                "the gate can only step a live storage thread"
            )
        return thread
