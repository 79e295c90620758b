"""``is_enabled`` and ``step``: the oracle's one entry point for every op.

``is_enabled(state, op)`` is the radix tree's discipline (what a correct driver may call now);
``step(state, op)`` applies an enabled op and returns ``(new_state, observations)``. Calling
``step`` with an op that is not enabled raises ``OpNotEnabledError`` naming the rule.
``all_ops(config)`` is the finite op universe the bounded checker enumerates.
"""

from __future__ import annotations

from collections.abc import Iterable

from hicache_ref.errors import HiCacheInputError
from hicache_ref.oracle.config import FORWARD, STREAMS, OracleConfig
from hicache_ref.oracle.geometry import compute_channel
from hicache_ref.oracle.landing import process_copy_landed, process_forward_ran
from hicache_ref.oracle.load_path import (
    process_drain_load_acks,
    process_forward_read,
    process_load,
    process_start_loading,
)
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
from hicache_ref.oracle.state import NodeState, Observation, OracleState, ReadKv, StoreKv, evolve
from hicache_ref.oracle.streams import execute_head, is_head_ready, settle_records
from hicache_ref.oracle.tree import (
    process_evict_device,
    process_evict_host,
    process_insert,
    process_reset,
    process_store,
)
from hicache_ref.oracle.write_path import (
    process_cancel_layer_write,
    process_drain_write_acks,
    process_on_layer_end,
    process_reserve_write_cp,
    process_write,
    submit_layer_states,
)

Step = tuple[OracleState, tuple[Observation, ...]]


class OpNotEnabledError(HiCacheInputError):
    """``step`` was given an op the protocol does not allow in this state."""


def why_disabled(state: OracleState, op: Op) -> str | None:
    """Why ``op`` is not enabled in ``state`` (the broken rule), or None if it is enabled."""
    config = state.config
    node = getattr(op, "node", None)
    grows = isinstance(op, Insert) and op.tokens is not None and node == config.num_nodes
    if node is not None and not 0 <= node < config.num_nodes and not grows:
        return f"node {node} is outside the universe [0, {config.num_nodes})"
    return _rule_for(state, op)


def is_enabled(state: OracleState, op: Op) -> bool:
    """Whether a correct radix-tree driver may issue ``op`` now (see ``why_disabled``)."""
    return why_disabled(state, op) is None


def step(state: OracleState, op: Op) -> Step:
    """Apply ``op`` to ``state``: ``(new_state, observations)``; raises if not enabled."""
    reason = why_disabled(state, op)
    if reason is not None:
        raise OpNotEnabledError(f"{op} is not enabled: {reason}")
    new_state, observations = _apply(state, op)
    if state.config.settle_records:
        new_state = settle_records(new_state)
    if new_state.fresh_epoch and not isinstance(op, Reset | Noop) and new_state != state:
        new_state = evolve(new_state, fresh_epoch=False)
    return new_state, observations


def run_ops(state: OracleState, ops: Iterable[Op]) -> Step:
    """Apply ``ops`` in order; the observations of all steps, concatenated."""
    observations: tuple[Observation, ...] = ()
    for op in ops:
        state, seen = step(state, op)
        observations += seen
    return state, observations


def all_ops(config: OracleConfig, include_reset: bool = True) -> tuple[Op, ...]:
    """Every op the bounded checker tries (no ``Noop``, no ``CopyLanded``, no explicit pages)."""
    nodes = range(config.num_nodes)
    layer_ops: list[Op] = []
    for pool in ("target", "draft"):
        for layer in range(config.layers_of(pool)):
            for node in nodes:
                layer_ops.append(Store(node, layer, pool))
                layer_ops.append(ForwardRead(node, layer, pool))
                if config.uses_cp:
                    layer_ops.append(SubmitLayer(node, layer, pool))
            if config.uses_cp:
                layer_ops.append(OnLayerEnd(layer, pool))
    ops: list[Op] = [Insert(n) for n in nodes]
    ops += layer_ops
    ops += [Write(n) for n in nodes]
    if config.uses_cp:
        ops += [ReserveWriteCp(n) for n in nodes] + [CancelLayerWrite(n) for n in nodes]
    ops += [DrainWriteAcks()]
    ops += [EvictDevice(n) for n in nodes] + [EvictHost(n) for n in nodes]
    ops += [Load(n) for n in nodes] + [StartLoading(), DrainLoadAcks()]
    ops += [Advance(name) for name in STREAMS]
    if include_reset:
        ops.append(Reset())
    return tuple(ops)


