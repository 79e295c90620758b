"""The oracle: a pure-Python model of what a correct HiCache controller + radix tree must do.

No torch. A state is a frozen, hashable value (``OracleState``); every transition is
``step(state, op) -> (new_state, observations)``; ``is_enabled(state, op)`` is the radix tree's
discipline. The model works at slot granularity: every device page and host page has a holder
(free / owned by node n / reserved for n's in-flight backup), and every (pool, layer, slot) a
content tag naming the (node, token) whose KV it holds, so the bytes each copy moves are
predicted. Streams are FIFOs of stores, reads, copies, event records and waits; waits bind to
the latest record at wait time, as on CUDA.

Primitives, in the order data flows through them:

1. write   ``Insert(node)`` (prefill allocates device pages), ``Store(node, layer, pool)`` (the
           forward queues a KV store), then either ``Write(node)`` (reserve host slots, fence,
           D2H of every layer, one ack per rank) or the CP per-layer path
           ``ReserveWriteCp(node)`` + ``SubmitLayer(node, layer, pool)`` /
           ``OnLayerEnd(layer, source)``, rolled back by ``CancelLayerWrite(node)``.
2. ack     ``Advance("write")`` runs the D2H; ``DrainWriteAcks()`` pops the FIFO prefix of
           completed acks (MIN over ranks) and unlocks the nodes (``writing_check``).
3. evict   ``EvictDevice(node)`` keeps a host-only copy (or deletes an unbacked node);
           ``EvictHost(node)`` frees the host copy and deletes the node.
4. load    ``Load(node)`` replays ``page_owners`` and pins; ``StartLoading()`` takes a producer
           slot and queues per-layer H2D + layer events; ``ForwardRead(node, layer, pool)`` waits
           on the layer's event and reads.
5. ack     ``Advance("load")`` runs the H2D; ``DrainLoadAcks()`` unpins (``loading_check``).

Plus ``Advance(stream)``, ``CopyLanded(...)`` (a harness reports an executed copy),
``ForwardRan()`` (a harness reports an executed forward store or read), ``Reset()`` and
``Noop()``. A harness grows the node universe as it inserts (``Insert(node, tokens=...)``
under ``OracleConfig(max_tokens=...)``) and drains what its tree drained
(``DrainWriteAcks(count)``), with ``OracleConfig(harness_schedule=True)`` admitting the
harness tree's looser schedule; ``harness/lockstep/oracle.py`` steps the oracle this way.
``check_invariants(state)`` returns every ``Violation`` (INV-02..18 where expressible);
``ProtocolVariant`` flags plant one bug each (``PLANTED_BUGS``).
Query functions (``get_*``) answer what a harness compares: slot owners and their in-flight
users, predicted and expected tags, ack rows, lifecycles and locks. The L3 storage tier has an
oracle of its own, one schedule point at a time: ``hicache_ref.oracle.storage``.

Modules, in the same order: ``config`` (the fixed world and the protocol variant) and
``geometry`` (its pure arithmetic); ``state`` (the frozen state) and ``ops`` (the operations);
``slots`` (allocating and freeing pages and slots), ``streams`` (stream FIFOs, events,
execution); the transitions: ``tree`` (insert, store, evict, reset), ``write_path`` (1-2),
``landing`` (``CopyLanded``), ``load_path`` (4-5); ``step`` (``is_enabled`` and ``step``, the
one entry point); ``queries`` (the ``get_*`` answers) and ``invariants``
(``check_invariants``); ``contracts`` (CrossHair's entry points over the step functions).
"""

from hicache_ref.oracle.config import (
    PLANTED_BUGS,
    POOLS,
    STREAMS,
    Direction,
    OracleConfig,
    Pool,
    ProtocolVariant,
    StreamName,
    make_variant,
)
from hicache_ref.oracle.invariants import assert_invariants, check_invariants, is_quiescent
from hicache_ref.oracle.ops import (
    Advance,
    CancelLayerWrite,
    CopyLanded,
    DrainLoadAcks,
    DrainWriteAcks,
    EvictDevice,
    EvictHost,
    ForwardRan,
    ForwardRead,
    Insert,
    Load,
    Noop,
    OnLayerEnd,
    Op,
    ReserveWriteCp,
    Reset,
    StartLoading,
    Store,
    SubmitLayer,
    Write,
)
from hicache_ref.oracle.queries import (
    InFlightUse,
    ResidentTag,
    SlotOwner,
    decode_tag,
    get_device_page_owner,
    get_device_page_users,
    get_device_pages,
    get_device_tag,
    get_expected_resident_tags,
    get_host_page_owner,
    get_host_page_users,
    get_host_pages,
    get_host_tag,
    get_lifecycle,
    get_load_ack_rows,
    get_lock_ref,
    get_write_ack_rows,
)
from hicache_ref.oracle.state import (
    Lifecycle,
    NodeState,
    Observation,
    OracleState,
    Violation,
    initial_state,
)
from hicache_ref.oracle.step import (
    OpNotEnabledError,
    all_ops,
    enabled_ops,
    is_enabled,
    run_ops,
    step,
    why_disabled,
)
from hicache_ref.oracle.write_path import node_has_undrained_write_ack

__all__ = [
    "PLANTED_BUGS",
    "POOLS",
    "STREAMS",
    "Advance",
    "CancelLayerWrite",
    "CopyLanded",
    "Direction",
    "DrainLoadAcks",
    "DrainWriteAcks",
    "EvictDevice",
    "EvictHost",
    "ForwardRan",
    "ForwardRead",
    "InFlightUse",
    "Insert",
    "Lifecycle",
    "Load",
    "NodeState",
    "Noop",
    "Observation",
    "OnLayerEnd",
    "Op",
    "OpNotEnabledError",
    "OracleConfig",
    "OracleState",
    "Pool",
    "ProtocolVariant",
    "ReserveWriteCp",
    "Reset",
    "ResidentTag",
    "SlotOwner",
    "StartLoading",
    "Store",
    "StreamName",
    "SubmitLayer",
    "Violation",
    "Write",
    "all_ops",
    "assert_invariants",
    "check_invariants",
    "decode_tag",
    "enabled_ops",
    "get_device_page_owner",
    "get_device_page_users",
    "get_device_pages",
    "get_device_tag",
    "get_expected_resident_tags",
    "get_host_page_owner",
    "get_host_page_users",
    "get_host_pages",
    "get_host_tag",
    "get_lifecycle",
    "get_load_ack_rows",
    "get_lock_ref",
    "get_write_ack_rows",
    "initial_state",
    "is_enabled",
    "is_quiescent",
    "make_variant",
    "node_has_undrained_write_ack",
    "run_ops",
    "step",
    "why_disabled",
]
