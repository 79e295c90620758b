"""Small worlds for the controller tests: pools, allocators, controllers and row checks.

A ``Rig`` is one rank: a device pool, its allocator, a host pool, optional draft pools and the
controller under test. ``build_cp_rigs`` builds one rig per CP rank on one shared device, with
identical allocators (same policy and seed), so every rank hands out the same logical pages; each
rank's device pool is physical (it holds only the pages that rank owns).

Row contents come from ``harness.content.expected_rows``: a row's value encodes (node content id,
target or draft, layer, component, position), so a misplaced row names where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.device import DeviceModule, SimDevice, SimStream
from hicache_ref.device.sim import SimDeadlock
from hicache_ref.harness.world.content import HARNESS_DTYPE, describe_row, expected_rows
from hicache_ref.invariants.models import CpHiCacheNodeMetadata
from hicache_ref.pools import (
    CpSharedKVLayout,
    HostKVCache,
    HybridLinearKVPool,
    KVCache,
    MHATokenToKVPool,
    MLATokenToKVPool,
    NSATokenToKVPool,
    PagedTokenToKVPoolAllocator,
    interleaved_layer_ids,
    make_host_pool,
)

POOL_KINDS = ("mha", "mla", "nsa")
LEGAL_PAIRS = [
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
]
ATTACH_MODES = ("constructor", "attach_draft_pool", "set_draft_kv_pool")
TARGET_LAYERS = 3


class RowStore(Protocol):
    """What a device or host pool offers a checker: its components, layers and rows."""

    layer_num: int

    def component_names(self) -> tuple[str, ...]: ...

    def read_rows(
        self, component: str, layer_id: int, indices: torch.Tensor, /
    ) -> torch.Tensor: ...


def make_device_pool(
    kind: str, device: DeviceModule, *, size_tokens: int, page_size: int, layer_num: int
) -> KVCache:
    """A tiny float64 device pool of ``kind`` (mha / mla / nsa, nsa with its index sidecar)."""
    if kind == "mha":
        return MHATokenToKVPool(size_tokens, page_size, HARNESS_DTYPE, 2, 2, layer_num, device)
    if kind == "mla":
        return MLATokenToKVPool(size_tokens, page_size, HARNESS_DTYPE, 3, 1, layer_num, device)
    return NSATokenToKVPool(
        size_tokens, page_size, HARNESS_DTYPE, 3, 1, layer_num, device, index_head_dim=2
    )


@dataclass
class Rig:
    """One rank: pools, allocator and the controller under test."""

    device: DeviceModule
    device_pool: KVCache
    allocator: PagedTokenToKVPoolAllocator
    host_pool: HostKVCache
    controller: HiCacheController
    draft_device_pool: KVCache | None = None
    draft_host_pool: HostKVCache | None = None
    cp_layout: CpSharedKVLayout | None = None
    hybrid_pool: HybridLinearKVPool | None = None
    """With ``hybrid=True``: what the allocator hands the controller (``device_pool`` is its
    ``full_kv_pool``, where the transfers land)."""

    def device_pools(self) -> list[tuple[KVCache, bool]]:
        """(pool, is_draft) for the target and, when attached, the draft device pool."""
        pools = [(self.device_pool, False)]
        if self.draft_device_pool is not None:
            pools.append((self.draft_device_pool, True))
        return pools

    def host_pools(self) -> list[tuple[HostKVCache, bool]]:
        pools = [(self.host_pool, False)]
        if self.draft_host_pool is not None:
            pools.append((self.draft_host_pool, True))
        return pools


def build_rig(
    device: DeviceModule,
    *,
    kind: str = "mha",
    layout: str = "layer_first",
    io_backend: str = "direct",
    page_size: int = 4,
    layer_num: int = TARGET_LAYERS,
    draft_layer_num: int | None = None,
    attach: str = "constructor",
    device_pages: int = 16,
    host_pages: int = 16,
    draft_host_pages: int | None = None,
    alloc_policy: str = "fifo",
    host_alloc_policy: str = "random",
    seed: int = 0,
    num_counters: int = 5,
    cp_layout: CpSharedKVLayout | None = None,
    controller_class: type[HiCacheController] = HiCacheController,
    hybrid: bool = False,
    copy_path: str = "auto",
) -> Rig:
    """One rank's pools and controller; under CP the device pool is physical; ``copy_path``:
    the host pools' (``make_host_pool``).

    ``hybrid=True`` wraps the device pool as the ``full_kv_pool`` of a ``HybridLinearKVPool``
    (``hybrid_layer_ids``: a linear-attention layer before each full one) and gives the hybrid
    pool to the allocator, as a hybrid model's scheduler does.
    """
    logical_tokens = device_pages * page_size
    physical_tokens = logical_tokens
    if cp_layout is not None:
        # logical page p lives on physical page p // cp_size of its owner (page 0 reserved)
        physical_tokens = (device_pages // cp_layout.cp_size + 1) * page_size
    device_pool = make_device_pool(
        kind, device, size_tokens=physical_tokens, page_size=page_size, layer_num=layer_num
    )
    hybrid_pool = None
    if hybrid:
        hybrid_pool = HybridLinearKVPool(device_pool, *hybrid_layer_ids(layer_num))
    allocator = PagedTokenToKVPoolAllocator(
        logical_tokens,
        page_size,
        HARNESS_DTYPE,
        device.device,
        device_pool if hybrid_pool is None else hybrid_pool,
        alloc_policy=alloc_policy,
        seed=seed,
        cp_layout=cp_layout,
    )
    host_pool = make_host_pool(
        device_pool,
        layout=layout,
        size_tokens=host_pages * page_size,
        alloc_policy=host_alloc_policy,
        seed=seed + 1,
        copy_path=copy_path,
    )
    draft_device_pool = draft_host_pool = None
    if draft_layer_num is not None:
        draft_device_pool = make_device_pool(
            kind,
            device,
            size_tokens=physical_tokens,
            page_size=page_size,
            layer_num=draft_layer_num,
        )
        pages = host_pages if draft_host_pages is None else draft_host_pages
        draft_host_pool = make_host_pool(
            draft_device_pool,
            layout=layout,
            size_tokens=pages * page_size,
            alloc_policy=host_alloc_policy,
            seed=seed + 2,
            copy_path=copy_path,
        )
    at_construction = attach == "constructor"
    controller = controller_class(
        allocator,
        host_pool,
        page_size,
        write_policy="write_through",
        io_backend=io_backend,
        cp_shared_kv_layout=cp_layout,
        draft_mem_pool_host=draft_host_pool if at_construction else None,
        draft_mem_pool_device=draft_device_pool if at_construction else None,
        device_module=device,
        num_counters=num_counters,
    )
    if draft_device_pool is not None and draft_host_pool is not None:
        if attach == "attach_draft_pool":
            controller.attach_draft_pool(draft_device_pool, draft_host_pool)
        elif attach == "set_draft_kv_pool":
            controller.set_draft_kv_pool(draft_device_pool, draft_host_pool)
    return Rig(
        device,
        device_pool,
        allocator,
        host_pool,
        controller,
        draft_device_pool,
        draft_host_pool,
        cp_layout,
        hybrid_pool,
    )


def hybrid_layer_ids(full_layers: int) -> tuple[list[int], list[int]]:
    """(full, linear) model layer ids: model layer 2i is linear, 2i + 1 is full-attention i."""
    return interleaved_layer_ids(full_layers)


def build_cp_rigs(
    device: DeviceModule, cp_size: int, *, page_size: int, **kwargs: Any
) -> list[Rig]:
    """One NSA rig per CP rank on one shared device, with identical allocators."""
    return [
        build_rig(
            device,
            kind="nsa",
            page_size=page_size,
            cp_layout=CpSharedKVLayout(cp_size, rank, page_size),
            **kwargs,
        )
        for rank in range(cp_size)
    ]


# -- row contents ----------------------------------------------------------------------------------
def node_rows(
    pool: KVCache, uid: int, draft: bool, layer: int, component: str, positions: torch.Tensor
) -> torch.Tensor:
    """The rows node ``uid`` holds at ``positions`` (see ``harness.content``)."""
    index = pool.component_names().index(component)
    row_shape = pool.component_row_shapes()[component]
    return expected_rows(uid, draft, layer, index, positions, row_shape)


def fill_node(
    pool: KVCache,
    locs: torch.Tensor,
    uid: int,
    *,
    draft: bool = False,
    positions: torch.Tensor | None = None,
    layers: range | None = None,
) -> None:
    """Write node ``uid``'s rows at ``locs`` in every component of ``layers`` (synchronously)."""
    positions = torch.arange(len(locs)) if positions is None else positions
    for layer in layers if layers is not None else range(pool.layer_num):
        for component in pool.component_names():
            rows = node_rows(pool, uid, draft, layer, component, positions)
            pool.write_rows(component, layer, locs, rows)