def enabled_ops(state: OracleState, universe: tuple[Op, ...]) -> tuple[Op, ...]:
    """The ops of ``universe`` that are enabled in ``state``."""
    return tuple(op for op in universe if why_disabled(state, op) is None)


# -- enabling rules (the tree's discipline) ----------------------------------------------------


def _has_forward_use(state: OracleState, node: int) -> bool:
    return any(
        isinstance(op, StoreKv | ReadKv) and op.node == node for op in state.streams[FORWARD]
    )


def _rule_insert(state: OracleState, op: Insert) -> str | None:
    config = state.config
    if op.tokens is not None and not 1 <= op.tokens <= config.max_tokens:
        return f"a sized insert needs 1 <= tokens={op.tokens} <= max_tokens={config.max_tokens}"
    if op.node < config.num_nodes and state.nodes[op.node].lifecycle != "absent":
        return "node ids are inserted once per epoch (TreeNode.counter only grows)"
    return None


def _rule_store(state: OracleState, op: Store) -> str | None:
    config = state.config
    record = state.nodes[op.node]
    if not 0 <= op.layer < config.layers_of(op.pool):
        return f"layer {op.layer} is outside [0, {config.layers_of(op.pool)}) of pool {op.pool}"
    if record.lifecycle not in ("device_only", "backup_in_flight"):
        return f"only a freshly inserted node is stored (lifecycle {record.lifecycle})"
    if config.harness_schedule:
        return None  # the harness's forward stores each pool's layers in order, any layer again
    channel = compute_channel(config.layer_num, op.pool == "draft", op.layer)
    if channel in record.stores_issued:
        return "each layer of a node is stored once"
    if channel != len(record.stores_issued):
        return "the forward stores layers in order: target layers, then draft layers"
    return None


def _all_stored(state: OracleState, node: int) -> bool:
    return len(state.nodes[node].stores_issued) == state.config.num_channels


def _rule_write(state: OracleState, op: Write) -> str | None:
    record = state.nodes[op.node]
    if op.node in state.cancelled and not state.config.harness_schedule:
        return "a rolled-back node is not backed up again this epoch (keeps the model finite)"
    if record.lifecycle != "device_only":
        return f"write_backup needs a device-only node (lifecycle {record.lifecycle})"
    if not _all_stored(state, op.node):
        return "write_backup runs after every layer's KV store was queued"
    return None


def _rule_reserve(state: OracleState, op: ReserveWriteCp) -> str | None:
    if not state.config.uses_cp:
        return "reserve_write_cp needs the CP layout (cp_size >= 1)"
    record = state.nodes[op.node]
    if op.node in state.cancelled and not state.config.harness_schedule:
        return "a rolled-back node is not backed up again this epoch (keeps the model finite)"
    if record.lifecycle != "device_only":
        return f"reserve_write_cp needs a device-only node (lifecycle {record.lifecycle})"
    return None


def _pending(state: OracleState, node: int) -> bool:
    return any(p.node == node for p in state.pending_layer_writes)


def _rule_submit(state: OracleState, op: SubmitLayer) -> str | None:
    config = state.config
    if not _pending(state, op.node):
        return "submit_write_cp_layer needs a pending per-layer write for the node"
    if not 0 <= op.layer < config.layers_of(op.pool):
        return f"layer {op.layer} is outside [0, {config.layers_of(op.pool)}) of pool {op.pool}"
    channel = compute_channel(config.layer_num, op.pool == "draft", op.layer)
    if channel not in state.nodes[op.node].stores_issued:
        return "a layer is submitted after its KV store was queued"
    if config.harness_schedule:
        return None  # the controller submits any layer not yet submitted, in any order
    if op.layer != _next_layer(state, op.node, op.pool):
        return "layers of a per-layer write are submitted in order"
    return None


def _next_layer(state: OracleState, node: int, pool: str) -> int:
    pending = next(p for p in state.pending_layer_writes if p.node == node)
    return len(pending.target_done if pool == "target" else pending.draft_done)


