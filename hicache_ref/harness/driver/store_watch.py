"""The store watch: on the simulator, which device rows hold no stored KV, and whether a backup
copy read any of them (INV-12).

A freed page is filled with the harness's poison on the forward stream (``tree.py``: what reuse
does to it). From then on, per rank, pool and layer, its rows hold no KV until a KV store of that
layer (the tree's forward) or a load (an H2D copy) writes them. The watch follows the device's
executions in order:

poison ran -> rows unstored -> a store or an H2D ran -> rows stored again; a D2H ran -> the rows
it read must be stored, else the copy backed up a layer before its store (INV-12: the write
stream did not wait for the layer's event on the forward stream).

Only rows a node being backed up holds are judged (``backing_up``: the tree's placement of each
such node), so a padding row a longer node once poisoned is never mistaken for an unstored one;
rows never written at all (a page fresh from the allocator) are not tracked. On a GPU nothing is
watched: executions are not observable there one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from hicache_ref.device.sim import ExecutedOp, SimDevice
from hicache_ref.harness.world.world import COPY_POOL_TAG, COPY_RANK_TAG, World
from hicache_ref.invariants.evidence import BackupRead

if TYPE_CHECKING:
    from hicache_ref.invariants.registry import CheckRunner

RowKey = tuple[int, str, int]
"""(rank, pool, layer): one layer's rows of one rank's target or draft device pool."""


class StoreWatch:
    """Tracks poisoned device rows per rank, pool and layer; judges every executed D2H."""

    def __init__(
        self,
        world: World,
        checks: CheckRunner,
        backing_up: Callable[[int, str], Mapping[int, set[int]]],
    ) -> None:
        self.checks = checks
        self.backing_up = backing_up  # (rank, pool) -> {handle: device rows} being backed up
        self.unstored: dict[RowKey, set[int]] = {}
        self.active = isinstance(world.device, SimDevice)
        if isinstance(world.device, SimDevice):
            world.device.on_execute.append(self._on_execute)

    # -- what the tree's kernels did when they ran ---------------------------------------------------
    def poisoned(self, rank: int, pools: Iterable[tuple[str, int]], locs: list[int]) -> None:
        """The reuse poison ran over ``locs`` of every layer of these (pool, layer_num)."""
        for pool, layer_num in pools:
            for layer in range(layer_num):
                self.unstored.setdefault((rank, pool, layer), set()).update(locs)

    def stored(self, rank: int, pool: str, layer: int, locs: list[int]) -> None:
        """A KV store of ``layer`` ran over ``locs``."""
        rows = self.unstored.get((rank, pool, layer))
        if rows:
            rows.difference_update(locs)

    def clear(self) -> None:
        self.unstored.clear()

    # -- the implementation's copies ------------------------------------------------------------
    def _on_execute(self, entry: ExecutedOp) -> None:
        meta = entry.meta
        if entry.kind != "copy" or COPY_RANK_TAG not in meta:
            return
        rank, pool = int(meta[COPY_RANK_TAG]), str(meta[COPY_POOL_TAG])  # type: ignore[call-overload]
        locs = _ints(meta["device_indices"])
        layers: tuple[int, ...] = meta["layer_ids"]  # type: ignore[assignment]
        for layer in layers:
            rows = self.unstored.get((rank, pool, layer))
            if meta["direction"] == "h2d":
                if rows:
                    rows.difference_update(locs)  # a load writes the rows: they hold KV again
                continue
            # Verify the D2H read no row of a node being backed up that no KV store has written
            # since it was poisoned
            unread: list[int] = []
            nodes: list[int] = []
            if rows:
                read = rows.intersection(locs)
                for handle, held in self.backing_up(rank, pool).items() if read else ():
                    if read & held:
                        nodes.append(handle)
                        unread.extend(sorted(read & held))
            self.checks.run("INV-12", BackupRead(tuple(nodes), layer, pool, tuple(unread)))


def _ints(indices: object) -> list[int]:
    values = indices.tolist() if hasattr(indices, "tolist") else indices
    assert isinstance(values, list | tuple), f"copy indices of type {type(indices).__name__}"
    return [int(v) for v in values]
