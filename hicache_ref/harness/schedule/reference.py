"""The reference tier's face on the step gate: its four storage threads, parked by the harness.

``GatedExecutor`` is the executor the harness builds the reference's ``StorageTier`` with in a
world with schedule points (the seam ``StorageTier(executor=factory)``): the same four threads
per epoch as ``ThreadExecutor``, each a ``GatedThread`` that parks at its wait for work (a
``wait`` point: its source queue, or a transfer still in progress) and, inside a step, at every
point of ``points.py`` (the recording backend's calls, the rank group's collectives, the
queues' puts). The storage driver reaches it through the tier's own handles (``has_work``,
``run_step``), which ask the executor: ``has_work`` (the thread is parked mid-step, or waits
with work queued) and ``advance`` (grant it, wait until it parks again; the step's result once a
loop body ended). Its name is ``manual``: the harness runs every step, as with the manual
executor, but each on the thread that owns it.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from hicache_ref.controller.storage.collectives import StorageInterrupted
from hicache_ref.controller.storage.executor import ThreadExecutor
from hicache_ref.controller.storage.records import (
    THREAD_NAMES,
    StepResult,
    StorageStepKind,
)
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.schedule.gate import GatedThread, StepGate
from hicache_ref.harness.schedule.points import ALL_REDUCE, WAIT, Grant, Point

if TYPE_CHECKING:
    from hicache_ref.controller.storage.ports import ExecutorTier

logger = logging.getLogger("hicache_ref.controller.storage")


class GatedExecutor(ThreadExecutor):
    """Four gated threads per epoch; the harness grants them one point at a time."""

    name = "manual"

    def __init__(
        self,
        tier: ExecutorTier,
        *,
        points: bool = True,
        page_points: bool = False,
        lock_points: bool = False,
    ) -> None:
        super().__init__(tier)
        self.gate = StepGate(
            lambda: self._stop_event.is_set(),
            points=points,
            page_points=page_points,
            lock_points=lock_points,
        )
        self._results: dict[StorageStepKind, StepResult] = {}
        self.hold: set[StorageStepKind] = set()  # kinds whose thread waits at a collective
        self.next_grant = Grant()  # what the driver hands the next advance (its drawn outcome)

    @property
    def _tier(self) -> Any:
        return self.tier  # the whole StorageTier: its step components answer has_work

    def make_thread(
        self, kind: StorageStepKind, epoch: int, stop: threading.Event
    ) -> threading.Thread:
        return GatedThread(
            target=self.run_loop,
            args=(kind, epoch, stop),
            name=f"{THREAD_NAMES[kind]}-r{self.tier.collectives.rank}-e{epoch}",
            daemon=True,
            gate=self.gate,
            function=kind.value,
        )

    def start(self, epoch: int) -> None:
        self.gate.epoch = epoch
        super().start(epoch)
        self.gate.settle()  # every new thread at its wait before the next step is drawn

    def run_loop(self, kind: StorageStepKind, epoch: int, stop: threading.Event) -> None:
        """One storage thread: park at its wait, run one step when granted, until stopped."""
        tier = self.tier
        thread = threading.current_thread()
        assert isinstance(thread, GatedThread)
        source = tier.steps.source(kind).name if hasattr(tier.steps, "source") else kind.value
        while not stop.is_set():
            if tier.epoch != epoch:
                return  # an old-epoch thread never acts (INV-24)
            if not self.gate.park_wait(thread, source):
                continue  # stopping: the loop sees its stop
            try:
                self._results[kind] = tier.steps.run_of_epoch(kind, epoch)
            except StorageInterrupted:
                return
            except BaseException as exc:  # kept for check_storage_threads
                logger.info("storage thread %s failed", thread.name, exc_info=True)
                tier.steps.record_thread_error(exc)
                if isinstance(exc, InvariantViolation):
                    return

    def stop(self) -> None:
        """Stop and join this epoch's threads; one parked inside a step runs it to its end
        (``ok`` at every point), its collectives abandoned (the peers stop after it)."""
        group = getattr(self.tier.collectives, "group", None)
        if group is not None:
            group.interrupt()
        try:
            super().stop()
        finally:
            if group is not None:
                group.resume()

    def close(self) -> None:
        """The world is gone: every parked thread sees the stop at once (no step follows)."""
        group = getattr(self.tier.collectives, "group", None)
        if group is not None:
            group.interrupt()
        self._stop_event.set()
        self.gate.close()

    # -- the harness's handles (through StepRunner.has_work / run_manual) ---------------------
    def position(self, kind: StorageStepKind) -> tuple[GatedThread, Point] | None:
        """Where the ``kind`` thread parks: one parked inside its step first (of any epoch:
        a thread a reset left behind is granted, and INV-35 names it), else the newest."""
        return self.gate.position(kind.value)

    def current_request(self, kind: StorageStepKind) -> str | None:
        """The prefetch the IO step works on (the reference's transfer in progress)."""
        transfer = self._tier.prefetch_io.current if kind is StorageStepKind.IO else None
        return None if transfer is None else str(transfer.operation.request_id)

    def has_work(self, kind: StorageStepKind) -> bool:
        at = self.position(kind)
        if at is None:
            return False
        if at[1].kind != WAIT:
            return True
        return bool(self._tier.steps.component(kind).has_work())

    def advance(self, kind: StorageStepKind, grant: Grant | None = None) -> StepResult:
        """Run the ``kind`` thread to its next point; the step's result once a body ended."""
        tier = self._tier
        at = self.position(kind)
        if at is None or not self.has_work(kind):
            return StepResult(kind, tier.rank, tier.epoch)
        thread, point = at
        if kind in self.hold and point.kind == ALL_REDUCE:
            return StepResult(kind, tier.rank, tier.epoch)  # a peer is not there yet
        self._results.pop(kind, None)
        self.gate.resume(thread, grant or self.next_grant, kind.value, tier.rank)
        tier.check_storage_threads()
        return self._results.pop(kind, None) or StepResult(kind, tier.rank, tier.epoch)


def gated_executor(
    points: bool = True, page_points: bool = False, lock_points: bool = False
) -> Any:
    """The factory a reference controller takes as ``storage_executor``."""

    def build(tier: ExecutorTier) -> GatedExecutor:
        return GatedExecutor(tier, points=points, page_points=page_points, lock_points=lock_points)

    return build
