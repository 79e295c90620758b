"""Backup and prefetch end to end through ``StorageMixin``, stepped by hand (manual executor)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch
from storage_fakes import FakeHostPool, FakeStorageController, TreeSide

from hicache_ref.errors import HiCacheInputError, PageAlignmentError
from hicache_ref.invariants.checks_prefetch import check_prefetch_release_split
from hicache_ref.storage.backend import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.fault_injection import FaultInjectingStorage
from hicache_ref.storage.hashing import compute_page_hashes
from hicache_ref.storage.memory_backend import MemoryStorage
from hicache_ref.storage.operations import PrefetchOperation, StorageOperation
from hicache_ref.storage.protocols import StorageHostPool
from hicache_ref.storage.queues import StorageQueueOverflow

PAGE = 4
TOKENS = list(range(100, 116))  # four pages


def make(
    backend: str = "memory", threshold: int = PAGE, **kwargs: object
) -> tuple[FakeStorageController, FakeHostPool, TreeSide]:
    pool = FakeHostPool(size=64, page_size=PAGE)
    controller = FakeStorageController(pool, **kwargs)  # type: ignore[arg-type]
    controller.attach_storage_backend(backend, prefetch_threshold=threshold)
    return controller, pool, TreeSide(controller, pool)


def back_up(
    controller: FakeStorageController, pool: FakeHostPool, tokens: list[int], seed: int = 1
) -> torch.Tensor:
    """Fill host slots for ``tokens``, write them to storage, drain the ack; return the slots."""
    host = pool.alloc(len(tokens))
    assert host is not None
    pool.fill(host, seed)
    controller.write_storage(host, tokens)
    controller.run_storage_until_idle()
    ack = controller.ack_backup_queue.get_nowait()
    assert ack.completed_tokens == len(tokens)
    return host


def start_prefetch(
    controller: FakeStorageController, pool: FakeHostPool, tokens: list[int], rid: str = "r1"
) -> tuple[PrefetchOperation, torch.Tensor]:
    bounce = pool.alloc(len(tokens))
    assert bounce is not None
    return controller.prefetch(rid, bounce, tokens), bounce


def test_backup_then_prefetch_round_trips_the_bytes() -> None:
    controller, pool, tree = make()
    source = back_up(controller, pool, TOKENS)
    operation, bounce = start_prefetch(controller, pool, TOKENS)
    assert controller.run_storage_until_idle() == 2  # one hit query, one transfer
    assert tree.finish_prefetch(operation) == 16
    assert torch.equal(pool.read(bounce), pool.read(source))
    assert controller.host_mem_release_queue.empty()


def test_partial_hit_transfers_the_leading_run_and_releases_the_rest_once() -> None:
    controller, pool, tree = make()
    source = back_up(controller, pool, TOKENS[:8])  # only the first two pages are stored
    operation, bounce = start_prefetch(controller, pool, TOKENS)
    controller.run_storage_until_idle()
    assert tree.finish_prefetch(operation) == 8
    assert torch.equal(pool.read(bounce[:8]), pool.read(source))
    # the non-hit tail [8:16) went back exactly once, through the release queue (INV-19)
    assert sorted(tree.drain_releases()) == bounce[8:].tolist()
    assert [(r.start, r.end, r.releaser) for r in operation.released_ranges()] == [
        (8, 16, "controller")
    ]


def test_too_few_hits_revokes_terminates_and_releases_the_whole_buffer() -> None:
    controller, pool, tree = make(threshold=3 * PAGE)
    back_up(controller, pool, TOKENS[:8])
    operation, bounce = start_prefetch(controller, pool, TOKENS)
    controller.run_storage_until_idle()
    assert controller.prefetch_revoke_queue.get_nowait() == "r1"
    assert operation.is_terminated()  # sglang#16747: a revoked prefetch must end
    assert controller.terminate_prefetch(operation) == (0, [])
    assert sorted(tree.drain_releases()) == bounce.tolist()


def test_termination_mid_transfer_freezes_completed_tokens_at_a_page_boundary() -> None:
    controller, pool, tree = make()
    back_up(controller, pool, TOKENS)
    operation, bounce = start_prefetch(controller, pool, TOKENS)
    controller.storage_batch_size = 1
    returned: list[int] = []

    def terminate_on_second_page(index: int) -> None:
        # the tree terminates while page 2's bytes have landed but before it is counted
        if index == int(bounce[PAGE]):
            returned.append(controller.terminate_prefetch(operation)[0])

    pool.on_set_page = terminate_on_second_page
    controller.run_storage_until_idle()
    assert returned == [PAGE]
    assert operation.completed_tokens == PAGE  # unchanged after terminate_prefetch returned
    assert tree.finish_prefetch(operation) == PAGE
    assert sorted(tree.drain_releases()) == bounce[PAGE:].tolist()


def test_a_page_is_counted_only_after_its_bytes_are_set() -> None:
    # sglang#8901: counting first lets the tree read a page before its bytes land
    controller, pool, _ = make()
    back_up(controller, pool, TOKENS)
    operation, _ = start_prefetch(controller, pool, TOKENS)
    seen_completed: list[int] = []
    pool.on_set_page = lambda index: seen_completed.append(operation.completed_tokens)
    controller.run_storage_until_idle()
    assert seen_completed == [0, 4, 8, 12]
    assert operation.completed_tokens == 16


def test_every_bounce_slot_is_released_or_inserted_exactly_once() -> None:
    controller, pool, tree = make()
    back_up(controller, pool, TOKENS[:12])
    free_before = pool.available_size()
    operation, bounce = start_prefetch(controller, pool, TOKENS)
    controller.run_storage_until_idle()
    completed = tree.finish_prefetch(operation, matched_tokens=PAGE)  # page 0 was cached meanwhile
    tree.drain_releases()
    inserted = bounce[PAGE:completed].tolist()
    assert sorted(tree.freed + inserted) == sorted(bounce.tolist())
    assert pool.available_size() == free_before - len(inserted)
    ranges = [(r.start, r.end) for r in operation.released_ranges()] + [(PAGE, completed)]
    check_prefetch_release_split(16, ranges)  # INV-19: the four ranges tile the buffer once


@pytest.fixture
def faulty_backend_name() -> Iterator[str]:
    def build(
        config: HiCacheStorageConfig, pool: StorageHostPool | None, extra: Mapping[str, object]
    ) -> HiCacheStorage:
        return FaultInjectingStorage(MemoryStorage(config), seed=0, get_fail_pages=[2])

    StorageBackendFactory.register_backend("test-faulty", build)
    yield "test-faulty"
    StorageBackendFactory.unregister_backend("test-faulty")


def test_a_failed_page_get_ends_the_prefetch_at_the_pages_before_it(
    faulty_backend_name: str,
) -> None:
    controller, pool, tree = make(backend=faulty_backend_name)
    source = back_up(controller, pool, TOKENS)
    operation, bounce = start_prefetch(controller, pool, TOKENS)
    controller.run_storage_until_idle()
    assert operation.is_terminated()
    assert tree.finish_prefetch(operation) == 2 * PAGE
    assert torch.equal(pool.read(bounce[:8]), pool.read(source[:8]))
    assert sorted(tree.drain_releases()) == bounce[8:].tolist()


def test_a_failed_backup_batch_stops_the_backup_there() -> None:
    controller, pool, _ = make()
    backend = controller.storage_backend
    assert backend is not None
    controller.storage_backend = FaultInjectingStorage(backend, seed=0, set_fail_pages=[1])
    controller.storage_batch_size = 1
    host = pool.alloc(16)
    assert host is not None
    controller.write_storage(host, TOKENS)
    controller.run_storage_until_idle()
    ack = controller.ack_backup_queue.get_nowait()
    assert ack.completed_tokens == PAGE
    assert backend.batch_exists(compute_page_hashes(TOKENS, PAGE)) == 1


def test_prefix_keys_grow_per_batch_without_touching_the_callers_list() -> None:
    # bug class 20: SGLang extended the operation's own prefix list in place
    controller, pool, _ = make()
    back_up(controller, pool, TOKENS)
    controller.storage_batch_size = 2
    keys = compute_page_hashes(TOKENS, PAGE)
    seen: list[tuple[str, ...] | None] = []
    transfer = controller.page_get_func

    def spy(
        op: PrefetchOperation,
        hashes: list[str],
        host: torch.Tensor,
        extra: HiCacheStorageExtraInfo | None,
    ) -> None:
        seen.append(None if extra is None else extra.prefix_keys)
        transfer(op, hashes, host, extra)

    controller.page_get_func = spy
    prefix = ["p"]
    for rid in ("r1", "r2"):
        bounce = pool.alloc(16)
        assert bounce is not None
        operation = controller.prefetch(rid, bounce, TOKENS, prefix_keys=prefix)
        controller.run_storage_until_idle()
        assert operation.completed_tokens == 16
    assert prefix == ["p"] and operation.prefix_keys == ("p",)
    assert seen == [("p",), ("p", keys[0], keys[1])] * 2


def test_prefetch_with_misaligned_host_slots_is_refused() -> None:
    controller, _, _ = make()
    with pytest.raises(PageAlignmentError, match="INV-01"):
        controller.prefetch("r", torch.arange(1, 5), TOKENS[:4])


def test_prefetch_needs_one_slot_per_token() -> None:
    controller, _, _ = make()
    with pytest.raises(HiCacheInputError, match="one slot per token"):
        controller.prefetch("r", torch.arange(8), TOKENS)


def test_write_storage_needs_a_host_page_per_key() -> None:
    controller, _, _ = make()
    with pytest.raises(HiCacheInputError, match="2 page keys but only 4 host slots"):
        controller.write_storage(torch.arange(4), TOKENS[:8], hash_value=["a", "b"])


def test_storage_calls_before_attach_name_the_fix() -> None:
    controller = FakeStorageController(FakeHostPool(size=16, page_size=PAGE))
    with pytest.raises(HiCacheInputError, match="call attach_storage_backend"):
        controller.write_storage(torch.arange(4), TOKENS[:4])


def test_empty_release_is_a_no_op_and_a_release_splits_into_pages() -> None:
    controller, _, _ = make()
    controller.append_host_mem_release(torch.arange(0))
    assert controller.host_mem_release_queue.empty()  # sglang#11005
    controller.append_host_mem_release(torch.arange(8))
    assert [p.tolist() for p in controller.host_mem_release_queue.snapshot()] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def test_release_queue_is_bounded_by_the_host_page_count() -> None:
    controller, _, _ = make()
    controller.append_host_mem_release(torch.arange(64))
    with pytest.raises(StorageQueueOverflow, match="released twice \\(INV-19\\)"):
        controller.append_host_mem_release(torch.arange(4))


def test_rate_limit_trips_at_eighty_percent_of_host_beyond_device() -> None:
    controller, _, _ = make()  # host 64, device 16: limit int(0.8 * 48) = 38
    controller.prefetch_tokens_occupied = 37
    assert not controller.prefetch_rate_limited()
    controller.prefetch_tokens_occupied = 38
    assert controller.prefetch_rate_limited()


def test_a_prefetch_chained_onto_a_cached_prefix_finds_its_pages() -> None:
    controller, pool, tree = make()
    keys = compute_page_hashes(TOKENS, PAGE)
    host = pool.alloc(16)
    assert host is not None
    pool.fill(host, seed=4)
    controller.write_storage(host, TOKENS, hash_value=keys)
    controller.run_storage_until_idle()
    operation, bounce = start_prefetch(controller, pool, TOKENS[8:])
    operation.last_hash = keys[1]  # the tree already holds the first two pages
    controller.run_storage_until_idle()
    assert tree.finish_prefetch(operation) == 8
    assert torch.equal(pool.read(bounce), pool.read(host[8:]))


def test_mla_ranks_other_than_zero_skip_backups_but_still_ack() -> None:
    from storage_fakes import MLATokenToKVPool

    for tp_rank, stored in ((1, 0), (0, 4)):
        pool = FakeHostPool(size=64, page_size=PAGE)
        controller = FakeStorageController(
            pool, device_pool=MLATokenToKVPool(16), tp_rank=tp_rank, tp_size=2
        )
        controller.attach_storage_backend("memory")
        host = pool.alloc(16)
        assert host is not None
        controller.write_storage(host, TOKENS)
        controller.run_storage_until_idle()
        ack = controller.ack_backup_queue.get_nowait()
        assert isinstance(ack, StorageOperation)
        backend = controller.storage_backend
        assert backend is not None
        assert backend.batch_exists(compute_page_hashes(TOKENS, PAGE)) == stored
