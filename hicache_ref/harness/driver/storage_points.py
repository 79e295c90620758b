"""The storage driver under schedule points: who may move, and what each thread's body did.

In a world with ``storage_points`` a storage step no longer runs one whole loop body: it runs
one thread kind, on every rank, to its next point (``harness/schedule/``). This module keeps
what that changes for the driver, in the order a step needs it:

- ``movable(kind)``: a rank's thread can move (parked inside its body, or waiting with work),
  except one parked at a collective while a peer's is not there yet (``hold``: a collective is
  granted on every rank at once, so every rank issues it within one lockstep step, INV-20);
- ``before_step`` / ``after_step``: the grant for the drawn rank, the holds, and the backend
  calls of each thread gathered per rank and kind until its loop body ends (calls of different
  threads interleave now), then observed as one body's calls, as without points;
- ``stuck_at_collective``: at quiescence a thread still parked at a collective waits for a peer
  that never comes (INV-20).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache_ref.controller.storage.lockstep import run_lockstep
from hicache_ref.controller.storage.records import STEP_KINDS, StepResult, StorageStepKind
from hicache_ref.harness.driver.storage_events import (
    DriverView,
    observe_calls,
    observe_polled_step,
    on_io_ack_put,
    on_polled_progress,
)
from hicache_ref.harness.driver.storage_windows import mark_reads
from hicache_ref.harness.schedule.pct import PctBias, campaign_bias
from hicache_ref.harness.schedule.points import (
    ALL_REDUCE,
    THREAD_KINDS,
    Grant,
    face,
    position,
)
from hicache_ref.harness.step_types import Outcome, done
from hicache_ref.harness.world.recording_storage import BackendCall


class PointSchedule:
    """One case's point-level bookkeeping over every rank's tier."""

    def __init__(self, ranks: int, seed: int = 0) -> None:
        self.seed = seed
        self.bias = campaign_bias(seed, [kind.value for kind in STEP_KINDS])  # PCT (campaign)
        self.pending: list[dict[StorageStepKind, list[tuple[BackendCall, int]]]] = [
            {} for _ in range(ranks)
        ]

    def use_pct(self, on: bool) -> None:
        """The campaign's profile decides the bias (``campaign``: PCT), not the environment."""
        self.bias = PctBias(self.seed, [kind.value for kind in STEP_KINDS]) if on else None

    # -- who may move --------------------------------------------------------------------------
    def holds(self, tiers: Sequence[Any], kind: StorageStepKind) -> list[bool]:
        """Per rank: its ``kind`` thread waits at a collective some peer has not reached."""
        at = [position(t, kind) for t in tiers]
        at_collective = [p is not None and p.kind == ALL_REDUCE for p in at]
        if all(at_collective):
            return [False] * len(tiers)
        return at_collective

    def movable(self, tiers: Sequence[Any], kind: StorageStepKind) -> bool:
        held = self.holds(tiers, kind)
        return any(t.has_work(kind) and not h for t, h in zip(tiers, held, strict=True))

    def runnable(self, tiers: Sequence[Any]) -> list[StorageStepKind]:
        return [kind for kind in STEP_KINDS if self.movable(tiers, kind)]

    def choose(self, runnable: Sequence[str], pick: int) -> str:
        """Which thread kind runs next: PCT's under the campaign profile, else ``pick``'s."""
        if self.bias is not None:
            return self.bias.pick(runnable)
        return str(runnable[pick % len(runnable)])

    def stuck_at_collective(self, tiers: Sequence[Any]) -> str | None:
        for kind in STEP_KINDS:
            held = self.holds(tiers, kind)
            if any(held):
                waiting = [r for r, h in enumerate(held) if h]
                return (
                    f"the {kind.value} thread of rank(s) {waiting} waits at a collective the "
                    "other ranks' never reach (every rank must issue the same collectives)"
                )
        return None

    # -- one step ------------------------------------------------------------------------------
    def before_step(
        self, tiers: Sequence[Any], kind: StorageStepKind, grant: Grant, rank: int
    ) -> None:
        held = self.holds(tiers, kind)
        for r, tier in enumerate(tiers):
            f = face(tier)
            f.hold = {kind} if held[r] else set()
            f.next_grant = grant if r == rank % len(tiers) else Grant()

    def after_step(self, tiers: Sequence[Any]) -> None:
        for tier in tiers:
            f = face(tier)
            f.hold, f.next_grant = set(), Grant()

    def gather(self, rank: int, calls: list[BackendCall], step: int) -> None:
        """File a rank's new calls (run in ``step``) under the kind of the thread that made them."""
        for call in calls:
            kind = StorageStepKind(THREAD_KINDS.get(call.thread, "backup"))
            self.pending[rank].setdefault(kind, []).append((call, step))

    def body_calls(self, result: StepResult) -> tuple[list[BackendCall], list[int]]:
        """The calls of the loop body that just ended on ``result``'s rank, and their steps."""
        got = self.pending[result.rank].pop(result.kind, [])
        return [c for c, _ in got], [s for _, s in got]

    def released_by_body(self, tier: Any, result: StepResult) -> list[Any]:
        """The pages the body's own thread put on ``host_mem_release_queue`` (0.5.10's threads
        release there; the tree may add its own releases while the body runs)."""
        return [p for p in tier.body_puts.get(result.kind, []) if isinstance(p, torch.Tensor)]

    def forget_bodies(self, ranks: Sequence[Any]) -> None:
        """After a reset: the bodies the stop ran to their end belong to no step."""
        for rank in ranks:
            if rank.recording is not None:
                rank.recording.take()
        self.pending = [{} for _ in self.pending]


