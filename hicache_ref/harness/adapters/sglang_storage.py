"""Upstream's storage controller under the harness: the class factory and its tier's face.

0.5.10 - 0.5.18's controllers have three storage threads (``prefetch_thread_func`` starts
``prefetch_io_aux_func`` itself; no sync thread, no PrefetchAck: ``ACK_PROTOCOL_FUNC``), and
their trees poll the operation instead, so the storage driver pairs them with the tree half of
that protocol (``driver/storage_tree_0510.py``; ``UpstreamTier.protocol``, read from the class by
``prefetch_protocol``): 0.5.10 - 0.5.15 take the host pages of the whole prefetch up front
(``poll``), 0.5.16 - 0.5.18 hand the hit back on ``prefetch_hit_queue`` for the tree to
allocate (``hit-poll``); 0.5.11 - 0.5.18 reduce the hit on gloo groups of their own
(``_create_prefetch_sync_groups``, served by ``sglang_world.SyncGroups``). 0.5.19+ publish
PrefetchAcks (``ack``). SGLang 0.5.23's
controller runs its L3 tier on four threads (``prefetch_thread_func``,
``prefetch_io_aux_func``, ``prefetch_sync_thread_func``, ``backup_thread_func``), each a loop
whose body starts with a blocking ``get`` on its queue. The gate runs those real functions on
real threads whose ``get``s the harness serves (``sglang_gate.py``), under the storage world's
process group (``sglang_world.py``). Nothing of upstream's logic is rewritten here; this module
adds, in the order a case meets them:

- ``storage_controller_class``: upstream's ``HiCacheController`` subclassed with the shapes the
  harness's tree half calls (``storage`` for the lockstep driver, keys for ``write_storage``
  computed with the tree's hash functions as upstream's radix cache does, ``is_prefetch_complete``
  as 0.5.23's radix cache decides it, ``alloc_prefetch_host_buffers`` where 0.5.20 - 0.5.21's
  radix cache allocates the bounce buffer itself, ``prefetch`` in either release's signature,
  ``clear_storage_backend`` as the clear endpoint runs it); the module's ``Queue``,
  ``threading`` and ``torch`` become the served queue, the gated thread, lock and event, and the
  harness's process group; in a ``buffer_only`` world it is built in that host-memory mode and
  carries the tree's storage existence beliefs (``harness_beliefs``: upstream's own class,
  ``sglang_buffer.TreeBeliefs``);
- ``UpstreamTier``: what the storage driver reads as ``controller.storage``.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import types
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hicache_ref.controller.storage.collectives import SingleRank, SyncGroup
from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.harness.adapters.sglang_buffer import TreeBeliefs
from hicache_ref.harness.adapters.sglang_gate import (
    GatedEvent,
    GatedLock,
    GatedThread,
    GateStopEvent,
    ServedQueue,
    StepGate,
)
from hicache_ref.harness.adapters.sglang_hashes import page_keys_function
from hicache_ref.harness.adapters.sglang_world import (
    TpHandle,
    attaching,
    harness_torch,
    pp_broadcast_pyobj,
)
from hicache_ref.harness.driver.storage_side import staging_pages
from hicache_ref.harness.schedule.points import ALL_REDUCE, WAIT, Grant, Point
from hicache_ref.storage.pool_transfers import MAMBA_POOL

THREAD_FUNCS: dict[StorageStepKind, str] = {
    StorageStepKind.HIT_QUERY: "prefetch_thread_func",
    StorageStepKind.IO: "prefetch_io_aux_func",
    StorageStepKind.SYNC: "prefetch_sync_thread_func",
    StorageStepKind.BACKUP: "backup_thread_func",
}
SOURCE_QUEUES: dict[StorageStepKind, str] = {
    StorageStepKind.HIT_QUERY: "prefetch_queue",
    StorageStepKind.IO: "prefetch_buffer",
    StorageStepKind.SYNC: "prefetch_sync_queue",
    StorageStepKind.BACKUP: "backup_queue",
}
CONTROL_QUEUES = (
    "pp_prefetch_command_queue",
    "prefetch_queue",
    "prefetch_buffer",
    "prefetch_sync_queue",
    "backup_queue",
    "prefetch_hit_queue",
    "ack_prefetch_queue",
    "prefetch_revoke_queue",
    "ack_backup_queue",
    "host_mem_release_queue",
)
STORAGE_THREAD_FUNCS = ("prefetch_thread_func", "prefetch_io_aux_func", "backup_thread_func")
"""Every release since runtime attach (0.5.10) has these three; 0.5.23 adds the sync thread."""
ACK_PROTOCOL_FUNC = "prefetch_sync_thread_func"
"""0.5.23's PrefetchAck stream: the hit queue, the tree's bounce buffer and the sync thread.
Without it (0.5.10) the tree allocates the whole prefetch up front, reads ``completed_tokens``
off the operation and reduces it itself (``PROTOCOL_POLL``, ``driver/storage_tree_0510.py``)."""
PROTOCOL_ACK = "ack"
PROTOCOL_POLL = "poll"
PROTOCOL_HIT_POLL = "hit-poll"
"""0.5.16 - 0.5.18: no PrefetchAck either, but ``prefetch`` takes no host pages: the hit thread
hands the agreed hit back on ``prefetch_hit_queue`` and the tree allocates the bounce buffer
when it drains it (as 0.5.19+'s tree does), then polls ``completed_tokens`` as 0.5.10's does."""
POLLING_PROTOCOLS = (PROTOCOL_POLL, PROTOCOL_HIT_POLL)
SHORTENED_PREFETCH = "available_size - (available_size % self.page_size)"
"""0.5.13 - 0.5.21's radix caches: what is fetched, cut to the free host pages (0.5.13 - 0.5.15
cut the prefetch they allocate up front, 0.5.16+ the hit they allocate a bounce buffer for)."""
PP_TICKET_FUNC = "pp_prefetch_command_thread_func"
"""0.5.23's PP ticket thread: PP rank 0 takes a ticket off ``pp_prefetch_command_queue``, every
rank takes it off the command group's broadcast, queries, allocates and stages it in order."""


