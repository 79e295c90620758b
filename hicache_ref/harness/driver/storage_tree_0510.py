"""The tree's half of 0.5.10's prefetch protocol, modelled on its radix cache (our own code).

SGLang 0.5.10's controller publishes no ``PrefetchAck``: its radix cache (``hiradix_cache.py``)
allocates the host pages of a whole prefetch up front, polls ``operation.completed_tokens``
and reduces it over the TP group itself. ``PollTreeRank`` is one rank's side of that, in
protocol order:

- ``prefetch_from_storage``: page-align, threshold, rate limit, pin the anchor, allocate host
  pages for every token and ``cc.prefetch(rid, host_indices, tokens, last_hash, prefix_keys)``;
  under host pressure (0.5.13 - 0.5.15) a prefetch that does not fit is cut to the free whole
  pages first, if they reach the threshold (the radix cache's fallback).
  The hit thread later gives back ``[hit:]`` itself and cuts ``host_indices`` to the hit, or
  gives back all of it and puts the rid on ``prefetch_revoke_queue`` (hit below threshold);
- ``drain_revokes``: each revoked rid still ongoing is retired (anchor unpinned, occupancy
  returned);
- ``is_complete``: the policy's view of one rank (progress reached ``len(hash_value)`` pages,
  never with an empty ``hash_value``: sglang#9397);
- ``settle``: after ``terminate_prefetch`` and the MIN over ranks, ``[0:min)`` goes to
  ``on_insert``, ``[0:matched)`` is freed, ``[min:completed)`` released, the anchor unpinned;
- ``abort`` (``release_aborted_request``): terminate, release ``[0:completed)``, nothing
  inserted.

``HitPollTreeRank`` is 0.5.16 - 0.5.18's variant: ``prefetch`` takes no pages, the hit thread
hands the agreed hit back on ``prefetch_hit_queue`` and the tree's drain gives it a bounce buffer
of exactly the hit (``PollStorageTree.drain_hits``, ``StorageTree``'s all-ranks-alike rule);
a prefetch stopped before its buffer is retired with nothing to settle. 0.5.18 has no revoke
queue (a below-threshold hit is revoked at the drain).

``PollStorageTree`` holds one per rank and issues the collectives 0.5.10's scheduler issues on
``tp_group`` through the storage world's ``RankGroup`` (``reduce_over_ranks``: each rank's part
on its own thread, as its own scheduler would): the MAX of (cannot terminate, terminated) for a
policy that waits, then the MIN of the completed tokens. The hit thread's and the IO thread's
work is upstream's own; what they leave on the operation is read by the storage driver after
each of their steps (``storage_events.observe_polled_step``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache_ref.controller.storage.collectives import RankGroup, ReduceOp, SyncGroup
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.driver.storage_tree import (
    OngoingPrefetch,
    StorageTree,
    StorageTreeRank,
)
from hicache_ref.storage.hashing import Token

COMPLETION_GROUP = SyncGroup("prefetch_completion")
"""The MIN of every rank's completed tokens at termination (0.5.10 issues it on ``tp_group``;
named as the completion reduction the checks pair published progress with, INV-21)."""
VERDICT_GROUP = SyncGroup("prefetch_verdict")
"""The MAX of (cannot terminate, terminated) a waiting policy reduces (0.5.10: ``tp_group``)."""
REDUCE_JOIN_S = 30.0


def reduce_over_ranks(
    group: RankGroup, name: SyncGroup, op: ReduceOp, values: Sequence[Sequence[int]]
) -> list[int]:
    """Every rank's ``values[rank]`` all-reduced with ``op`` over ``group``, as one lockstep
    step (each rank's part on its own thread, so the group's rendezvous and its checks serve
    the tree's collectives exactly as they serve the threads'; INV-20)."""
    results: list[list[int] | None] = [None] * group.world_size
    errors: list[BaseException | None] = [None] * group.world_size

    def run(rank: int) -> None:
        tensor = torch.tensor(list(values[rank]), dtype=torch.int64)
        try:
            group.view(rank).all_reduce(tensor, op, name)
            results[rank] = [int(v) for v in tensor.tolist()]
        except BaseException as exc:  # re-raised below, on the caller's thread
            errors[rank] = exc
        finally:
            group.rank_finished(rank)

    group.begin_step()
    try:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(values))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(REDUCE_JOIN_S)
    finally:
        group.end_step()
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    # Verify every rank's part returned (a rank still waiting is a collective nobody answers)
    if any(r is None for r in results):
        raise InvariantViolation(
            "INV-20",
            f"the tree's {name.name} reduction did not return on every rank within "
            f"{REDUCE_JOIN_S:g} s (every rank must issue the same collectives)",
        )
    return results[0] or []


@dataclass
class PollTreeRank(StorageTreeRank):
    """One rank's 0.5.10-shaped storage bookkeeping (the backups and releases are shared)."""

    def prefetch_from_storage(
        self,
        rid: str,
        anchor: object,
        tokens: Sequence[Token],
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> Any:
        """Start a prefetch with host pages for every token; None when it is not started."""
        tokens = list(tokens[: len(tokens) - len(tokens) % self.page_size])
        if rid in self.ongoing_prefetch or len(tokens) < self.cc.prefetch_threshold:
            return None
        if self.cc.prefetch_rate_limited():
            return None
        self.protect_host(anchor)
        host_indices = self.host_pool.alloc(len(tokens))
        if host_indices is None and self.host_pressure:
            # 0.5.13 - 0.5.15: no room for the whole prefetch (evict_host frees nothing here: the
            # harness's host nodes are pinned), so fetch the free whole pages if they reach the
            # threshold: the prefetch, its keys and the hit it can find are cut before the query
            room = self.room()
            if room >= max(self.cc.prefetch_threshold, self.page_size):
                tokens = tokens[:room]
                host_indices = self.host_pool.alloc(room)
        if host_indices is None:  # 0.5.10 evicts host nodes first; the harness's are pinned
            self.release_host(anchor)
            return None
        cc: Any = self.cc
        operation = cc.prefetch(rid, host_indices, tokens, last_hash, prefix_keys)
        self.ongoing_prefetch[rid] = OngoingPrefetch(operation, len(tokens), anchor, host_indices)
        self.cc.prefetch_tokens_occupied += len(tokens)
        self.on_event("started", {"rid": rid, "operation": operation, "tokens": len(tokens)})
        self.on_event("allocated", {"operation": operation, "host_indices": host_indices})
        return operation

    def drain_revokes(self, count: int) -> None:
        """``_drain_revoke``: a revoked prefetch still ongoing is retired."""
        cc: Any = self.cc  # 0.5.10's controller: its revoke queue is no part of the 0.5.23 surface
        queue = cc.prefetch_revoke_queue
        for _ in range(count):
            rid = queue.get_nowait()
            if rid in self.ongoing_prefetch:
                self._retire(rid, "revoked")

    def is_complete(self, rid: str) -> bool:
        """0.5.10's ``completed``: progress reached the hit, and a hit is known."""
        operation: Any = self.ongoing_prefetch[rid].operation
        pages = len(operation.hash_value)
        complete = bool(pages) and operation.completed_tokens == pages * self.page_size
        self.on_event("verdict", {"operation": operation, "complete": complete})
        return complete

    def can_terminate(self, rid: str) -> tuple[bool, bool]:
        """This rank's (can terminate, terminated) before the MAX over ranks."""
        info = self.ongoing_prefetch[rid]
        terminated = bool(info.operation.is_terminated())
        if self.policy == "best_effort":
            return True, terminated
        complete = self.is_complete(rid)
        if self.policy == "wait_complete":
            return complete, terminated
        return complete or info.age >= self.timeout_steps, terminated

    def terminate_op(self, rid: str) -> int:
        """``cc.terminate_prefetch``: this rank's completed tokens, frozen from now on."""
        info = self.ongoing_prefetch[rid]
        completed, _ = self.cc.terminate_prefetch(info.operation)
        self.on_event("terminate", {"operation": info.operation, "completed": int(completed)})
        return int(completed)

    def settle(self, rid: str, completed: int, agreed: int) -> None:
        """Insert ``[0:agreed)``, free what the tree had, release ``[agreed:completed)``."""
        info = self.ongoing_prefetch[rid]
        operation = info.operation
        host_indices = info.host_indices
        assert host_indices is not None
        self.on_event("published", {"operation": operation, "agreed": agreed})
        matched = self.on_insert(rid, operation, host_indices[:agreed]) if agreed else 0
        if matched:
            self.host_pool.free(host_indices[:matched])
        self.on_event(
            "insert", {"operation": operation, "matched": matched, "end": agreed, "agreed": agreed}
        )
        self.release(operation, host_indices, agreed, completed, "tail")
        self._retire(rid, "done")

    def abort(self, rid: str) -> int:
        """``release_aborted_request``: terminate; ``[0:completed)`` goes back, nothing is
        inserted (the IO gives back the rest when it is done with the operation)."""
        info = self.ongoing_prefetch[rid]
        completed = self.terminate_op(rid)
        assert info.host_indices is not None
        self.release(info.operation, info.host_indices, 0, completed, "aborted")
        self._retire(rid, "aborted")
        return completed

    def release(
        self, operation: Any, host_indices: torch.Tensor, start: int, end: int, how: str
    ) -> None:
        if end <= start:
            return
        self.on_event("release", {"operation": operation, "start": start, "end": end, "how": how})
        self.cc.append_host_mem_release(host_indices[start:end])


@dataclass
class HitPollTreeRank(PollTreeRank):
    """0.5.16 - 0.5.18's tree half: no pages up front; the hit thread hands the agreed hit
    back on ``prefetch_hit_queue`` and the tree gives it a bounce buffer of exactly the hit
    when it drains it (``_drain_and_alloc_storage_hit``: ``StorageTree.drain_hits``, revoking
    a terminated or below-threshold hit, or one with no host room); completion is polled as in
    0.5.10. A prefetch stopped before its buffer was given is terminated and retired with no
    reduction and nothing inserted (``check_prefetch_progress``, ``release_aborted_request``)."""

    def prefetch_from_storage(
        self,
        rid: str,
        anchor: object,
        tokens: Sequence[Token],
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> Any:
        return StorageTreeRank.prefetch_from_storage(
            self, rid, anchor, tokens, last_hash, prefix_keys
        )

    def has_buffer(self, rid: str) -> bool:
        return self.ongoing_prefetch[rid].host_indices is not None

    def stop_unbuffered(self, rid: str) -> int:
        """``terminate_prefetch`` then ``_revoke_pending_prefetch``: no buffer, nothing to give."""
        completed = self.terminate_op(rid)
        self._retire(rid, "revoked")
        return completed

    def abort(self, rid: str) -> int:
        if not self.has_buffer(rid):
            return self.stop_unbuffered(rid)
        return super().abort(rid)


def revoke_queue(rank: PollTreeRank) -> Any:
    cc: Any = rank.cc
    return getattr(cc, "prefetch_revoke_queue", None)


@dataclass
class PollStorageTree:
    """Every rank's 0.5.10 tree half; the tree's collectives go through the rank group."""

    ranks: list[PollTreeRank]
    group: RankGroup

    def drain_revokes(self) -> int:
        """``drain_storage_control_queues``'s revoke part: the MIN over ranks of its length
        (0.5.18 has no revoke queue: its tree revokes a below-threshold hit at the drain)."""
        if any(revoke_queue(r) is None for r in self.ranks):
            return 0
        count = min(int(revoke_queue(r).qsize()) for r in self.ranks)
        for rank in self.ranks:
            rank.drain_revokes(count)
        return count

    def check_prefetch_progress(self, rid: str) -> bool:
        """True once ``rid`` is settled on every rank (or was never ongoing)."""
        if any(rid not in r.ongoing_prefetch for r in self.ranks):
            return True
        for rank in self.ranks:
            rank.ongoing_prefetch[rid].age += 1
        states = [rank.can_terminate(rid) for rank in self.ranks]
        if self.ranks[0].policy != "best_effort" and len(self.ranks) > 1:
            reduced = reduce_over_ranks(
                self.group, VERDICT_GROUP, ReduceOp.MAX, [[1 - int(c), int(t)] for c, t in states]
            )
            can, terminated = reduced[0] == 0, reduced[1] == 1
        else:
            can, terminated = states[0]
        if not (can or terminated):
            return False
        self.finish(rid)
        return True

    def drain_hits(self) -> int:
        """0.5.16 - 0.5.18 (``HitPollTreeRank``): the hit queue by its MIN length over ranks,
        each hit started or revoked on every rank alike (``StorageTree.drain_hits``)."""
        if not all(isinstance(r, HitPollTreeRank) for r in self.ranks):
            return 0
        count = min(int(r.cc.prefetch_hit_queue.qsize()) for r in self.ranks)
        StorageTree(list(self.ranks)).drain_hits(count)
        return count

    def finish(self, rid: str) -> list[int]:
        """Terminate on every rank, agree on the MIN of the completed tokens, settle (a
        prefetch with no bounce buffer yet is stopped and retired on every rank instead)."""
        if all(isinstance(r, HitPollTreeRank) and not r.has_buffer(rid) for r in self.ranks):
            return [r.stop_unbuffered(rid) for r in self.ranks if isinstance(r, HitPollTreeRank)]
        completed = [rank.terminate_op(rid) for rank in self.ranks]
        agreed = completed[0]
        if len(self.ranks) > 1:
            agreed = reduce_over_ranks(
                self.group, COMPLETION_GROUP, ReduceOp.MIN, [[c] for c in completed]
            )[0]
        for rank, mine in zip(self.ranks, completed, strict=True):
            rank.settle(rid, mine, agreed)
        return completed

    def abort(self, rid: str) -> list[int]:
        return [rank.abort(rid) for rank in self.ranks]

    def reset(self) -> None:
        for rank in self.ranks:
            rank.reset()
