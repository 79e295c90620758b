"""What the storage driver holds for an SWA window's storage world, beside its chains.

In a storage world with an independent SWA side pool (``storage_swa_window``) the driver also
holds, per rank, in the order a chain and its prefetch meet them:

- ``alloc_side`` / ``fill_side``: a backup's SWA source pages, filled with the content oracle's
  rows of the chain (the digests the L3 model expects back: ``StorageLog.expected_swa``, INV-39),
  given back at the backup's ack (``free_source``);
- ``note``: every side slot the storage half holds (sources, staged windows), from its own
  allocations and the frees it heard, so rank 0's count in INV-05's conservation;
- ``crowd`` / ``release_crowds``: other requests' host pages while a prefetch's query runs (the
  harness's chains stand for one request each), so under host pressure a hit often finds less
  room than it needs and is served cut, the cut ``_sync_trailing_keys`` re-aligns the window to;
- ``holdings``: rank 0's crowds and side slots as pseudo nodes of the harness's model
  (``pseudo_holding``, which the driver's sources and bounce buffers use too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hicache_ref.harness.driver.node_model import pages_covered
from hicache_ref.harness.driver.storage_chains import Chain, fill_chain
from hicache_ref.invariants.snapshot import NodeHoldings

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_log import StorageLog
    from hicache_ref.harness.world.storage_world import StorageRank


class SideBook:
    """The side slots and crowds of one storage world's ranks."""

    def __init__(self, ranks: int, page: int) -> None:
        self.page = page
        self.sources: list[dict[int, torch.Tensor]] = [{} for _ in range(ranks)]
        self.held: list[set[int]] = [set() for _ in range(ranks)]
        self.crowds: dict[str, list[torch.Tensor | None]] = {}

    def reset(self) -> None:
        """A reset: the host and side pools are cleared, nothing is held any more."""
        self.sources = [{} for _ in self.sources]
        self.held = [set() for _ in self.held]
        self.crowds = {}

    # -- a backup's SWA source pages -------------------------------------------------------------
    @staticmethod
    def alloc_side(ranks: Sequence[StorageRank], tokens: int) -> list[torch.Tensor] | None:
        """Every rank's side slots for a chain (``[]`` outside an SWA world, None when some
        rank has no room: none kept)."""
        pools = [r.side_host_pool for r in ranks]
        if any(pool is None for pool in pools):
            return []
        got = [pool.alloc(tokens) for pool in pools if pool is not None]
        if any(slots is None for slots in got):
            for pool, slots in zip(pools, got, strict=True):
                if pool is not None and slots is not None:
                    pool.free(slots)
            return None
        return [slots for slots in got if slots is not None]

    def fill_side(
        self,
        rank: StorageRank,
        uid: int,
        chain: Chain,
        slots: torch.Tensor,
        layers: int,
        log: StorageLog,
        op_id: int,
    ) -> None:
        """The side pool's rows of content ``uid`` at ``slots`` (what L3 must give back)."""
        assert rank.side_host_pool is not None
        for prefix, digest in fill_chain(rank.side_host_pool, uid, chain, slots, layers, True):
            log.expected_swa[(rank.rank, prefix)] = digest
        self.sources[rank.rank][op_id] = slots
        self.note(rank.rank, slots, held=True)

    def free_source(self, rank: StorageRank, op_id: int) -> None:
        slots = self.sources[rank.rank].pop(op_id, None)
        if slots is not None and rank.side_host_pool is not None:
            self.note(rank.rank, slots, held=False)
            rank.side_host_pool.free(slots)

    def note(self, rank: int, slots: torch.Tensor, held: bool) -> None:
        """Side slots the storage half took (``held``) or gave back."""
        values = {int(s) for s in slots.tolist()}
        if held:
            self.held[rank] |= values
        else:
            self.held[rank] -= values

    # -- other requests' host room -----------------------------------------------------------------
    def crowd(self, rid: str, ranks: Sequence[StorageRank], leave_pages: int) -> None:
        """Other requests take every rank's free host pages but ``leave_pages`` while ``rid``'s
        query runs (chosen by the prefetch's own ``pick``: replayed alike)."""
        held: list[torch.Tensor | None] = []
        for rank in ranks:
            free = int(rank.host_pool.available_size())
            take = free - free % self.page - leave_pages * self.page
            held.append(rank.host_pool.alloc(take) if take > 0 else None)
        self.crowds[rid] = held

    def release_crowds(
        self, ranks: Sequence[StorageRank], log: StorageLog, every: bool = False
    ) -> None:
        """The host pages of each crowd whose prefetch's hit every rank drained (or all)."""
        for rid in list(self.crowds):
            logs = [logs.get(rid) for logs in log.prefetches]
            drained = all(
                each is None or each.published_hit_tokens is not None or each.retired
                for each in logs
            )
            if not (every or drained):
                continue
            for rank, held in zip(ranks, self.crowds.pop(rid), strict=True):
                if held is not None:
                    rank.host_pool.free(held)

    # -- the harness's model -----------------------------------------------------------------------
    def holdings(self, first: int) -> list[NodeHoldings]:
        """Rank 0's crowds (host pages) and side slots (side pool pages) as pseudo nodes with
        handles ``first``, ``first - 1``, ..."""
        held: list[NodeHoldings] = []
        crowds = [c[0] for c in self.crowds.values() if c and c[0] is not None]
        for slots in crowds:
            pages = pages_covered(slots, self.page)
            held.append(pseudo_holding(first - len(held), pages, frozenset()))
        if self.held[0]:
            side = frozenset(s // self.page for s in self.held[0])
            held.append(pseudo_holding(first - len(held), frozenset(), side))
        return held


def pseudo_holding(
    handle: int, host: frozenset[int], side: frozenset[int] = frozenset()
) -> NodeHoldings:
    """Pages the storage half holds, as a node of the harness's model (rank 0's only)."""
    return NodeHoldings(handle, handle, frozenset(), (host,), (side,), "none")