def supports_storage(module: types.ModuleType) -> bool:
    """Whether the tree's controller has upstream's storage threads (0.5.10+)."""
    cls = getattr(module, "HiCacheController", None)
    return cls is not None and all(callable(getattr(cls, f, None)) for f in STORAGE_THREAD_FUNCS)


def has_ack_protocol(cls: type[Any]) -> bool:
    return callable(getattr(cls, ACK_PROTOCOL_FUNC, None))


def prefetch_protocol(cls: type[Any]) -> str:
    """Which tree half a release's prefetch needs, read from its controller class: the
    PrefetchAck stream (0.5.19+), pages allocated up front (``prefetch(rid, host_indices, ...)``,
    0.5.10 - 0.5.15), or the hit handed back for the tree to allocate (0.5.16 - 0.5.18)."""
    if has_ack_protocol(cls):
        return PROTOCOL_ACK
    params = inspect.signature(cls.prefetch).parameters
    return PROTOCOL_POLL if "host_indices" in params else PROTOCOL_HIT_POLL


# -- the controller, and its tier as the driver reads it --------------------------------------------
class _Executor:
    name = "manual"  # the harness serves every step (lockstep.detach_ranks runs them)


class UpstreamTier:
    """``controller.storage`` for the storage driver: upstream's threads, served step by step
    (with schedule points, point by point: ``position``, ``hold``, ``run_step(kind, grant)``)."""

    executor = _Executor()

    def __init__(
        self, controller: Any, gate: StepGate, collectives: Any, *, protocol: str = PROTOCOL_ACK
    ) -> None:
        self.protocol = protocol  # which tree half drives its prefetches (ACK_PROTOCOL_FUNC)
        self._controller = weakref.proxy(controller)
        self.gate = gate
        self.collectives = collectives
        self.epoch = 0
        self.live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.queues = types.SimpleNamespace(sizes=self.queue_sizes)
        self.hold: set[StorageStepKind] = set()  # kinds whose thread waits at a collective
        self.next_grant = Grant()  # what the driver hands the next run_step (drawn outcome)
        self._current: dict[StorageStepKind, Any] = {}  # the item each loop body took
        self.body_puts: dict[StorageStepKind, list[Any]] = {}  # what the last body put

    def name_queues(self) -> None:
        """The gate names each control queue by its attribute (a point's detail in the trace).
        0.5.10's threads put their releases on ``host_mem_release_queue`` as the last act of a
        loop body, and its tree half (``storage_tree_0510``) learns the operation is done only
        with the body's end: those puts are no schedule point (one grant does both)."""
        for name in CONTROL_QUEUES:
            q = getattr(self._controller, name, None)
            if q is not None:
                self.gate.queue_names[id(q)] = name
                if self.protocol in POLLING_PROTOCOLS and name == "host_mem_release_queue":
                    self.gate.unpointed.add(id(q))

    @property
    def rank(self) -> int:
        return int(self.collectives.rank)

    @property
    def enable_storage(self) -> bool:
        return bool(self._controller.enable_storage)

    def queue_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for name in CONTROL_QUEUES:
            q = getattr(self._controller, name, None)
            sizes[name] = 0 if q is None else sum(1 for item in list(q.queue) if item is not None)
        return sizes

    def _source(self, kind: StorageStepKind) -> ServedQueue | None:
        q = getattr(self._controller, SOURCE_QUEUES[kind], None)
        return q if isinstance(q, ServedQueue) else None

    def position(self, kind: StorageStepKind) -> tuple[GatedThread, Point] | None:
        """Where the ``kind`` thread parks (mid-body first, else its wait), or None."""
        return self.gate.position(THREAD_FUNCS[kind])

    def current_request(self, kind: StorageStepKind) -> str | None:
        """The request of the item the ``kind`` thread's body took (the harness served it)."""
        return getattr(self._current.get(kind), "request_id", None)

    def has_work(self, kind: StorageStepKind) -> bool:
        at = self.position(kind) if self.gate.points else None
        if at is not None and at[1].kind != WAIT:
            return True
        q = self._source(kind)
        return (
            self.enable_storage
            and q is not None
            and any(i is not None for i in list(q.queue))
            and self.gate.serves(THREAD_FUNCS[kind])
        )

    def has_any_work(self) -> bool:
        return any(self.has_work(kind) for kind in SOURCE_QUEUES)

    def run_step(self, kind: StorageStepKind, grant: Grant | None = None) -> StepResult:
        """One iteration of upstream's ``kind`` thread, on the item at the head of its queue;
        with schedule points, its run to its next point (the iteration's result once it ended,
        else an idle one)."""
        at = self.position(kind) if self.gate.points else None
        if at is not None and at[1].kind != WAIT:
            if kind in self.hold and at[1].kind == ALL_REDUCE:
                return StepResult(kind, self.rank, self.epoch)  # a peer is not there yet
            self.gate.resume(at[0], grant or self.next_grant, kind.value, self.rank)
        else:
            q = self._source(kind)
            if q is None or not self.has_work(kind):
                return StepResult(kind, self.rank, self.epoch)
            self._current[kind] = q.queue[0]
            self.gate.puts.pop(THREAD_FUNCS[kind], None)
            self.gate.serve(q, kind.value, self.rank)
        at = self.position(kind) if self.gate.points else None
        if at is not None and at[1].kind != WAIT:
            return StepResult(kind, self.rank, self.epoch)  # parked inside its loop body
        item = self._current.pop(kind, None)
        if item is None:
            return StepResult(kind, self.rank, self.epoch)
        self.body_puts[kind] = self.gate.puts.pop(THREAD_FUNCS[kind], [])
        if self.protocol in POLLING_PROTOCOLS and kind is not StorageStepKind.BACKUP:
            return self._polled_result(kind, item)
        return self._result(kind, item, self.body_puts[kind])

    def _polled_result(self, kind: StorageStepKind, item: Any) -> StepResult:
        """0.5.10 - 0.5.18: the hit thread leaves the agreed hit in ``hash_value`` (empty when
        it revoked), the IO thread its progress in ``completed_tokens``; neither acks."""
        if kind is StorageStepKind.HIT_QUERY:
            tokens = len(item.hash_value) * int(self._controller.page_size)
        else:
            tokens = int(item.completed_tokens)
        return StepResult(kind, self.rank, self.epoch, item.id, item.request_id, tokens, False)

    def release_queue_items(self) -> list[torch.Tensor]:
        """What ``host_mem_release_queue`` holds now (0.5.10's threads release into it)."""
        q = getattr(self._controller, "host_mem_release_queue", None)
        return [] if q is None else [t for t in list(q.queue) if t is not None]

    def _result(self, kind: StorageStepKind, item: Any, acks: list[Any]) -> StepResult:
        rank, epoch = self.rank, self.epoch
        if kind is StorageStepKind.SYNC:
            operation = item.operation
            tokens = int(item.completed_tokens or 0)
            return StepResult(
                kind, rank, epoch, operation.id, item.rid, tokens, True, bool(item.completed_req)
            )
        request_id = getattr(item, "request_id", None)
        if kind is StorageStepKind.HIT_QUERY:
            tokens = int(item.storage_hit_count)
        elif kind is StorageStepKind.IO:  # the acks its puts carried (the sync may take them)
            tokens = max((int(getattr(a, "completed_tokens", 0) or 0) for a in acks), default=0)
        else:
            tokens = int(item.completed_tokens)
        return StepResult(
            kind, rank, epoch, item.id, request_id, tokens, True, kind.value == "backup"
        )

    def terminate_live_prefetches(self) -> int:
        live = list(self.live.values())
        for operation in live:
            operation.mark_terminate()
        return len(live)

    def detach_storage_backend(self) -> None:
        self._controller.detach_storage_backend()

    def close(self) -> None:
        """The world is gone: stop this rank's threads without waiting (no step follows)."""
        group = getattr(self.collectives, "group", None)
        if group is not None:
            group.interrupt()  # a thread draining its queue waits for no peer
        self.gate.close()
        try:
            self._controller.storage_stop_event.set()
        except ReferenceError:
            return

    def alive_threads(self) -> list[str]:
        self.gate.forget_dead()
        return self.gate.alive()


