"""Attach, detach and reset of the storage tier, and the thread executor."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch
from storage_fakes import FakeHostPool, FakeStorageController, TreeSide, wait_until

from hicache_ref.errors import HiCacheInputError, UnknownOptionError
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.memory_backend import MemoryStorage
from hicache_ref.storage.protocols import StorageHostPool

PAGE = 4
TOKENS = list(range(100, 116))


def new_controller(executor: str = "manual", **kwargs: object) -> FakeStorageController:
    return FakeStorageController(FakeHostPool(size=64, page_size=PAGE), executor=executor, **kwargs)  # type: ignore[arg-type]


def storage_threads(controller: FakeStorageController) -> list[object]:
    return [controller.prefetch_thread, controller.prefetch_io_aux_thread, controller.backup_thread]


def assert_detached(controller: FakeStorageController) -> None:
    assert not controller.enable_storage
    assert controller.storage_backend is None and controller.storage_backend_type is None
    assert storage_threads(controller) == [None, None, None]


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
        new_controller(uses_cp_hicache=True).attach_storage_backend("memory")


def test_attach_twice_is_refused() -> None:
    controller = new_controller()
    controller.attach_storage_backend("memory")
    with pytest.raises(RuntimeError, match="already attached"):
        controller.attach_storage_backend("memory")


def test_unknown_backend_leaves_nothing_attached_and_a_later_attach_works() -> None:
    controller = new_controller()
    with pytest.raises(UnknownOptionError, match="legal values: file, memory"):
        controller.attach_storage_backend("hf3fs")
    assert_detached(controller)
    controller.attach_storage_backend("memory")
    assert controller.enable_storage and controller.storage_backend_type == "memory"


@pytest.mark.parametrize("executor", ["manual", "thread"])
def test_failing_backend_factory_rolls_back(broken_backends: None, executor: str) -> None:
    controller = new_controller(executor)
    with pytest.raises(RuntimeError, match="backend unreachable"):
        controller.attach_storage_backend("test-unreachable")
    assert_detached(controller)
    assert not controller.storage_stop_event.is_set()
    controller.attach_storage_backend("memory")
    controller.detach_storage_backend()


def test_backend_failing_after_creation_is_closed_on_rollback(broken_backends: None) -> None:
    controller = new_controller("thread")
    closed_before = ClosingStorage.closed
    with pytest.raises(RuntimeError, match="pool refused"):
        controller.attach_storage_backend("test-refuse-pool")
    assert ClosingStorage.closed == closed_before + 1
    assert_detached(controller)


def test_unknown_executor_is_refused_before_anything_is_built() -> None:
    controller = new_controller("fiber")
    with pytest.raises(
        UnknownOptionError, match="storage_executor 'fiber'; legal values: thread, manual"
    ):
        controller.attach_storage_backend("memory")
    assert_detached(controller)


def test_attach_copies_extra_config_and_takes_tp_lcm_size_out() -> None:
    controller = new_controller()
    extra: dict[str, object] = {"tp_lcm_size": 2, "other": 1}
    controller.attach_storage_backend("memory", model_name="m", storage_backend_extra_config=extra)
    assert extra == {"tp_lcm_size": 2, "other": 1}
    config = controller.storage_config
    assert config is not None
    assert config.tp_lcm_size == 2 and dict(config.extra_config) == {"other": 1}
    assert config.model_name == "m" and not config.is_mla_model


def test_threshold_is_at_least_one_page() -> None:
    controller = new_controller()
    controller.attach_storage_backend("memory", prefetch_threshold=1)
    assert controller.prefetch_threshold == PAGE


# -- detach ----------------------------------------------------------------------------------------
def test_detach_is_idempotent_and_allows_reattach() -> None:
    controller = new_controller("thread")
    controller.detach_storage_backend()  # never attached
    controller.attach_storage_backend("memory")
    controller.detach_storage_backend()
    controller.detach_storage_backend()
    assert_detached(controller)
    assert not controller.storage_stop_event.is_set()
    controller.attach_storage_backend("memory")
    assert all(t is not None and t.is_alive() for t in storage_threads(controller))  # type: ignore[attr-defined]
    controller.detach_storage_backend()


def test_detach_returns_pending_releases_and_unrun_prefetches_to_the_pool() -> None:
    controller = new_controller()
    pool = controller.mem_pool_host
    controller.attach_storage_backend("memory")
    full = pool.available_size()
    queued = pool.alloc(8)
    released = pool.alloc(4)
    assert queued is not None and released is not None
    operation = controller.prefetch("r", queued, TOKENS[:8])
    controller.append_host_mem_release(released)
    controller.detach_storage_backend()
    assert pool.available_size() == full
    assert operation.is_terminated() and controller.terminate_prefetch(operation) == (0, [])


# -- reset -----------------------------------------------------------------------------------------
def test_reset_empties_every_storage_queue_including_releases() -> None:
    # bug class 15: a stale release surviving reset frees a slot twice after the pool is cleared
    controller = new_controller()
    controller.attach_storage_backend("memory")
    pool = controller.mem_pool_host
    bounce = pool.alloc(16)
    source = pool.alloc(16)
    assert bounce is not None and source is not None
    controller.prefetch("r", bounce, TOKENS)
    controller.write_storage(source, TOKENS)
    controller.append_host_mem_release(torch.arange(48, 56))
    controller.reset()
    queues = controller._storage_queues()
    assert len(queues) == 6 and all(q.empty() for q in queues)
    assert controller.enable_storage
    controller.write_storage(source, TOKENS)
    assert controller.run_storage_until_idle() == 1


def test_reset_without_storage_is_a_no_op() -> None:
    controller = new_controller()
    controller.reset()
    assert not controller.enable_storage


def test_reset_joins_every_thread_including_the_prefetch_io_thread() -> None:
    controller = new_controller("thread")
    controller.attach_storage_backend("memory")
    old = storage_threads(controller)
    controller.reset()
    assert not any(t.is_alive() for t in old)  # type: ignore[attr-defined]
    new = storage_threads(controller)
    assert all(t is not None and t.is_alive() for t in new)  # type: ignore[attr-defined]
    assert set(map(id, new)).isdisjoint(map(id, old))
    controller.detach_storage_backend()
    assert not any(t.is_alive() for t in new)  # type: ignore[attr-defined]


# -- executors -------------------------------------------------------------------------------------
def test_steps_are_refused_in_thread_mode() -> None:
    controller = new_controller("thread")
    controller.attach_storage_backend("memory")
    try:
        with pytest.raises(HiCacheInputError, match="storage_executor='manual'"):
            controller.step_backup()
    finally:
        controller.detach_storage_backend()


def test_manual_steps_return_false_when_idle() -> None:
    controller = new_controller()
    controller.attach_storage_backend("memory")
    assert not controller.step_prefetch_query()
    assert not controller.step_prefetch_io()
    assert not controller.step_backup()
    assert controller.run_storage_until_idle() == 0


def test_thread_mode_backs_up_and_prefetches_the_same_bytes() -> None:
    controller = new_controller("thread")
    pool: FakeHostPool = controller.mem_pool_host  # type: ignore[assignment]
    tree = TreeSide(controller, pool)
    controller.attach_storage_backend("memory", prefetch_threshold=PAGE)
    try:
        source = pool.alloc(8)
        assert source is not None
        pool.fill(source, seed=9)
        controller.write_storage(source, TOKENS[:8])
        ack = controller.ack_backup_queue.get(timeout=10)
        assert ack.completed_tokens == 8
        bounce = pool.alloc(16)
        assert bounce is not None
        operation = controller.prefetch("r", bounce, TOKENS)
        wait_until(lambda: operation.completed_tokens == 8)
        wait_until(lambda: bool(operation.released_ranges()))  # non-hit tail released
        assert tree.finish_prefetch(operation) == 8
        assert torch.equal(pool.read(bounce[:8]), pool.read(source))
        wait_until(lambda: controller.host_mem_release_queue.qsize() == 2)
        assert sorted(tree.drain_releases()) == bounce[8:].tolist()
        controller.check_storage_threads()
    finally:
        controller.detach_storage_backend()
    assert_detached(controller)


def test_thread_errors_are_kept_and_reraised() -> None:
    controller = new_controller("thread")
    controller.attach_storage_backend("memory")

    def broken_pool_read(index: int, flat: bool = True) -> torch.Tensor:
        raise RuntimeError("host pool read failed")

    controller.mem_pool_host.get_data_page = broken_pool_read  # type: ignore[method-assign,assignment]
    try:
        controller.write_storage(torch.arange(4), TOKENS[:4])
        wait_until(lambda: bool(controller.storage_thread_errors))
        with pytest.raises(RuntimeError, match="host pool read failed"):
            controller.check_storage_threads()
        backup_thread = controller.backup_thread
        assert backup_thread is not None
        backup_thread.join(timeout=10)
        assert not backup_thread.is_alive()  # the failed thread stopped; detach still joins
    finally:
        controller.detach_storage_backend()
