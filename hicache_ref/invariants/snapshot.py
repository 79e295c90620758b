"""Plain data the harness checks: what one rank looks like now, and what the harness knows.

A ``RankSnapshot`` is read once per step per rank (``harness/adapters/base.snapshot_rank``):
the implementation's ack queues as node-id rows with their finished flags, and the pages the
HARNESS's own pools report allocated (the pools are our code handed to the implementation, so
a controller cannot misreport them). A ``HarnessModel`` is what the tree driver recorded about
its nodes: which pages each node holds on each rank. The checks of ``invariants/registry.py``
read only these two, so any implementation is checked the same way and none is trusted.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class AckRow:
    """One undrained ack: its node ids and whether its finish event has completed."""

    node_ids: tuple[int, ...]
    finished: bool


@dataclass(frozen=True)
class RankSnapshot:
    """One rank, read without trusting the implementation's own bookkeeping of pages."""

    rank: int
    write_acks: tuple[AckRow, ...]
    load_acks: tuple[AckRow, ...]
    device_pages: frozenset[int]  # logical pages the rank's allocator reports allocated
    host_pages: frozenset[int]  # pages the rank's host pool reports allocated
    draft_host_pages: frozenset[int] | None  # None: no separately accounted draft host pool
    pending_layer_writes: frozenset[int]  # node ids; empty when the implementation has none
    producer_slots: int  # num_counters of the implementation's layer counter
    producer_index: int = -1
    consumer_indices: tuple[int, ...] = ()
    gate_answers: tuple[tuple[int, bool], ...] | None = None
    """``node_has_undrained_write_ack(id)`` for the model's node ids; None without a gate."""
    side_device_pages: frozenset[int] | None = None
    """Pages an independent side pool's own device allocator reports allocated (None: none)."""

    # cached: several checks read the rows of one snapshot per step (callers never mutate them)
    @cached_property
    def write_rows(self) -> list[list[int]]:
        return [list(ack.node_ids) for ack in self.write_acks]

    @cached_property
    def load_rows(self) -> list[list[int]]:
        return [list(ack.node_ids) for ack in self.load_acks]

    def same_state(self, other: RankSnapshot, exclude: Collection[str] = ()) -> bool:
        """Whether ``other`` has the same ``parts`` (a fast comparison of the raw fields)."""
        return (
            [a.node_ids for a in self.write_acks] == [a.node_ids for a in other.write_acks]
            and [a.node_ids for a in self.load_acks] == [a.node_ids for a in other.load_acks]
            and ("device pages" in exclude or self.device_pages == other.device_pages)
            and self.host_pages == other.host_pages
            and self.draft_host_pages == other.draft_host_pages
            and self.side_device_pages == other.side_device_pages
            and self.pending_layer_writes == other.pending_layer_writes
        )

    def parts(self, exclude: Collection[str] = ()) -> dict[str, object]:
        """The state a refused operation must leave as it was (INV-17), by name."""
        parts: dict[str, object] = {
            "write ack rows": self.write_rows,
            "load ack rows": self.load_rows,
            "device pages": sorted(self.device_pages),
            "host pages": sorted(self.host_pages),
            "draft host pages": None
            if self.draft_host_pages is None
            else sorted(self.draft_host_pages),
            "pending layer writes": sorted(self.pending_layer_writes),
        }
        if self.side_device_pages is not None:  # an independent side pool's own allocator
            parts["side device pages"] = sorted(self.side_device_pages)
        return {name: value for name, value in parts.items() if name not in exclude}


@dataclass(frozen=True)
class NodeHoldings:
    """The pages the harness recorded for one tree node (per rank where they differ)."""

    handle: int
    node_id: int
    device_pages: frozenset[int]  # logical pages, identical on every rank
    host_pages: tuple[frozenset[int], ...]  # per rank
    draft_host_pages: tuple[frozenset[int], ...]  # per rank (CP draft or side host pool only)
    backup: str  # none | in_flight | done
    layers_stored: int = 0  # layers of the forward the tree has stored (target and draft alike)
    busy: str = ""  # why its device pages must stay allocated now ("": nothing in flight)
    side_device_pages: frozenset[int] = frozenset()  # its rows' pages in a side pool's allocator


@dataclass(frozen=True)
class HarnessModel:
    """What the harness itself knows: its configuration and its nodes' holdings."""

    num_counters: int
    nodes: tuple[NodeHoldings, ...]
    allow_lag: bool = False  # the harness drives all ranks in lockstep: no rank may lag
    layer_num: int = 1
    draft_layer_num: int = 0

    @property
    def total_layers(self) -> int:
        return max(self.layer_num, self.draft_layer_num)

    @property
    def node_ids(self) -> list[int]:
        return [node.node_id for node in self.nodes]
