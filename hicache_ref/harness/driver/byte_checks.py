"""Every byte comparison of the harness, and the poison it writes into free slots.

device rows / host rows (the content oracle's rows for a node, cached) -> ``check_device_bytes``
/ ``check_host_bytes`` (a node's resident copies) -> ``check_rows`` (the one comparison:
``check_bytes_equal`` under the id of the moment, INV-06 at rest, INV-09 at a drain, INV-11 in
a read) -> ``FreeSlotWatch``: poison written by the CPU (not stream-ordered) into slots the
harness's own pools report free, then verified after every step while copies may still run, so
a copy that lands in a freed slot (a D2H after its slots were freed, a stale copy after a
reset) is seen even when no later user of the slot reads it -> ``DeferredReads``: on a GPU a
forward read's rows are gathered on the forward stream and compared once that gather has run
(INV-11), so a read never makes the host wait for the forward stream and the timing windows a
spin opened stay open for the steps after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache_ref.device.protocol import EventT, StreamT
from hicache_ref.harness.driver.node_model import Node
from hicache_ref.harness.driver.rank_geometry import RankGeometry
from hicache_ref.harness.driver.uploads import SideUploads
from hicache_ref.harness.world.content import describe_row, expected_rows, expected_rows_of_layers
from hicache_ref.harness.world.world import World
from hicache_ref.invariants.evidence import Rows
from hicache_ref.invariants.registry import CheckRunner
from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator, pages_to_token_locs
from hicache_ref.pools.host_pool import HostKVCache

SCRIBBLE_ROW_VALUE: dict[str, float] = {"host": 0.75, "device": 0.625}
"""What the harness's CPU writes into free host slots and free device pages: no oracle row is
fractional at its first element, both differ from the tree's freed-page poison
(``FREED_ROW_VALUE``) and from each other, so a stale copy between two poisoned slots still
moves a value that does not belong where it lands."""


BOUNCE_DRAFT_ROW_VALUE = 0.875
"""What the storage driver writes into a fresh bounce buffer's draft rows (a sidecar world):
no draft page is there until L3's is read in (INV-37); distinct from the free-slot scribbles."""


def describe(row: torch.Tensor) -> str:
    value = float(row.reshape(-1)[0])
    for pool, scribble in SCRIBBLE_ROW_VALUE.items():
        if value == scribble:
            return f"the harness's scribble into a free {pool} slot"
    if value == BOUNCE_DRAFT_ROW_VALUE:
        return "the harness's scribble into a fresh bounce buffer's draft rows (no draft page read into it)"
    return describe_row(value)


