"""The round-trip stories, shared by the simulated tests and their CUDA twins.

Each story fills device rows with node-specific bytes, backs them up through the controller,
drains the write acks, evicts the device copies, lets the free list move on, loads the nodes
back into NEW device locations and checks every layer and component, target and draft, bit for
bit (INV-06). The CP story does the same on every rank and checks the owner rank's physical rows.
"""

from __future__ import annotations

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.device import SimDevice
from hicache_ref.invariants.models import (
    CpHiCacheNodeMetadata,
    HiCacheWriteReservation,
    HiCacheWriteResult,
)
from hicache_ref.pools import KVCache
from hicache_ref.pools.page_math import compute_padded_len

from .rig import (
    CpNodeView,
    Rig,
    ack_rows,
    assert_rows,
    drain_acks,
    fill_node,
    page_set,
    run_streams,
    zero_device_pool,
)

CP_WRITE_PATHS = ("write", "catch_up", "all_layer", "early_reservation")


class HeldWriteController(HiCacheController):
    """``write`` only queues while ``hold`` is set, so one ``start_writing`` merges the nodes."""

    hold = False

    def start_writing(self) -> None:
        if not self.hold:
            super().start_writing()


def _nothing_ran(rig: Rig) -> bool:
    return isinstance(rig.device, SimDevice)


# -- one rank, no CP -------------------------------------------------------------------------------
def assert_write_evict_load_round_trip(rig: Rig, *, merged: bool) -> None:
    """write n1, n2 -> ack -> evict_device -> alloc other -> load -> bytes at the new locs."""
    c, page = rig.controller, rig.allocator.page_size
    assert isinstance(c, HeldWriteController)
    nodes = {1: _alloc(rig, 2 * page), 2: _alloc(rig, page)}
    for uid, locs in nodes.items():
        for pool, draft in rig.device_pools():
            fill_node(pool, locs, uid, draft=draft)

    # write n1, n2 -> one merged D2H (or one each) -> one ack row per start_writing
    c.hold = merged
    host: dict[int, torch.Tensor] = {}
    for uid, locs in nodes.items():
        result = c.write(locs, node_id=uid)
        assert isinstance(result, torch.Tensor)
        host[uid] = result
    if merged:
        c.hold = False
        c.start_writing()
    write_rows = [[1, 2]] if merged else [[1], [2]]
    assert ack_rows(c.ack_write_queue) == write_rows
    if _nothing_ran(rig):
        assert not any(ack.finish_event.query() for ack in c.ack_write_queue)

    # run the streams -> every ack finished -> drain
    run_streams(rig.device)
    assert drain_acks(c.ack_write_queue) == write_rows

    # the host copies (target and draft) hold each node's bytes
    for uid in nodes:
        for host_pool, draft in rig.host_pools():
            assert_rows(
                host_pool, host[uid], host_pool.device_pool, uid, draft=draft, where=f"host n{uid}"
            )

    # evict the device copies -> another request takes a page -> wipe the device
    for locs in nodes.values():
        assert c.evict_device(locs) == len(locs)
    other = _alloc(rig, page)
    for pool, _ in rig.device_pools():
        zero_device_pool(pool)

    # load n1, n2 -> new device locations -> one producer slot, one merged load ack
    new: dict[int, torch.Tensor] = {}
    for uid in nodes:
        loaded = c.load(host[uid], node_id=uid)
        assert loaded is not None
        new[uid] = loaded
    assert page_set(new[1], page) != page_set(nodes[1], page)
    assert c.start_loading() == 0
    assert ack_rows(c.ack_load_queue) == [[1, 2]]
    if _nothing_ran(rig):
        assert not c.ack_load_queue[0].finish_event.query()
    run_streams(rig.device)
    assert drain_acks(c.ack_load_queue) == [[1, 2]]

    # every layer and component, target and draft, landed at the NEW locations
    for uid in nodes:
        for pool, draft in rig.device_pools():
            assert_rows(pool, new[uid], pool, uid, draft=draft, where=f"device n{uid}")

    # give everything back -> nothing leaks (INV-05)
    for uid in nodes:
        c.evict_host(host[uid])
        c.evict_device(new[uid])
    c.evict_device(other)
    assert rig.allocator.allocated_page_ids() == set()
    assert rig.host_pool.allocated_pages() == set()


