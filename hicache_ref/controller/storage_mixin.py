"""The controller's storage tier (L3): backup to and prefetch from a ``HiCacheStorage`` backend.

Data flows, in protocol order:

1. ``write_storage`` queues a backup -> ``_page_backup`` copies host pages to the backend batch by
   batch -> the op lands on ``ack_backup_queue`` for the tree to drain.
2. ``prefetch`` queues a read into a bounce buffer the tree allocated -> ``_storage_hit_query``
   counts the leading run of stored pages -> too few: revoke (``prefetch_revoke_queue``, whole
   buffer released); enough: the non-hit tail is released and the op moves to
   ``prefetch_buffer`` -> ``_page_transfer`` fills pages, counting each only after its bytes land
   -> the untransferred rest is released.
3. ``terminate_prefetch`` freezes ``completed_tokens``; the tree splits the buffer at it and
   drains ``host_mem_release_queue`` into the host pool (INV-19 prefetch-ranges).

Work runs on three threads (``storage_executor = "thread"``, SGLang's behaviour) or, for
deterministic tests, only when the caller steps it (``"manual"``: ``step_prefetch_query``,
``step_prefetch_io``, ``step_backup``, ``run_storage_until_idle``). Both run the same per-item
functions. Every queue has a bound that ``put`` checks.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, TypeVar

import torch

from hicache_ref.controller.base import ControllerState
from hicache_ref.errors import HiCacheInputError, InvariantViolation, UnknownOptionError
from hicache_ref.storage.backend import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.hashing import Token, compute_page_hashes, get_hash_str
from hicache_ref.storage.operations import PrefetchOperation, StorageOperation
from hicache_ref.storage.pages import get_page_head, require_page_aligned, split_pages
from hicache_ref.storage.queues import BoundedQueue

logger = logging.getLogger("hicache_ref.controller.storage")

STORAGE_EXECUTORS = ("thread", "manual")
STORAGE_OPS_MAX = 65_536
"""Bound on queued storage operations (and revoke ids) per queue."""
STORAGE_POLL_S = 0.05
"""How long an idle storage thread waits before re-checking the stop event."""
STORAGE_JOIN_TIMEOUT_S = 10.0
STORAGE_ERRORS_MAX = 64

OpT = TypeVar("OpT")
PageGetFunc = Callable[
    [PrefetchOperation, list[str], torch.Tensor, "HiCacheStorageExtraInfo | None"], None
]
PageSetFunc = Callable[[list[str], torch.Tensor, "HiCacheStorageExtraInfo | None"], bool]
MLA_POOL_CLASS_NAMES = frozenset({"MLATokenToKVPool", "NSATokenToKVPool"})


class StorageMixin(ControllerState):
    """Storage backup/prefetch for ``HiCacheController`` (attach, detach, threads, reset)."""

    STORAGE_BATCH_PAGES_DEFAULT: ClassVar[int] = 128

    # Set by the controller's constructor (defaults here so a bare subclass works too).
    enable_storage: bool = False
    storage_backend: HiCacheStorage | None = None
    storage_backend_type: str | None = None
    storage_executor: str = "thread"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    enable_storage_metrics: bool = False

    # Set by attach_storage_backend.
    storage_config: HiCacheStorageConfig | None
    backup_skip: bool
    prefetch_threshold: int
    prefetch_capacity_limit: int
    prefetch_tokens_occupied: int
    storage_batch_size: int
    tp_world_size: int
    get_hash_str: Callable[[Sequence[Token], str | None], str]
    page_get_func: PageGetFunc
    page_set_func: PageSetFunc
    prefetch_queue: BoundedQueue[PrefetchOperation]
    prefetch_buffer: BoundedQueue[PrefetchOperation]
    backup_queue: BoundedQueue[StorageOperation]
    ack_backup_queue: BoundedQueue[StorageOperation]
    prefetch_revoke_queue: BoundedQueue[str]
    host_mem_release_queue: BoundedQueue[torch.Tensor]
    storage_thread_errors: list[BaseException]
    _active_storage_executor: str
    prefetch_thread: threading.Thread | None = None
    prefetch_io_aux_thread: threading.Thread | None = None
    backup_thread: threading.Thread | None = None

    # -- attach / detach ---------------------------------------------------------------------------
    def attach_storage_backend(
        self,
        storage_backend: str,
        prefetch_threshold: int = 256,
        model_name: str | None = None,
        storage_backend_extra_config: Mapping[str, object] | None = None,
    ) -> None:
        """Enable storage at runtime; on any failure nothing is left half-attached."""
        if self.uses_cp_hicache:
            raise RuntimeError(
                "CP shared KV HiCache does not support attaching a storage backend at runtime."
            )
        if self.enable_storage:
            raise RuntimeError("Storage backend already attached.")
        if self.storage_executor not in STORAGE_EXECUTORS:
            raise UnknownOptionError(
                f"unknown storage_executor {self.storage_executor!r}; legal values: "
                f"{', '.join(STORAGE_EXECUTORS)}"
            )
        # A previous partial detach may have left threads alive: never attach on top of them
        try:
            self._stop_storage_threads()
        except Exception as exc:
            raise RuntimeError(
                "Cannot attach storage backend: previous detach did not stop storage threads "
                "cleanly."
            ) from exc
        try:
            self._attach_storage_backend(
                storage_backend, prefetch_threshold, model_name, storage_backend_extra_config
            )
        except BaseException:
            self._rollback_storage_attach()
            raise

    def _attach_storage_backend(
        self,
        storage_backend: str,
        prefetch_threshold: int,
        model_name: str | None,
        storage_backend_extra_config: Mapping[str, object] | None,
    ) -> None:
        self.storage_backend_type = storage_backend
        self.get_hash_str = get_hash_str
        self.storage_config = self._generate_storage_config(
            model_name, storage_backend_extra_config
        )
        # MLA ranks hold identical KV: only rank 0 writes it to storage
        self.backup_skip = self.storage_config.is_mla_model and self.storage_config.tp_rank != 0
        self.storage_backend = StorageBackendFactory.create_backend(
            storage_backend, self.storage_config, self.mem_pool_host
        )
        self.storage_backend.register_mem_pool_host(self.mem_pool_host)
        self.prefetch_threshold = max(prefetch_threshold, self.page_size)
        self.prefetch_capacity_limit = max(
            0, int(0.8 * (self.mem_pool_host.size - self.mem_pool_device.size))
        )
        self.storage_batch_size = self.STORAGE_BATCH_PAGES_DEFAULT
        self.prefetch_tokens_occupied = 0
        self.tp_world_size = 1
        self.page_get_func = self._generic_page_get
        self.page_set_func = self._generic_page_set
        self.storage_stop_event.clear()
        self.enable_storage = True
        self._start_storage_threads()

    def _rollback_storage_attach(self) -> None:
        """Undo a failed attach: no thread, no backend, no queued work, storage disabled."""
        stopped = True
        try:
            self._stop_storage_threads()
        except Exception:
            stopped = False
            logger.exception("storage threads did not stop while rolling back an attach")
        self._close_storage_backend()
        self._clear_storage_attributes()
        if stopped:
            self.storage_stop_event.clear()

    def detach_storage_backend(self) -> None:
        """Disable storage (idempotent). Call it with no prefetch or backup in flight.

        Host pages still queued for release, and the bounce buffers of prefetches that never
        ran, go straight back to the host pool: nobody will drain those queues any more.
        """
        try:
            pending_release = self._stop_storage_threads()
        except Exception as exc:
            logger.exception("stop storage threads failed: %s", exc)
            raise RuntimeError("Stop storage threads failed; detach aborted.") from exc
        if pending_release:
            self.mem_pool_host.free(torch.cat(pending_release))
        self._close_storage_backend()
        self._clear_storage_attributes()
        self.storage_stop_event.clear()

    def _close_storage_backend(self) -> None:
        backend = self.storage_backend
        if backend is None:
            return
        try:
            backend.close()
        except Exception:
            logger.exception("failed to close storage backend cleanly")

    def _clear_storage_attributes(self) -> None:
        self.storage_backend = None
        self.storage_backend_type = None
        self.storage_config = None
        self.enable_storage = False
        self.page_get_func = self._generic_page_get
        self.page_set_func = self._generic_page_set

    def _generate_storage_config(
        self,
        model_name: str | None = None,
        storage_backend_extra_config: Mapping[str, object] | None = None,
    ) -> HiCacheStorageConfig:
        # A copy: the seed popped tp_lcm_size out of the caller's own dict
        extra = dict(storage_backend_extra_config or {})
        is_mla = self._is_mla_device_pool()
        layout: str = self.mem_pool_host.layout  # page_head may be absent from the pools' layouts
        tp_lcm_size = extra.pop("tp_lcm_size", None)
        should_split_heads = False
        if tp_lcm_size is not None:
            if not isinstance(tp_lcm_size, int) or tp_lcm_size < 1 or tp_lcm_size % self.tp_size:
                raise HiCacheInputError(
                    f"tp_lcm_size={tp_lcm_size!r} must be a positive multiple of "
                    f"tp_size={self.tp_size}"
                )
            should_split_heads = not is_mla and layout == "page_head" and tp_lcm_size > self.tp_size
        return HiCacheStorageConfig(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            is_mla_model=is_mla,
            enable_storage_metrics=self.enable_storage_metrics,
            is_page_first_layout=layout == "page_first",
            model_name=model_name,
            tp_lcm_size=tp_lcm_size,
            should_split_heads=should_split_heads,
            extra_config=extra,
        )

    def _is_mla_device_pool(self) -> bool:
        """Whether the device pool is an MLA pool (NSA pools are MLA pools with a sidecar)."""
        return any(
            cls.__name__ in MLA_POOL_CLASS_NAMES for cls in type(self.mem_pool_device).__mro__
        )

    # -- threads, queues, reset --------------------------------------------------------------------
    def _init_storage_state(self) -> None:
        """Constructor hook: storage detached, empty queues, no threads, generic page functions.

        The queues exist from the start so the tree may poll them before any attach.
        """
        self.storage_config = None
        self.backup_skip = False
        self.prefetch_threshold = 0
        self.prefetch_capacity_limit = 0
        self.prefetch_tokens_occupied = 0
        self.storage_batch_size = self.STORAGE_BATCH_PAGES_DEFAULT
        self.tp_world_size = 1
        self.get_hash_str = get_hash_str
        self.page_get_func = self._generic_page_get
        self.page_set_func = self._generic_page_set
        self.prefetch_thread = self.prefetch_io_aux_thread = self.backup_thread = None
        self._active_storage_executor = self.storage_executor
        self._create_storage_queues()

    def _create_storage_queues(self) -> None:
        host_pages = max(1, self.mem_pool_host.size // self.page_size)
        self.prefetch_queue = BoundedQueue(
            "prefetch_queue",
            STORAGE_OPS_MAX,
            "prefetch faster than storage answers; check prefetch_rate_limited()",
        )
        self.prefetch_buffer = BoundedQueue(
            "prefetch_buffer", STORAGE_OPS_MAX, "the prefetch io step is not running"
        )
        self.backup_queue = BoundedQueue(
            "backup_queue", STORAGE_OPS_MAX, "the backup step is not running"
        )
        self.ack_backup_queue = BoundedQueue(
            "ack_backup_queue", STORAGE_OPS_MAX, "drain it every scheduler step"
        )
        self.prefetch_revoke_queue = BoundedQueue(
            "prefetch_revoke_queue", STORAGE_OPS_MAX, "drain it every scheduler step"
        )
        # A host page can wait for release at most once, so the pool's page count bounds it
        self.host_mem_release_queue = BoundedQueue(
            "host_mem_release_queue",
            host_pages,
            "drain it into the host pool every scheduler step; more means a page was released twice (INV-19)",
        )
        self.storage_thread_errors = []

    def _start_storage_threads(self) -> None:
        """Create fresh storage queues and, in thread mode, start the three storage threads."""
        if not self.enable_storage or self.storage_stop_event.is_set():
            raise RuntimeError(
                "storage threads start only while storage is enabled and not stopping"
            )
        self._create_storage_queues()
        self._active_storage_executor = self.storage_executor
        if self._active_storage_executor == "manual":
            return
        self.prefetch_thread = threading.Thread(
            target=self.prefetch_thread_func, name="hicache-storage-prefetch", daemon=True
        )
        self.prefetch_io_aux_thread = threading.Thread(
            target=self.prefetch_io_aux_func, name="hicache-storage-prefetch-io", daemon=True
        )
        self.backup_thread = threading.Thread(
            target=self.backup_thread_func, name="hicache-storage-backup", daemon=True
        )
        for thread in (self.prefetch_thread, self.prefetch_io_aux_thread, self.backup_thread):
            thread.start()

    def _storage_queues(self) -> list[BoundedQueue[object]]:
        names = (
            "prefetch_queue",
            "prefetch_buffer",
            "backup_queue",
            "ack_backup_queue",
            "prefetch_revoke_queue",
            "host_mem_release_queue",
        )
        found = [getattr(self, name, None) for name in names]
        return [q for q in found if isinstance(q, BoundedQueue)]

    def _stop_storage_threads(self) -> list[torch.Tensor]:
        """Stop and join every storage thread, then empty every storage queue (bug class 15).

        Returns the host pages whose release was still pending: queued releases plus the
        unreleased bounce buffers of prefetches that never ran. ``reset`` drops them (the host
        pool is cleared next); ``detach`` frees them. Leaves ``storage_stop_event`` set.
        """
        self.storage_stop_event.set()
        for storage_queue in self._storage_queues():
            storage_queue.wake_all()
        threads = [
            t
            for t in (self.prefetch_thread, self.prefetch_io_aux_thread, self.backup_thread)
            if t is not None
        ]
        for thread in threads:
            thread.join(timeout=STORAGE_JOIN_TIMEOUT_S)
        alive = [thread.name for thread in threads if thread.is_alive()]
        if alive:
            raise RuntimeError(f"Failed to stop HiCache storage threads cleanly: {alive}")
        self.prefetch_thread = self.prefetch_io_aux_thread = self.backup_thread = None
        return self._clear_storage_queues()

    def _clear_storage_queues(self) -> list[torch.Tensor]:
        if not isinstance(getattr(self, "prefetch_queue", None), BoundedQueue):
            return []
        pending: list[torch.Tensor] = []
        # Prefetches that never ran end here: terminate them and release what they still hold
        for operation in self.prefetch_queue.clear() + self.prefetch_buffer.clear():
            operation.mark_terminate()
            start = operation.completed_tokens
            operation.record_release(start, operation.host_indices.numel(), "controller")
            if operation.host_indices.numel() > start:
                pending.append(operation.host_indices[start:])
        self.backup_queue.clear()
        self.ack_backup_queue.clear()
        self.prefetch_revoke_queue.clear()
        pending.extend(self.host_mem_release_queue.clear())
        return pending

    def _reset_storage(self) -> None:
        """The storage part of ``reset()``: join all threads, empty all queues, restart.

        Pending host releases are dropped, not freed: ``reset`` is followed by the host pool's
        ``clear()``, after which a stale release would free a slot twice (bug class 15).
        """
        if not self.enable_storage:
            self._clear_storage_queues()
            return
        self._stop_storage_threads()
        self.prefetch_tokens_occupied = 0
        self.storage_stop_event.clear()
        self._start_storage_threads()

    def prefetch_thread_func(self) -> None:
        """Thread: answer hit queries for queued prefetches."""
        self._run_storage_worker(self.prefetch_queue, self._process_prefetch_query)

    def prefetch_io_aux_func(self) -> None:
        """Thread: move hit pages from storage into prefetch bounce buffers."""
        self._run_storage_worker(self.prefetch_buffer, self._process_prefetch_io)

    def backup_thread_func(self) -> None:
        """Thread: copy queued backups from host pages to storage."""
        self._run_storage_worker(self.backup_queue, self._process_backup)

    def _run_storage_worker(
        self, source: BoundedQueue[OpT], process: Callable[[OpT], None]
    ) -> None:
        while not self.storage_stop_event.is_set():
            item = source.poll(STORAGE_POLL_S)
            if item is None:
                continue
            try:
                process(item)
            except BaseException as exc:  # kept for check_storage_threads; the thread stops
                logger.exception("storage thread %s failed", threading.current_thread().name)
                if len(self.storage_thread_errors) < STORAGE_ERRORS_MAX:
                    self.storage_thread_errors.append(exc)
                return

    def check_storage_threads(self) -> None:
        """Re-raise the first error a storage thread stopped on, if any."""
        errors = getattr(self, "storage_thread_errors", [])
        if errors:
            raise errors[0]

    # -- manual executor ---------------------------------------------------------------------------
    def _require_manual_executor(self) -> None:
        if not self.enable_storage or self._active_storage_executor != "manual":
            raise HiCacheInputError(
                "storage steps need an attached backend with storage_executor='manual' "
                "(in thread mode the storage threads do this work)"
            )

    def _step_storage(self, source: BoundedQueue[OpT], process: Callable[[OpT], None]) -> bool:
        self._require_manual_executor()
        try:
            item = source.get_nowait()
        except queue.Empty:
            return False
        process(item)
        return True

    def step_prefetch_query(self) -> bool:
        """Run the hit query of the oldest queued prefetch; False if none was queued."""
        return self._step_storage(self.prefetch_queue, self._process_prefetch_query)

    def step_prefetch_io(self) -> bool:
        """Run the transfer of the oldest hit prefetch; False if none was waiting."""
        return self._step_storage(self.prefetch_buffer, self._process_prefetch_io)

    def step_backup(self) -> bool:
        """Run the oldest queued backup; False if none was queued."""
        return self._step_storage(self.backup_queue, self._process_backup)

    def run_storage_until_idle(self) -> int:
        """Step until no storage work is left; returns the number of steps taken."""
        self._require_manual_executor()
        # Each prefetch takes at most two steps and each backup one, so this bounds the loop
        round_bound = (
            2 * self.prefetch_queue.qsize()
            + self.prefetch_buffer.qsize()
            + self.backup_queue.qsize()
            + 1
        )
        steps = 0
        for _ in range(round_bound):
            round_steps = sum(
                (self.step_prefetch_query(), self.step_prefetch_io(), self.step_backup())
            )
            if round_steps == 0:
                return steps
            steps += round_steps
        raise InvariantViolation(
            "INV-16",
            f"storage work did not quiesce within {round_bound} rounds (a step re-queued work)",
        )

    # -- public operations -------------------------------------------------------------------------
    def _require_storage(self, what: str) -> HiCacheStorage:
        if not self.enable_storage or self.storage_backend is None:
            raise HiCacheInputError(f"{what} needs a storage backend (call attach_storage_backend)")
        return self.storage_backend

    def prefetch(
        self,
        request_id: str,
        host_indices: torch.Tensor,
        new_input_tokens: Sequence[Token],
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> PrefetchOperation:
        """Queue a prefetch of ``new_input_tokens`` into the tree's bounce buffer."""
        self._require_storage("prefetch")
        require_page_aligned(host_indices, self.page_size, "prefetch host_indices")
        # Verify one bounce slot per token: a hit beyond the buffer would have nowhere to land
        if host_indices.numel() != len(new_input_tokens):
            raise HiCacheInputError(
                f"prefetch of {len(new_input_tokens)} tokens got {host_indices.numel()} host "
                "slots; pass one slot per token (truncate the tokens to whole pages first)"
            )
        operation = PrefetchOperation(
            request_id,
            host_indices,
            new_input_tokens,
            last_hash,
            prefix_keys,
            page_size=self.page_size,
        )
        self.prefetch_queue.put(operation)
        return operation

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
        """Queue host slots, page by page, for the scheduler to free; empty is a no-op."""
        if host_indices.numel() == 0:
            return  # an empty split must not queue an empty page (sglang#11005)
        self._require_storage("append_host_mem_release")
        require_page_aligned(host_indices, self.page_size, "released host_indices")
        for page in split_pages(host_indices, self.page_size):
            self.host_mem_release_queue.put(page)

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[Token],
        hash_value: Sequence[str] | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> int:
        """Queue a backup of host pages to storage; returns the operation id.

        Without ``hash_value`` the keys are chained over ``token_ids`` from the root (the seed
        backed up nothing in that case).
        """
        self._require_storage("write_storage")
        require_page_aligned(host_indices, self.page_size, "write_storage host_indices")
        keys = (
            list(hash_value)
            if hash_value is not None
            else compute_page_hashes(token_ids, self.page_size)
        )
        # Verify every key has a host page to read
        if len(keys) * self.page_size > host_indices.numel():
            raise HiCacheInputError(
                f"write_storage got {len(keys)} page keys but only {host_indices.numel()} host "
                f"slots ({host_indices.numel() // self.page_size} pages)"
            )
        operation = StorageOperation(
            host_indices, token_ids, hash_value=keys, prefix_keys=prefix_keys
        )
        self.backup_queue.put(operation)
        return operation.id

    def prefetch_rate_limited(self) -> bool:
        """Whether prefetch bounce buffers already hold too much of the host pool."""
        return self.prefetch_tokens_occupied >= self.prefetch_capacity_limit

    # -- prefetch: hit query -----------------------------------------------------------------------
    def _storage_hit_query(self, operation: PrefetchOperation) -> tuple[list[str], int]:
        """Keys of the leading run of stored pages, and how many tokens they cover."""
        backend = self._require_storage("_storage_hit_query")
        last_hash = operation.last_hash
        tokens = operation.token_ids
        prefix_keys = operation.prefix_keys
        hash_value: list[str] = []
        storage_hit_count = 0
        batch_tokens = self.page_size * self.storage_batch_size
        for start in range(0, len(tokens), batch_tokens):
            chunk = tokens[start : start + batch_tokens]
            batch_hashes: list[str] = []
            for i in range(0, len(chunk), self.page_size):
                last_hash = self.get_hash_str(chunk[i : i + self.page_size], last_hash)
                batch_hashes.append(last_hash)
            hit_pages = self._query_batch_exists(backend, batch_hashes, prefix_keys)
            hash_value.extend(batch_hashes[:hit_pages])
            storage_hit_count += hit_pages * self.page_size
            if hit_pages < len(batch_hashes):
                break
            if prefix_keys:
                prefix_keys = (*prefix_keys, *batch_hashes)  # a new tuple (bug class 20)
        return hash_value, storage_hit_count

    def _query_batch_exists(
        self, backend: HiCacheStorage, keys: list[str], prefix_keys: tuple[str, ...] | None
    ) -> int:
        try:
            hit_pages = backend.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=prefix_keys))
        except InvariantViolation:
            raise
        except Exception:
            logger.exception("storage batch_exists failed; counting no hits")
            return 0
        # A backend must not claim more hits than keys asked about
        return max(0, min(int(hit_pages), len(keys)))

    def _reduce_storage_hit_count(self, storage_hit_count: int) -> int:
        """MIN of the hit count over TP ranks; one rank here, so the count itself (a seam)."""
        return storage_hit_count

    def _process_prefetch_query(self, operation: PrefetchOperation) -> None:
        """Decide one prefetch: revoke it, or trim it to its hits and queue its transfer."""
        hash_value, storage_hit_count = self._storage_hit_query(operation)
        storage_hit_count = self._reduce_storage_hit_count(storage_hit_count)
        buffer_tokens = operation.host_indices.numel()
        if storage_hit_count < self.prefetch_threshold:
            # A revoked prefetch must reach a terminal state (sglang#16747)
            operation.mark_terminate()
            self._release_prefetch_range(operation, 0, buffer_tokens)
            self.prefetch_revoke_queue.put(operation.request_id)
            logger.debug(
                "revoking prefetch %s: %d hit tokens", operation.request_id, storage_hit_count
            )
            return
        operation.hash_value = hash_value[: storage_hit_count // self.page_size]
        self._release_prefetch_range(operation, storage_hit_count, buffer_tokens)
        operation.host_indices = operation.host_indices[:storage_hit_count]
        self.prefetch_buffer.put(operation)

    def _release_prefetch_range(self, operation: PrefetchOperation, start: int, end: int) -> None:
        """Release bounce-buffer tokens ``[start, end)``, each at most once (INV-19)."""
        operation.record_release(start, end, "controller")
        self.append_host_mem_release(operation.host_indices[start:end])

    # -- prefetch: transfer ------------------------------------------------------------------------
    def _process_prefetch_io(self, operation: PrefetchOperation) -> None:
        """Transfer one prefetch's hit pages, then release what did not arrive."""
        if not operation.is_terminated():
            self._page_transfer(operation)
        # Verify nothing counted a page after termination (INV-19)
        operation.check_completed_frozen()
        completed_tokens = operation.completed_tokens
        self._release_prefetch_range(operation, completed_tokens, operation.host_indices.numel())
        # Verify the controller released exactly [completed:] of the buffer (INV-19, sglang#13483)
        operation.check_controller_released_tail()

    def _page_transfer(self, operation: PrefetchOperation) -> None:
        """Fill the bounce buffer batch by batch; a short batch terminates the prefetch."""
        prefix_keys = operation.prefix_keys
        for start_page in range(0, len(operation.hash_value), self.storage_batch_size):
            if self.storage_stop_event.is_set():
                operation.mark_terminate()
                break
            batch_hashes = operation.hash_value[start_page : start_page + self.storage_batch_size]
            batch_host_indices = operation.host_indices[
                start_page * self.page_size : (start_page + len(batch_hashes)) * self.page_size
            ]
            completed_before = operation.completed_tokens
            extra_info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
            self.page_get_func(operation, batch_hashes, batch_host_indices, extra_info)
            if operation.completed_tokens != completed_before + len(batch_hashes) * self.page_size:
                operation.mark_terminate()  # a page failed, or the tree terminated the prefetch
                break
            if prefix_keys:
                prefix_keys = (*prefix_keys, *batch_hashes)  # a new tuple (bug class 20)

    def _generic_page_get(
        self,
        operation: PrefetchOperation,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> None:
        """Read pages into host slots; count each page only after its bytes are set (sglang#8901)."""
        backend = self._require_storage("_generic_page_get")
        targets = [self.mem_pool_host.get_dummy_flat_data_page() for _ in hash_values]
        try:
            page_data = backend.batch_get(hash_values, targets)
        except InvariantViolation:
            raise
        except Exception:
            logger.exception("storage batch_get failed for prefetch %s", operation.request_id)
            return
        for i, key in enumerate(hash_values):
            data = page_data[i] if i < len(page_data) else None
            if data is None:
                logger.warning("prefetch %s: page %s not retrieved", operation.request_id, key)
                break
            if operation.is_terminated():
                break
            # Set the bytes BEFORE counting the page: a counted page may be read at once
            self.mem_pool_host.set_from_flat_data_page(
                get_page_head(host_indices, i, self.page_size), data
            )
            if not operation.increment(self.page_size):
                break  # terminated by the tree meanwhile

    # -- backup ------------------------------------------------------------------------------------
    def _process_backup(self, operation: StorageOperation) -> None:
        """Back up one operation (unless this rank skips backups) and ack it."""
        if not self.backup_skip:
            self._page_backup(operation)
        self.ack_backup_queue.put(operation)

    def _page_backup(self, operation: StorageOperation) -> None:
        """Write pages batch by batch; stop at the first failed batch."""
        prefix_keys = operation.prefix_keys
        for start_page in range(0, len(operation.hash_value), self.storage_batch_size):
            if self.storage_stop_event.is_set():
                break
            batch_hashes = operation.hash_value[start_page : start_page + self.storage_batch_size]
            batch_host_indices = operation.host_indices[
                start_page * self.page_size : (start_page + len(batch_hashes)) * self.page_size
            ]
            extra_info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
            if not self.page_set_func(batch_hashes, batch_host_indices, extra_info):
                logger.warning("backup op %d: %d pages failed", operation.id, len(batch_hashes))
                break
            if prefix_keys:
                prefix_keys = (*prefix_keys, *batch_hashes)  # a new tuple (bug class 20)
            operation.completed_tokens += self.page_size * len(batch_hashes)

    def _generic_page_set(
        self,
        hash_values: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> bool:
        """Write one batch of host pages (flat, layout-independent) to the backend."""
        backend = self._require_storage("_generic_page_set")
        pages = [
            self.mem_pool_host.get_data_page(get_page_head(host_indices, i, self.page_size), True)
            for i in range(len(hash_values))
        ]
        try:
            return bool(backend.batch_set(hash_values, pages))
        except InvariantViolation:
            raise
        except Exception:
            logger.exception("storage batch_set failed")
            return False
