"""The tree's model of its radix nodes: one ``Node`` per handle, and the pages each one holds.

A node's lifecycle (specs/protocol.md): computing -> device -> backing_up -> backed_up ->
evicted (host only) -> loading -> backed_up; a node never backed up can be dropped. The driver
(``tree.py``) moves nodes along it; ``compute_holdings`` turns one node into the plain
``NodeHoldings`` the session's checks read (``invariants/snapshot.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import torch

from hicache_ref.harness.adapters.base import CpMetadataLike, WriteReservationLike
from hicache_ref.invariants.snapshot import NodeHoldings
from hicache_ref.pools.page_index import get_small_cpu_values

FORWARD_META = "forward"
"""The meta key of the tree's forward kernels (a ``ForwardKernel``)."""


@dataclass(frozen=True)
class ForwardKernel:
    """What a forward kernel the tree launches is: a store or read of one layer of one node."""

    kind: Literal["store", "read"]
    handle: int
    layer: int


@dataclass
class Node:
    handle: int
    node_id: int
    logical_len: int
    value: torch.Tensor | None  # logical device locs [:logical_len], identical on every rank
    layers_stored: int = 0
    backup: str = "none"  # none | in_flight | done
    host_value: list[torch.Tensor | None] = field(default_factory=list)  # non-CP, per rank
    cp_meta: list[CpMetadataLike | None] = field(default_factory=list)  # CP, per rank
    reservations: list[WriteReservationLike] = field(default_factory=list)  # CP, per rank
    # recorded by the harness at write time, from its own CP layout (never the metadata's):
    page_owners: list[int] = field(default_factory=list)  # owner rank of each padded page
    owned_positions: list[torch.Tensor] = field(default_factory=list)  # per rank, padded span
    # an independent side pool (``config.has_side_pools``): the node's rows there, chosen by
    # the tree from the side allocator (or, on a load, by the controller from it), and the host
    # slots the controller resolved for them, per rank
    side_value: torch.Tensor | None = None
    side_host: list[torch.Tensor | None] = field(default_factory=list)
    side_placement: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False
    )  # (side_value it was computed from, positions, rows on the pools' device)
    # a Mamba world with ``state_cow``: the request's state slot a load also copies the node's
    # state into (allocated by the tree before the load, freed once the load is drained)
    side_request: torch.Tensor | None = None
    loading: bool = False
    producer_id: int | None = None
    pending_reads: int = 0
    # caches of what the harness derives from ``value`` (rebuilt when ``value`` is replaced)
    placement_of: torch.Tensor | None = field(default=None, repr=False)
    placement: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )  # rank -> (owned positions, physical locs)
    rows_positions: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    rows_cache: dict[tuple[int, bool, int, int, tuple[int, ...]], torch.Tensor] = field(
        default_factory=dict, repr=False
    )  # (rank, draft, layer, component, row shape) -> the oracle's rows at ``rows_positions``
    host_rows_of: list[torch.Tensor] | None = field(default=None, repr=False)
    host_rows_cache: dict[tuple[int, bool, int, int, tuple[int, ...]], torch.Tensor] = field(
        default_factory=dict, repr=False
    )  # the same key -> the oracle's rows at the host positions of ``owned_positions``
    holdings_key: tuple[object, ...] | None = field(default=None, repr=False)
    holdings: NodeHoldings | None = field(default=None, repr=False)

    @property
    def on_device(self) -> bool:
        return self.value is not None


@dataclass
class CpNodeView:
    """What ``load_cp`` reads from a node (id, host_len, cp_hicache) for one rank."""

    id: int
    host_len: int
    cp_hicache: CpMetadataLike


def handle_of(node: Node) -> int:
    return node.handle


def _same(cached: object, now: object) -> bool:
    """A cache key part unchanged: the same tensor object, or an equal plain value."""
    return cached is now or (not isinstance(now, torch.Tensor) and cached == now)


def compute_busy(node: Node) -> str:
    """Why the node's device pages must stay allocated now ("" when nothing is in flight)."""
    if node.loading:
        return "loading"
    if node.pending_reads:
        return "forward reads queued"
    return "backup in flight" if node.backup == "in_flight" and node.value is not None else ""


def compute_holdings(
    node: Node, page: int, num_ranks: int, uses_cp: bool, side_page: int | None = None
) -> NodeHoldings:
    """One node's pages, rebuilt only when a tensor it reads (or its backup) changed;
    ``side_page``: the page size of an independent side pool's allocator and host pool (one
    slot in a Mamba state pool; the anchor's ``page`` when None)."""
    side_page = page if side_page is None else side_page
    if uses_cp:
        metas = node.cp_meta or [None] * num_ranks
        host_of = [meta.host_indices if meta else None for meta in metas]
        draft_of = [meta.draft_host_indices if meta else None for meta in metas]
    else:
        host_of = list(node.host_value)
        draft_of = list(node.side_host)  # an independent side pool's own slots, else none
    busy = compute_busy(node)
    side = node.side_value
    request = node.side_request  # a load's copy-on-write state slot, held until drained
    key = (node.value, side, request, node.backup, node.layers_stored, busy, *host_of, *draft_of)
    if node.holdings is not None and _is_same_key(node.holdings_key, key):
        return node.holdings
    device = pages_covered(node.value, page) if node.value is not None else frozenset()
    host = tuple(pages_covered(t, page) if t is not None else frozenset() for t in host_of)
    if draft_of:
        draft_page = page if uses_cp else side_page  # a CP draft pool pages like the anchor
        draft = tuple(
            pages_covered(t, draft_page) if t is not None else frozenset() for t in draft_of
        )
    else:
        draft = tuple(frozenset() for _ in range(num_ranks))
    side_pages = pages_covered(side, side_page) if side is not None else frozenset()
    if request is not None:
        side_pages |= pages_covered(request, side_page)
    node.holdings = NodeHoldings(
        node.handle,
        node.node_id,
        device,
        host,
        draft,
        node.backup,
        node.layers_stored,
        busy,
        side_pages,
    )
    node.holdings_key = key
    return node.holdings


def _is_same_key(cached: tuple[object, ...] | None, key: tuple[object, ...]) -> bool:
    """Whether every part of ``cached`` is ``_same`` as in ``key`` (a plain loop: the model is
    asked for every node after every step)."""
    if cached is None or len(cached) != len(key):
        return False
    for a, b in zip(cached, key, strict=True):
        if a is not b and (isinstance(b, torch.Tensor) or a != b):  # ``_same``, inlined
            return False
    return True


PAGES_CACHE_MAX = 4096


@functools.lru_cache(maxsize=PAGES_CACHE_MAX)
def pages_covered(indices: torch.Tensor, page: int) -> frozenset[int]:
    """The pages an index tensor covers (cached per tensor: node tensors never change; a tensor
    hashes by identity, and the cache holds it, so its identity stays its own)."""
    values = get_small_cpu_values(indices)
    if values is not None:
        return frozenset(value // page for value in values)
    return frozenset(torch.unique(indices // page).tolist())