def _alloc(rig: Rig, tokens: int) -> torch.Tensor:
    locs = rig.allocator.alloc(tokens)
    assert locs is not None
    return locs


# -- CP ranks sharing one device -------------------------------------------------------------------
def cp_node_lengths(page_size: int) -> dict[int, int]:
    """n1 ends in a partial page (padded on write); n2 is one page, owned by one rank only."""
    return {1: 2 * page_size + 1 if page_size > 1 else 3, 2: page_size}


def assert_cp_round_trip(rigs: list[Rig], *, path: str) -> None:
    """Every rank writes its owned pages, evicts, load_cp's with new owners-replaying pages."""
    page = rigs[0].allocator.page_size
    lengths = cp_node_lengths(page)

    # identical allocators -> every rank sees the same logical locations
    values = {
        uid: _alloc_on_every_rank(rigs, compute_padded_len(n, page))[:n]
        for uid, n in lengths.items()
    }
    metas = _write_on_every_rank(rigs, values, path=path)

    # every rank, zero-owned ones included, has the same ack rows -> run -> drain
    for rig in rigs:
        assert ack_rows(rig.controller.ack_write_queue) == [[1], [2]]
    run_streams(rigs[0].device)
    for rig in rigs:
        assert drain_acks(rig.controller.ack_write_queue) == [[1], [2]]

    # each rank's host holds exactly the positions it owns (padding positions are not checked)
    for rig, rank_metas in zip(rigs, metas, strict=True):
        for uid, meta in rank_metas.items():
            _assert_cp_host_rows(rig, meta, uid)

    # evict the device copies on every rank -> another request takes a page -> wipe devices
    for rig in rigs:
        for locs in values.values():
            rig.controller.evict_device(locs)
    other = _alloc_on_every_rank(rigs, page)
    for rig in rigs:
        for pool, _ in rig.device_pools():
            zero_device_pool(pool)

    # load_cp n1, n2 on every rank -> same visible locs everywhere -> one merged ack per rank
    visible: dict[int, torch.Tensor] = {}
    for uid, n in lengths.items():
        per_rank = []
        for rig, rank_metas in zip(rigs, metas, strict=True):
            loaded = rig.controller.load_cp([CpNodeView(uid, n, rank_metas[uid])], node_id=uid)
            assert loaded is not None
            per_rank.append(loaded)
        assert all(torch.equal(loaded, per_rank[0]) for loaded in per_rank)
        visible[uid] = per_rank[0]
    assert page_set(visible[1], page) != page_set(values[1], page)
    for rig in rigs:
        rig.controller.start_loading()
        assert ack_rows(rig.controller.ack_load_queue) == [[1, 2]]
    run_streams(rigs[0].device)
    for rig in rigs:
        assert drain_acks(rig.controller.ack_load_queue) == [[1, 2]]

    # every position < valid_len: the owner rank's physical row at the new loc is the original
    cp = len(rigs)
    for uid, locs in visible.items():
        new_owners = torch.remainder(torch.div(locs, page, rounding_mode="floor"), cp)
        old_owners = torch.remainder(torch.div(values[uid], page, rounding_mode="floor"), cp)
        assert torch.equal(new_owners, old_owners)  # owner replay (INV-03)
        for rank, rig in enumerate(rigs):
            layout = rig.cp_layout
            assert layout is not None
            mine = new_owners == rank
            physical = layout.logical_locs_to_physical(locs[mine])
            positions = mine.nonzero(as_tuple=True)[0]
            for pool, draft in rig.device_pools():
                assert_rows(
                    pool,
                    physical,
                    pool,
                    uid,
                    draft=draft,
                    positions=positions,
                    where=f"rank {rank} device n{uid}",
                )

    # evict_cp_host and evict_device on every rank -> nothing leaks
    for rig, rank_metas in zip(rigs, metas, strict=True):
        for uid, meta in rank_metas.items():
            rig.controller.evict_cp_host(meta)
            rig.controller.evict_device(visible[uid])
        assert rig.host_pool.allocated_pages() == set()
        if rig.draft_host_pool is not None:
            assert rig.draft_host_pool.allocated_pages() == set()
        assert rig.allocator.allocated_page_ids() == page_set(other, page)


