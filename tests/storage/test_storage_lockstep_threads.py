"""Lockstep steps on long-lived rank threads: the same steps as on fresh threads, and INV-20
still bounds every rank's step."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from storage_fakes import RankWorld

from hicache_ref.controller.storage import StepResult, StorageStepKind, lockstep
from hicache_ref.errors import InvariantViolation

PAGE = 4
TOKENS = list(range(300, 316))  # four pages


def relative(results: tuple[StepResult, ...], first_op: int | None) -> list[StepResult]:
    """Results with their op ids counted from the world's first (ids are process-wide)."""
    assert first_op is not None
    return [
        r if r.op_id is None else dataclasses.replace(r, op_id=r.op_id - first_op) for r in results
    ]


def story(world: RankWorld) -> list[object]:
    """Back four pages up on every rank, prefetch them, settle: every result and collective."""
    for rank, (pool, tier) in enumerate(zip(world.pools, world.tiers, strict=True)):
        host = pool.alloc(4 * PAGE)
        assert host is not None
        pool.fill(host, seed=20 + rank)
        tier.write_storage(host, TOKENS)
    backups = world.step(StorageStepKind.BACKUP)
    first_op = backups[0].op_id
    seen: list[object] = [relative(backups, first_op)]
    world.drain()
    operations = world.start("r", TOKENS)
    for kind in (StorageStepKind.HIT_QUERY, StorageStepKind.IO, StorageStepKind.SYNC):
        seen.append(relative(world.step(kind), first_op))
    world.settle()
    seen.append([(op.storage_hit_count, op.completed_tokens) for op in operations])
    seen.append([torch.cat(list(t.inserted.values())).tolist() for t in world.trees])
    seen.append(world.group.logs())
    return seen


def test_a_step_on_the_long_lived_threads_equals_one_on_fresh_threads() -> None:
    threads = lockstep.LockstepThreads()
    on_long_lived = story(RankWorld.build(3, threads=threads))
    on_fresh = story(RankWorld.build(3))  # no threads handed in: every step starts its own
    busy = lockstep.LockstepThreads()
    with busy.lock:  # busy: every step of this world starts its own too
        on_busy = story(RankWorld.build(3, threads=busy))
    assert on_long_lived == on_fresh == on_busy
    assert all(on_long_lived[-1])  # every rank issued collectives
    threads.close()


def test_closing_the_threads_ends_every_one_and_a_later_step_starts_fresh_ones() -> None:
    threads = lockstep.LockstepThreads()
    ran: list[str] = []
    assert threads.run(lambda rank: ran.append(threading.current_thread().name), 2, 5.0) == []
    started = [t.thread for t in threads._threads]
    threads.close()
    for thread in started:
        thread.join(5.0)
        assert not thread.is_alive()
    assert threads.run(lambda rank: ran.append(threading.current_thread().name), 2, 5.0) == []
    assert sorted(ran) == ["lockstep-r0", "lockstep-r0", "lockstep-r1", "lockstep-r1"]
    assert all(t.thread not in started for t in threads._threads)  # two new threads ran it
    threads.close()


def test_rank_r_of_every_step_runs_on_the_same_thread() -> None:
    threads = lockstep.LockstepThreads()
    seen: list[tuple[int, int]] = []

    def run_rank(rank: int) -> None:
        seen.append((rank, threading.get_ident()))

    for _ in range(3):
        assert threads.run(run_rank, 2, join_timeout_s=5.0) == []
    by_rank = {rank: {ident for r, ident in seen if r == rank} for rank in (0, 1)}
    assert [len(idents) for idents in by_rank.values()] == [1, 1]  # one thread per rank
    assert by_rank[0] != by_rank[1]
    assert threading.get_ident() not in by_rank[0] | by_rank[1]  # never the caller's


def test_a_rank_stuck_past_the_join_timeout_is_inv20_and_its_thread_is_replaced() -> None:
    release = threading.Event()
    idents: dict[int, list[int]] = {0: [], 1: []}

    def run_rank(rank: int) -> None:
        idents[rank].append(threading.get_ident())
        if rank == 1 and len(idents[1]) == 1:
            release.wait(10.0)  # rank 1's first step waits for a collective nobody issues

    threads = lockstep.LockstepThreads()
    with pytest.raises(
        InvariantViolation,
        match=r"INV-20 violated: lockstep steps \['lockstep-r1'\] did not end within 0.1 s",
    ):
        lockstep._run_on_threads(run_rank, 2, 0.1, threads)
    release.set()
    lockstep._run_on_threads(run_rank, 2, 5.0, threads)  # a fresh thread runs rank 1
    assert idents[0][0] == idents[0][1]
    assert idents[1][0] != idents[1][1]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # its death
def test_a_rank_thread_that_died_outside_a_step_is_replaced_before_the_next() -> None:
    threads = lockstep.LockstepThreads()
    ran: list[int] = []

    def run_rank(rank: int) -> None:
        ran.append(rank)
        if rank == 1 and ran.count(1) == 1:
            raise SystemExit  # escapes the step's own handler: thread 1 ends with it

    assert threads.run(run_rank, 2, join_timeout_s=5.0) == []
    threads._threads[1].thread.join(5.0)
    assert threads.run(run_rank, 2, join_timeout_s=5.0) == []  # not a false INV-20
    assert sorted(ran) == [0, 0, 1, 1]
