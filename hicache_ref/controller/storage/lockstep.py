"""One storage step on every rank at once (the manual executor of a rank group), and the
lifecycle calls that must reach every rank of a group together.

``run_lockstep(tiers, group, kind)`` runs the ``kind`` step of every rank's tier inside one
lockstep scope of the ``RankGroup``: each rank's step runs on a thread of its own, so a
collective of one rank can wait for the others' (the group computes the MIN over their
contributions), and when all are done the group checks that every rank issued the same
collectives in the same order (INV-20). Each rank touches only its own pools and backend, so
the outcome does not depend on how the threads interleave: a lockstep step is deterministic.
One rank runs inline, without a thread.

The caller may hand it long-lived threads (``LockstepThreads``: thread ``r`` runs rank ``r`` of
every step, one step at a time, and waits for the next in between; a storage world owns one set
and closes it with the world), because starting fresh threads for every step cost more than the
step itself. Without them, or when they are busy (a step of the same world on another thread),
a step starts threads of its own, and a thread whose step did not end in time is retired, so
no step ever waits behind another.

``reset_ranks`` and ``detach_ranks`` reset or detach every rank of a group: the group is
interrupted while every rank's threads stop, so no thread waits in a collective for a peer that
already stopped, then every rank starts its next epoch (INV-24).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

from hicache_ref.controller.storage.collectives import RankGroup
from hicache_ref.controller.storage.executor import STORAGE_JOIN_TIMEOUT_S
from hicache_ref.controller.storage.records import STEP_KINDS, StepResult, StorageStepKind
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.errors import HiCacheInputError, InvariantViolation

LOCKSTEP_JOIN_MARGIN_S = 5.0


def runnable_steps(tiers: Sequence[StorageTier]) -> list[StorageStepKind]:
    """The kinds runnable on some rank (a rank without the work then issues no collective:
    if another rank does, the step is an INV-20 violation, as a real TP group would hang)."""
    return [kind for kind in STEP_KINDS if any(t.has_work(kind) for t in tiers)]


def run_lockstep(
    tiers: Sequence[StorageTier],
    group: RankGroup,
    kind: StorageStepKind,
    threads: LockstepThreads | None = None,
) -> tuple[StepResult, ...]:
    """Run one ``kind`` step on every rank (on ``threads`` where given); the first violation
    (lowest rank) is raised."""
    if len(tiers) != group.world_size:
        raise HiCacheInputError(
            f"{len(tiers)} tiers for a {group.world_size}-rank group (one tier per rank)"
        )
    results: list[StepResult | None] = [None] * len(tiers)
    errors: list[BaseException | None] = [None] * len(tiers)

    def run_rank(rank: int) -> None:
        try:
            results[rank] = tiers[rank].run_step(kind)
        except BaseException as exc:  # re-raised below, on the caller's thread
            errors[rank] = exc
        finally:
            group.rank_finished(rank)

    group.begin_step()
    try:
        if len(tiers) == 1:
            run_rank(0)
        else:
            timeout_s = group.timeout_s + LOCKSTEP_JOIN_MARGIN_S
            _run_on_threads(run_rank, len(tiers), timeout_s, threads)
    finally:
        step_error: BaseException | None = None
        try:
            group.end_step()
        except InvariantViolation as exc:
            step_error = exc
    first = _first_error(errors) or step_error
    if first is not None:
        raise first
    return tuple(r for r in results if r is not None)


def _run_on_threads(
    run_rank: Callable[[int], None],
    ranks: int,
    join_timeout_s: float,
    threads: LockstepThreads | None = None,
) -> None:
    if threads is None or not threads.lock.acquire(blocking=False):  # none, or busy
        _run_on_fresh_threads(run_rank, ranks, join_timeout_s)
        return
    try:
        stuck = threads.run(run_rank, ranks, join_timeout_s)
    finally:
        threads.lock.release()
    _verify_every_rank_ended(stuck, join_timeout_s)


def _run_on_fresh_threads(
    run_rank: Callable[[int], None], ranks: int, join_timeout_s: float
) -> None:
    threads = [
        threading.Thread(target=run_rank, args=(rank,), name=f"lockstep-r{rank}", daemon=True)
        for rank in range(ranks)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=join_timeout_s)
    _verify_every_rank_ended([t.name for t in threads if t.is_alive()], join_timeout_s)


def _verify_every_rank_ended(stuck: Sequence[str], join_timeout_s: float) -> None:
    # Verify every rank's step ended: the group's timeouts bound every collective (INV-20)
    if stuck:
        raise InvariantViolation(
            "INV-20",
            f"lockstep steps {list(stuck)} did not end within {join_timeout_s:g} s (a rank "
            "waits for a collective no other rank issues)",
        )


_Job = tuple[Callable[[int], None], int, threading.Event]


class _RankThread:
    """One long-lived thread: runs the rank part it is handed, then waits for the next."""

    def __init__(self, rank: int) -> None:
        self.name = f"lockstep-r{rank}"
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self._inbox.get()) is not None:
            run_rank, rank, done = job
            try:
                run_rank(rank)  # catches everything itself (``run_lockstep``'s ``run_rank``)
            finally:
                done.set()
                # waiting for the next job, the frame holds nothing of this one (a step's
                # closure reaches its whole world, which would live as long as this thread)
                del job, run_rank, done

    def submit(self, run_rank: Callable[[int], None], rank: int) -> threading.Event:
        done = threading.Event()
        self._inbox.put((run_rank, rank, done))
        return done

    def retire(self) -> None:
        """Exit once the step it runs ends (it is never handed another)."""
        self._inbox.put(None)


class LockstepThreads:
    """One world's lockstep threads, one per rank of its largest step so far, started on first
    use; ``lock`` is held by the step that uses them, ``close`` ends them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._threads: list[_RankThread] = []

    def run(self, run_rank: Callable[[int], None], ranks: int, join_timeout_s: float) -> list[str]:
        """Run ``run_rank(r)`` for every rank on thread ``r``; the names of those that did not
        end within ``join_timeout_s`` (each waited for in turn, as ``Thread.join`` would)."""
        while len(self._threads) < ranks:
            self._threads.append(_RankThread(len(self._threads)))
        for rank in range(ranks):  # one that died of an error outside its step: a fresh one
            if not self._threads[rank].thread.is_alive():
                self._threads[rank] = _RankThread(rank)
        done = [self._threads[rank].submit(run_rank, rank) for rank in range(ranks)]
        stuck = [rank for rank in range(ranks) if not done[rank].wait(join_timeout_s)]
        names = [self._threads[rank].name for rank in stuck]
        for rank in stuck:  # still in its step: a fresh thread takes its place next time
            self._threads[rank].retire()
            self._threads[rank] = _RankThread(rank)
        return names

    def close(self) -> None:
        """Every thread exits once its step (if any) ends; a later ``run`` starts fresh ones."""
        threads, self._threads = self._threads, []
        for thread in threads:
            thread.retire()


