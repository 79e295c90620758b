"""The seed's storage methods on ``HiCacheController``, each delegating to its ``StorageTier``.

The tier (``controller/storage/``) is an object the controller owns, with its own queues,
epochs and executor; this class only keeps SGLang's public names where the tree expects them
(``cc.prefetch(...)``, ``cc.ack_backup_queue``, ``cc.prefetch_tokens_occupied += n``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.storage.hashing import Token

if TYPE_CHECKING:
    from hicache_ref.controller.storage.tier import StorageTier
    from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
    from hicache_ref.storage.operations import PrefetchAck, PrefetchOperation, StorageOperation
    from hicache_ref.storage.pool_transfers import PoolTransfer
    from hicache_ref.storage.queues import BoundedQueue


class StorageFacade:
    """Delegates only: every storage call goes to ``self.storage``."""

    storage: StorageTier

    # -- lifecycle ---------------------------------------------------------------------------------
    def attach_storage_backend(
        self,
        storage_backend: str,
        prefetch_threshold: int = 256,
        model_name: str | None = None,
        storage_backend_extra_config: Mapping[str, object] | None = None,
    ) -> None:
        self.storage.attach_storage_backend(
            storage_backend, prefetch_threshold, model_name, storage_backend_extra_config
        )

    def detach_storage_backend(self) -> None:
        self.storage.detach_storage_backend()

    def clear_storage_backend(self) -> bool:
        return self.storage.clear_storage_backend()

    def check_storage_threads(self) -> None:
        self.storage.check_storage_threads()

    # -- the tree's calls --------------------------------------------------------------------------
    def prefetch(
        self,
        request_id: str,
        new_input_tokens: Sequence[Token],
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
        extra_pools: Sequence[PoolTransfer] | None = None,
    ) -> PrefetchOperation:
        if extra_pools is None:  # a tier of the seed's signature (a mutant's) takes no windows
            return self.storage.prefetch(request_id, new_input_tokens, last_hash, prefix_keys)
        return self.storage.prefetch(
            request_id, new_input_tokens, last_hash, prefix_keys, extra_pools
        )

    def alloc_prefetch_host_buffers(
        self, operation: PrefetchOperation, need_size: int
    ) -> torch.Tensor | None:
        return self.storage.alloc_prefetch_host_buffers(operation, need_size)

    def is_prefetch_complete(self, operation: PrefetchOperation) -> bool:
        return self.storage.is_prefetch_complete(operation)

    def terminate_prefetch(self, operation: PrefetchOperation) -> tuple[int, list[str]]:
        return self.storage.terminate_prefetch(operation)

    def append_host_mem_release(self, host_indices: torch.Tensor) -> None:
        self.storage.append_host_mem_release(host_indices)

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[Token],
        hash_value: Sequence[str] | None = None,
        prefix_keys: Sequence[str] | None = None,
        extra_pools: Sequence[PoolTransfer] | None = None,
    ) -> int:
        if extra_pools is None:  # a tier of the seed's signature (a mutant's) takes no windows
            return self.storage.write_storage(host_indices, token_ids, hash_value, prefix_keys)
        return self.storage.write_storage(
            host_indices, token_ids, hash_value, prefix_keys, extra_pools
        )

    def prefetch_rate_limited(self) -> bool:
        return self.storage.prefetch_rate_limited()

    @property
    def host_memory_mode(self) -> str:
        return self.storage.host_memory_mode

    @property
    def host_write_staged_tokens_fn(self) -> Callable[[], int] | None:
        """Buffer mode: the tree's write staging (tokens), left out of the rate limit."""
        return self.storage.host_write_staged_tokens_fn

    @host_write_staged_tokens_fn.setter
    def host_write_staged_tokens_fn(self, staged: Callable[[], int] | None) -> None:
        self.storage.host_write_staged_tokens_fn = staged

    # -- state the tree reads ----------------------------------------------------------------------
    @property
    def enable_storage(self) -> bool:
        return self.storage.enable_storage

    @property
    def storage_backend(self) -> HiCacheStorage | None:
        return self.storage.storage_backend

    @property
    def storage_backend_type(self) -> str | None:
        return self.storage.storage_backend_type

    @property
    def storage_config(self) -> HiCacheStorageConfig | None:
        return self.storage.storage_config

    @property
    def backup_skip(self) -> bool:
        return self.storage.backup_skip

    @property
    def prefetch_threshold(self) -> int:
        return self.storage.prefetch_threshold

    @property
    def prefetch_capacity_limit(self) -> int:
        return self.storage.prefetch_capacity_limit

    @property
    def prefetch_tokens_occupied(self) -> int:
        return self.storage.prefetch_tokens_occupied

    @prefetch_tokens_occupied.setter
    def prefetch_tokens_occupied(self, value: int) -> None:
        self.storage.prefetch_tokens_occupied = value

    @property
    def storage_batch_size(self) -> int:
        return self.storage.storage_batch_size

    @storage_batch_size.setter
    def storage_batch_size(self, value: int) -> None:
        self.storage.storage_batch_size = value

    @property
    def storage_executor(self) -> str:
        return self.storage.executor_name

    # -- the queues --------------------------------------------------------------------------------
    @property
    def prefetch_queue(self) -> BoundedQueue[PrefetchOperation]:
        return self.storage.queues.prefetch_queue

    @property
    def prefetch_hit_queue(self) -> BoundedQueue[PrefetchOperation]:
        return self.storage.queues.prefetch_hit_queue

    @property
    def prefetch_buffer(self) -> BoundedQueue[PrefetchOperation]:
        return self.storage.queues.prefetch_buffer

    @property
    def prefetch_sync_queue(self) -> BoundedQueue[PrefetchAck]:
        return self.storage.queues.prefetch_sync_queue

    @property
    def ack_prefetch_queue(self) -> BoundedQueue[PrefetchAck]:
        return self.storage.queues.ack_prefetch_queue

    @property
    def backup_queue(self) -> BoundedQueue[StorageOperation]:
        return self.storage.queues.backup_queue

    @property
    def ack_backup_queue(self) -> BoundedQueue[StorageOperation]:
        return self.storage.queues.ack_backup_queue

    @property
    def host_mem_release_queue(self) -> BoundedQueue[torch.Tensor]:
        return self.storage.queues.host_mem_release_queue

    @property
    def extra_host_mem_release_queues(self) -> dict[str, BoundedQueue[torch.Tensor]]:
        """An independent side pool's release queue, by pool name (a window's staged tail)."""
        return self.storage.extra_host_mem_release_queues

    # -- manual steps ------------------------------------------------------------------------------
    def runnable_storage_steps(self) -> list[StorageStepKind]:
        return self.storage.runnable_steps()

    def step_prefetch_query(self) -> bool:
        """Run one hit query step; False if no prefetch was queued."""
        return self.storage.run_step(StorageStepKind.HIT_QUERY).ran

    def step_prefetch_io(self) -> bool:
        """Run one batch of the current (or oldest queued) transfer; False if none."""
        return self.storage.run_step(StorageStepKind.IO).ran

    def step_prefetch_sync(self) -> bool:
        """Publish the oldest progress ack; False if none was waiting."""
        return self.storage.run_step(StorageStepKind.SYNC).ran

    def step_backup(self) -> bool:
        """Run the oldest queued backup; False if none was queued."""
        return self.storage.run_step(StorageStepKind.BACKUP).ran

    def run_storage_until_idle(self) -> int:
        return self.storage.run_until_idle()
