"""CrossHair entry points for the step functions: pure functions of a few ints.

CrossHair cannot build a consistent ``OracleState`` symbolically (nested records whose fields
must agree, see testing_anchors E11), so each function here builds a world from small ints,
drives ``step`` through one protocol phase, and returns whether the phase kept its promises.
``post: __return__`` makes CrossHair search the ints for a counterexample; the tests call the
same functions with concrete ints.
"""

from __future__ import annotations

from hicache_ref.oracle.config import STREAMS, WRITE, Direction, OracleConfig, Pool
from hicache_ref.oracle.geometry import FREE, compute_page_slots
from hicache_ref.oracle.invariants import check_invariants, is_quiescent
from hicache_ref.oracle.ops import (
    Advance,
    CancelLayerWrite,
    CopyLanded,
    DrainLoadAcks,
    DrainWriteAcks,
    EvictDevice,
    EvictHost,
    ForwardRead,
    Insert,
    Load,
    OnLayerEnd,
    Op,
    ReserveWriteCp,
    StartLoading,
    Store,
    Write,
)
from hicache_ref.oracle.queries import get_expected_resident_tags
from hicache_ref.oracle.state import CopyPages, OracleState, initial_state
from hicache_ref.oracle.step import all_ops, enabled_ops, is_enabled, run_ops, step
from hicache_ref.oracle.streams import is_head_ready

MAX_QUIET_STEPS = 256
"""Bound on stream steps ``run_until_quiet`` takes (a runaway would be an oracle bug)."""


