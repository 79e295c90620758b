"""The oracle's frozen state: nodes, page holders, content tags, streams, ack queues.

All records are frozen dataclasses over ints and tuples, so a state is hashable (the bounded
checker keeps a visited set) and CrossHair can build one. Nothing here changes a state; the
step functions in ``write_path``, ``load_path`` and ``tree`` return new ones.

Content is abstract: each (channel, slot) holds a *tag*, ``GARBAGE`` or the tag of the
(node, token) whose KV was stored there (``geometry.compute_token_tag``). Copies move tags, so
the oracle predicts the bytes every transfer carries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Literal, TypeVar

from hicache_ref.errors import InvariantViolation
from hicache_ref.oracle.config import OracleConfig
from hicache_ref.oracle.geometry import FREE, GARBAGE

Lifecycle = Literal[
    "absent",
    "device_only",
    "backup_in_flight",
    "backed_up",
    "host_only",
    "load_queued",
    "load_in_flight",
    "loaded",
    "gone",
]
"""Where a node's KV lives.

- ``absent``: not inserted since the last reset; ``gone``: deleted (ids are never reused
  before a reset, as ``TreeNode.counter`` only grows).
- ``device_only`` -> ``backup_in_flight`` (host slots reserved, D2H queued, write ack undrained,
  ``lock_ref`` held) -> ``backed_up`` (device + host) -> ``host_only`` (device evicted) ->
  ``load_queued`` (device pages allocated, H2D not started, pinned) -> ``load_in_flight`` (H2D
  queued, load ack undrained, pinned) -> ``loaded`` (device + host, pin released).
"""

HOST_RESIDENT: frozenset[Lifecycle] = frozenset(
    {"backed_up", "host_only", "load_queued", "load_in_flight", "loaded"}
)
"""Lifecycles whose host copy is settled (its write ack drained)."""

EventName = tuple[str, int, int]
"""An event: ``(kind, a, b)``. Kinds: ``fence``/``wstart``/``wfin`` (a = node), ``wlayer``
(a = layer), ``lstart``/``lfin`` (a = producer slot), ``lload`` (a = slot, b = layer), and
under ``harness_schedule`` ``ldraft`` (a = slot, b = draft layer: after that layer's draft copy)."""

NODE_EVENT_KINDS = frozenset({"fence", "wstart", "wfin"})
"""Event kinds whose first field is a node id."""

PagePair = tuple[int, int, int]
"""``(rank, host_page, device_page)``: one page that a copy moves."""


@dataclass(frozen=True)
class StoreKv:
    """Forward stream: the model writes KV of ``node`` for ``channel`` into its device pages."""

    node: int
    channel: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class ReadKv:
    """Forward stream: attention reads ``channel`` of ``node`` from its device pages."""

    node: int
    channel: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class RecordEvent:
    """``event.record()`` on this stream; ``seq`` tells apart records of one event in flight."""

    event: EventName
    seq: int


@dataclass(frozen=True)
class WaitEvent:
    """``stream.wait_event(event)``, bound to the pending record ``(event, seq)``."""

    event: EventName
    seq: int


@dataclass(frozen=True)
class CopyPages:
    """One transfer of one channel: D2H (write) or H2D (load), for ``nodes``, page by page.

    ``direction`` is ``"d2h"`` or ``"h2d"``: a plain ``str``, because CrossHair 0.0.113 cannot
    build a dataclass with a ``typing.Literal`` field (the contracts in ``streams`` need it).
    """

    direction: str
    channel: int
    nodes: tuple[int, ...]
    pairs: tuple[PagePair, ...]


StreamOp = StoreKv | ReadKv | RecordEvent | WaitEvent | CopyPages


@dataclass(frozen=True)
class Ack:
    """One ``HiCacheAck``: the node ids it releases and its finish event.

    ``finish`` is None for an ack appended already complete; ``slot`` is the producer slot of
    a load ack (-1 for write acks).
    """

    node_ids: tuple[int, ...]
    finish: EventName | None
    slot: int = -1


@dataclass(frozen=True)
class LayerWriteState:
    """``HiCacheLayerWriteState``: which target and draft layers of a CP write were submitted."""

    node: int
    target_done: tuple[int, ...] = ()
    draft_done: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeState:
    """One radix-tree node as the oracle sees it.

    ``host_pages[r]`` / ``draft_host_pages[r]`` are rank ``r``'s host pages, one per page of the
    node that ``r`` owns (``page_owners``), in page order; both are ``()`` without a host copy.
    ``stores_issued`` are the channels whose KV store was queued on the forward stream;
    ``backup_channels`` the channels whose D2H the current backup has queued;
    ``reads_issued`` the channels the forward has read since the node's last load.
    """

    lifecycle: Lifecycle = "absent"
    device_pages: tuple[int, ...] = ()
    host_pages: tuple[tuple[int, ...], ...] = ()
    draft_host_pages: tuple[tuple[int, ...], ...] = ()
    page_owners: tuple[int, ...] = ()
    stores_issued: tuple[int, ...] = ()
    backup_channels: tuple[int, ...] = ()
    reads_issued: tuple[int, ...] = ()
    lock_ref: int = 0
    load_slot: int = -1


@dataclass(frozen=True, order=True)
class Violation:
    """A broken invariant found by the oracle: the id and what went wrong."""

    inv_id: str
    message: str

    def as_exception(self) -> InvariantViolation:
        return InvariantViolation(self.inv_id, self.message)

    def __str__(self) -> str:
        return f"{self.inv_id} violated: {self.message}"


@dataclass(frozen=True)
class Observation:
    """What a step returns to its caller (an API result, a drained ack, bytes a read saw)."""

    kind: str
    node: int = -1
    pages: tuple[tuple[int, ...], ...] = ()
    values: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class OracleState:
    """The whole model: one value per step; see the module docstring.

    - ``device_holders[p]``: holder of logical device page ``p``;
    - ``host_holders[pool][rank][p]``: holder of host page ``p`` (pool 0 target, 1 draft);
    - ``device_tags[channel][slot]``, ``host_tags[channel][rank][slot]``: content tags;
    - ``streams``: the forward, write and load FIFOs (``config.FORWARD/WRITE/LOAD``);
    - ``write_acks[rank]``, ``load_acks[rank]``: ``ack_write_queue``/``ack_load_queue``;
    - ``load_queue[rank]``: node ids loaded but not yet started;
    - ``pending_layer_writes``: CP per-layer write states, in insertion order;
    - ``producer_index``: ``LayerDoneCounter.producer_index`` (-1 after reset);
    - ``cancelled``: nodes whose per-layer write was cancelled (INV-15);
    - ``fresh_epoch``: nothing happened since the last reset (INV-18);
    - ``faults``: violations found while stepping (sticky; ``check_invariants`` reports them).
    """

    config: OracleConfig
    nodes: tuple[NodeState, ...]
    device_holders: tuple[int, ...]
    host_holders: tuple[tuple[tuple[int, ...], ...], ...]
    device_tags: tuple[tuple[int, ...], ...]
    host_tags: tuple[tuple[tuple[int, ...], ...], ...]
    streams: tuple[tuple[StreamOp, ...], ...]
    write_acks: tuple[tuple[Ack, ...], ...]
    load_acks: tuple[tuple[Ack, ...], ...]
    load_queue: tuple[tuple[int, ...], ...]
    pending_layer_writes: tuple[LayerWriteState, ...] = ()
    producer_index: int = -1
    cancelled: tuple[int, ...] = ()
    fresh_epoch: bool = True
    faults: tuple[Violation, ...] = ()

    def __hash__(self) -> int:
        # States are hashed many times by the bounded checker's visited set; compute once.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(
                (
                    self.nodes,
                    self.device_holders,
                    self.host_holders,
                    self.device_tags,
                    self.host_tags,
                    self.streams,
                    self.write_acks,
                    self.load_acks,
                    self.load_queue,
                    self.pending_layer_writes,
                    self.producer_index,
                    self.cancelled,
                    self.fresh_epoch,
                    self.faults,
                )
            )
            self.__dict__["_hash"] = cached
        return int(cached)