def zero_device_pool(pool: KVCache) -> None:
    """Every row of every layer and component becomes 0 (never a node's value)."""
    for layer in range(pool.layer_num):
        for component in pool.component_names():
            pool.component_buffer(component, layer).zero_()


def assert_rows(
    store: RowStore,
    indices: torch.Tensor,
    expected_pool: KVCache,
    uid: int,
    *,
    draft: bool = False,
    positions: torch.Tensor | None = None,
    where: str = "",
) -> None:
    """Rows ``indices`` of ``store`` hold node ``uid``'s bytes in every layer and component."""
    positions = torch.arange(len(indices)) if positions is None else positions
    for layer in range(store.layer_num):
        for component in store.component_names():
            actual = store.read_rows(component, layer, indices)
            expected = node_rows(expected_pool, uid, draft, layer, component, positions)
            assert_bytes_equal(actual, expected, f"{where} layer {layer} {component}")


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    """Bitwise equality; on a mismatch name the first bad row and what it holds instead."""
    assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
    if actual.numel() == 0 or bool(torch.equal(actual, expected)):
        return
    flat_actual, flat_expected = actual.flatten(1), expected.flatten(1)
    row = int((flat_actual != flat_expected).any(dim=1).nonzero()[0, 0])
    got, want = float(flat_actual[row, 0]), float(flat_expected[row, 0])
    raise AssertionError(
        f"{where}: row {row} holds {describe_row(got)}, expected {describe_row(want)}"
    )


