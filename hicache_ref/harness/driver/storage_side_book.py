"""What the storage driver holds for an SWA window's storage world, beside its chains.

In a storage world with an independent SWA side pool (``storage_swa_window``) the driver also
holds, per rank, in the order a chain and its prefetch meet them:

- ``of`` / ``staging``: the book of a world (its side pool's page, whether it is a state pool)
  and the window pages a prefetch names;
- ``alloc_side`` / ``fill_side``: a backup's SWA source pages, filled with the content oracle's
  rows of the chain (the digests the L3 model expects back: ``StorageLog.expected_swa``, INV-39),
  given back at the backup's ack (``free_source``); in a Mamba storage world (``state``) the
  chain's one state slot, filled with the oracle's state of the chain's node, expected back
  for the chain's whole prefix only (a state is valid at its node's end);
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
from hicache_ref.harness.driver.storage_side import staging_pages
from hicache_ref.harness.world.content import expected_rows
from hicache_ref.harness.world.recording_storage import page_digest
from hicache_ref.invariants.snapshot import NodeHoldings
from hicache_ref.invariants.storage_snapshot import Prefix

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_log import StorageLog
    from hicache_ref.harness.world.config import HarnessConfig
    from hicache_ref.harness.world.storage_world import StorageRank
    from hicache_ref.pools.host_pool import HostKVCache


class SideBook:
    """The side slots and crowds of one storage world's ranks."""

    def __init__(self, ranks: int, page: int, side_page: int = 0, state: bool = False) -> None:
        self.page = page
        self.side_page = side_page or page  # the side pool's page: one slot for a state pool
        self.state = state  # a Mamba state pool: one slot per chain (node)
        self.sources: list[dict[int, torch.Tensor]] = [{} for _ in range(ranks)]
        self.held: list[set[int]] = [set() for _ in range(ranks)]
        self.crowds: dict[str, list[torch.Tensor | None]] = {}

    @classmethod
    def of(cls, config: HarnessConfig) -> SideBook:
        """The book of ``config``'s storage world (its side pool's page and kind)."""
        return cls(
            config.storage_ranks, config.page_size, config.side_page_size, config.has_state_pool
        )

    def staging(self, pages: int, window: int, at_root: bool) -> int:
        """The window pages a prefetch of ``pages`` names (``storage_side.staging_pages``: a
        Mamba state's one page on every prefetch)."""
        return staging_pages(pages, window, at_root, self.state)

    def reset(self) -> None:
        """A reset: the host and side pools are cleared, nothing is held any more."""
        self.sources = [{} for _ in self.sources]
        self.held = [set() for _ in self.held]
        self.crowds = {}

    # -- a backup's SWA source pages -------------------------------------------------------------
    def alloc_side(self, ranks: Sequence[StorageRank], tokens: int) -> list[torch.Tensor] | None:
        """Every rank's side slots for a chain of ``tokens`` (one state slot in a Mamba
        world; ``[]`` outside a side-pool world, None when some rank has no room: none kept)."""
        pools = [r.side_host_pool for r in ranks]
        if any(pool is None for pool in pools):
            return []
        rows = 1 if self.state else tokens
        got = [pool.alloc(rows) for pool in pools if pool is not None]
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
        if self.state:
            prefix, digest = fill_state(rank.side_host_pool, uid, chain, slots, layers, self.page)
            log.expected_swa[(rank.rank, prefix)] = digest
        else:
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
            side = frozenset(s // self.side_page for s in self.held[0])
            held.append(pseudo_holding(first - len(held), frozenset(), side))
        return held


def fill_state(
    pool: HostKVCache, uid: int, chain: Chain, slots: torch.Tensor, layers: int, page: int
) -> tuple[Prefix, str]:
    """The oracle's state of content ``uid`` (a node's one slot, as the tree's model of a Mamba
    node has it: the draft rows of position 0) at the one slot ``slots`` holds; (the chain's
    whole prefix, the slot's digest)."""
    assert slots.numel() == 1, "a node's Mamba state is one slot"
    positions = torch.arange(1)
    for c, name in enumerate(pool.device_pool.component_names()):
        shape = tuple(pool.row_shapes[name])
        for layer in range(layers):
            pool.write_rows(
                name, layer, slots, expected_rows(uid, True, layer, c, positions, shape)
            )
    return chain.prefix(page), page_digest(pool.get_data_page(int(slots[0]), True))


def pseudo_holding(
    handle: int, host: frozenset[int], side: frozenset[int] = frozenset()
) -> NodeHoldings:
    """Pages the storage half holds, as a node of the harness's model (rank 0's only)."""
    return NodeHoldings(handle, handle, frozenset(), (host,), (side,), "none")
