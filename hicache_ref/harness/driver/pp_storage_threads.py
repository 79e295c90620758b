"""The IO, sync and backup threads of a PP world, stepped by the harness (``pp_tree.PpTree``).

Every PP rank's storage threads are upstream's own, on gated threads. Without storage points a
step runs one whole loop body of a thread kind on every rank at once (``run_lockstep``); with
them (``PpTree(storage_points=True)``) every thread parks at the points it parks at in any
storage world with points, and a step runs the kind's thread of every rank to its next point.
In the order a step needs them:

- ``step``: one step of a kind on every rank; under points a rank parked at a collective waits
  there until every rank's is, then all go at once (``storage_points.PointSchedule``'s holds);
- ``stopped_at``: whether a step landed where a program's step asked (a kind of point, or the
  body's end: ``wait``);
- ``busy``: some IO or sync thread has work (parked inside its body, or an item queued);
- ``stuck``: at rest, a thread still parked at a collective no peer reaches (INV-20).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.storage.collectives import RankGroup
from hicache_ref.controller.storage.lockstep import LockstepThreads, run_lockstep
from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.harness.driver.storage_points import PointSchedule
from hicache_ref.harness.schedule.points import WAIT, Grant, position

TICKET_KINDS = (StorageStepKind.IO, StorageStepKind.SYNC)
"""The threads a ticket passes through after its command step, in order."""


class PpStorageThreads:
    """Every PP rank's IO, sync and backup threads, and how the harness steps them."""

    def __init__(
        self,
        controllers: list[Any],
        group: RankGroup,
        threads: LockstepThreads | None,
        *,
        points: bool,
    ) -> None:
        self.cc = controllers
        self.group = group
        self.threads = threads
        self.schedule = PointSchedule(len(controllers)) if points else None

    @property
    def tiers(self) -> list[Any]:
        return [c.storage for c in self.cc]

    def step(self, kind: StorageStepKind) -> bool:
        """The ``kind`` thread of every rank, one body or one point (False: none could move)."""
        tiers = self.tiers
        if self.schedule is None:
            if not any(t.has_work(kind) for t in tiers):
                return False
            run_lockstep(tiers, self.group, kind, self.threads)
            return True
        if not self.schedule.movable(tiers, kind):
            return False
        self.schedule.before_step(tiers, kind, Grant(), 0)
        try:
            run_lockstep(tiers, self.group, kind, self.threads)
        finally:
            self.schedule.after_step(tiers)
        return True

    def stopped_at(self, kind: StorageStepKind, stop: str) -> bool:
        """Some rank's ``kind`` thread parks at a point of kind ``stop``; for ``wait``: every
        rank's waits again (its body ended)."""
        at = [position(t, kind) for t in self.tiers]
        kinds = {WAIT if p is None else p.kind for p in at}
        return kinds == {WAIT} if stop == WAIT else stop in kinds

    def busy(self) -> bool:
        return any(t.has_work(k) for t in self.tiers for k in TICKET_KINDS)

    def stuck(self) -> str | None:
        return None if self.schedule is None else self.schedule.stuck_at_collective(self.tiers)