class ByteChecks:
    """Compares resident copies with the content oracle (counts each comparison per id)."""

    def __init__(self, world: World, geometry: RankGeometry, checks: CheckRunner) -> None:
        self.world = world
        self.geometry = geometry
        self.checks = checks
        self.uploads = SideUploads(world)

    def device_rows(
        self,
        rank: int,
        node: Node,
        draft: bool,
        layer: int,
        component: int,
        row_shape: tuple[int, ...],
    ) -> torch.Tensor:
        """The content oracle's rows for the node's positions on ``rank`` (cached; read only)."""
        positions, _ = self.geometry.placement(rank, node, draft)  # a side pool's own
        key = (rank, draft, layer, component, row_shape)
        rows = node.rows_cache.get(key)
        if rows is None:
            # every layer of this kind at once: the stores of the next layers find them here
            layer_num = self.geometry.layer_num(draft)
            if not 0 <= layer < layer_num:
                return expected_rows(node.handle, draft, layer, component, positions, row_shape)
            block = expected_rows_of_layers(
                node.handle, draft, layer_num, component, positions, row_shape
            )
            for each in range(layer_num):
                node.rows_cache[(rank, draft, each, component, row_shape)] = block[each]
            rows = block[layer]
        return rows

    def staged_rows(
        self, rank: int, node: Node, row_of: tuple[bool, int, int], buf: torch.Tensor
    ) -> torch.Tensor:
        """``device_rows`` on ``buf``'s device, uploaded once per node placement (a store's
        payload: on a GPU an upload inside the launched work would sync the host there)."""
        draft, layer, component = row_of
        rows = self.device_rows(rank, node, draft, layer, component, tuple(buf.shape[1:]))
        if rows.device == buf.device:
            return rows
        key = (rank, draft, layer, component, (-1, *buf.shape[1:]))  # -1: the staged copy
        staged = node.rows_cache.get(key)
        if staged is None:
            staged = node.rows_cache[key] = self._upload(rows, buf.device)
        return staged

    def _upload(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``rows`` on ``device`` without waiting for the current stream (``uploads.py``)."""
        return self.uploads.upload(rows, device)

    def host_rows(
        self,
        rank_index: int,
        node: Node,
        row_of: tuple[bool, int, int],
        positions: torch.Tensor,
        row_shape: tuple[int, ...],
    ) -> torch.Tensor:
        """The oracle's rows at the node's host positions (cached while the harness's recorded
        layout, ``owned_positions``, is the same list; the positions depend on nothing else)."""
        if node.host_rows_of is not node.owned_positions:
            node.host_rows_of, node.host_rows_cache = node.owned_positions, {}
        draft, layer, component = row_of
        key = (rank_index, draft, layer, component, row_shape)
        rows = node.host_rows_cache.get(key)
        if rows is None:
            rows = expected_rows(node.handle, draft, layer, component, positions, row_shape)
            node.host_rows_cache[key] = rows
        return rows

    def check_host_bytes(self, node: Node, inv_id: str, when: str) -> None:
        g = self.geometry
        for rank_index in range(g.num_ranks):
            for draft, layer_num in g.layer_kinds():
                _, host_pool = g.pools(rank_index, draft)
                positions, slots = g.host_positions(rank_index, node, draft)
                for layer in range(layer_num):
                    for c, name in enumerate(host_pool.device_pool.component_names()):
                        actual = host_pool.read_rows(name, layer, slots)
                        rows = self.host_rows(
                            rank_index, node, (draft, layer, c), positions, tuple(actual.shape[1:])
                        )
                        self.check_rows(
                            actual,
                            rows,
                            inv_id,
                            f"{when}: host copy of node {node.handle} "
                            f"{'draft' if draft else 'target'} layer {layer} {name} rank {rank_index}",
                        )

    def check_device_bytes(self, node: Node, inv_id: str, when: str) -> None:
        assert node.value is not None
        g = self.geometry
        for rank_index in range(g.num_ranks):
            for draft, layer_num in g.layer_kinds():
                _, locs = g.placement(rank_index, node, draft)
                pool, _ = g.pools(rank_index, draft)
                for layer in range(min(layer_num, node.layers_stored)):
                    for c, buf in enumerate(pool.layer_buffers(layer)):
                        rows = self.device_rows(
                            rank_index, node, draft, layer, c, tuple(buf.shape[1:])
                        )
                        self.check_rows(
                            buf[locs],
                            rows,
                            inv_id,
                            f"{when}: device copy of node {node.handle} "
                            f"{'draft' if draft else 'target'} layer {layer} component {c} "
                            f"rank {rank_index}",
                        )

    def check_request_bytes(
        self, node: Node, request: torch.Tensor, inv_id: str, when: str
    ) -> None:
        """A request's state slot a load copied the node's state into (``state_cow``): each
        state layer holds the node's state, as its own slot does (the oracle's rows at
        position 0)."""
        pool, _ = self.geometry.pools(0, True)
        slot = request.to(pool.device)
        for layer in range(min(self.geometry.layer_num(True), node.layers_stored)):
            for c, buf in enumerate(pool.layer_buffers(layer)):
                rows = self.device_rows(0, node, True, layer, c, tuple(buf.shape[1:]))
                self.check_rows(
                    buf[slot],
                    rows,
                    inv_id,
                    f"{when}: the request's state slot {request.tolist()} of node {node.handle} "
                    f"layer {layer} component {c}",
                    "the load's copy-on-write transfer left the request's slot without the "
                    "node's state (its slot was not the one the caller allocated)",
                )

    def check_rows(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        inv_id: str,
        where: str,
        fix: str = "bytes moved before their copy landed, or into the wrong slots",
    ) -> None:
        """The rows hold the content oracle's bytes, judged by the registry under the id of the
        moment (INV-06 at rest, INV-09 at a drain, INV-11 at a read, INV-07 / INV-18 in a
        poisoned free slot)."""
        if (
            actual.device != expected.device
        ):  # a GPU world: the content oracle's rows are on the CPU
            actual = actual.to(expected.device)
        self.checks.run(inv_id, Rows(actual, expected, where, describe, fix))


@dataclass
class _Watched:
    """Free pages of one pool of one rank that hold the scribble until they are handed out."""

    rank: int
    pool: str  # "device" | "host"
    draft: bool
    pages: set[int]
    inv_id: str
    why: str  # what a changed byte means, and the fix
    locs: torch.Tensor | None = None  # the slots of ``pages`` (rebuilt when pages shrink)
    slots: str = ""  # the first of ``locs``, as a message names them
    poison: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(default_factory=dict)


class FreeSlotWatch:
    """Poison free slots from the CPU, then verify them while copies may still land there:
    after ``scribble_free_host`` a D2H landing in a freed host slot is INV-07, after
    ``reset_in_flight`` a copy landing after the reset is INV-18 (the id each watch carries).

    A watched page leaves the watch once its pool hands it out (its new owner writes it). The
    watch lasts until every copy queued when the poison was written has run: a marker event
    recorded then on each rank's write and load stream (the horizon); one more verification
    after the horizon passed ends it.
    """

    def __init__(self, world: World, geometry: RankGeometry, bytes_: ByteChecks) -> None:
        self.world = world
        self.geometry = geometry
        self.bytes = bytes_
        self.watched: list[_Watched] = []
        self.horizon: list[EventT] = []

    @property
    def active(self) -> bool:
        return bool(self.watched)

    def clear(self) -> None:
        self.watched, self.horizon = [], []

    # -- which pages are free (the harness's own pools) ----------------------------------------
    def _free_pages(self, rank: int, pool: str, draft: bool) -> set[int]:
        if pool == "device":
            return set(self._allocator(rank, draft).free_page_ids())
        host = self._host_pool(rank, draft)
        return set(range(host.num_pages)) - host.allocated_pages()

    def _allocator(self, rank: int, draft: bool) -> PagedTokenToKVPoolAllocator:
        """The allocator of a pool's device rows: an independent side pool has its own."""
        r = self.world.ranks[rank]
        if draft and r.side_allocator is not None:
            return r.side_allocator
        return r.allocator

    def _host_pool(self, rank: int, draft: bool) -> HostKVCache:
        r = self.world.ranks[rank]
        config = self.world.config
        if draft and (config.uses_cp or config.has_side_pools):
            assert r.draft_host_pool is not None
            return r.draft_host_pool  # outside CP the draft host copy mirrors the target slots
        return r.host_pool

    def _still_free(self, watched: _Watched) -> set[int]:
        if watched.pool == "device":
            allocator = self._allocator(watched.rank, watched.draft)
            return {p for p in watched.pages if allocator.is_page_free(p)}
        host = self._host_pool(watched.rank, watched.draft)
        return {p for p in watched.pages if host.is_page_free(p)}

    def _rows_of(self, watched: _Watched, locs: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(what, rows) of every layer and component at ``locs`` of the watched pool."""
        device_pool, host_pool = self.geometry.pools(watched.rank, watched.draft)
        out: list[tuple[str, torch.Tensor]] = []
        kind = "draft " if watched.draft else ""
        if watched.pool == "device":
            physical = self.geometry.owned_physical(watched.rank, locs)
            for layer in range(device_pool.layer_num):
                for c, buf in enumerate(device_pool.layer_buffers(layer)):
                    out.append((f"free {kind}device locs layer {layer} c{c}", buf[physical]))
            return out
        for layer in range(device_pool.layer_num):
            for name in host_pool.device_pool.component_names():
                rows = host_pool.read_rows(name, layer, locs)
                out.append((f"free {kind}host slots layer {layer} {name}", rows))
        return out

    # -- poison ---------------------------------------------------------------------------------
    def poison_free(self, pool: str, inv_id: str, why: str) -> int:
        """Write the scribble into every free page of ``pool`` on every rank, from the CPU;
        returns the number of slots written."""
        written = 0
        for rank in range(self.geometry.num_ranks):
            for draft, _ in self.geometry.layer_kinds():
                pages = self._free_pages(rank, pool, draft)
                if not pages:
                    continue
                locs = pages_to_token_locs(sorted(pages), self.geometry.page_size(draft))
                device_pool, host_pool = self.geometry.pools(rank, draft)
                for layer in range(device_pool.layer_num):
                    if pool == "device":
                        physical = self.geometry.owned_physical(rank, locs)
                        for buf in device_pool.layer_buffers(layer):
                            buf[physical] = SCRIBBLE_ROW_VALUE[pool]
                        continue
                    for name in host_pool.device_pool.component_names():
                        rows = host_pool.read_rows(name, layer, locs)
                        host_pool.write_rows(
                            name, layer, locs, torch.full_like(rows, SCRIBBLE_ROW_VALUE[pool])
                        )
                written += len(locs)
                self.watched.append(_Watched(rank, pool, draft, pages, inv_id, why))
        self._record_horizon()
        return written

    def _record_horizon(self) -> None:
        """A marker after every copy queued now, on each rank's write and load stream."""
        self.horizon = []
        for rank in self.world.ranks:
            for stream in (rank.controller.write_stream, rank.controller.load_stream):
                marker = self.world.device.Event()
                marker.record(stream)
                self.horizon.append(marker)

    # -- verify ---------------------------------------------------------------------------------
    def verify(self) -> None:
        """Every watched page still free holds the scribble; handed-out pages leave the watch."""
        passed = all(marker.query() for marker in self.horizon)
        for watched in self.watched:
            still_free = self._still_free(watched)
            if still_free != watched.pages or watched.locs is None:
                watched.pages = still_free
                page = self.geometry.page_size(watched.draft)  # a state pool's: one slot
                watched.locs = pages_to_token_locs(sorted(still_free), page)
                watched.slots = str(watched.locs.tolist()[:16])
                watched.poison = {}
            if not watched.pages:
                continue
            locs = watched.locs
            scribble = SCRIBBLE_ROW_VALUE[watched.pool]
            for where, rows in self._rows_of(watched, locs):
                # the poison rows are built once per shape while the watched slots stay
                key = (tuple(rows.shape), rows.dtype)
                poison = watched.poison.get(key)
                if poison is None:
                    poison = watched.poison[key] = torch.full_like(rows, scribble, device="cpu")
                self.bytes.check_rows(
                    rows,
                    poison,
                    watched.inv_id,
                    f"rank {watched.rank}: {where} (slots {watched.slots})",
                    fix=watched.why,
                )
        self.watched = [w for w in self.watched if w.pages and not passed]
        if not self.watched:
            self.horizon = []


@dataclass
class _PendingRead:
    actual: torch.Tensor  # the rows as the forward stream read them (on the device)
    expected: torch.Tensor  # the content oracle's rows (CPU)
    where: str
    gathered: EventT  # recorded on the forward stream right after the gather


class DeferredReads:
    """Forward reads on a GPU, compared once their gather has run (INV-11).

    ``defer`` takes rows just gathered on the current (forward) stream, so they are exactly what
    the forward pass reads there, in stream order, and records an event behind the gather;
    ``collect`` compares every read whose event has passed (all of them, waiting, with
    ``wait=True``: at quiescence). The copy to the host runs on a side stream once the gather
    is done, so no read makes the host wait for work queued on the forward stream after it.
    """

    def __init__(self, world: World, bytes_: ByteChecks) -> None:
        self.world = world
        self.bytes = bytes_
        self.pending: list[_PendingRead] = []
        self._side: StreamT | None = None

    def clear(self) -> None:
        self.pending = []

    def defer(self, actual: torch.Tensor, expected: torch.Tensor, where: str) -> None:
        gathered = self.world.device.Event()
        gathered.record()
        self.pending.append(_PendingRead(actual, expected, where, gathered))

    def collect(self, *, wait: bool = False) -> None:
        """Compare the reads whose gather has run (every read, waiting for it, when ``wait``)."""
        if not self.pending:
            return
        ready: list[_PendingRead] = []
        waiting: list[_PendingRead] = []
        for read in self.pending:  # one query per read: an event may pass between two
            (ready if wait or read.gathered.query() else waiting).append(read)
        self.pending = waiting
        if self._side is None:
            self._side = self.world.device.Stream()
        for read in ready:
            read.gathered.synchronize()  # at once unless ``wait``: the event had passed
            with self.world.device.stream(self._side):
                actual = read.actual.to(read.expected.device)
            self.bytes.check_rows(actual, read.expected, "INV-11", read.where)