def _first_error(errors: Sequence[BaseException | None]) -> BaseException | None:
    """The lowest rank's invariant violation, else the lowest rank's other error; a rank whose
    storage thread died (INV-25) comes first: its peers' unanswered collectives (INV-20)
    follow from it."""
    violations = [e for e in errors if isinstance(e, InvariantViolation)]
    violations.sort(key=lambda e: e.inv_id != "INV-25")
    if violations:
        return violations[0]
    return next((e for e in errors if e is not None), None)


def run_until_idle(tiers: Sequence[StorageTier], group: RankGroup, max_steps: int = 100_000) -> int:
    """Lockstep steps, in thread order, until no rank has storage work; returns how many."""
    steps = 0
    while True:
        runnable = runnable_steps(tiers)
        if not runnable:
            return steps
        for kind in runnable:
            run_lockstep(tiers, group, kind)
            steps += 1
        if steps > max_steps:
            raise InvariantViolation(
                "INV-25",
                f"storage work did not quiesce within {max_steps} lockstep steps (a step "
                "re-queued work instead of bringing its operation to its one final ack)",
            )


def reset_ranks(tiers: Sequence[StorageTier], group: RankGroup) -> None:
    """Reset every rank: stop all threads (collectives abandoned), then a new epoch each."""
    group.interrupt()
    try:
        for tier in tiers:
            tier.stop_threads()
    finally:
        group.resume()
    for tier in tiers:
        tier.reset()


def detach_ranks(tiers: Sequence[StorageTier], group: RankGroup) -> None:
    """Detach every rank: terminate every prefetch, let every op reach its final ack, stop."""
    for tier in tiers:
        if tier.enable_storage:
            tier.terminate_live_prefetches()
    if all(tier.executor.name == "manual" for tier in tiers):
        run_until_idle([t for t in tiers if t.enable_storage], group)
    else:
        _wait_idle(tiers)
    for tier in tiers:
        tier.detach_storage_backend()


def _wait_idle(tiers: Sequence[StorageTier]) -> None:
    deadline = time.monotonic() + STORAGE_JOIN_TIMEOUT_S
    while any(tier.enable_storage and tier.has_any_work() for tier in tiers):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"detach: storage work did not finish within {STORAGE_JOIN_TIMEOUT_S:g} s on "
                "every rank; detach aborted"
            )
        time.sleep(0.002)
