"""``StorageTier``: the L3 tier one controller owns (one rank): its lifecycle, epochs and API.

Lifecycle: ``attach_storage_backend`` builds the backend, fresh queues and a new *epoch*, then
starts the executor; ``reset`` stops and joins every thread, drops every queue and the transfer
in progress, zeroes ``prefetch_tokens_occupied`` and starts the next epoch (INV-24);
``detach_storage_backend`` terminates every prefetch still running, lets the steps bring every
operation to its final ack, stops the threads and closes the backend; ``clear_storage_backend``
(the scheduler's clear endpoint) empties this rank's namespace and keeps it attached. An
operation remembers
the epoch it was created in, and every step refuses one from another epoch (INV-24).

The tree-facing API keeps SGLang 0.5.23's names: ``prefetch`` -> (``prefetch_hit_queue``) ->
``alloc_prefetch_host_buffers`` + ``prefetch_buffer.put`` -> (``ack_prefetch_queue``) ->
``terminate_prefetch`` -> ``append_host_mem_release``; ``write_storage`` ->
(``ack_backup_queue``). ``runnable_steps`` / ``run_step`` are the manual executor's handles.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, cast

import torch

from hicache_ref.controller.storage.backup import Backup
from hicache_ref.controller.storage.buffer_mode import (
    BUFFER_ONLY,
    CACHE,
    StagingHostPool,
    check_host_memory_mode,
    compute_load_capacity_limit,
    is_load_rate_limited,
)
from hicache_ref.controller.storage.collectives import Collectives, SingleRank
from hicache_ref.controller.storage.config import (
    compute_prefetch_capacity_limit,
    generate_storage_config,
)
from hicache_ref.controller.storage.executor import (
    ExecutorFactory,
    StorageExecutor,
    make_executor,
)
from hicache_ref.controller.storage.hit_query import HitQuery
from hicache_ref.controller.storage.lifecycle import close_backend, finish_pending_work
from hicache_ref.controller.storage.prefetch_io import PrefetchIO
from hicache_ref.controller.storage.prefetch_sync import PrefetchSync
from hicache_ref.controller.storage.queues import StorageQueues
from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.controller.storage.releases import (
    check_release_not_io_owned,
    queue_page_releases,
)
from hicache_ref.controller.storage.side_window import WindowPools, is_window_transfer
from hicache_ref.controller.storage.steps import StepRunner
from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.hashing import Token, get_hash_str
from hicache_ref.storage.operations import PrefetchOperation, StorageOperation
from hicache_ref.storage.pages import require_page_aligned
from hicache_ref.storage.pool_transfers import PoolTransfer, pool_name
from hicache_ref.storage.protocols import StorageHostPool
from hicache_ref.storage.queues import BoundedQueue

logger = logging.getLogger("hicache_ref.controller.storage")


class StorageTier:
    """Prefetch and backup between one host pool and one backend, on its own executor."""

    hit_query_class: ClassVar[type[HitQuery]] = HitQuery
    prefetch_io_class: ClassVar[type[PrefetchIO]] = PrefetchIO
    prefetch_sync_class: ClassVar[type[PrefetchSync]] = PrefetchSync
    backup_class: ClassVar[type[Backup]] = Backup
    STORAGE_BATCH_PAGES_DEFAULT: ClassVar[int] = 128

    def __init__(
        self,
        mem_pool_host: StorageHostPool,
        mem_pool_device: object,
        page_size: int,
        *,
        executor: str | ExecutorFactory = "thread",
        collectives: Collectives | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        enable_storage_metrics: bool = False,
        uses_cp_hicache: bool = False,
        host_memory_mode: str = CACHE,
    ) -> None:
        if page_size < 1 or page_size != mem_pool_host.page_size:
            raise HiCacheInputError(
                f"page_size={page_size} must be >= 1 and equal the host pool's page_size="
                f"{mem_pool_host.page_size}"
            )
        self.mem_pool_host = mem_pool_host
        self.mem_pool_device = mem_pool_device
        self.page_size = page_size
        self.collectives: Collectives = collectives or SingleRank()
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.enable_storage_metrics = enable_storage_metrics
        self.uses_cp_hicache = uses_cp_hicache
        self.host_memory_mode = check_host_memory_mode(host_memory_mode, mem_pool_host)
        self.host_write_staged_tokens_fn: Callable[[], int] | None = None
        """Buffer mode: the tree's write staging (tokens), which the rate limit leaves out."""
        self.executor: StorageExecutor = make_executor(executor, self)
        self.executor_name = executor if isinstance(executor, str) else self.executor.name
        self.enable_storage = False
        self.storage_backend: HiCacheStorage | None = None
        self.storage_backend_type: str | None = None
        self.storage_config: HiCacheStorageConfig | None = None
        self.backup_skip = False
        self.prefetch_threshold = 0
        self.prefetch_capacity_limit = 0
        self.prefetch_tokens_occupied = 0
        self.storage_batch_size = self.STORAGE_BATCH_PAGES_DEFAULT
        self.sidecar_pools: dict[str, StorageHostPool] = {}
        self.window_pools = WindowPools()  # an independent side pool's windows (side_window.py)
        self.get_hash_str: Callable[[Sequence[Token], str | None], str] = get_hash_str
        self.epoch = 0
        self.queues = StorageQueues.create(self._host_pages())
        self._live_prefetches: weakref.WeakValueDictionary[int, PrefetchOperation] = (
            weakref.WeakValueDictionary()
        )
        self.step_observer: Callable[[StepResult], None] | None = None
        self.hit_query = self.hit_query_class(self)
        self.prefetch_io = self.prefetch_io_class(self)
        self.prefetch_sync = self.prefetch_sync_class(self)
        self.backup = self.backup_class(self)
        self.steps = StepRunner(self)

    @property
    def rank(self) -> int:
        return self.collectives.rank

    def _host_pages(self) -> int:
        return max(1, self.mem_pool_host.size // self.page_size)

    # -- attach / detach ---------------------------------------------------------------------------
    def attach_storage_backend(
        self,
        storage_backend: str,
        prefetch_threshold: int = 256,
        model_name: str | None = None,
        storage_backend_extra_config: Mapping[str, object] | None = None,
    ) -> None:
        """Enable storage; on any failure nothing is left half-attached."""
        if self.uses_cp_hicache:
            raise RuntimeError(
                "CP shared KV HiCache does not support attaching a storage backend at runtime."
            )
        if self.enable_storage:
            raise RuntimeError("Storage backend already attached.")
        leftovers = {name: n for name, n in self.queues.sizes().items() if n}
        # Verify the last detach's acks and releases were drained: they hold host pages and locks
        if leftovers:
            raise HiCacheInputError(
                f"attach_storage_backend with undrained storage queues {leftovers} (drain the "
                "storage control queues after detach, before attaching again)"
            )
        try:
            self.executor.stop()
        except Exception as exc:
            raise RuntimeError(
                "Cannot attach storage backend: previous detach did not stop storage threads "
                "cleanly."
            ) from exc
        try:
            self._attach(
                storage_backend, prefetch_threshold, model_name, storage_backend_extra_config
            )
        except BaseException:
            self._rollback_attach()
            raise

    def _attach(
        self,
        storage_backend: str,
        prefetch_threshold: int,
        model_name: str | None,
        storage_backend_extra_config: Mapping[str, object] | None,
    ) -> None:
        self.storage_backend_type = storage_backend
        self.storage_config = self.generate_storage_config(model_name, storage_backend_extra_config)
        # MLA ranks hold identical KV: only rank 0 writes it to storage
        self.backup_skip = self.storage_config.is_mla_model and self.storage_config.tp_rank != 0
        self.storage_backend = StorageBackendFactory.create_backend(
            storage_backend, self.storage_config, self.mem_pool_host
        )
        self.storage_backend.register_mem_pool_host(self.mem_pool_host)
        for name, pool in (self.sidecar_pools | self.window_pools.pools).items():
            self.storage_backend.register_mem_host_pool_v2(pool, name)
        self.storage_backend.on_host_pools_registered()
        self.prefetch_threshold = max(prefetch_threshold, self.page_size)
        self.prefetch_capacity_limit = (
            compute_load_capacity_limit(self.mem_pool_host)
            if self.host_memory_mode == BUFFER_ONLY
            else compute_prefetch_capacity_limit(self.mem_pool_host)
        )
        self.prefetch_tokens_occupied = 0
        self._begin_epoch()
        self.enable_storage = True
        self.executor.start(self.epoch)

    def add_sidecar_pool(self, name: str, host_pool: StorageHostPool) -> None:
        """A KV-derived sidecar: ``host_pool`` is indexed by the KV host slots, and every page
        this tier stores, queries or reads carries the pool's page along (INV-37)."""
        if host_pool.page_size != self.page_size or host_pool.size < self.mem_pool_host.size:
            raise HiCacheInputError(
                f"sidecar pool {name!r} (page_size={host_pool.page_size}, size={host_pool.size})"
                f" must be indexed by the KV host slots: page_size={self.page_size} and size >= "
                f"{self.mem_pool_host.size}"
            )
        self.sidecar_pools[name] = host_pool
        if self.storage_backend is not None:
            self.storage_backend.register_mem_host_pool_v2(host_pool, name)

    def add_window_pool(self, name: str, host_pool: StorageHostPool) -> None:
        """An independent side pool (SWA, Mamba state) on host slots of its own: the tree names
        its window on each ``write_storage`` and ``prefetch`` (``extra_pools``), and a prefix is
        restorable only where its window is stored too (INV-39; ``side_window.py``)."""
        self.window_pools.add(name, host_pool)
        if self.storage_backend is not None:
            self.storage_backend.register_mem_host_pool_v2(host_pool, name)

    @property
    def extra_host_mem_release_queues(self) -> dict[str, BoundedQueue[torch.Tensor]]:
        """Each window pool's release queue: staged window slots the IO gave back."""
        return self.window_pools.release_queues

    def sidecar_transfers(
        self, keys: Sequence[str], host_indices: torch.Tensor | None = None
    ) -> list[PoolTransfer]:
        """One transfer per sidecar pool over ``keys`` (at the KV's ``host_indices``)."""
        return [
            PoolTransfer(name, host_indices=host_indices, keys=list(keys))
            for name in self.sidecar_pools
        ]

    def generate_storage_config(
        self, model_name: str | None, storage_backend_extra_config: Mapping[str, object] | None
    ) -> HiCacheStorageConfig:
        """What the backend is told: this rank's shard (its keys' namespace, INV-28)."""
        return generate_storage_config(
            self.mem_pool_host,
            self.mem_pool_device,
            tp_rank=self.collectives.rank,
            tp_size=self.collectives.world_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            enable_storage_metrics=self.enable_storage_metrics,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
        )

    def _rollback_attach(self) -> None:
        """Undo a failed attach: no thread, no backend, no queued work, storage disabled."""
        try:
            self.executor.stop()
        except Exception:
            logger.exception("storage threads did not stop while rolling back an attach")
        close_backend(self.storage_backend)
        self._clear_attributes()

    def detach_storage_backend(self) -> None:
        """Disable storage (idempotent): terminate what runs, finish every op, stop, close.

        Every prefetch still in flight is terminated; the steps then bring every queued
        operation to its final ack, which stays on the ack queues for the tree to drain (the
        bounce buffers and host locks it names go back there). Raises, attached as before, if
        the work does not finish or a thread does not stop within its bound.
        """
        if self.enable_storage:
            self.terminate_live_prefetches()
            finish_pending_work(self)
        try:
            self.executor.stop()
        except Exception as exc:
            logger.exception("stop storage threads failed: %s", exc)
            raise RuntimeError("Stop storage threads failed; detach aborted.") from exc
        close_backend(self.storage_backend)
        self._clear_attributes()

    def clear_storage_backend(self) -> bool:
        """The clear endpoint (SGLang's ``clear_storage_backend``): the backend drops every page
        of its own namespace and nothing of another rank's or model's (INV-28); True once done."""
        self.require_backend("clear_storage_backend").clear()
        return True

    def terminate_live_prefetches(self) -> int:
        """Mark every prefetch of this epoch terminated (detach's first move); how many."""
        live = list(self._live_prefetches.values())
        for operation in live:
            operation.mark_terminate()
        return len(live)

    def stop_threads(self) -> None:
        """Stop and join the storage threads without starting new ones (a rank group stops
        every rank's threads before resetting any, so no thread waits for a stopped peer)."""
        self.executor.stop()

    def _clear_attributes(self) -> None:
        self.storage_backend = None
        self.storage_backend_type = None
        self.storage_config = None
        self.enable_storage = False
        self.backup_skip = False

    # -- epochs and reset --------------------------------------------------------------------------
    def _begin_epoch(self) -> None:
        """A new epoch: fresh queues, no transfer in progress, no prefetch remembered."""
        self.epoch += 1
        self.queues = StorageQueues.create(self._host_pages())
        self.prefetch_io.reset()
        self._live_prefetches = weakref.WeakValueDictionary()

    def reset(self) -> None:
        """Join every thread, drop every queue, zero occupancy, start the next epoch (INV-24).

        Queued releases are dropped, not freed: a reset is followed by the host pool's
        ``clear()``, after which a stale release would free a slot twice (bug class 15).
        """
        self.executor.stop()
        self._begin_epoch()
        self.window_pools.renew()  # the side pools are cleared too: no stale release
        self.prefetch_tokens_occupied = 0
        if self.enable_storage:
            self.executor.start(self.epoch)

    def check_current_epoch(self, operation: StorageOperation, what: str) -> None:
        """Raise INV-24 if ``operation`` belongs to an epoch before this one."""
        # Verify no operation of an old epoch reaches a step (sglang#36882)
        if operation.epoch != self.epoch:
            raise InvariantViolation(
                "INV-24",
                f"rank {self.rank}: {what} of op {operation.id} from epoch {operation.epoch} "
                f"ran in epoch {self.epoch} (a reset must drop every queued op and join every "
                "storage thread)",
            )

    # -- the tree's API ----------------------------------------------------------------------------
    def require_backend(self, what: str) -> HiCacheStorage:
        if not self.enable_storage or self.storage_backend is None:
            raise HiCacheInputError(f"{what} needs a storage backend (call attach_storage_backend)")
        return self.storage_backend

    def compute_page_keys(self, token_ids: Sequence[Token], prior_hash: str | None) -> list[str]:
        """Chained keys of the whole pages of ``token_ids``, continuing from ``prior_hash``."""
        keys: list[str] = []
        last_hash = prior_hash
        for start in range(0, len(token_ids) - len(token_ids) % self.page_size, self.page_size):
            last_hash = self.get_hash_str(token_ids[start : start + self.page_size], last_hash)
            keys.append(last_hash)
        return keys

    def prefetch(
        self,
        request_id: str,
        new_input_tokens: Sequence[Token],
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
        extra_pools: Sequence[PoolTransfer] | None = None,
    ) -> PrefetchOperation:
        """Queue a hit query for ``new_input_tokens`` (whole pages) after ``last_hash``;
        ``extra_pools``: the windows the tree names (placeholder keys, one per window page; the
        tree gives them host slots at the hit)."""
        self.require_backend("prefetch")
        self._check_windows(extra_pools, "prefetch", staged=False)
        if len(new_input_tokens) % self.page_size:
            raise HiCacheInputError(
                f"prefetch of {len(new_input_tokens)} tokens is not whole pages of "
                f"{self.page_size} (truncate the tokens to whole pages first)"
            )
        operation = PrefetchOperation(
            request_id,
            new_input_tokens,
            last_hash,
            prefix_keys,
            page_size=self.page_size,
            epoch=self.epoch,
            pool_transfers=extra_pools,
        )
        self.queues.prefetch_queue.put(operation)
        self._live_prefetches[operation.id] = operation
        return operation

    def alloc_prefetch_host_buffers(
        self, operation: PrefetchOperation, need_size: int
    ) -> torch.Tensor | None:
        """The host bounce buffer for a hit of ``need_size`` tokens, or None if it does not fit."""
        return self.mem_pool_host.alloc(need_size)

    def is_prefetch_complete(self, operation: PrefetchOperation) -> bool:
        """Whether every page of the published hit has landed on every rank (INV-22: never
        before the hit query published its result and the tree gave it a bounce buffer)."""
        return (
            operation.hit_known
            and operation.host_indices is not None
            and operation.completed_tokens >= operation.storage_hit_count
        )

    def terminate_prefetch(self, operation: PrefetchOperation) -> tuple[int, list[str]]:
        """Stop a prefetch; returns its final ``completed_tokens`` and the hit keys."""
        operation.mark_terminate()
        completed_tokens = operation.completed_tokens
        # Verify the tree splits the buffer at a page boundary (INV-19)
        if completed_tokens % self.page_size:
            raise InvariantViolation(
                "INV-19",
                f"prefetch {operation.request_id!r} op {operation.id} terminated at "
                f"completed_tokens={completed_tokens}, not a multiple of page_size={self.page_size}",
            )
        return completed_tokens, list(operation.hash_value)

    def append_host_mem_release(self, host_indices: torch.Tensor) -> None:
        """Queue host slots, page by page, for the tree to free; empty is a no-op."""
        if host_indices.numel() == 0:
            return
        check_release_not_io_owned(
            host_indices, self.prefetch_io.busy_operations(), "append_host_mem_release"
        )
        queue_page_releases(self.queues.host_mem_release_queue, host_indices, self.page_size)

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[Token],
        hash_value: Sequence[str] | None = None,
        prefix_keys: Sequence[str] | None = None,
        extra_pools: Sequence[PoolTransfer] | None = None,
    ) -> int:
        """Queue a backup of host pages; returns the operation id (one ack per id, INV-25);
        ``extra_pools``: the node's windows (their host slots and the node's trailing keys).

        Without ``hash_value`` the keys chain over ``token_ids`` from the last of
        ``prefix_keys`` (the parent's last page key): a key depends on the whole prefix, also
        for a node created before storage was attached (INV-27, sglang#35269).
        """
        self.require_backend("write_storage")
        require_page_aligned(host_indices, self.page_size, "write_storage host_indices")
        prior = prefix_keys[-1] if prefix_keys else None
        keys = (
            list(hash_value) if hash_value is not None else self.compute_page_keys(token_ids, prior)
        )
        # Verify every key has a host page to read
        if len(keys) * self.page_size > host_indices.numel():
            raise HiCacheInputError(
                f"write_storage got {len(keys)} page keys but only {host_indices.numel()} host "
                f"slots ({host_indices.numel() // self.page_size} pages)"
            )
        self._check_windows(extra_pools, "write_storage", staged=True)
        operation = StorageOperation(
            host_indices,
            token_ids,
            hash_value=keys,
            prefix_keys=prefix_keys,
            epoch=self.epoch,
            pool_transfers=extra_pools,
        )
        self.queues.backup_queue.put(operation)
        return operation.id

    def _check_windows(
        self, transfers: Sequence[PoolTransfer] | None, what: str, staged: bool
    ) -> None:
        """Every transfer is a window of a pool this tier stores, with one page of its own host
        slots per key on a backup (``staged``) and none yet on a prefetch."""
        if not transfers:
            return
        for transfer in transfers:
            pool = self.window_pools.pools.get(pool_name(transfer.name))
            keys, slots = transfer.keys or [], transfer.host_indices
            fits = slots is None  # a prefetch's window: the tree stages it at the hit
            if staged:  # a backup's: one page of the pool's own slots per key
                page = pool.page_size if pool is not None else 0
                fits = slots is not None and slots.numel() == len(keys) * page
            # Verify a window of a stored pool: keys, and slots only where the call needs them
            if not is_window_transfer(transfer) or pool is None or not keys or not fits:
                raise HiCacheInputError(
                    f"{what}: extra pool {transfer.name!r} is not a window this tier stores "
                    f"(pools {sorted(self.window_pools.pools)}, policy trailing_pages, keys "
                    "given; a backup's host_indices one page of the pool per key, a prefetch's "
                    "none: the tree stages them at the hit)"
                )

    def prefetch_rate_limited(self) -> bool:
        """Whether prefetch bounce buffers already hold too much of the host pool (buffer mode:
        the host pages in use less the write staging, ``buffer_mode.is_load_rate_limited``)."""
        if self.host_memory_mode == BUFFER_ONLY:
            pool = cast(StagingHostPool, self.mem_pool_host)  # checked at construction
            staged = self.host_write_staged_tokens_fn
            return is_load_rate_limited(pool, staged, self.prefetch_capacity_limit)
        return self.prefetch_tokens_occupied >= self.prefetch_capacity_limit

    # -- steps (``steps.StepRunner``) --------------------------------------------------------------
    def has_work(self, kind: StorageStepKind) -> bool:
        return self.steps.has_work(kind)

    def has_any_work(self) -> bool:
        return self.steps.has_any_work()

    def runnable_steps(self) -> list[StorageStepKind]:
        """The step kinds with work now, in thread order (what a manual caller may run)."""
        return self.steps.runnable()

    def run_step(self, kind: StorageStepKind) -> StepResult:
        """Run one ``kind`` step now (manual executor only); an idle result if none is runnable."""
        return self.steps.run_manual(kind)

    def run_until_idle(self) -> int:
        """Run steps until none is runnable (one rank, manual); returns how many ran."""
        return self.steps.run_until_idle()

    def result(
        self,
        kind: StorageStepKind,
        operation: StorageOperation,
        *,
        tokens: int,
        acked: bool,
        final: bool = False,
    ) -> StepResult:
        request_id = operation.request_id if isinstance(operation, PrefetchOperation) else None
        return StepResult(
            kind, self.rank, self.epoch, operation.id, request_id, tokens, acked, final
        )

    def idle_result(self, kind: StorageStepKind) -> StepResult:
        return StepResult(kind, self.rank, self.epoch)

    # -- thread errors -----------------------------------------------------------------------------
    @property
    def thread_errors(self) -> list[BaseException]:
        return self.steps.thread_errors

    def check_storage_threads(self) -> None:
        """Re-raise the first error a storage thread hit, if any."""
        self.steps.check_thread_errors()

    def alive_threads(self) -> list[str]:
        return self.executor.alive_threads()