def initial_state(config: OracleConfig) -> OracleState:
    """Empty pools, empty queues, every node absent: the state after construction or reset."""
    ranks = config.num_ranks
    host_sizes = (config.host_pages, config.draft_host_pages if config.has_draft else 0)
    ps = config.page_size
    return OracleState(
        config=config,
        nodes=tuple(NodeState() for _ in config.node_tokens),
        device_holders=(FREE,) * config.device_pages,
        host_holders=tuple(tuple((FREE,) * size for _ in range(ranks)) for size in host_sizes),
        device_tags=tuple(
            (GARBAGE,) * (config.device_pages * ps) for _ in range(config.num_channels)
        ),
        host_tags=tuple(
            tuple(
                (GARBAGE,) * (host_sizes[1 if c >= config.layer_num else 0] * ps)
                for _ in range(ranks)
            )
            for c in range(config.num_channels)
        ),
        streams=((), (), ()),
        write_acks=((),) * ranks,
        load_acks=((),) * ranks,
        load_queue=((),) * ranks,
    )


def with_fault(state: OracleState, inv_id: str, message: str) -> OracleState:
    """``state`` with one more fault recorded (kept sorted and unique)."""
    fault = Violation(inv_id, message)
    if fault in state.faults:
        return state
    return evolve(state, faults=tuple(sorted((*state.faults, fault))))


T = TypeVar("T")

FIELD_NAMES_CACHE_MAX = 64  # one entry per record type of the oracle


@functools.lru_cache(maxsize=FIELD_NAMES_CACHE_MAX)
def _field_names(kind: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(kind))


def evolve(record: T, **changes: object) -> T:
    """``dataclasses.replace`` for the oracle's frozen records, without re-running ``__init__``.

    The bounded checker builds millions of records; ``replace`` costs ~20 us each, this ~1 us.
    Unknown field names still raise, as with ``replace``.
    """
    kind = type(record)
    names = _field_names(kind)  # type: ignore[arg-type]  # a class is hashable
    if not names.issuperset(changes):
        raise TypeError(f"{kind.__name__} has no field(s) {sorted(set(changes) - names)}")
    updated = object.__new__(kind)
    updated.__dict__.update(record.__dict__)
    updated.__dict__.update(changes)
    updated.__dict__.pop("_hash", None)
    return updated


def replace_at(items: tuple[T, ...], index: int, value: T) -> tuple[T, ...]:
    """``items`` with entry ``index`` replaced by ``value``.

    pre: 0 <= index < len(items)
    post: len(__return__) == len(items)
    post: __return__[index] == value
    """
    return (*items[:index], value, *items[index + 1 :])


def with_node(state: OracleState, node: int, updated: NodeState) -> OracleState:
    """``state`` with node ``node`` replaced."""
    return evolve(state, nodes=replace_at(state.nodes, node, updated))
