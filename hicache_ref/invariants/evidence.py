"""What the harness hands an invariant's checker: one small record per kind of evidence.

A registered checker (``registry.check_inv_NN_*``) takes one ``Evidence`` and raises the
invariant's ``InvariantViolation`` when it shows a breach. The evidence, in the order a step
produces it:

- ``StateView``: every rank's snapshot and the harness's model after a step (or at reset, or at
  quiescence): ack rows, pages, pending writes, producer slots, the gate;
- ``Refusal``: the state before and after a refused call;
- ``ReturnedIndices``: indices an implementation handed back (host slots of a write, CP host
  indices), which must be whole pages;
- ``RankValues``: what every CP rank reported for the same call (ack rows drained, producer
  slots taken, logical pages allocated), which must agree;
- ``SlotCount``, ``OwnerReplay``: what a CP reservation or load chose, against the harness's
  own layout;
- ``DrainedAck``: an ack the tree drained, and whether the tree had that node in flight;
- ``SlotReuse``: a producer slot handed out while the tree still has a load on it;
- ``Rows``: bytes read back from a pool against the bytes the content oracle predicts (at a
  drain, at a forward read, at rest, in a poisoned free slot);
- ``BackupRead``: a D2H copy that read device rows, and whether each held a stored layer;
- ``PoolIndices``: rows or slots one pool of a group handed a node (an independent side pool's
  or the anchor's), with what that pool's own allocator reports and what other nodes hold;
- ``StorageSnapshot`` (``storage_snapshot.py``): the storage tier of every rank after a storage
  step, with the harness's own model of what L3 holds.

Only the harness builds these, from its own pools and model: nothing here is the
implementation's word about itself.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hicache_ref.invariants.snapshot import HarnessModel, RankSnapshot
from hicache_ref.invariants.storage_snapshot import StorageSnapshot

if TYPE_CHECKING:
    import torch

    from hicache_ref.invariants.checks_layout import CpMetadataLike


@dataclass(frozen=True)
class StateView:
    """Every rank's snapshot and the harness's model at one moment."""

    snapshots: Sequence[RankSnapshot]
    model: HarnessModel


@dataclass(frozen=True)
class Refusal:
    """A refused call: the state before and after it (``may_change``: parts changed before)."""

    before: Sequence[RankSnapshot]
    after: Sequence[RankSnapshot]
    what: str
    may_change: Collection[str] = ()


@dataclass(frozen=True)
class ReturnedIndices:
    """Indices an implementation returned, which the harness will copy through or free."""

    indices: torch.Tensor
    page_size: int
    what: str


@dataclass(frozen=True)
class RankValues:
    """What each rank reported for one call (rows of ints per rank), which must agree."""

    what: str
    rows_per_rank: Sequence[Sequence[Sequence[int]]]
    allow_lag: bool = False
    ack_rows: bool = True  # False: plain values (pages, slots), compared whole


@dataclass(frozen=True)
class SlotCount:
    """The host slots a CP reservation chose on one rank (``slots``) against the positions the
    harness's own layout says the rank owns (``owned``); with ``meta``, its metadata record."""

    slots: int
    owned: int
    what: str
    pool: str = "host"
    meta: CpMetadataLike | None = None


@dataclass(frozen=True)
class OwnerReplay:
    """The logical pages a CP load allocated, against the owners recorded at write time."""

    node: int
    allocated: torch.Tensor
    page_owners: Sequence[int]
    page_size: int
    cp_size: int
    owner_of_page: Callable[[int], int]


@dataclass(frozen=True)
class DrainedAck:
    """An ack the tree drained: its queue, the node id, and whether that node was in flight."""

    queue: str  # ack_write_queue | ack_load_queue
    node_id: int
    in_flight: bool


@dataclass(frozen=True)
class SlotReuse:
    """A producer slot ``start_loading`` handed out, and the tree's undrained loads on it."""

    slot: int
    busy_handles: Sequence[int]


@dataclass(frozen=True)
class Rows:
    """Rows read back from a pool against the content oracle's rows."""

    actual: torch.Tensor
    expected: torch.Tensor
    where: str
    describe_row: Callable[[torch.Tensor], str] | None = None
    fix: str = ""


@dataclass(frozen=True)
class BackupRead:
    """A D2H copy of one layer that read device rows; ``unstored`` are the rows whose last
    writer on the device was no KV store or load (a freed page's poison)."""

    node_handles: Sequence[int]
    layer: int
    pool: str
    unstored: Sequence[int] = field(default_factory=tuple)


@dataclass(frozen=True)
class PoolIndices:
    """Indices a write or load handed one node in one pool of a pool group: ``allocated`` are
    the pages that pool's own allocator (the harness's) reports allocated now, ``others`` the
    pages the tree's other nodes hold in that pool."""

    pool: str  # "anchor host", "side host", "anchor device", "side device"
    indices: torch.Tensor
    page_size: int
    allocated: frozenset[int]
    others: frozenset[int]
    what: str


@dataclass(frozen=True)
class StateSlots:
    """The state slots a write (``pool="side host"``) or load (``"side device"``) handed one
    node in a state pool (Mamba), counted against what the harness's geometry says a node
    holds there (``HarnessConfig.side_rows``: one)."""

    pool: str
    indices: torch.Tensor
    expected: int
    what: str


Evidence = (
    StateView
    | Refusal
    | ReturnedIndices
    | RankValues
    | SlotCount
    | OwnerReplay
    | DrainedAck
    | SlotReuse
    | Rows
    | BackupRead
    | PoolIndices
    | StateSlots
    | StorageSnapshot
)


def storage_snapshot_of(inv_id: str, evidence: Evidence) -> StorageSnapshot:
    """The evidence as a storage snapshot (the storage tier's ids are judged from nothing else)."""
    if not isinstance(evidence, StorageSnapshot):
        raise TypeError(f"{inv_id} is not checked from {type(evidence).__name__} evidence")
    return evidence
