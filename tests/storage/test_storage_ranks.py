"""Storage worlds of several ranks in one process: MIN reductions and symmetric collectives."""

from __future__ import annotations

import threading

import pytest
import torch
from storage_fakes import RankWorld

from hicache_ref.controller.storage import PREFETCH_HITS, RankGroup, ReduceOp, StorageStepKind
from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.storage.fault_injection import FaultInjectingStorage

PAGE = 4
TOKENS = list(range(200, 216))  # four pages
HIT, IO, SYNC, BACKUP = (
    StorageStepKind.HIT_QUERY,
    StorageStepKind.IO,
    StorageStepKind.SYNC,
    StorageStepKind.BACKUP,
)


def back_up_everywhere(world: RankWorld, pages_by_rank: list[int]) -> list[torch.Tensor]:
    """Rank r stores the first ``pages_by_rank[r]`` pages of TOKENS (its own shard, its own
    bytes); returns each rank's source slots."""
    sources = []
    for rank, (pool, tier, pages) in enumerate(
        zip(world.pools, world.tiers, pages_by_rank, strict=True)
    ):
        host = pool.alloc(pages * PAGE)
        assert host is not None
        pool.fill(host, seed=10 + rank)
        tier.write_storage(host, TOKENS[: pages * PAGE])
        sources.append(host)
    world.step(BACKUP)
    world.drain()
    return sources


def test_a_group_reduces_each_collective_over_every_rank() -> None:
    group = RankGroup(3)
    out = [torch.tensor(v) for v in (7, 3, 5)]
    threads = [
        threading.Thread(
            target=group.view(r).all_reduce, args=(out[r], ReduceOp.MIN, PREFETCH_HITS)
        )
        for r in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [int(t) for t in out] == [3, 3, 3]
    assert [[(r.group, r.seq, r.result) for r in group.log(rank)] for rank in range(3)] == [
        [("prefetch_hits", 0, (3,))]
    ] * 3


def test_the_published_hit_is_the_min_over_ranks() -> None:
    world = RankWorld.build(3)
    back_up_everywhere(world, [4, 2, 3])
    operations = world.start("r", TOKENS)
    results = world.step(HIT)
    assert [r.tokens for r in results] == [8, 8, 8]
    assert [op.storage_hit_count for op in operations] == [8, 8, 8]
    assert all(len(op.hash_value) == 2 for op in operations)


def test_published_progress_is_the_min_over_ranks() -> None:
    # sglang#27010: ranks inserted and freed bounce pages by their own progress (INV-21)
    world = RankWorld.build(2)
    back_up_everywhere(world, [4, 4])
    backend = world.tiers[1].storage_backend
    assert backend is not None
    world.tiers[1].storage_backend = FaultInjectingStorage(backend, seed=0, get_fail_pages=[1])
    world.start("r", TOKENS)
    world.settle()
    inserted = [tree.inserted["r"].numel() for tree in world.trees]
    assert inserted == [PAGE, PAGE]  # rank 1 read one page; rank 0 inserts one page too


def test_every_rank_emits_the_same_acks_even_after_a_failed_batch() -> None:
    world = RankWorld.build(2)
    back_up_everywhere(world, [4, 4])
    for tier in world.tiers:
        tier.storage_batch_size = 1
    backend = world.tiers[0].storage_backend
    assert backend is not None
    world.tiers[0].storage_backend = FaultInjectingStorage(backend, seed=0, get_fail_pages=[0])
    world.start("r", TOKENS)
    world.step(HIT)
    world.drain()
    for _ in range(4):
        assert [r.acked for r in world.step(IO)] == [True, True]
    counts = [tier.queues.prefetch_sync_queue.qsize() for tier in world.tiers]
    assert counts == [5, 5]  # four progress acks and the final one on every rank


def test_a_rank_without_the_work_breaks_the_lockstep_step() -> None:
    # sglang#30760: a collective whose count depends on rank-local state hangs TP
    world = RankWorld.build(2)
    back_up_everywhere(world, [4, 4])
    world.trees[0].start("only-rank-0", TOKENS)
    with pytest.raises(InvariantViolation, match=r"INV-20 violated: rank 0 issued collective #0"):
        world.step(HIT)


def test_a_collective_nobody_joins_is_a_deadlock_violation_not_a_hang() -> None:
    group = RankGroup(2, timeout_s=0.2)
    with pytest.raises(InvariantViolation, match=r"INV-20 violated: deadlock: rank.s. .1. never"):
        group.view(0).all_reduce(torch.tensor(1), ReduceOp.MIN, PREFETCH_HITS)
    assert len(group.violations) == 1


def test_ranks_reducing_with_different_ops_are_a_violation() -> None:
    group = RankGroup(2, timeout_s=2.0)
    errors: list[BaseException] = []

    def reduce(rank: int, op: ReduceOp) -> None:
        try:
            group.view(rank).all_reduce(torch.tensor(rank), op, PREFETCH_HITS)
        except InvariantViolation as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=reduce, args=(0, ReduceOp.MIN)),
        threading.Thread(target=reduce, args=(1, ReduceOp.MAX)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 2 and "mixes ops or shapes" in str(errors[0])


def test_a_group_accepts_torch_distributed_reduce_ops() -> None:
    group = RankGroup(1)
    value = torch.tensor(4)
    group.view(0).all_reduce(value, torch.distributed.ReduceOp.MIN, PREFETCH_HITS)
    assert group.log(0)[0].op == "min"


def test_group_sizes_and_ranks_are_checked() -> None:
    with pytest.raises(HiCacheInputError, match=r"1\.\.8 ranks"):
        RankGroup(0)
    with pytest.raises(HiCacheInputError, match="rank 2 is outside"):
        RankGroup(2).view(2)


def test_a_four_rank_world_round_trips_every_rank_its_own_bytes() -> None:
    world = RankWorld.build(4)
    sources = back_up_everywhere(world, [4, 4, 4, 4])
    world.start("r", TOKENS)
    world.settle()
    for pool, tree, source in zip(world.pools, world.trees, sources, strict=True):
        assert torch.equal(pool.read(tree.inserted["r"]), pool.read(source))