# -- streams and acks ------------------------------------------------------------------------------
def run_streams(device: DeviceModule) -> None:
    """Let every queued transfer land (the simulator runs its queues; CUDA synchronizes)."""
    if isinstance(device, SimDevice):
        device.run_until_idle()
    else:
        device.synchronize()


def run_first(device: SimDevice, first: SimStream) -> None:
    """Adversarial schedule: ``first`` runs whenever it can; others only when it is blocked."""
    while not device.is_idle():
        if device.advance(first, 1):
            continue
        others = [s for s in device.runnable_streams() if s is not first]
        if not others:
            raise SimDeadlock(f"nothing can run while {first.name} is blocked")
        device.advance(others[0], 1)


def ack_rows(queue: list[Any]) -> list[list[int]]:
    return [list(ack.node_ids) for ack in queue]


def drain_acks(queue: list[Any]) -> list[list[int]]:
    """Drain a fully completed ack queue (what writing_check/loading_check do); its rows."""
    # Verify every ack's transfer landed before it is drained (INV-09)
    assert all(ack.finish_event.query() for ack in queue), "an ack is drained before it finished"
    rows = ack_rows(queue)
    queue.clear()
    return rows


@dataclass(frozen=True)
class Snapshot:
    """Which device pages and host pages are handed out (for "a refusal changes nothing")."""

    free_device_pages: tuple[int, ...]
    allocated_device_pages: frozenset[int]
    host_pages: frozenset[int]
    draft_host_pages: frozenset[int]
    queued: tuple[int, int, int, int, int, int]


def snapshot(rig: Rig) -> Snapshot:
    c = rig.controller
    draft = rig.draft_host_pool
    return Snapshot(
        tuple(rig.allocator.free_page_ids()),
        frozenset(rig.allocator.allocated_page_ids()),
        frozenset(rig.host_pool.allocated_pages()),
        frozenset(draft.allocated_pages()) if draft is not None else frozenset(),
        (
            len(c.write_queue),
            len(c.load_queue),
            len(c.draft_write_queue),
            len(c.draft_load_queue),
            len(c.ack_write_queue),
            len(c.ack_load_queue),
        ),
    )


def page_set(locs: torch.Tensor, page_size: int) -> set[int]:
    return {int(p) for p in torch.div(locs, page_size, rounding_mode="floor").tolist()}


@dataclass
class CpNodeView:
    """What ``load_cp`` reads from a radix node."""

    id: int
    host_len: int
    cp_hicache: CpHiCacheNodeMetadata | None