def _alloc_on_every_rank(rigs: list[Rig], tokens: int) -> torch.Tensor:
    per_rank = [_alloc(rig, tokens) for rig in rigs]
    assert all(torch.equal(locs, per_rank[0]) for locs in per_rank)
    return per_rank[0]


def _owned(rig: Rig, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, physical locs) of ``value`` on pages this rank owns."""
    layout = rig.cp_layout
    assert layout is not None
    mask = layout.owned_by_this_rank(value)
    return mask.nonzero(as_tuple=True)[0], layout.logical_locs_to_physical(value[mask])


def _store(rig: Rig, value: torch.Tensor, uid: int) -> None:
    """The rank's part of a forward store of node ``uid``, every layer (synchronous)."""
    positions, physical = _owned(rig, value)
    for pool, draft in rig.device_pools():
        fill_node(pool, physical, uid, draft=draft, positions=positions)


def _write_on_every_rank(
    rigs: list[Rig], values: dict[int, torch.Tensor], *, path: str
) -> list[dict[int, CpHiCacheNodeMetadata]]:
    metas: list[dict[int, CpHiCacheNodeMetadata]] = [{} for _ in rigs]
    if path == "early_reservation":
        return _write_with_early_reservation(rigs, values)
    for uid, value in values.items():
        for rig, rank_metas in zip(rigs, metas, strict=True):
            _store(rig, value, uid)
            c = rig.controller
            if path == "write":
                result = c.write(value, node_id=uid)
                assert isinstance(result, HiCacheWriteResult)
                assert isinstance(result.metadata, CpHiCacheNodeMetadata)
                rank_metas[uid] = result.metadata
                continue
            reservation = c.reserve_write_cp(value, node_id=uid)
            assert isinstance(reservation, HiCacheWriteReservation)
            if path == "catch_up":
                c.submit_write_cp_per_layer(reservation)
            else:
                c.submit_write_cp_all_layer(reservation)
            rank_metas[uid] = reservation.metadata
    return metas


def _write_with_early_reservation(
    rigs: list[Rig], values: dict[int, torch.Tensor]
) -> list[dict[int, CpHiCacheNodeMetadata]]:
    """Reserve before the forward; each layer's store is followed by the pools' layer-end hook."""
    metas: list[dict[int, CpHiCacheNodeMetadata]] = [{} for _ in rigs]
    for uid, value in values.items():
        for rig, rank_metas in zip(rigs, metas, strict=True):
            reservation = rig.controller.reserve_write_cp(value, node_id=uid)
            assert isinstance(reservation, HiCacheWriteReservation)
            rig.controller.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
            rank_metas[uid] = reservation.metadata
    total = max(pool.layer_num for pool, _ in rigs[0].device_pools())
    for layer in range(total):
        for rig in rigs:
            for pool, draft in rig.device_pools():
                if layer >= pool.layer_num:
                    continue
                for uid, value in values.items():
                    _launch_store(rig, pool, value, uid, layer, draft)
                pool.notify_layer_end(layer)
    return metas


def _launch_store(
    rig: Rig, pool: KVCache, value: torch.Tensor, uid: int, layer: int, draft: bool
) -> None:
    """Queue the rank's store of one layer of node ``uid`` on the current (forward) stream."""
    positions, physical = _owned(rig, value)
    rig.device.launch(
        lambda: fill_node(
            pool, physical, uid, draft=draft, positions=positions, layers=range(layer, layer + 1)
        ),
        label=f"store n{uid} L{layer}",
        kind="kernel",
    )


def _assert_cp_host_rows(rig: Rig, meta: CpHiCacheNodeMetadata, uid: int) -> None:
    keep = meta.owned_positions < meta.logical_len
    positions = meta.owned_positions[keep]
    host_pools = [(rig.host_pool, meta.host_indices, False)]
    if rig.draft_host_pool is not None:
        assert meta.draft_host_indices is not None
        host_pools.append((rig.draft_host_pool, meta.draft_host_indices, True))
    for host_pool, indices, draft in host_pools:
        assert_rows(
            host_pool,
            indices[keep],
            host_pool.device_pool,
            uid,
            draft=draft,
            positions=positions,
            where=f"host n{uid}",
        )
