"""Where a node's bytes live on each rank, computed from the harness's own CP layout.

placement (owned positions -> physical locs) -> padding (whole pages) -> the layout recorded
at write time (page owners, owned positions per rank) -> host positions and the host slots the
implementation chose (their number checked, INV-13) -> owner replay of a load (INV-03).

Nothing here reads what an implementation says about where bytes live: owned positions,
padding and page owners come from ``CpSharedKVLayout``; from the implementation only the host
slots it chose, and only after checking their count.
"""

from __future__ import annotations

from typing import cast

import torch

from hicache_ref.harness.adapters.base import CpMetadataLike
from hicache_ref.harness.driver.node_model import Node
from hicache_ref.harness.driver.uploads import SideUploads
from hicache_ref.harness.world.world import World
from hicache_ref.invariants.checks_layout import CpMetadataLike as FullMetadata
from hicache_ref.invariants.evidence import OwnerReplay, ReturnedIndices, SlotCount
from hicache_ref.invariants.registry import CheckRunner
from hicache_ref.pools.device_pool import KVCache
from hicache_ref.pools.host_pool import HostKVCache
from hicache_ref.pools.page_index import get_small_cpu_values

METADATA_FIELDS = ("logical_len", "padded_len", "page_size", "owned_positions", "page_owners")


