"""The tree's half of the storage protocol, modelled on upstream's radix cache (our own code).

``StorageTreeRank`` is one rank's scheduler-side storage bookkeeping, in protocol order:

- ``prefetch_from_storage``: page-align, check the threshold and the rate limit, pin the anchor
  (``host_locks``), ``cc.prefetch(...)``, remember it in ``ongoing_prefetch`` and reserve its
  tokens in ``prefetch_tokens_occupied``;
- ``drain_hits``: each rank-reduced hit is revoked (terminated, or below threshold, or no host
  room) or given a bounce buffer of exactly the hit and put on ``prefetch_buffer``; under host
  pressure (``host_pressure``) a hit that does not fit is cut to the room every rank has, when
  that reaches the threshold (``cut_hit``; 0.5.23's hybrid controller decides the cut itself,
  ``allocate_storage_hit``);
- ``drain_acks``: progress is applied to the operation while it is current; on the final ack a
  current prefetch's ``[0:completed]`` goes to ``on_insert`` (the tree's host-only node) and the
  rest of the buffer is released, whether or not it was current (INV-23);
- ``check_prefetch_progress`` (policy ``best_effort`` / ``wait_complete`` / ``timeout``) and
  ``release_aborted_request``: terminate, then settle ``[0:completed]`` now;
- ``write_backup_storage`` -> ``drain_backups``: the node's host lock is held until its one ack;
- ``drain_releases``: the release queue into the host pool.

In a world with an SWA side pool in L3 each rank also stages a prefetch's window at the hit,
judges the result all-or-nothing and drains the controller's SWA release queue
(``storage_side.py``: 0.5.23's hybrid radix cache in cache mode).

``StorageTree`` holds one per rank and drains every queue by the MIN of its length over the
ranks, as upstream's ``drain_storage_control_queues`` does, so every rank takes the same items
in the same order even while real threads fill the queues at different speeds. ``on_event``
(the harness's storage log) hears every decision the tree makes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.driver.storage_side import (
    alloc_staging,
    drain_side_releases,
    is_whole,
    note_pool_hits,
    release_staging,
    side_release_count,
    side_transfers,
)
from hicache_ref.storage.hashing import Token
from hicache_ref.storage.operations import PrefetchAck, PrefetchOperation, StorageOperation
from hicache_ref.storage.protocols import StorageHostPool
from hicache_ref.storage.queues import BoundedQueue

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
TIMEOUT_STEPS_DEFAULT = 64


class StorageControllerLike(Protocol):
    """The storage surface of a controller the tree drives (SGLang 0.5.23's names)."""

    prefetch_tokens_occupied: int

    @property
    def prefetch_threshold(self) -> int: ...
    @property
    def prefetch_hit_queue(self) -> BoundedQueue[PrefetchOperation]: ...
    @property
    def prefetch_buffer(self) -> BoundedQueue[PrefetchOperation]: ...
    @property
    def ack_prefetch_queue(self) -> BoundedQueue[PrefetchAck]: ...
    @property
    def ack_backup_queue(self) -> BoundedQueue[StorageOperation]: ...
    @property
    def host_mem_release_queue(self) -> BoundedQueue[torch.Tensor]: ...

    def prefetch(
        self,
        request_id: str,
        new_input_tokens: Sequence[Token],
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> PrefetchOperation: ...
    def prefetch_rate_limited(self) -> bool: ...
    def alloc_prefetch_host_buffers(
        self, operation: PrefetchOperation, need_size: int
    ) -> torch.Tensor | None: ...
    def is_prefetch_complete(self, operation: PrefetchOperation) -> bool: ...
    def terminate_prefetch(self, operation: PrefetchOperation) -> tuple[int, list[str]]: ...
    def append_host_mem_release(self, host_indices: torch.Tensor) -> None: ...
    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[Token],
        hash_value: Sequence[str] | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> int: ...


@dataclass
class OngoingPrefetch:
    """``ongoing_prefetch[rid]``: the op, its tokens, its anchor and (after the hit) its buffer."""

    operation: PrefetchOperation
    tokens: int
    anchor: object
    host_indices: torch.Tensor | None = None
    age: int = 0


InsertFn = Callable[[str, PrefetchOperation, torch.Tensor], int]
"""``on_insert(rid, op, host[:completed])`` -> matched tokens (already cached; the tree frees
their pages, the rest now belongs to the inserted node)."""
EventFn = Callable[[str, dict[str, Any]], None]


@dataclass
class StorageTreeRank:
    """One rank's storage bookkeeping on the scheduler side."""

    cc: StorageControllerLike
    host_pool: StorageHostPool
    page_size: int
    on_insert: InsertFn
    on_event: EventFn = field(default=lambda kind, data: None)
    policy: str = "best_effort"
    timeout_steps: int = TIMEOUT_STEPS_DEFAULT
    host_pressure: bool = False  # serve a hit that does not fit with a shorter bounce buffer
    side_host_pool: StorageHostPool | None = None  # an SWA side pool's slots (its window)
    side_done: dict[int, dict[str, int]] = field(default_factory=dict)
    """Per prefetch (``id``) whose side windows were read while it was current: the pool hits
    (``pool_transfers_done``; ``storage_side.py``)."""
    ongoing_prefetch: dict[str, OngoingPrefetch] = field(default_factory=dict)
    ongoing_backup: dict[int, object] = field(default_factory=dict)
    host_locks: dict[object, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in PREFETCH_POLICIES:
            raise HiCacheInputError(
                f"unknown prefetch policy {self.policy!r}; legal values: "
                f"{', '.join(PREFETCH_POLICIES)}"
            )

    # -- host locks --------------------------------------------------------------------------------
    def protect_host(self, node: object) -> None:
        self.host_locks[node] = self.host_locks.get(node, 0) + 1

    def release_host(self, node: object) -> None:
        count = self.host_locks.get(node, 0)
        if count <= 0:
            raise HiCacheInputError(f"release_host of {node!r} whose host lock is not held")
        if count == 1:
            del self.host_locks[node]
        else:
            self.host_locks[node] = count - 1

    # -- prefetch ----------------------------------------------------------------------------------
    def prefetch_from_storage(
        self,
        rid: str,
        anchor: object,
        tokens: Sequence[Token],
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> PrefetchOperation | None:
        """Start a prefetch of ``tokens`` after ``anchor``; None when it is not worth one."""
        tokens = list(tokens[: len(tokens) - len(tokens) % self.page_size])
        if rid in self.ongoing_prefetch or len(tokens) < self.cc.prefetch_threshold:
            return None
        if self.cc.prefetch_rate_limited():
            return None
        self.protect_host(anchor)
        operation = self.cc.prefetch(rid, tokens, last_hash, prefix_keys)
        self.ongoing_prefetch[rid] = OngoingPrefetch(operation, len(tokens), anchor)
        self.cc.prefetch_tokens_occupied += len(tokens)
        self.on_event("started", {"rid": rid, "operation": operation, "tokens": len(tokens)})
        return operation

    def is_current(self, operation: PrefetchOperation) -> bool:
        info = self.ongoing_prefetch.get(operation.request_id)
        return info is not None and info.operation is operation

    def drain_hits(self, count: int) -> None:
        """One rank alone: revoke or start each drained hit (a ``StorageTree`` agrees first)."""
        for _ in range(count):
            operation = self.take_hit()
            if operation is None:
                continue
            host = self.alloc_bounce(operation) if self.wants_transfer(operation) else None
            if host is None:
                self.revoke(operation)
            else:
                self.start_transfer(operation, host)

    def take_hit(self) -> PrefetchOperation | None:
        """The next hit result, or None when it is not a current prefetch's."""
        operation = self.cc.prefetch_hit_queue.get_nowait()
        current = self.is_current(operation)
        self.on_event("hit", {"operation": operation, "current": current})
        return operation if current else None

    def wants_transfer(self, operation: PrefetchOperation) -> bool:
        """Not terminated and at least the threshold: worth a bounce buffer."""
        return not operation.is_terminated() and (
            operation.storage_hit_count >= self.cc.prefetch_threshold
        )

    def alloc_bounce(self, operation: PrefetchOperation) -> torch.Tensor | None:
        return self.cc.alloc_prefetch_host_buffers(operation, operation.storage_hit_count)

    def room(self) -> int:
        """The whole pages of host room this rank has now (what a cut hit may take)."""
        available: Callable[[], int] = getattr(self.host_pool, "available_size")  # noqa: B009
        free = int(available())
        return free - free % self.page_size

    def cut_hit(self, operation: PrefetchOperation, tokens: int) -> None:
        """Host pressure: serve ``tokens`` of the hit (whole pages, below it) and no more, as
        the radix cache does before it hands the bounce buffer over: the hit count and the keys
        the IO reads shrink to it (INV-29 judges the buffer against this cut)."""
        operation.storage_hit_count = tokens
        operation.hash_value = list(operation.hash_value[: tokens // self.page_size])
        self.on_event("shorten", {"operation": operation, "tokens": tokens})

    def revoke(self, operation: PrefetchOperation) -> None:
        self._retire(operation.request_id, "revoked")

    def start_transfer(self, operation: PrefetchOperation, host_indices: torch.Tensor) -> None:
        operation.host_indices = host_indices
        self.ongoing_prefetch[operation.request_id].host_indices = host_indices
        self.on_event("bounce", {"operation": operation, "host_indices": host_indices})
        self.cc.prefetch_buffer.put(operation)

    def drain_acks(self, count: int) -> None:
        for _ in range(count):
            ack = self.cc.ack_prefetch_queue.get_nowait()
            operation = ack.operation
            current = self.is_current(operation)
            if ack.completed_tokens is not None and current:
                operation.completed_tokens = ack.completed_tokens
            pool_hits = getattr(ack, "pool_hits", None)
            if pool_hits is not None and current and self.side_host_pool is not None:
                note_pool_hits(self, operation, pool_hits)
            self.on_event("ack", {"ack": ack, "current": current})
            if ack.completed_req:
                if current:
                    self._handle_prefetch_result(operation)
                self._release_tail(operation)

    def _release_tail(self, operation: PrefetchOperation) -> None:
        """The final ack: the IO is done, ``[completed:]`` of the buffer goes back (INV-23)."""
        host_indices = operation.host_indices
        if host_indices is None:
            return
        done = operation.completed_tokens
        self.on_event("release", {"operation": operation, "start": done, "how": "tail"})
        self.cc.append_host_mem_release(host_indices[done:])
        if self.side_host_pool is not None:  # a window the IO never read goes back now
            if self.side_done.pop(id(operation), None) is None:
                release_staging(self, side_transfers(operation))

    def _handle_prefetch_result(self, operation: PrefetchOperation) -> None:
        """Insert ``[0:completed]``; free what the tree already had; retire the prefetch."""
        rid = operation.request_id
        host_indices = self.ongoing_prefetch[rid].host_indices
        assert host_indices is not None
        completed = operation.completed_tokens
        if self.side_host_pool is not None and not self._judge_side_result(operation):
            self._release_window(operation)
            if completed:  # discarded whole: its KV pages go back (all-or-nothing)
                self.host_pool.free(host_indices[:completed])
            self.on_event(
                "insert", {"operation": operation, "matched": completed, "end": completed}
            )
            self._retire(rid, "discarded")
            return
        matched = self.on_insert(rid, operation, host_indices[:completed]) if completed else 0
        if matched:
            self.host_pool.free(host_indices[:matched])
        if self.side_host_pool is not None and (matched or not completed):
            self._release_window(operation)  # no node took the window (an inserted one did)
        self.on_event("insert", {"operation": operation, "matched": matched, "end": completed})
        self._retire(rid, "done")

    def _judge_side_result(self, operation: PrefetchOperation) -> bool:
        """An SWA world's verdict on a result (``storage_side.is_whole``), judged (INV-39)
        before anything of it goes back or into a node."""
        whole = is_whole(self, operation)
        self.on_event("side_verdict", {"operation": operation, "accepted": whole})
        return whole

    def _release_window(self, operation: PrefetchOperation) -> None:
        if id(operation) in self.side_done:  # the IO is done with the window
            release_staging(self, side_transfers(operation))

    def _retire(self, rid: str, outcome: str) -> None:
        info = self.ongoing_prefetch.pop(rid)
        self.release_host(info.anchor)
        self.cc.prefetch_tokens_occupied -= info.tokens
        self.on_event("retire", {"operation": info.operation, "outcome": outcome})

    def can_terminate_prefetch(self, rid: str) -> bool:
        """The policy's verdict: stop now, or keep waiting."""
        info = self.ongoing_prefetch[rid]
        if self.policy == "best_effort":
            return True
        complete = self.cc.is_prefetch_complete(info.operation)
        self.on_event("verdict", {"operation": info.operation, "complete": complete})
        if self.policy == "wait_complete":
            return complete
        return complete or info.age >= self.timeout_steps

    def check_prefetch_progress(self, rid: str) -> bool:
        """True once ``rid`` needs no more waiting (terminated and settled, or never started)."""
        info = self.ongoing_prefetch.get(rid)
        if info is None:
            return True
        info.age += 1
        if not info.operation.is_terminated() and not self.can_terminate_prefetch(rid):
            return False
        self.terminate(rid)
        return True

    def terminate(self, rid: str) -> int:
        """Terminate ``rid`` and settle what it fetched; returns the completed tokens."""
        info = self.ongoing_prefetch[rid]
        completed, _ = self.cc.terminate_prefetch(info.operation)
        self.on_event("terminate", {"operation": info.operation, "completed": completed})
        if info.host_indices is None:
            self._retire(rid, "revoked")
        else:
            self._handle_prefetch_result(info.operation)
        return completed

    # -- backup ------------------------------------------------------------------------------------
    def write_backup_storage(
        self,
        node: object,
        host_indices: torch.Tensor,
        tokens: Sequence[Token],
        hash_value: Sequence[str] | None = None,
        prefix_keys: Sequence[str] | None = None,
        side_host: torch.Tensor | None = None,
    ) -> int:
        """``side_host``: the chain's SWA host pages, named beside its KV's (an SWA world)."""
        if side_host is not None:
            write: Callable[..., int] = getattr(self.cc, "write_storage")  # noqa: B009
            op_id = write(host_indices, tokens, hash_value, prefix_keys, side_host=side_host)
        else:
            op_id = self.cc.write_storage(host_indices, tokens, hash_value, prefix_keys)
        self.ongoing_backup[op_id] = node
        self.protect_host(node)
        self.on_event("backup", {"op_id": op_id, "node": node, "host_indices": host_indices})
        return op_id

    def drain_backups(self, count: int) -> None:
        for _ in range(count):
            operation = self.cc.ack_backup_queue.get_nowait()
            node = self.ongoing_backup.pop(operation.id, None)
            if node is not None:
                self.release_host(node)
            self.on_event("backup_ack", {"operation": operation, "node": node})

    def drain_side_releases(self, count: int) -> None:
        drain_side_releases(self, count)

    def drain_releases(self, count: int) -> list[int]:
        pages = [self.cc.host_mem_release_queue.get_nowait() for _ in range(count)]
        if not pages:
            return []
        slots = torch.cat(pages)
        self.on_event("free", {"slots": slots})
        self.host_pool.free(slots)
        return [int(s) for s in slots.tolist()]

    def reset(self) -> None:
        """Forget every prefetch and backup (the host pool is cleared next)."""
        self.side_done.clear()
        self.ongoing_prefetch.clear()
        self.ongoing_backup.clear()
        self.host_locks.clear()


def _has_storage_hit_alloc(cc: object) -> bool:
    """Whether the controller decides a hit's bounce itself (0.5.23's hybrid controller)."""
    return callable(getattr(cc, "allocate_storage_hit", None))


QUEUES = ("prefetch_hit_queue", "ack_prefetch_queue", "ack_backup_queue", "host_mem_release_queue")


@dataclass
class StorageTree:
    """Every rank's tree half, drained in step: the MIN over ranks of each queue's length."""

    ranks: list[StorageTreeRank]

    def drain_hits(self, count: int) -> None:
        """Each of the next ``count`` hits on every rank: started on every rank (each one's
        bounce buffer allocated) or revoked on every rank, never started on some only: a rank
        that alone revoked would issue no sync collectives while the others wait (INV-20)."""
        for _ in range(count):
            taken = [rank.take_hit() for rank in self.ranks]
            current = [(rank, op) for rank, op in zip(self.ranks, taken, strict=True) if op]
            if len(current) != len(self.ranks):
                for rank, op in current:
                    rank.revoke(op)
                continue
            if not all(rank.wants_transfer(op) for rank, op in current):
                for rank, op in current:
                    rank.revoke(op)
                continue
            hits = [int(op.storage_hit_count) for _, op in current]  # before a cut
            pressure = all(rank.host_pressure for rank, _ in current)
            if pressure and all(_has_storage_hit_alloc(rank.cc) for rank, _ in current):
                hosts = self._allocate_storage_hits(current)
            else:
                hosts = [rank.alloc_bounce(op) for rank, op in current]
                if pressure and any(host is None for host in hosts):
                    hosts = self._cut_to_room(current, hosts)
            if any(host is None for host in hosts) or not self._staged(current, hits):
                for (rank, op), host in zip(current, hosts, strict=True):
                    if host is not None:
                        rank.host_pool.free(host)
                    rank.revoke(op)
                continue
            for (rank, op), host in zip(current, hosts, strict=True):
                assert host is not None
                rank.start_transfer(op, host)

    @staticmethod
    def _staged(current: list[tuple[StorageTreeRank, PrefetchOperation]], hits: list[int]) -> bool:
        """An SWA world: every rank's window staged at its hit before any cut (all ranks or
        none: a rank that alone revoked would join no sync collective, INV-20)."""
        if not any(rank.side_host_pool is not None for rank, _ in current):
            return True
        staged = [
            alloc_staging(rank, op, hit) for (rank, op), hit in zip(current, hits, strict=True)
        ]
        if all(staged):
            return True
        for (rank, op), ok in zip(current, staged, strict=True):
            if ok:
                release_staging(rank, side_transfers(op))
        return False

    @staticmethod
    def _cut_to_room(
        current: list[tuple[StorageTreeRank, PrefetchOperation]],
        hosts: list[torch.Tensor | None],
    ) -> list[torch.Tensor | None]:
        """No room for the whole hit on some rank: the room every rank has, in whole pages,
        if it reaches the threshold; the hit cut to it on every rank (0.5.16 - 0.5.21's radix
        caches after ``evict_host``; the driver's chains pin their host pages, so no eviction
        makes room here)."""
        for (rank, _), host in zip(current, hosts, strict=True):
            if host is not None:
                rank.host_pool.free(host)
        hit = int(current[0][1].storage_hit_count)
        cut = min(hit, *(rank.room() for rank, _ in current))
        if cut < max(rank.cc.prefetch_threshold for rank, _ in current) or cut >= hit:
            return [None] * len(current)
        cut_hosts = [rank.cc.alloc_prefetch_host_buffers(op, cut) for rank, op in current]
        if all(host is not None for host in cut_hosts):
            for rank, op in current:
                rank.cut_hit(op, cut)
        return cut_hosts

    @staticmethod
    def _allocate_storage_hits(
        current: list[tuple[StorageTreeRank, PrefetchOperation]],
    ) -> list[torch.Tensor | None]:
        """0.5.23's hybrid controller decides the bounce itself (``allocate_storage_hit``,
        ``allow_partial``): each rank's answer, agreed on the shortest (upstream's ranks see the
        same room; the harness's rank 0 also holds its tree's nodes), the hit cut to it."""
        answers = [
            rank.cc.allocate_storage_hit(  # type: ignore[attr-defined]
                op,
                int(op.storage_hit_count),
                allow_partial=True,
                min_tokens=rank.cc.prefetch_threshold,
                evict_host=lambda tokens: 0,  # the driver's chains pin their host pages
            )
            for rank, op in current
        ]
        hosts: list[torch.Tensor | None] = [host for host, _ in answers]
        if any(host is None for host in hosts):
            return hosts
        agreed = min(int(length) for _, length in answers)
        for index, ((rank, op), host) in enumerate(zip(current, hosts, strict=True)):
            assert host is not None
            if host.numel() > agreed:
                rank.host_pool.free(host[agreed:])
                hosts[index] = host[:agreed]
            if agreed < int(op.storage_hit_count):
                rank.cut_hit(op, agreed)
        return hosts

    def drain_storage_control_queues(self) -> int:
        """Drain each control queue by its MIN length over the ranks; returns items taken."""
        taken = 0
        for name in QUEUES:
            count = min(getattr(rank.cc, name).qsize() for rank in self.ranks)
            if name == "prefetch_hit_queue":
                self.drain_hits(count)
                taken += count
                continue
            for rank in self.ranks:
                if name == "ack_prefetch_queue":
                    rank.drain_acks(count)
                elif name == "ack_backup_queue":
                    rank.drain_backups(count)
                else:
                    rank.drain_releases(count)
            taken += count
        return taken + self.drain_side_releases()

    def drain_side_releases(self) -> int:
        """The SWA pool's release queue, by its MIN length over the ranks."""
        count = min(side_release_count(rank.cc) for rank in self.ranks)
        for rank in self.ranks:
            rank.drain_side_releases(count)
        return count

    def reset(self) -> None:
        for rank in self.ranks:
            rank.reset()