def _rule_on_layer_end(state: OracleState, op: OnLayerEnd) -> str | None:
    config = state.config
    if not config.uses_cp:
        return "on_layer_end drives CP per-layer writes (cp_size >= 1)"
    if not 0 <= op.layer < config.layers_of(op.source):
        return f"layer {op.layer} is outside [0, {config.layers_of(op.source)}) of {op.source}"
    channel = compute_channel(config.layer_num, op.source == "draft", op.layer)
    if not state.pending_layer_writes:
        return "no pending per-layer write (the hook would return at once)"
    if config.harness_schedule:
        return _rule_harness_layer_end(state, op, channel)
    if any(channel not in state.nodes[p.node].stores_issued for p in state.pending_layer_writes):
        return "the layer hook fires after the layer's KV store of every pending node"
    if any(_next_layer(state, p.node, op.source) != op.layer for p in state.pending_layer_writes):
        return "the layer hooks fire in layer order for every pending write"
    return None


def _rule_harness_layer_end(state: OracleState, op: OnLayerEnd, channel: int) -> str | None:
    """The harness's hooks fire for any layer: a pending write that already submitted it skips
    it (as the controller does); every other pending node must have the layer's store queued."""
    for pending in state.pending_layer_writes:
        done = pending.target_done if op.source == "target" else pending.draft_done
        if op.layer not in done and channel not in state.nodes[pending.node].stores_issued:
            return "the layer hook fires after the layer's KV store of every pending node"
    return None


def _rule_cancel(state: OracleState, op: CancelLayerWrite) -> str | None:
    if not _pending(state, op.node):
        return "cancel_layer_write_state rolls back a pending per-layer write only"
    return None


def _rule_evict_device(state: OracleState, op: EvictDevice) -> str | None:
    record = state.nodes[op.node]
    variant = state.config.variant
    legal = {"device_only", "backed_up", "loaded"}
    if variant.evict_device_while_loading:
        legal |= {"load_in_flight"}
    if record.lifecycle not in legal:
        return f"evict_device needs an evictable device copy (lifecycle {record.lifecycle})"
    if record.lock_ref > 0 and record.lifecycle != "load_in_flight":
        return "evict skips nodes with lock_ref > 0"
    if _has_forward_use(state, op.node) and not state.config.harness_schedule:
        return "the node's queued forward store/read still holds it"
    return None


def _rule_evict_host(state: OracleState, op: EvictHost) -> str | None:
    record = state.nodes[op.node]
    legal = {"host_only"}
    if state.config.variant.free_host_before_write_ack:
        legal |= {"backup_in_flight"}
    if record.lifecycle not in legal:
        return f"evict_host takes host-only nodes (lifecycle {record.lifecycle})"
    if _pending(state, op.node):
        return "a pending per-layer write is rolled back with cancel_layer_write_state"
    return None


def _rule_load(state: OracleState, op: Load) -> str | None:
    record = state.nodes[op.node]
    if record.lifecycle != "host_only":
        return f"load_back needs an evicted, backed-up node (lifecycle {record.lifecycle})"
    return None


def _rule_start_loading(state: OracleState, op: StartLoading) -> str | None:
    config = state.config
    if not any(state.load_queue):
        return "start_loading with an empty load queue returns -1 and changes nothing"
    undrained = max(len(queue) for queue in state.load_acks)
    if undrained >= config.num_counters and not config.variant.reuse_busy_producer_slot:
        return (
            f"has_free_load_back_slot: {undrained} undrained load acks >= "
            f"num_counters={config.num_counters}"
        )
    return None


def _rule_forward_read(state: OracleState, op: ForwardRead) -> str | None:
    config = state.config
    if not 0 <= op.layer < config.layers_of(op.pool):
        return f"layer {op.layer} is outside [0, {config.layers_of(op.pool)}) of pool {op.pool}"
    record = state.nodes[op.node]
    channel = compute_channel(config.layer_num, op.pool == "draft", op.layer)
    if config.harness_schedule:
        return _rule_harness_read(record, channel)
    if record.lifecycle not in ("load_in_flight", "loaded"):
        return "the forward reads a loaded-back node after start_loading"
    if channel in record.reads_issued or channel != len(record.reads_issued):
        return "a forward reads each layer once, in order: target layers, then draft layers"
    return None