def make_config(
    page_size: int, tokens: int, layer_num: int, draft_layer_num: int, cp_size: int, nodes: int = 1
) -> OracleConfig:
    """A world with room for ``nodes`` nodes of ``tokens`` tokens on every rank."""
    pages = -(-tokens // page_size) * nodes
    ranks = max(1, cp_size)
    return OracleConfig(
        page_size=page_size,
        layer_num=layer_num,
        draft_layer_num=draft_layer_num,
        device_pages=pages * ranks,
        host_pages=pages,
        draft_host_pages=pages,
        cp_size=cp_size,
        node_tokens=(tokens,) * nodes,
    )


def run_until_quiet(state: OracleState) -> OracleState:
    """Advance ready stream heads (forward, write, load order) until no stream can move."""
    for _ in range(MAX_QUIET_STEPS):
        ready = [name for i, name in enumerate(STREAMS) if is_head_ready(state.streams, i)]
        if not ready:
            return state
        state, _ = step(state, Advance(ready[0]))
    raise AssertionError(f"streams still busy after {MAX_QUIET_STEPS} steps")


def store_all(config: OracleConfig, node: int) -> tuple[Op, ...]:
    """The forward's KV stores of every target layer, then every draft layer, of ``node``."""
    target = tuple(Store(node, layer, "target") for layer in range(config.layer_num))
    return target + tuple(Store(node, layer, "draft") for layer in range(config.draft_layer_num))


def _is_clean(state: OracleState) -> bool:
    return not check_invariants(state)


def _resident_tags_hold(state: OracleState) -> bool:
    for expect in get_expected_resident_tags(state):
        channel = expect.layer + (state.config.layer_num if expect.pool == "draft" else 0)
        if expect.rank < 0:
            got = state.device_tags[channel][expect.slot]
        else:
            got = state.host_tags[channel][expect.rank][expect.slot]
        if got != expect.tag:
            return False
    return True


def write_then_drain_backs_up(
    page_size: int, tokens: int, layer_num: int, draft_layer_num: int, cp_size: int
) -> bool:
    """A write whose copies ran leaves every host copy with the node's tags once drained.

    pre: 1 <= page_size <= 3
    pre: 1 <= tokens <= 6
    pre: 1 <= layer_num <= 2
    pre: 0 <= draft_layer_num <= 2
    pre: 0 <= cp_size <= 3
    post: __return__
    """
    config = make_config(page_size, tokens, layer_num, draft_layer_num, cp_size)
    state, _ = run_ops(initial_state(config), (Insert(0), *store_all(config, 0), Write(0)))
    state = run_until_quiet(state)
    state, _ = step(state, DrainWriteAcks())
    record = state.nodes[0]
    host_held = sum(len(p) for p in record.host_pages)
    return (
        record.lifecycle == "backed_up"
        and record.lock_ref == 0
        and host_held == config.node_pages(0)
        and _resident_tags_hold(state)
        and _is_clean(state)
        and is_quiescent(state)
    )


def roundtrip_restores_tags(
    page_size: int, tokens: int, layer_num: int, draft_layer_num: int, cp_size: int
) -> bool:
    """write -> drain -> evict_device -> load -> start_loading -> read -> drain: bytes come back.

    pre: 1 <= page_size <= 3
    pre: 1 <= tokens <= 6
    pre: 1 <= layer_num <= 2
    pre: 0 <= draft_layer_num <= 2
    pre: 0 <= cp_size <= 3
    post: __return__
    """
    config = make_config(page_size, tokens, layer_num, draft_layer_num, cp_size)
    state, _ = run_ops(initial_state(config), (Insert(0), *store_all(config, 0), Write(0)))
    state = run_until_quiet(state)
    state, _ = run_ops(state, (DrainWriteAcks(), EvictDevice(0), Load(0), StartLoading()))
    reads = tuple(ForwardRead(0, layer, "target") for layer in range(layer_num))
    reads += tuple(ForwardRead(0, layer, "draft") for layer in range(draft_layer_num))
    state, _ = run_ops(state, reads)
    state = run_until_quiet(state)
    state, observations = step(state, DrainLoadAcks())
    owners = tuple(config.page_owner(p) for p in state.nodes[0].device_pages)
    return (
        state.nodes[0].lifecycle == "loaded"
        and owners == state.nodes[0].page_owners
        and observations[0].values == (0,)
        and _resident_tags_hold(state)
        and _is_clean(state)
        and is_quiescent(state)
    )


def per_layer_write_acks_once(layer_num: int, draft_layer_num: int, cp_size: int) -> bool:
    """CP per-layer write: the ack is appended once, and only after every target and draft layer.

    pre: 1 <= layer_num <= 3
    pre: 0 <= draft_layer_num <= 3
    pre: 1 <= cp_size <= 3
    post: __return__
    """
    config = make_config(2, 3, layer_num, draft_layer_num, cp_size)
    state, _ = run_ops(initial_state(config), (Insert(0), ReserveWriteCp(0)))
    hooks = [OnLayerEnd(layer, "target") for layer in range(layer_num)]
    hooks += [OnLayerEnd(layer, "draft") for layer in range(draft_layer_num)]
    stores = store_all(config, 0)
    for index, (store, hook) in enumerate(zip(stores, hooks, strict=True)):
        # Verify no ack is appended before the last layer was submitted (INV-04)
        if any(state.write_acks) and index > 0:
            return False
        state, _ = run_ops(state, (store, hook))
    rows = [tuple(a.node_ids for a in queue) for queue in state.write_acks]
    state = run_until_quiet(state)
    state, _ = step(state, DrainWriteAcks())
    return (
        all(row == ((0,),) for row in rows)
        and not state.pending_layer_writes
        and state.nodes[0].lifecycle == "backed_up"
        and _resident_tags_hold(state)
        and _is_clean(state)
    )


def cancel_leaves_no_trace(layer_num: int, submitted: int, cp_size: int) -> bool:
    """A cancelled per-layer write frees its host slots, appends no ack, and quiesces (INV-15).

    pre: 2 <= layer_num <= 3
    pre: 0 <= submitted < layer_num
    pre: 1 <= cp_size <= 3
    post: __return__
    """
    config = make_config(2, 4, layer_num, 0, cp_size)
    state, _ = run_ops(initial_state(config), (Insert(0), ReserveWriteCp(0)))
    for layer in range(submitted):
        state, _ = run_ops(state, (Store(0, layer), OnLayerEnd(layer)))
    state, _ = step(state, CancelLayerWrite(0))
    state = run_until_quiet(state)
    host_free = all(h == FREE for per_rank in state.host_holders for hs in per_rank for h in hs)
    return (
        host_free
        and not any(state.write_acks)
        and state.nodes[0].lifecycle == "device_only"
        and state.nodes[0].lock_ref == 0
        and not is_enabled(state, Write(0))
        and _is_clean(state)
    )


def landed_copies_match_advance(
    page_size: int, tokens: int, layer_num: int, draft_layer_num: int, cp_size: int
) -> bool:
    """Reporting each queued copy with ``CopyLanded`` predicts the same tags as ``Advance``.

    pre: 1 <= page_size <= 3
    pre: 1 <= tokens <= 6
    pre: 1 <= layer_num <= 2
    pre: 0 <= draft_layer_num <= 2
    pre: 0 <= cp_size <= 3
    post: __return__
    """
    config = make_config(page_size, tokens, layer_num, draft_layer_num, cp_size)
    state, _ = run_ops(initial_state(config), (Insert(0), *store_all(config, 0), Write(0)))
    while is_head_ready(state.streams, 0):
        state, _ = step(state, Advance("forward"))
    by_advance = run_until_quiet(state)
    by_report = state
    for op in state.streams[WRITE]:
        if isinstance(op, CopyPages):
            for report in _reports(config, op):
                by_report, _ = step(by_report, report)
    return (
        not by_report.streams[WRITE]
        and by_report.host_tags == by_advance.host_tags
        and by_report.write_acks == by_advance.write_acks
        and _is_clean(by_report)
    )


def _reports(config: OracleConfig, op: CopyPages) -> tuple[CopyLanded, ...]:
    """One ``CopyLanded`` per rank that ``op`` moves pages for."""
    draft = op.channel >= config.layer_num
    layer = op.channel - config.layer_num if draft else op.channel
    reports: list[CopyLanded] = []
    for rank in sorted({r for r, _, _ in op.pairs}):
        mine = [(h, d) for r, h, d in op.pairs if r == rank]
        host = tuple(s for h, _ in mine for s in compute_page_slots(h, config.page_size))
        device = tuple(s for _, d in mine for s in compute_page_slots(d, config.page_size))
        direction: Direction = "d2h" if op.direction == "d2h" else "h2d"
        pool: Pool = "draft" if draft else "target"
        reports.append(CopyLanded(direction, layer, host, device, pool, rank))
    return tuple(reports)


def trace_keeps_invariants(choices: tuple[int, ...]) -> bool:
    """Any trace of the correct protocol (two nodes, CP over two ranks, a draft layer) is clean.

    Choice ``c`` picks ``enabled[c % len(enabled)]``, so every int sequence is a legal trace.

    pre: len(choices) <= 24
    post: __return__
    """
    config = OracleConfig(
        page_size=2,
        layer_num=2,
        draft_layer_num=1,
        device_pages=2,
        host_pages=2,
        draft_host_pages=2,
        cp_size=2,
        node_tokens=(2, 2),
    )
    universe = all_ops(config)
    state = initial_state(config)
    for choice in choices:
        enabled = enabled_ops(state, universe)
        state, _ = step(state, enabled[choice % len(enabled)])
        if not _is_clean(state):
            return False
    return True


def evict_host_frees_everything(cp_size: int, draft_layer_num: int) -> bool:
    """After write -> drain -> evict_device -> evict_host every page is free again (INV-05).

    pre: 0 <= cp_size <= 3
    pre: 0 <= draft_layer_num <= 2
    post: __return__
    """
    config = make_config(2, 3, 1, draft_layer_num, cp_size)
    state, _ = run_ops(initial_state(config), (Insert(0), *store_all(config, 0), Write(0)))
    state = run_until_quiet(state)
    state, _ = run_ops(state, (DrainWriteAcks(), EvictDevice(0), EvictHost(0)))
    every = (*state.device_holders, *(h for pr in state.host_holders for hs in pr for h in hs))
    return all(h == FREE for h in every) and state.nodes[0].lifecycle == "gone" and _is_clean(state)


__all__ = [
    "cancel_leaves_no_trace",
    "evict_host_frees_everything",
    "landed_copies_match_advance",
    "make_config",
    "per_layer_write_acks_once",
    "roundtrip_restores_tags",
    "run_until_quiet",
    "store_all",
    "trace_keeps_invariants",
    "write_then_drain_backs_up",
]
