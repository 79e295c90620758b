"""Attach, detach and reset of the storage tier, its epochs, and both executors."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import pytest
import torch
from storage_fakes import FakeHostPool, TreeSide, make_tier, wait_until

from hicache_ref.controller.storage import QUEUE_NAMES, StorageStepKind, StorageTier
from hicache_ref.controller.storage.executor import ThreadExecutor
from hicache_ref.errors import HiCacheInputError, InvariantViolation, UnknownOptionError
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.memory_backend import MemoryStorage
from hicache_ref.storage.protocols import StorageHostPool

PAGE = 4
TOKENS = list(range(100, 116))


def new_tier(executor: str = "manual", **kwargs: object) -> StorageTier:
    return make_tier(FakeHostPool(size=64, page_size=PAGE), executor=executor, **kwargs)  # type: ignore[arg-type]


def assert_detached(tier: StorageTier) -> None:
    assert not tier.enable_storage
    assert tier.storage_backend is None and tier.storage_backend_type is None
    assert tier.alive_threads() == []


class ClosingStorage(MemoryStorage):
    closed = 0

    def close(self) -> None:
        ClosingStorage.closed += 1


class RefusingPoolStorage(ClosingStorage):
    def register_mem_pool_host(self, mem_pool_host: StorageHostPool) -> None:
        raise RuntimeError("pool refused")


@pytest.fixture
def broken_backends() -> Iterator[None]:
    def fail_to_build(
        config: HiCacheStorageConfig, pool: StorageHostPool | None, extra: Mapping[str, object]
    ) -> HiCacheStorage:
        raise RuntimeError("backend unreachable")

    def refuse_pool(
        config: HiCacheStorageConfig, pool: StorageHostPool | None, extra: Mapping[str, object]
    ) -> HiCacheStorage:
        return RefusingPoolStorage(config)

    StorageBackendFactory.register_backend("test-unreachable", fail_to_build)
    StorageBackendFactory.register_backend("test-refuse-pool", refuse_pool)
    yield
    StorageBackendFactory.unregister_backend("test-unreachable")
    StorageBackendFactory.unregister_backend("test-refuse-pool")


# -- attach ----------------------------------------------------------------------------------------
def test_attach_refused_under_cp_shared_kv() -> None:
    with pytest.raises(RuntimeError, match="CP shared KV HiCache does not support attaching"):
        new_tier(uses_cp_hicache=True).attach_storage_backend("memory")


def test_attach_twice_is_refused() -> None:
    tier = new_tier()
    tier.attach_storage_backend("memory")
    with pytest.raises(RuntimeError, match="already attached"):
        tier.attach_storage_backend("memory")


def test_unknown_backend_leaves_nothing_attached_and_a_later_attach_works() -> None:
    tier = new_tier()
    with pytest.raises(UnknownOptionError, match="legal values: file, memory"):
        tier.attach_storage_backend("hf3fs")
    assert_detached(tier)
    tier.attach_storage_backend("memory")
    assert tier.enable_storage and tier.storage_backend_type == "memory"


@pytest.mark.parametrize("executor", ["manual", "thread"])
def test_failing_backend_factory_rolls_back(broken_backends: None, executor: str) -> None:
    tier = new_tier(executor)
    with pytest.raises(RuntimeError, match="backend unreachable"):
        tier.attach_storage_backend("test-unreachable")
    assert_detached(tier)
    tier.attach_storage_backend("memory")
    tier.detach_storage_backend()


def test_backend_failing_after_creation_is_closed_on_rollback(broken_backends: None) -> None:
    tier = new_tier("thread")
    closed_before = ClosingStorage.closed
    with pytest.raises(RuntimeError, match="pool refused"):
        tier.attach_storage_backend("test-refuse-pool")
    assert ClosingStorage.closed == closed_before + 1
    assert_detached(tier)


def test_unknown_executor_is_refused_when_the_tier_is_built() -> None:
    with pytest.raises(
        UnknownOptionError, match="storage_executor 'fiber'; legal values: thread, manual"
    ):
        new_tier("fiber")


def test_attach_copies_extra_config_and_takes_tp_lcm_size_out() -> None:
    tier = new_tier()
    extra: dict[str, object] = {"tp_lcm_size": 1, "other": 1}
    tier.attach_storage_backend("memory", model_name="m", storage_backend_extra_config=extra)
    assert extra == {"tp_lcm_size": 1, "other": 1}
    config = tier.storage_config
    assert config is not None
    assert config.tp_lcm_size == 1 and dict(config.extra_config) == {"other": 1}
    assert config.model_name == "m" and not config.is_mla_model


def test_threshold_is_at_least_one_page() -> None:
    tier = new_tier()
    tier.attach_storage_backend("memory", prefetch_threshold=1)
    assert tier.prefetch_threshold == PAGE


def test_each_attach_starts_a_new_epoch() -> None:
    tier = new_tier()
    tier.attach_storage_backend("memory")
    first = tier.epoch
    tier.detach_storage_backend()
    tier.attach_storage_backend("memory")
    assert tier.epoch == first + 1


# -- detach ----------------------------------------------------------------------------------------
def test_detach_is_idempotent_and_allows_reattach() -> None:
    tier = new_tier("thread")
    tier.detach_storage_backend()  # never attached
    tier.attach_storage_backend("memory")
    assert len(tier.alive_threads()) == 4
    tier.detach_storage_backend()
    tier.detach_storage_backend()
    assert_detached(tier)
    tier.attach_storage_backend("memory")
    assert len(tier.alive_threads()) == 4
    tier.detach_storage_backend()
    assert_detached(tier)


def test_detach_terminates_what_runs_and_leaves_every_final_ack_for_the_tree() -> None:
    tier = new_tier()
    pool: FakeHostPool = tier.mem_pool_host  # type: ignore[assignment]
    tree = TreeSide(tier, pool)
    tier.attach_storage_backend("memory", prefetch_threshold=PAGE)
    source = pool.alloc(16)
    assert source is not None
    tier.write_storage(source, TOKENS)
    tier.run_until_idle()
    tree.drain_backups()
    full = pool.available_size()
    queued = tree.start("queued", TOKENS)
    running = tree.start("running", TOKENS)
    tier.storage_batch_size = 1
    tier.run_step(StorageStepKind.HIT_QUERY)
    tree.drain_hits()  # "running" has a bounce buffer and its IO is queued
    tier.detach_storage_backend()
    assert queued.is_terminated() and running.is_terminated()
    assert_detached(tier)
    tree.drain_all()  # the tree settles both from the acks detach left behind
    assert not tree.ongoing and pool.available_size() == full
    assert tier.queues.is_empty()


def test_attach_refused_while_the_last_detach_left_acks_undrained() -> None:
    tier = new_tier()
    tier.attach_storage_backend("memory")
    tier.write_storage(torch.arange(4), TOKENS[:4])
    tier.detach_storage_backend()
    with pytest.raises(
        HiCacheInputError, match=r"undrained storage queues {.ack_backup_queue.: 1}"
    ):
        tier.attach_storage_backend("memory")


# -- reset -----------------------------------------------------------------------------------------
def test_reset_empties_every_queue_zeroes_occupancy_and_starts_an_epoch() -> None:
    # sglang#36882, #26009: old entries and occupancy survived a reset
    tier = new_tier()
    tier.attach_storage_backend("memory")
    pool: FakeHostPool = tier.mem_pool_host  # type: ignore[assignment]
    tree = TreeSide(tier, pool)
    source = pool.alloc(16)
    assert source is not None
    tree.start("r", TOKENS)
    tier.write_storage(source, TOKENS)
    tier.append_host_mem_release(torch.arange(48, 56))
    epoch = tier.epoch
    tier.reset()
    assert set(tier.queues.sizes()) == set(QUEUE_NAMES) and tier.queues.is_empty()
    assert tier.prefetch_tokens_occupied == 0 and tier.epoch == epoch + 1
    tier.write_storage(source, TOKENS)
    assert tier.run_until_idle() == 1


def test_an_operation_of_an_old_epoch_is_refused_by_every_step() -> None:
    tier = new_tier()
    tier.attach_storage_backend("memory")
    stale = tier.prefetch("old", TOKENS)
    tier.reset()
    tier.queues.prefetch_queue.put(stale)  # what an old thread draining the new queue does
    with pytest.raises(
        InvariantViolation, match=r"INV-24 violated: .* from epoch 1 ran in epoch 2"
    ):
        tier.run_step(StorageStepKind.HIT_QUERY)


def test_reset_without_storage_is_a_no_op() -> None:
    tier = new_tier()
    tier.reset()
    assert not tier.enable_storage


def test_reset_joins_every_thread_and_starts_four_new_ones() -> None:
    tier = new_tier("thread")
    tier.attach_storage_backend("memory")
    old = set(tier.alive_threads())
    tier.reset()
    new = set(tier.alive_threads())
    assert len(old) == len(new) == 4 and old.isdisjoint(new)
    tier.detach_storage_backend()
    assert tier.alive_threads() == []


def test_ctrl_c_while_the_threads_start_rolls_the_attach_back_quietly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # SIGINT lands inside the third thread's start: two threads run, two never will
    class InterruptedStart(threading.Thread):
        def start(self) -> None:
            raise KeyboardInterrupt

    made: list[threading.Thread] = []
    make = ThreadExecutor.make_thread

    def make_thread(
        self: ThreadExecutor, kind: StorageStepKind, epoch: int, stop: threading.Event
    ) -> threading.Thread:
        thread = make(self, kind, epoch, stop) if len(made) < 2 else InterruptedStart(daemon=True)
        made.append(thread)
        return thread

    monkeypatch.setattr(ThreadExecutor, "make_thread", make_thread)
    tier = new_tier("thread")
    with pytest.raises(KeyboardInterrupt):
        tier.attach_storage_backend("memory")
    assert_detached(tier)  # the two that ran are joined; the rollback logged no failure
    assert not any(t.is_alive() for t in made)
    assert "did not stop" not in caplog.text


# -- executors -------------------------------------------------------------------------------------
def test_steps_are_refused_in_thread_mode() -> None:
    tier = new_tier("thread")
    tier.attach_storage_backend("memory")
    try:
        with pytest.raises(HiCacheInputError, match="storage_executor='manual'"):
            tier.run_step(StorageStepKind.BACKUP)
    finally:
        tier.detach_storage_backend()


def test_manual_steps_are_idle_without_work() -> None:
    tier = new_tier()
    tier.attach_storage_backend("memory")
    assert tier.runnable_steps() == []
    assert not any(tier.run_step(kind).ran for kind in StorageStepKind)
    assert tier.run_until_idle() == 0


def test_thread_mode_backs_up_and_prefetches_the_same_bytes() -> None:
    tier = new_tier("thread")
    pool: FakeHostPool = tier.mem_pool_host  # type: ignore[assignment]
    tree = TreeSide(tier, pool)
    tier.attach_storage_backend("memory", prefetch_threshold=PAGE)
    try:
        source = pool.alloc(8)
        assert source is not None
        pool.fill(source, seed=9)
        tier.write_storage(source, TOKENS[:8])
        assert tier.queues.ack_backup_queue.get(timeout=10).completed_tokens == 8
        tree.start("r", TOKENS)
        wait_until(lambda: tier.queues.prefetch_hit_queue.qsize() == 1)
        tree.drain_hits()
        wait_until(lambda: tier.queues.ack_prefetch_queue.qsize() == 2)
        tree.drain_acks()
        assert torch.equal(pool.read(tree.inserted["r"]), pool.read(source))
        tier.check_storage_threads()
    finally:
        tier.detach_storage_backend()
    assert_detached(tier)


def test_thread_errors_are_kept_and_reraised_and_the_backup_still_acks() -> None:
    tier = new_tier("thread")
    tier.attach_storage_backend("memory")

    def broken_ack_put(item: object) -> None:
        raise RuntimeError("ack queue broken")

    try:
        tier.queues.ack_backup_queue.put = broken_ack_put  # type: ignore[method-assign]
        tier.write_storage(torch.arange(4), TOKENS[:4])
        wait_until(lambda: bool(tier.thread_errors))
        with pytest.raises(RuntimeError, match="ack queue broken"):
            tier.check_storage_threads()
        assert len(tier.alive_threads()) == 4  # one failed step does not end its thread
    finally:
        tier.detach_storage_backend()