class RankGeometry:
    """The harness's layout of one world: pools, placements, padding and host positions."""

    def __init__(self, world: World, checks: CheckRunner) -> None:
        self.world = world
        self.config = world.config
        self.checks = checks  # runs per invariant id (shared with the session)
        self.uploads = SideUploads(world)

    @property
    def num_ranks(self) -> int:
        return len(self.world.ranks)

    def layer_kinds(self) -> list[tuple[bool, int]]:
        """(draft, layer_num) of the target and, when there is one, the draft pool."""
        kinds = [(False, self.config.layer_num)]
        if self.config.has_draft:
            kinds.append((True, self.config.draft_layer_num))
        return kinds

    def page_size(self, draft: bool) -> int:
        """Rows per page of a pool's allocator and host pool: an independent side pool's own
        (one slot in a Mamba state pool), the anchor's page elsewhere."""
        if draft and self.config.has_side_pools:
            return self.config.side_page_size
        return self.config.page_size

    def layer_num(self, draft: bool) -> int:
        """Layers of the target (or the draft) pool."""
        return self.config.draft_layer_num if draft else self.config.layer_num

    def host_copies(self) -> list[bool]:
        """Which host copies a CP node has: the target, and the draft when a draft pool exists."""
        return [False, True] if self.config.has_draft else [False]

    def pools(self, rank: int, draft: bool) -> tuple[KVCache, HostKVCache]:
        r = self.world.ranks[rank]
        if not draft:
            return r.device_pool, r.host_pool
        assert r.draft_device_pool is not None and r.draft_host_pool is not None
        return r.draft_device_pool, r.draft_host_pool

    def meta(self, node: Node, rank: int) -> CpMetadataLike:
        meta = node.cp_meta[rank]
        assert meta is not None, f"node {node.handle} has no CP metadata on rank {rank}"
        return meta

    # -- device placement ----------------------------------------------------------------------
    def owned_positions(self, rank: int, node: Node, locs: torch.Tensor) -> torch.Tensor:
        """Positions (< logical_len) of ``locs`` whose page this rank owns (all when no CP)."""
        if not self.config.uses_cp:
            return torch.arange(node.logical_len)
        layout = self.world.ranks[rank].cp_layout
        assert layout is not None
        visible = locs[: node.logical_len]
        values = get_small_cpu_values(visible)
        if values is not None:  # the same positions in Python: a mask costs several torch ops
            page, cp_size, owner = layout.page_size, layout.cp_size, layout.cp_rank
            owned = [i for i, loc in enumerate(values) if (loc // page) % cp_size == owner]
            return torch.tensor(owned, dtype=torch.int64)
        return torch.arange(node.logical_len)[layout.owned_by_this_rank(visible)]

    def placement(
        self, rank: int, node: Node, draft: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(owned positions, physical locs) of the node's device copy on ``rank`` (of its
        draft copy: the same locs, except in an independent side pool: its own rows).

        Computed from the harness's own layout once per ``node.value`` (a node's device locs
        never change in place; ``load_back`` replaces the tensor), not once per store or read.
        """
        if draft and self.config.has_side_pools:
            return self.side_placement(node)
        value = node.value
        assert value is not None
        if node.placement_of is not value:
            node.placement_of, node.placement = value, {}
        hit = node.placement.get(rank)
        if hit is None:
            positions = self.owned_positions(rank, node, value)
            old = node.rows_positions.get(rank)
            if old is None or not torch.equal(old, positions):
                # the oracle's rows depend only on the positions: keep them across a reload
                # that owns the same positions (always, without CP)
                node.rows_positions[rank] = positions
                node.rows_cache = {k: v for k, v in node.rows_cache.items() if k[0] != rank}
            # on the pools' device: a harness kernel indexing with CPU locs would upload them
            # with a host sync, and a GPU campaign's spins could then never delay it
            locs = self.physical(rank, value[positions])
            target = self.world.device.device
            if locs.device != target:
                # kept by the node across steps and read by kernels on the forward's stream as
                # well as the default one, so uploaded on a side stream that both wait for and
                # marked used by both (``uploads.py``): a plain upload would make the host wait
                # for the forward stream whenever a node is first placed, draining the window a
                # GPU campaign's spins open; a block handed out again while a kernel still reads
                # it is an out-of-bounds index kernel (seen on an H200 under 16 processes)
                locs = self.uploads.upload(locs, target)
            hit = (positions, locs)
            node.placement[rank] = hit
        return hit

    def side_placement(self, node: Node) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, rows) of the node in the independent side pool (no CP: every position;
        a state pool: its one state slot, position 0), once per ``node.side_value`` (replaced,
        never changed, by a load)."""
        value = node.side_value
        assert value is not None, f"node {node.handle} holds no side pool rows"
        cached = node.side_placement
        if cached is not None and cached[0] is value:
            return cached[1], cached[2]
        rows = self.config.side_rows(node.logical_len)
        locs = value[:rows]
        target = self.world.device.device
        if locs.device != target:  # uploaded once per value, as ``placement`` does
            locs = self.uploads.upload(locs, target)
        positions = torch.arange(rows)
        node.side_placement = (value, positions, locs)
        return positions, locs

    def physical(self, rank: int, locs: torch.Tensor) -> torch.Tensor:
        layout = self.world.ranks[rank].cp_layout
        if layout is None:
            return locs
        physical: torch.Tensor = layout.logical_locs_to_physical(locs)
        return physical

    def owned_physical(self, rank: int, locs: torch.Tensor) -> torch.Tensor:
        """The physical locs of the logical ``locs`` this rank owns (all of them without CP)."""
        layout = self.world.ranks[rank].cp_layout
        if layout is None:
            return locs
        return self.physical(rank, locs[layout.owned_by_this_rank(locs)])

    def padded_locs(self, locs: torch.Tensor) -> torch.Tensor:
        """``locs`` padded to whole pages, as the harness pads them (each page is contiguous)."""
        page = self.config.page_size
        pages = torch.div(locs[::page], page, rounding_mode="floor")
        return (pages[:, None] * page + torch.arange(page)).reshape(-1)

    # -- the layout recorded at write time -----------------------------------------------------
    def record_layout(self, node: Node) -> None:
        """Record, from the harness's CP layout, each page's owner and each rank's positions."""
        assert node.value is not None
        page = self.config.page_size
        padded = self.padded_locs(node.value)
        node.owned_positions = []
        for rank in self.world.ranks:
            assert rank.cp_layout is not None
            mask = rank.cp_layout.owned_by_this_rank(padded)
            node.owned_positions.append(mask.nonzero(as_tuple=True)[0])
        layout = self.world.ranks[0].cp_layout
        assert layout is not None
        pages = torch.div(padded[::page], page, rounding_mode="floor")
        node.page_owners = [int(o) for o in layout.owner_for_logical_pages(pages).tolist()]

    def host_positions(
        self, rank_index: int, node: Node, draft: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions < logical_len held on this rank's host, their host slots).

        The positions come from the harness's layout (``Node.owned_positions``); only the slots
        are the implementation's, and their number must match (INV-13).
        """
        if not self.config.uses_cp:
            # draft copies reuse the target slots; an independent side pool has its own
            side = draft and self.config.has_side_pools
            host = node.side_host[rank_index] if side else node.host_value[rank_index]
            assert host is not None
            rows = self.config.side_rows(node.logical_len) if side else node.logical_len
            return torch.arange(rows), host
        owned = node.owned_positions[rank_index]
        keep = owned < node.logical_len
        return owned[keep], self.host_slots(rank_index, node, draft)[keep]

    def host_slots(self, rank_index: int, node: Node, draft: bool) -> torch.Tensor:
        """The host (or draft host) slots the implementation chose for the node on a rank,
        after checking there is exactly one per position the harness's layout says it owns."""
        meta = self.meta(node, rank_index)
        slots = meta.draft_host_indices if draft else meta.host_indices
        owned = len(node.owned_positions[rank_index])
        count = SlotCount(
            0 if slots is None else len(slots),
            owned,
            f"node {node.handle} rank {rank_index}",
            pool="draft host" if draft else "host",
        )
        self.checks.run("INV-13", count)
        return slots if slots is not None else torch.empty((0,), dtype=torch.int64)

    def check_reservation(self, rank_index: int, node: Node) -> None:
        """What a CP reservation chose on a rank: whole host pages (INV-01), metadata that obeys
        every rule, and one host (and draft host) slot per owned position (INV-13)."""
        meta = self.meta(node, rank_index)
        page, what = self.config.page_size, f"node {node.handle} rank {rank_index}"
        for pool, slots in (("host", meta.host_indices), ("draft host", meta.draft_host_indices)):
            if slots is not None and len(slots):
                returned = ReturnedIndices(slots, page, f"{what} {pool} indices")
                self.checks.run("INV-01", returned)
        owned = len(node.owned_positions[rank_index])
        # the record's own rules where it carries them (the contract promises only host indices)
        full = meta if all(hasattr(meta, f) for f in METADATA_FIELDS) else None
        count = SlotCount(
            len(meta.host_indices), owned, what, meta=cast("FullMetadata | None", full)
        )
        self.checks.run("INV-13", count)
        for draft in self.host_copies():
            self.host_slots(rank_index, node, draft)

    def check_owner_replay(self, node: Node) -> None:
        """The fresh pages repeat the owners the harness recorded at write time (INV-03)."""
        assert node.value is not None
        page = self.config.page_size
        layout = self.world.ranks[0].cp_layout
        assert layout is not None
        padded = self.padded_locs(node.value)  # visible spans start page-aligned
        pages = torch.div(padded[::page], page, rounding_mode="floor")
        owners = layout.owner_for_logical_pages(pages).tolist()
        owner_of = {int(p): int(o) for p, o in zip(pages.tolist(), owners, strict=True)}
        replay = OwnerReplay(
            node.handle, padded, node.page_owners, page, self.config.cp_size, owner_of.__getitem__
        )
        self.checks.run("INV-03", replay)
