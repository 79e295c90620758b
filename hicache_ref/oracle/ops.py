"""The oracle's operations: what the radix tree asks of the controller, and what the device does.

Ops are frozen dataclasses, so a trace is a plain tuple that prints as runnable code and replays
exactly (``step`` over a tuple of ops). Ops that allocate take optional explicit pages: the
bounded checker leaves them None (the oracle picks), a harness passes the pages the real
controller returned so the oracle predicts the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_ref.oracle.config import Direction, Pool, StreamName


@dataclass(frozen=True)
class Insert:
    """The tree inserts node ``node`` with freshly allocated device pages (prefill).

    ``tokens`` (a harness's insert) sizes the node first: the universe grows by this id, or an
    absent id is re-sized (``OracleConfig.with_node_tokens``).
    """

    node: int
    device_pages: tuple[int, ...] | None = None
    tokens: int | None = None


@dataclass(frozen=True)
class Store:
    """The forward queues the KV store of ``layer`` of ``pool`` for ``node``."""

    node: int
    layer: int
    pool: Pool = "target"


@dataclass(frozen=True)
class Write:
    """``write(device_indices, node_id=node)``: reserve host slots, queue a fenced D2H of every
    layer (target, then draft) and its write ack. Under CP this is ``_write_cp``."""

    node: int
    host_pages: tuple[tuple[int, ...], ...] | None = None
    draft_host_pages: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class ReserveWriteCp:
    """``reserve_write_cp`` + ``submit_write_cp_per_layer(catch_up_all_layers=False)``."""

    node: int
    host_pages: tuple[tuple[int, ...], ...] | None = None
    draft_host_pages: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class SubmitLayer:
    """``submit_write_cp_layer(reservation, layer, submit_target=..., submit_draft=...)``."""

    node: int
    layer: int
    pool: Pool = "target"


@dataclass(frozen=True)
class OnLayerEnd:
    """``on_layer_end(layer, source)``: the device pool's layer hook drives every pending write."""

    layer: int
    source: Pool = "target"


@dataclass(frozen=True)
class CancelLayerWrite:
    """Rollback: ``cancel_layer_write_state(node)`` then ``evict_cp_host`` of its reservation."""

    node: int


@dataclass(frozen=True)
class DrainWriteAcks:
    """``writing_check``: drain the FIFO prefix of completed write acks and unlock their nodes.

    ``count`` (a harness's drain) is how many acks the tree drained; any that the oracle does
    not see completed is an INV-09 fault. None: the oracle drains its own completed prefix.
    """

    count: int | None = None


@dataclass(frozen=True)
class EvictDevice:
    """The tree evicts ``node``'s device copy (``evict_device``); an unbacked node is deleted."""

    node: int


@dataclass(frozen=True)
class EvictHost:
    """The tree evicts ``node``'s host copy (``evict_host``/``evict_cp_host``) and deletes it."""

    node: int


@dataclass(frozen=True)
class Load:
    """``load``/``load_cp``: allocate device pages (replaying ``page_owners``) and queue the H2D."""

    node: int
    device_pages: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StartLoading:
    """``start_loading``: take a producer slot and queue every queued load's per-layer H2D."""


@dataclass(frozen=True)
class ForwardRead:
    """The forward reads ``layer`` of ``pool`` for ``node``: ``wait_until(layer)`` then attention."""

    node: int
    layer: int
    pool: Pool = "target"


@dataclass(frozen=True)
class DrainLoadAcks:
    """``loading_check``: drain the FIFO prefix of completed load acks and unpin their nodes.

    ``count``: as for ``DrainWriteAcks``.
    """

    count: int | None = None


@dataclass(frozen=True)
class Advance:
    """The device runs the head op of ``stream`` (if its waits are satisfied)."""

    stream: StreamName


@dataclass(frozen=True)
class CopyLanded:
    """A harness reports that the device executed a copy: one rank's pages of one channel.

    ``host_slots`` and ``device_locs`` are token slots (device locs are *logical* under CP), in
    matching order and whole pages. ``layer=None`` reports an all-layer copy of ``pool``.
    """

    direction: Direction
    layer: int | None
    host_slots: tuple[int, ...]
    device_locs: tuple[int, ...]
    pool: Pool = "target"
    rank: int = 0


@dataclass(frozen=True)
class ForwardRan:
    """A harness reports that the device ran the next queued forward store or read.

    The oracle runs its forward stream up to and including its next ``StoreKv``/``ReadKv``
    (event records ahead of it run; a wait ahead of it whose record has not run means the
    device ran the op before the event it waits on: an INV-11 fault, and the op runs anyway).
    """


@dataclass(frozen=True)
class Reset:
    """``reset()`` of tree and controller once the device is idle: back to a fresh epoch."""


@dataclass(frozen=True)
class Noop:
    """Does nothing; always enabled (keeps a swarm-tested state machine from starving)."""


Op = (
    Insert
    | Store
    | Write
    | ReserveWriteCp
    | SubmitLayer
    | OnLayerEnd
    | CancelLayerWrite
    | DrainWriteAcks
    | EvictDevice
    | EvictHost
    | Load
    | StartLoading
    | ForwardRead
    | DrainLoadAcks
    | Advance
    | CopyLanded
    | ForwardRan
    | Reset
    | Noop
)
