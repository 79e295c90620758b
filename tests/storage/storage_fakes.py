"""Test doubles for the storage tier: a small host pool, tiers, and the tree's half of 0.5.23.

``FakeHostPool`` keeps KV in a CPU tensor in one of two layouts but always hands out pages in
one canonical flat order (kv, layer, token, head, dim), like the real host pools.
``TreeSide`` plays the radix tree's part of the protocol for one rank: start a prefetch, drain
the hit queue (revoke, or allocate the bounce buffer and start the IO), drain the progress acks
(apply them, insert ``[0:completed]`` and release the rest on the final ack), terminate, back up
and drain backup acks, and free the release queue into the pool, remembering what it freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hicache_ref.controller.storage import (
    RankGroup,
    StepResult,
    StorageStepKind,
    StorageTier,
    drain_host_mem_release,
    run_lockstep,
    run_until_idle,
    runnable_steps,
)
from hicache_ref.controller.storage.collectives import Collectives
from hicache_ref.controller.storage.lockstep import LockstepThreads
from hicache_ref.errors import DoubleFreeError
from hicache_ref.ids import HostSlot
from hicache_ref.storage.operations import PrefetchOperation

LAYOUTS = ("layer_first", "page_first")


class FakeHostPool:
    """A host KV pool over a CPU tensor with a page-granular FIFO free list."""

    def __init__(
        self,
        size: int,
        page_size: int,
        layout: str = "layer_first",
        layer_num: int = 2,
        head_num: int = 2,
        head_dim: int = 4,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        assert layout in LAYOUTS and size % page_size == 0
        self.size = size
        self.page_size = page_size
        self.layout = layout
        self.layer_num = layer_num
        self.dtype = dtype
        if layout == "layer_first":
            shape = (2, layer_num, size, head_num, head_dim)
        else:
            shape = (2, size, layer_num, head_num, head_dim)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)
        self.free_slots: list[int] = list(range(size))
        self.on_set_page: Callable[[int], None] | None = None

    def _canonical(self) -> torch.Tensor:
        """A (kv, layer, token, head, dim) view of the buffer, whatever the layout."""
        if self.layout == "layer_first":
            return self.kv_buffer
        return self.kv_buffer.permute(0, 2, 1, 3, 4)

    def _page_view(self, index: int) -> torch.Tensor:
        assert index % self.page_size == 0, f"page head {index} is not page aligned"
        return self._canonical()[:, :, index : index + self.page_size]

    def get_data_page(self, index: HostSlot, flat: bool = True) -> torch.Tensor:
        page = self._page_view(int(index)).contiguous()
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self._page_view(0).contiguous().flatten())

    def set_from_flat_data_page(self, index: HostSlot, data: torch.Tensor) -> None:
        view = self._page_view(int(index))
        view.copy_(data.reshape(view.shape))
        if self.on_set_page is not None:
            self.on_set_page(int(index))

    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert need_size % self.page_size == 0
        if need_size > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return torch.tensor(taken, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> int:
        slots = indices.tolist()
        if set(slots) & set(self.free_slots) or len(set(slots)) != len(slots):
            raise DoubleFreeError(f"double free of host slots {sorted(slots)}")
        self.free_slots.extend(slots)
        return len(slots)

    def available_size(self) -> int:
        return len(self.free_slots)

    def fill(self, indices: torch.Tensor, seed: int) -> None:
        """Write distinct, seed-dependent values into the given token slots."""
        canonical = self._canonical()
        for offset, slot in enumerate(indices.tolist()):
            values = torch.arange(canonical[:, :, slot].numel(), dtype=torch.float32)
            canonical[:, :, slot] = (
                (values + 1000 * seed + offset).reshape(canonical[:, :, slot].shape).to(self.dtype)
            )

    def read(self, indices: torch.Tensor) -> torch.Tensor:
        """The KV of the given token slots, canonical order (a copy)."""
        return self._canonical()[:, :, indices].clone()


class FakeDevicePool:
    def __init__(self, size: int) -> None:
        self.size = size


class MLATokenToKVPool(FakeDevicePool):
    """Named like SGLang's MLA pool, which is all the tier looks at."""