def run_to_next_point(
    driver: DriverView, points: PointSchedule, kind: StorageStepKind, grant: Grant, rank: int
) -> Outcome:
    """Run every rank's ``kind`` thread to its next point (``grant`` on rank ``rank``, ``ok``
    elsewhere); observe each loop body that ended, with all of its calls."""
    tiers = driver.l3.tiers
    polled_io = kind is StorageStepKind.IO and driver.polled_kind(kind)
    points.before_step(tiers, kind, grant, rank)
    try:
        results = run_lockstep(tiers, driver.l3.group, kind, driver.l3.threads)
    finally:
        points.after_step(tiers)
        for r in driver.l3.ranks:
            calls = r.recording.take() if r.recording is not None else []
            points.gather(r.rank, calls, driver.steps_run)
            io = [c for c in calls if THREAD_KINDS.get(c.thread) == StorageStepKind.IO.value]
            current = face(tiers[r.rank]).current_request(StorageStepKind.IO)
            mark_reads(driver, r.rank, current, io)  # before a later termination (INV-33)
            if r.faults is not None:  # a page dropped mid-body is lost now, not at its end
                driver.log.lost.update((r.rank, key) for key in r.faults.dropped_keys)
            for function, item in face(tiers[r.rank]).gate.take_visible():
                if THREAD_KINDS.get(function) == StorageStepKind.IO.value:
                    on_io_ack_put(driver, r.rank, item)  # judged before anyone reads it
            if polled_io:  # the progress on the operation is what the tree polls
                on_polled_progress(driver, r.rank, current)
    polled = driver.polled_kind(kind)  # read off the operation (0.5.10 - 0.5.18)
    ended = []
    for result in results:
        if result.ran:
            ended.append(result.rank)
            calls, steps = points.body_calls(result)
            observe_calls(driver, result, calls, steps)
            if polled:
                released = points.released_by_body(tiers[result.rank], result)
                observe_polled_step(driver, result, released)
    at = [position(t, kind) for t in tiers]
    where = ", ".join("gone" if p is None else p.describe() for p in at)
    how = (
        ""
        if grant.outcome == "ok"
        else f" ({grant.outcome} @{grant.at} on rank {rank % len(tiers)})"
    )
    body = f"; loop body ended on {ended}" if ended else ""
    return done(f"{kind.value} thread{how} -> [{where}]{body}", agreed=f"{kind.value} point")