def build_storage_controller(
    module: types.ModuleType, tree: Path, *args: Any, **kwargs: Any
) -> Any:
    """Upstream's controller of one storage rank (``collectives`` keyword: its rank's view)."""
    return storage_controller_class(module, tree)(*args, **kwargs)


def storage_controller_class(
    module: types.ModuleType, tree: Path, hybrid: types.ModuleType | None = None
) -> type[Any]:
    """Upstream's ``HiCacheController`` (with ``hybrid``: 0.5.19+'s ``HybridCacheController``
    over a ``HostPoolGroup``) with the shapes the harness's tree half calls.

    The modules' ``Queue``, ``threading`` and ``torch`` become the served queue, the gated
    thread and the harness's process group; the storage tier's own code is upstream's,
    unchanged. A hybrid controller's prefetches and backups name the group's ``DRAFT``
    sidecar (``extra_pools``, as the hybrid radix cache passes them), riding on the KV's slots,
    or its independent ``SWA`` pool's window (``swa_window`` pages: a backup's SWA host pages
    with the node's keys, a prefetch's placeholder keys; ``TRAILING_PAGES``), or its ``MAMBA``
    state pool's (``side_pool="mamba"``, a window of one page: a backup's one state slot under
    the node's last page key, a prefetch's one placeholder key).
    """
    owner = hybrid if hybrid is not None else module
    cached = owner.__dict__.get("_harness_storage_class")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    base: type[Any] = module.HiCacheController if hybrid is None else hybrid.HybridCacheController
    protocol = prefetch_protocol(base)
    acks = protocol == PROTOCOL_ACK
    page_keys = page_keys_function(tree)
    for patched in (module, owner):
        patched.__dict__["Queue"] = ServedQueue
        patched.__dict__["threading"] = types.SimpleNamespace(
            **{k: getattr(threading, k) for k in ("RLock", "Condition")},
            Thread=GatedThread,
            Lock=GatedLock,  # an operation's lock: its acquire by a storage thread is a point
            Event=GatedEvent,  # a set or wait by a storage thread is a point
        )
        patched.__dict__["torch"] = harness_torch
        if "broadcast_pyobj" in patched.__dict__:  # 0.5.23's PP command group (PP worlds only)
            patched.__dict__["broadcast_pyobj"] = pp_broadcast_pyobj
        # upstream logs every backend failure with its traceback; the harness checks what follows
        logging.getLogger(patched.__name__).setLevel(logging.CRITICAL)
    takes_handle = "handle" in inspect.signature(base.prefetch).parameters
    sidecars = sidecar_transfers if hybrid is not None else None

    class HarnessStorageController(base):  # type: ignore[misc]
        """Upstream's controller; only the tree-facing shapes are added (see the module doc)."""

        def __init__(
            self,
            *args: Any,
            collectives: Any = None,
            schedule_points: bool = False,
            page_points: bool = False,
            pp: bool = False,
            swa_window: int = 0,
            side_pool: str = "swa",
            buffer_only: bool = False,
            **kwargs: Any,
        ) -> None:
            self._harness_swa_window = swa_window  # pages; 0: no side pool window in L3
            self._harness_side_pool = side_pool  # the window pool: "swa" or "mamba" (a state)
            self._harness_gate = StepGate(
                lambda: bool(self.storage_stop_event.is_set()),
                points=schedule_points,
                page_points=page_points,
            )
            self._harness_collectives = collectives or SingleRank()
            # a PP world's group is its PP ranks (TP 1): upstream's pp_group, and its tp_group
            # too (both name the same ranks, so its sync groups are one of each, as with TP 1)
            self._harness_tp = TpHandle(self._harness_collectives, SyncGroup("tp"), pp=pp)
            if pp:
                kwargs["pp_group"] = TpHandle(self._harness_collectives, SyncGroup("pp"), pp=True)
                kwargs["host_memory_mode"] = "buffer_only"  # 0.5.23's enable_pp_ticket needs it
            # buffer mode: the tree's storage existence beliefs, upstream's own class (the tree
            # half, driver/storage_buffer.py, drives it as the buffer pipeline does)
            self.harness_beliefs = TreeBeliefs(tree) if buffer_only else None
            if buffer_only:
                kwargs["host_memory_mode"] = "buffer_only"
            super().__init__(*args, **kwargs)
            self.storage_stop_event = GateStopEvent(self._harness_gate)  # no thread runs yet
            self.tp_group = self._harness_tp
            self.storage = UpstreamTier(
                self,
                self._harness_gate,
                self._harness_collectives,
                protocol=protocol,
            )
            if protocol == PROTOCOL_POLL:  # 0.5.10: no hit queue; the tree's drains find it empty
                self.prefetch_hit_queue: queue.Queue[Any] = queue.Queue()
            if not acks:  # 0.5.10 - 0.5.18: no ack queue
                self.ack_prefetch_queue: queue.Queue[Any] = queue.Queue()

        def _harness_page_keys(self, tokens: list[Any], prior: str | None, page: int) -> list[str]:
            """The page keys the tree's radix cache computes for ``tokens`` after ``prior``."""
            return page_keys(tokens, prior, page)

        def _harness_sidecar(self) -> bool:
            """The group has a ``DRAFT`` entry (a sidecar world; a PP world's is KV alone)."""
            if sidecars is None:
                return False
            entries = getattr(self.mem_pool_host, "entry_map", {})
            return any(getattr(name, "value", name) == "draft" for name in entries)

        @property
        def storage_batch_size(self) -> int:
            return int(module.__dict__.get("STORAGE_BATCH_SIZE", 128))

        @storage_batch_size.setter
        def storage_batch_size(self, pages: int) -> None:
            module.__dict__["STORAGE_BATCH_SIZE"] = int(pages)

        def attach_storage_backend(self, *args: Any, **kwargs: Any) -> None:
            self.storage.epoch += 1
            self._harness_gate.epoch = self.storage.epoch  # the threads about to start
            self.storage.name_queues()
            if hybrid is not None:  # the group's pools, as the hybrid radix cache passes them
                kwargs.setdefault("host_pools", self.mem_pool_host.entries)
            with attaching(module, self._harness_tp, tree):
                super().attach_storage_backend(*args, **kwargs)
            self.storage.name_queues()
            self._harness_gate.settle()

        def reset(self) -> None:
            group = getattr(self._harness_collectives, "group", None)
            if group is not None and getattr(self, "enable_storage", False):
                group.interrupt()  # a thread draining its queue on stop waits for no peer
            self.storage.epoch += 1
            self._harness_gate.epoch = self.storage.epoch  # the threads reset() starts
            try:
                super().reset()
            finally:
                if group is not None and getattr(self, "enable_storage", False):
                    group.resume()
            self.storage.name_queues()
            self._harness_gate.settle()  # the new epoch's threads, each at its queue
            backend = getattr(self, "storage_backend", None)
            take = getattr(backend, "take", None)
            if callable(take):
                take()  # what the stopping threads did is no step's

        def prefetch(self, request_id: str, *args: Any) -> Any:
            """0.5.16+: ``(rid, tokens, last_hash, prefix_keys)``; 0.5.10 - 0.5.15: ``(rid,
            host_indices, tokens, last_hash, prefix_keys)`` (the tree allocated the pages)."""
            head, tokens, rest = (
                (args[:1], args[1], args[2:])
                if protocol == PROTOCOL_POLL
                else ((), args[0], args[1:])
            )
            request: Any = request_id
            if takes_handle:  # 0.5.20+'s hybrid controller: a CacheRequestHandle's fields
                request = types.SimpleNamespace(rid=request_id, attempt_id=0)
            extra = {"extra_pools": sidecar_transfers()} if self._harness_sidecar() else {}
            window, side = self._harness_swa_window, self._harness_side_pool
            last_hash = rest[0] if rest else None
            state = side == MAMBA_POOL
            staging = staging_pages(len(tokens) // self.page_size, window, last_hash is None, state)
            if staging:  # the side window, sized now, allocated by the tree at the hit
                extra = {"extra_pools": [_window_prefetch_transfer(side, staging)]}
            operation = super().prefetch(request, *head, list(tokens), *rest, **extra)
            self.storage.live[operation.id] = operation
            return operation

        def write_storage(
            self,
            host_indices: torch.Tensor,
            token_ids: Sequence[Any],
            hash_value: Sequence[str] | None = None,
            prefix_keys: Sequence[str] | None = None,
            side_host: torch.Tensor | None = None,
        ) -> int:
            if (
                hash_value is None
            ):  # the radix cache computes a node's keys (compute_node_hash_values)
                prior = prefix_keys[-1] if prefix_keys else None
                hash_value = page_keys(list(token_ids), prior, self.page_size)
            keys = None if prefix_keys is None else list(prefix_keys)
            extra = {"extra_pools": sidecar_transfers()} if self._harness_sidecar() else {}
            if side_host is not None:  # the node's SWA host pages (Mamba state) beside its KV's
                side = self._harness_side_pool
                pages = 1 if side == MAMBA_POOL else int(side_host.numel()) // self.page_size
                backup = _window_backup_transfer(side, side_host, list(hash_value), pages)
                extra = {"extra_pools": [backup]}
            op_id: int = super().write_storage(
                host_indices, list(token_ids), list(hash_value), keys, **extra
            )
            return op_id

        if protocol != PROTOCOL_POLL and not callable(
            getattr(base, "alloc_prefetch_host_buffers", None)
        ):

            def alloc_prefetch_host_buffers(self: Any, operation: Any, need_size: int) -> Any:
                """0.5.16 - 0.5.21: the radix cache allocates the bounce buffer from the host
                pool itself (0.5.22 moved that one line into the controller)."""
                return self.mem_pool_host.alloc(need_size)

        def clear_storage_backend(self) -> bool:
            """The scheduler's clear endpoint: 0.5.23's ``HybridCacheController`` and 0.5.10's
            radix cache both end in ``storage_backend.clear()``, which this class lacks."""
            if callable(getattr(base, "clear_storage_backend", None)):
                return bool(super().clear_storage_backend())
            if not self.enable_storage:
                return False
            self.storage_backend.clear()
            return True

        def is_prefetch_complete(self, operation: Any) -> bool:
            """0.5.23's radix cache: complete once ``completed_tokens`` reached the hit."""
            return bool(
                operation.host_indices is not None
                and operation.completed_tokens >= operation.storage_hit_count
            )

    HarnessStorageController.__name__ = base.__name__
    owner.__dict__["_harness_storage_class"] = HarnessStorageController
    return HarnessStorageController


def sidecar_transfers() -> list[Any]:
    """The hybrid radix cache's ``extra_pools`` for a group whose draft pool is the ``DRAFT``
    sidecar: one transfer riding on the KV's slots (fresh per call: upstream fills it in)."""
    import sys

    names = sys.modules["sglang.srt.mem_cache.hicache_storage"]
    return [names.PoolTransfer(name=names.PoolName.DRAFT, indices_from_pool=names.PoolName.KV)]


def _pool_names() -> Any:
    import sys

    return sys.modules["sglang.srt.mem_cache.hicache_storage"]


def _window_prefetch_transfer(side: str, staging_pages: int) -> Any:
    """The hybrid radix cache's window transfer of a prefetch (``CacheTransferPhase.PREFETCH``)
    of the ``side`` pool (SWA, or a Mamba state: one page): placeholder keys, one per staged
    page, which ``_sync_trailing_keys`` turns into the hit's trailing keys; no host slots yet
    (the tree allocates them at the hit; INV-39)."""
    names = _pool_names()
    return names.PoolTransfer(
        name=names.PoolName(side),
        keys=["__placeholder__"] * staging_pages,
        hit_policy=names.PoolHitPolicy.TRAILING_PAGES,
    )


def _window_backup_transfer(
    side: str, side_host: torch.Tensor, hash_value: list[str], pages: int
) -> Any:
    """The hybrid radix cache's window transfer of a backup (``BACKUP_STORAGE``) of the
    ``side`` pool: the node's SWA host pages with the node's last ``pages`` page keys, or a
    Mamba node's one state slot with its last page key; ``TRAILING_PAGES``."""
    names = _pool_names()
    return names.PoolTransfer(
        name=names.PoolName(side),
        host_indices=side_host,
        keys=hash_value[len(hash_value) - pages :],
        hit_policy=names.PoolHitPolicy.TRAILING_PAGES,
    )