def make_tier(
    pool: FakeHostPool,
    *,
    executor: str = "manual",
    collectives: Collectives | None = None,
    device_pool: FakeDevicePool | None = None,
    uses_cp_hicache: bool = False,
) -> StorageTier:
    return StorageTier(
        pool,
        device_pool or FakeDevicePool(pool.size // 4),
        pool.page_size,
        executor=executor,
        collectives=collectives,
        uses_cp_hicache=uses_cp_hicache,
    )


@dataclass
class Ongoing:
    """The tree's ``ongoing_prefetch`` entry: the op, its tokens and (once hit) its buffer."""

    operation: PrefetchOperation
    tokens: int
    host_indices: torch.Tensor | None = None
    matched: int = 0


@dataclass
class TreeSide:
    """The tree's half of a prefetch and a backup for one rank (0.5.23's cache mode)."""

    tier: StorageTier
    pool: FakeHostPool
    ongoing: dict[str, Ongoing] = field(default_factory=dict)
    inserted: dict[str, torch.Tensor] = field(default_factory=dict)
    freed: list[int] = field(default_factory=list)
    revoked: list[str] = field(default_factory=list)
    backup_acks: list[int] = field(default_factory=list)

    def start(
        self, rid: str, tokens: list[int], last_hash: str | None = None, matched: int = 0
    ) -> PrefetchOperation:
        """``prefetch_from_storage``: queue the query, reserve the occupancy."""
        operation = self.tier.prefetch(rid, tokens, last_hash)
        self.ongoing[rid] = Ongoing(operation, len(tokens), matched=matched)
        self.tier.prefetch_tokens_occupied += len(tokens)
        return operation

    def drain_hits(self) -> None:
        """Revoke each hit below threshold (or terminated); allocate and start the others."""
        queue = self.tier.queues.prefetch_hit_queue
        for _ in range(queue.qsize()):
            operation = queue.get_nowait()
            info = self.ongoing.get(operation.request_id)
            if info is None or info.operation is not operation:
                continue
            hit = operation.storage_hit_count
            if operation.is_terminated() or hit < self.tier.prefetch_threshold:
                self.retire(operation.request_id, revoked=True)
                continue
            host = self.tier.alloc_prefetch_host_buffers(operation, hit)
            if host is None:
                self.retire(operation.request_id, revoked=True)
                continue
            operation.host_indices = host
            info.host_indices = host
            self.tier.queues.prefetch_buffer.put(operation)

    def drain_acks(self) -> None:
        """Apply published progress; on the final ack insert the result, release the tail."""
        queue = self.tier.queues.ack_prefetch_queue
        for _ in range(queue.qsize()):
            ack = queue.get_nowait()
            operation = ack.operation
            info = self.ongoing.get(ack.rid)
            current = info is not None and info.operation is operation
            if ack.completed_tokens is not None and current:
                operation.completed_tokens = ack.completed_tokens
            if ack.completed_req:
                if current:
                    self.handle_result(ack.rid)
                host = operation.host_indices
                assert host is not None
                done = operation.completed_tokens
                operation.record_release(done, host.numel(), "tree-tail")
                self.tier.append_host_mem_release(host[done:])

    def terminate(self, rid: str) -> int:
        """``check_prefetch_progress`` once the policy says stop: terminate and settle."""
        info = self.ongoing[rid]
        completed, _ = self.tier.terminate_prefetch(info.operation)
        if info.host_indices is None:
            self.retire(rid, revoked=True)
        else:
            self.handle_result(rid)
        return completed

    def handle_result(self, rid: str) -> None:
        """Insert ``[matched:completed]``, free ``[0:matched]`` (cached meanwhile)."""
        info = self.ongoing[rid]
        operation = info.operation
        host = info.host_indices
        assert host is not None
        completed = operation.completed_tokens
        matched = min(info.matched, completed)
        if matched:
            self.pool.free(host[:matched])
            self.freed.extend(host[:matched].tolist())
            operation.record_release(0, matched, "tree-matched")
        self.inserted[rid] = host[matched:completed]
        operation.record_release(matched, completed, "tree-inserted")
        self.retire(rid, revoked=False)

    def retire(self, rid: str, *, revoked: bool) -> None:
        info = self.ongoing.pop(rid)
        self.tier.prefetch_tokens_occupied -= info.tokens
        if revoked:
            self.revoked.append(rid)

    def drain_backups(self) -> list[int]:
        queue = self.tier.queues.ack_backup_queue
        acked = [queue.get_nowait().completed_tokens for _ in range(queue.qsize())]
        self.backup_acks.extend(acked)
        return acked

    def drain_releases(self) -> list[int]:
        """Free every queued release page into the host pool (the scheduler does this)."""
        released = drain_host_mem_release(self.tier.queues.host_mem_release_queue, self.pool)
        self.freed.extend(released)
        return released

    def drain_all(self) -> None:
        self.drain_hits()
        self.drain_acks()
        self.drain_backups()
        self.drain_releases()

    def settle(self) -> None:
        """Run the tier (manual) and drain until nothing moves."""
        for _ in range(64):
            steps = self.tier.run_until_idle()
            self.drain_all()
            if steps == 0 and not self.tier.runnable_steps():
                return
        raise AssertionError("storage work did not settle")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Spin (1 ms naps) until ``predicate`` holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s}s")
        time.sleep(0.001)


@dataclass
class RankWorld:
    """``ranks`` tiers (manual) sharing one ``RankGroup``, each with its pool and tree."""

    group: RankGroup
    pools: list[FakeHostPool]
    tiers: list[StorageTier]
    trees: list[TreeSide]
    threads: LockstepThreads | None = None  # None: every step starts threads of its own

    @classmethod
    def build(
        cls,
        ranks: int,
        page_size: int = 4,
        timeout_s: float = 2.0,
        threads: LockstepThreads | None = None,
    ) -> RankWorld:
        group = RankGroup(ranks, timeout_s=timeout_s)
        pools = [FakeHostPool(size=64, page_size=page_size) for _ in range(ranks)]
        tiers = [make_tier(pool, collectives=group.view(r)) for r, pool in enumerate(pools)]
        for tier in tiers:
            tier.attach_storage_backend("memory", prefetch_threshold=page_size)
        trees = [TreeSide(t, p) for t, p in zip(tiers, pools, strict=True)]
        return cls(group, pools, tiers, trees, threads)

    def step(self, kind: StorageStepKind) -> tuple[StepResult, ...]:
        return run_lockstep(self.tiers, self.group, kind, self.threads)

    def start(self, rid: str, tokens: list[int]) -> list[PrefetchOperation]:
        return [tree.start(rid, tokens) for tree in self.trees]

    def drain(self) -> None:
        for tree in self.trees:
            tree.drain_all()

    def settle(self) -> None:
        for _ in range(64):
            steps = run_until_idle(self.tiers, self.group)
            self.drain()
            if steps == 0 and not runnable_steps(self.tiers):
                return
        raise AssertionError("storage work did not settle")
