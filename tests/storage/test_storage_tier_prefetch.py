"""Backup and prefetch end to end through one rank's ``StorageTier``, stepped by hand."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch
from storage_fakes import FakeHostPool, MLATokenToKVPool, Ongoing, TreeSide, make_tier

from hicache_ref.controller.storage import StorageStepKind, StorageTier
from hicache_ref.errors import HiCacheInputError, InvariantViolation, PageAlignmentError
from hicache_ref.invariants.checks_prefetch import check_prefetch_release_split
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.fault_injection import FaultInjectingStorage
from hicache_ref.storage.hashing import compute_page_hashes
from hicache_ref.storage.memory_backend import MemoryStorage
from hicache_ref.storage.protocols import StorageHostPool
from hicache_ref.storage.queues import StorageQueueOverflow

PAGE = 4
TOKENS = list(range(100, 116))  # four pages

HIT, IO, SYNC, BACKUP = (
    StorageStepKind.HIT_QUERY,
    StorageStepKind.IO,
    StorageStepKind.SYNC,
    StorageStepKind.BACKUP,
)


def make(
    backend: str = "memory", threshold: int = PAGE
) -> tuple[StorageTier, FakeHostPool, TreeSide]:
    pool = FakeHostPool(size=64, page_size=PAGE)
    tier = make_tier(pool)
    tier.attach_storage_backend(backend, prefetch_threshold=threshold)
    return tier, pool, TreeSide(tier, pool)


def back_up(
    tier: StorageTier, pool: FakeHostPool, tokens: list[int], seed: int = 1
) -> torch.Tensor:
    """Fill host slots for ``tokens``, write them to storage, drain the ack; return the slots."""
    host = pool.alloc(len(tokens))
    assert host is not None
    pool.fill(host, seed)
    tier.write_storage(host, tokens)
    tier.run_until_idle()
    assert tier.queues.ack_backup_queue.get_nowait().completed_tokens == len(tokens)
    return host


def test_backup_then_prefetch_round_trips_the_bytes() -> None:
    tier, pool, tree = make()
    source = back_up(tier, pool, TOKENS)
    tree.start("r1", TOKENS)
    tree.settle()
    assert torch.equal(pool.read(tree.inserted["r1"]), pool.read(source))
    assert not tree.ongoing and tier.prefetch_tokens_occupied == 0


def test_a_prefetch_runs_as_query_then_one_io_and_one_sync_per_batch() -> None:
    tier, pool, tree = make()
    back_up(tier, pool, TOKENS)
    tier.storage_batch_size = 2
    tree.start("r1", TOKENS)
    # query -> the tree gives it a buffer -> batch 1 -> its ack -> batch 2 (+ final) -> two acks
    assert tier.run_step(HIT).tokens == 16
    tree.drain_hits()
    first = tier.run_step(IO)
    assert (first.tokens, first.final) == (8, False)
    assert tier.run_step(SYNC).tokens == 8
    last = tier.run_step(IO)
    assert (last.tokens, last.final) == (16, True)
    assert [tier.run_step(SYNC).final for _ in range(2)] == [False, True]
    assert tier.runnable_steps() == []
    tree.drain_acks()
    assert tree.inserted["r1"].numel() == 16


def test_partial_hit_allocates_only_the_leading_run() -> None:
    tier, pool, tree = make()
    source = back_up(tier, pool, TOKENS[:8])  # only the first two pages are stored
    operation = tree.start("r1", TOKENS)
    tree.settle()
    assert operation.storage_hit_count == 8 and operation.bounce_buffer_tokens == 8
    assert torch.equal(pool.read(tree.inserted["r1"]), pool.read(source))


def test_too_few_hits_are_revoked_before_any_buffer_is_allocated() -> None:
    tier, pool, tree = make(threshold=3 * PAGE)
    back_up(tier, pool, TOKENS[:8])
    free_before = pool.available_size()
    operation = tree.start("r1", TOKENS)
    tree.settle()
    assert tree.revoked == ["r1"] and operation.host_indices is None
    assert pool.available_size() == free_before


def test_termination_mid_transfer_freezes_progress_and_the_final_ack_releases_the_rest() -> None:
    tier, pool, tree = make()
    back_up(tier, pool, TOKENS)
    tier.storage_batch_size = 1
    operation = tree.start("r1", TOKENS)
    tier.run_step(HIT)
    tree.drain_hits()
    bounce = operation.host_indices
    assert bounce is not None
    tier.run_step(IO)
    tier.run_step(SYNC)
    tree.drain_acks()  # one page published
    # the tree terminates: [0:4) inserted now; the IO keeps emitting acks but transfers nothing
    assert tree.terminate("r1") == PAGE
    tree.settle()
    assert operation.completed_tokens == PAGE  # unchanged after terminate_prefetch returned
    assert sorted(tree.freed) == bounce[PAGE:].tolist()
    ranges = [(r.start, r.end) for r in operation.released_ranges()]
    check_prefetch_release_split(16, ranges)  # INV-19: the ranges tile the buffer once


def test_a_page_is_counted_only_after_its_bytes_are_set() -> None:
    # sglang#8901: counting first lets the tree read a page before its bytes land
    tier, pool, tree = make()
    source = back_up(tier, pool, TOKENS)
    tier.storage_batch_size = 1
    operation = tree.start("r1", TOKENS)
    tier.run_step(HIT)
    tree.drain_hits()
    for _ in range(4):
        result = tier.run_step(IO)
        bounce = operation.host_indices
        assert bounce is not None
        assert torch.equal(pool.read(bounce[: result.tokens]), pool.read(source[: result.tokens]))


@pytest.fixture
def faulty_backend_name() -> Iterator[str]:
    def build(
        config: HiCacheStorageConfig, pool: StorageHostPool | None, extra: Mapping[str, object]
    ) -> HiCacheStorage:
        return FaultInjectingStorage(MemoryStorage(config), seed=0, get_fail_pages=[2])

    StorageBackendFactory.register_backend("test-faulty", build)
    yield "test-faulty"
    StorageBackendFactory.unregister_backend("test-faulty")


def test_a_page_that_exists_but_fails_to_read_shortens_the_prefetch_there(
    faulty_backend_name: str,
) -> None:
    tier, pool, tree = make(backend=faulty_backend_name)
    source = back_up(tier, pool, TOKENS)
    operation = tree.start("r1", TOKENS)
    tree.settle()
    assert operation.storage_hit_count == 16  # batch_exists said all four pages exist
    assert operation.completed_tokens == 2 * PAGE  # the third page's get failed
    assert torch.equal(pool.read(tree.inserted["r1"]), pool.read(source[:8]))


def test_a_failed_backup_batch_stops_the_backup_and_acks_the_stored_prefix() -> None:
    tier, pool, tree = make()
    backend = tier.storage_backend
    assert backend is not None
    tier.storage_backend = FaultInjectingStorage(backend, seed=0, set_fail_pages=[1])
    tier.storage_batch_size = 1
    host = pool.alloc(16)
    assert host is not None
    tier.write_storage(host, TOKENS)
    tier.run_until_idle()
    assert tree.drain_backups() == [PAGE]  # INV-26: the ack is the stored prefix
    assert backend.batch_exists(compute_page_hashes(TOKENS, PAGE)) == 1


def test_a_backend_exception_still_acks_the_backup_once() -> None:
    # sglang#38427: the exception killed the backup thread; acks stopped, locks leaked (INV-25)
    tier, pool, tree = make()

    class Exploding(MemoryStorage):
        def batch_set(self, *args: object, **kwargs: object) -> bool:
            raise ConnectionError("storage service went away")

    tier.storage_backend = Exploding()
    host = pool.alloc(8)
    assert host is not None
    tier.write_storage(host, TOKENS[:8])
    tier.run_until_idle()
    assert tree.drain_backups() == [0]


def test_write_storage_without_keys_chains_from_the_parents_last_key() -> None:
    # sglang#35269: a node created before attach had no hash and its chain restarted (INV-27)
    tier, pool, _ = make()
    keys = compute_page_hashes(TOKENS, PAGE)
    host = pool.alloc(8)
    assert host is not None
    tier.write_storage(host, TOKENS[8:], prefix_keys=keys[:2])
    tier.run_until_idle()
    backend = tier.storage_backend
    assert backend is not None
    assert backend.batch_exists(keys[2:]) == 2 and backend.batch_exists(keys[:1]) == 0


def test_prefix_keys_grow_per_batch_without_touching_the_callers_list() -> None:
    # bug class 20: SGLang 0.5.10 extended the operation's own prefix list in place
    tier, pool, tree = make()
    back_up(tier, pool, TOKENS)
    tier.storage_batch_size = 2
    keys = compute_page_hashes(TOKENS, PAGE)
    seen: list[tuple[str, ...] | None] = []
    original = tier.prefetch_io.page_get

    def spy(operation, hashes, host, extra):  # type: ignore[no-untyped-def]
        seen.append(extra.prefix_keys)
        return original(operation, hashes, host, extra)

    tier.prefetch_io.page_get = spy  # type: ignore[method-assign]
    prefix = ["p"]
    operation = tier.prefetch("r1", TOKENS, prefix_keys=prefix)
    tree.ongoing["r1"] = Ongoing(operation, 16)
    tree.settle()
    assert prefix == ["p"] and operation.prefix_keys == ("p",)
    assert seen == [("p",), ("p", keys[0], keys[1])]


def test_prefetch_of_a_partial_page_is_refused() -> None:
    tier, _, _ = make()
    with pytest.raises(HiCacheInputError, match="not whole pages of 4"):
        tier.prefetch("r", TOKENS[:6])


def test_write_storage_with_misaligned_slots_or_too_few_is_refused() -> None:
    tier, _, _ = make()
    with pytest.raises(PageAlignmentError, match="INV-01"):
        tier.write_storage(torch.arange(1, 5), TOKENS[:4])
    with pytest.raises(HiCacheInputError, match="2 page keys but only 4 host slots"):
        tier.write_storage(torch.arange(4), TOKENS[:8], hash_value=["a", "b"])


def test_storage_calls_before_attach_name_the_fix() -> None:
    tier = make_tier(FakeHostPool(size=16, page_size=PAGE))
    with pytest.raises(HiCacheInputError, match="call attach_storage_backend"):
        tier.write_storage(torch.arange(4), TOKENS[:4])
    with pytest.raises(HiCacheInputError, match="call attach_storage_backend"):
        tier.run_step(HIT)


def test_a_buffer_that_does_not_cover_the_hit_is_refused_at_the_io_step() -> None:
    # sglang#40193: a hit silently shortened to free host space (INV-29)
    tier, pool, tree = make()
    back_up(tier, pool, TOKENS)
    operation = tree.start("r1", TOKENS)
    tier.run_step(HIT)
    tier.queues.prefetch_hit_queue.get_nowait()
    operation.host_indices = pool.alloc(8)  # half the hit
    tier.queues.prefetch_buffer.put(operation)
    with pytest.raises(InvariantViolation, match=r"INV-29 violated: .* bounce buffer 8 tokens"):
        tier.run_step(IO)


def test_releasing_pages_the_io_may_still_write_is_refused() -> None:
    # sglang#27550 / #31668: a tail freed while the transfer still wrote it (INV-23)
    tier, pool, tree = make()
    back_up(tier, pool, TOKENS)
    tier.storage_batch_size = 1
    operation = tree.start("r1", TOKENS)
    tier.run_step(HIT)
    tree.drain_hits()
    tier.run_step(IO)
    bounce = operation.host_indices
    assert bounce is not None
    with pytest.raises(InvariantViolation, match=r"INV-23 violated: .* may still write them"):
        tier.append_host_mem_release(bounce[PAGE:])
    assert tier.queues.host_mem_release_queue.empty()


def test_empty_release_is_a_no_op_and_a_release_splits_into_pages() -> None:
    tier, _, _ = make()
    tier.append_host_mem_release(torch.arange(0))
    assert tier.queues.host_mem_release_queue.empty()  # sglang#11005
    tier.append_host_mem_release(torch.arange(8))
    assert [p.tolist() for p in tier.queues.host_mem_release_queue.snapshot()] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def test_release_queue_is_bounded_by_the_host_page_count() -> None:
    tier, _, _ = make()
    tier.append_host_mem_release(torch.arange(64))
    with pytest.raises(StorageQueueOverflow, match="released twice \\(INV-19\\)"):
        tier.append_host_mem_release(torch.arange(4))


def test_rate_limit_trips_at_half_the_host_pool() -> None:
    tier, _, _ = make()  # host 64: limit 32
    tier.prefetch_tokens_occupied = 31
    assert not tier.prefetch_rate_limited()
    tier.prefetch_tokens_occupied = 32
    assert tier.prefetch_rate_limited()


def test_a_prefetch_chained_onto_a_cached_prefix_finds_its_pages() -> None:
    tier, pool, tree = make()
    keys = compute_page_hashes(TOKENS, PAGE)
    host = back_up(tier, pool, TOKENS, seed=4)
    tree.start("r1", TOKENS[8:], last_hash=keys[1])  # the tree already holds two pages
    tree.settle()
    assert torch.equal(pool.read(tree.inserted["r1"]), pool.read(host[8:]))


def test_prefetch_complete_only_after_the_hit_and_every_page() -> None:
    # sglang#9397: 0 == 0 counted as complete before the hit query had run (INV-22)
    tier, pool, tree = make()
    back_up(tier, pool, TOKENS)
    operation = tree.start("r1", TOKENS)
    assert not tier.is_prefetch_complete(operation)
    tier.run_step(HIT)
    assert not tier.is_prefetch_complete(operation)  # no bounce buffer yet
    tree.drain_hits()
    tier.run_step(IO)
    assert not tier.is_prefetch_complete(operation)  # landed but not published
    tier.run_step(SYNC)
    tree.drain_acks()
    assert tier.is_prefetch_complete(operation)


def test_mla_ranks_other_than_zero_skip_backups_but_still_ack() -> None:
    from hicache_ref.controller.storage import RankGroup

    group = RankGroup(2)
    for rank, stored in ((1, 0), (0, 4)):
        pool = FakeHostPool(size=64, page_size=PAGE)
        tier = make_tier(pool, device_pool=MLATokenToKVPool(16), collectives=group.view(rank))
        tier.attach_storage_backend("memory")
        host = pool.alloc(16)
        assert host is not None
        tier.write_storage(host, TOKENS)
        tier.run_step(BACKUP)
        assert tier.queues.ack_backup_queue.qsize() == 1
        backend = tier.storage_backend
        assert backend is not None
        assert backend.batch_exists(compute_page_hashes(TOKENS, PAGE)) == stored