def _rule_harness_read(record: NodeState, channel: int) -> str | None:
    """The harness's forward reads any stored layer of a device node, or any loaded layer."""
    if record.lifecycle in ("load_in_flight", "loaded"):
        return None
    if record.lifecycle not in ("device_only", "backup_in_flight", "backed_up"):
        return f"the forward reads a node on device (lifecycle {record.lifecycle})"
    if channel not in record.stores_issued:
        return f"the forward reads channel {channel} after its KV store was queued"
    return None


def _rule_forward_ran(state: OracleState) -> str | None:
    if not any(isinstance(op, StoreKv | ReadKv) for op in state.streams[FORWARD]):
        return "no forward store or read is queued (the device ran work the oracle never saw)"
    return None


def _rule_advance(state: OracleState, op: Advance) -> str | None:
    index = STREAMS.index(op.stream)
    if not is_head_ready(state.streams, index):
        return f"the {op.stream} stream is empty or its head waits on a pending record"
    return None


def _rule_copy_landed(state: OracleState, op: CopyLanded) -> str | None:
    config = state.config
    if not 0 <= op.rank < config.num_ranks:
        return f"rank {op.rank} is outside [0, {config.num_ranks})"
    if op.layer is not None and not 0 <= op.layer < config.layers_of(op.pool):
        return f"layer {op.layer} is outside [0, {config.layers_of(op.pool)}) of {op.pool}"
    if op.pool == "draft" and not config.has_draft:
        return "no draft pool in this config"
    return None


# -- dispatch -----------------------------------------------------------------------------------


def _rule_for(state: OracleState, op: Op) -> str | None:
    match op:
        case Insert():
            return _rule_insert(state, op)
        case Store():
            return _rule_store(state, op)
        case Write():
            return _rule_write(state, op)
        case ReserveWriteCp():
            return _rule_reserve(state, op)
        case SubmitLayer():
            return _rule_submit(state, op)
        case OnLayerEnd():
            return _rule_on_layer_end(state, op)
        case CancelLayerWrite():
            return _rule_cancel(state, op)
        case EvictDevice():
            return _rule_evict_device(state, op)
        case EvictHost():
            return _rule_evict_host(state, op)
        case Load():
            return _rule_load(state, op)
        case StartLoading():
            return _rule_start_loading(state, op)
        case ForwardRead():
            return _rule_forward_read(state, op)
        case Advance():
            return _rule_advance(state, op)
        case CopyLanded():
            return _rule_copy_landed(state, op)
        case ForwardRan():
            return _rule_forward_ran(state)
        case DrainWriteAcks() | DrainLoadAcks() | Reset() | Noop():
            return None


def _apply(state: OracleState, op: Op) -> Step:
    match op:
        case Insert():
            return process_insert(state, op)
        case Store():
            return process_store(state, op)
        case Write():
            return process_write(state, op)
        case ReserveWriteCp():
            return process_reserve_write_cp(state, op)
        case SubmitLayer():
            targets = op.pool == "target"
            return submit_layer_states(state, (op.node,), op.layer, targets, not targets)
        case OnLayerEnd():
            return process_on_layer_end(state, op.layer, op.source)
        case CancelLayerWrite():
            return process_cancel_layer_write(state, op.node)
        case DrainWriteAcks():
            return process_drain_write_acks(state, op.count)
        case EvictDevice():
            return process_evict_device(state, op.node)
        case EvictHost():
            return process_evict_host(state, op.node)
        case Load():
            return process_load(state, op)
        case StartLoading():
            return process_start_loading(state)
        case ForwardRead():
            return process_forward_read(state, op)
        case DrainLoadAcks():
            return process_drain_load_acks(state, op.count)
        case Advance():
            return execute_head(state, STREAMS.index(op.stream))
        case CopyLanded():
            return process_copy_landed(state, op)
        case ForwardRan():
            return process_forward_ran(state)
        case Reset():
            return process_reset(state)
        case Noop():
            return state, ()


__all__ = [
    "OpNotEnabledError",
    "all_ops",
    "enabled_ops",
    "is_enabled",
    "run_ops",
    "step",
    "why_disabled",
]
