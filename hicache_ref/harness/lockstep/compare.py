"""What the lockstep oracle compares, and which worlds it can follow (``harness/lockstep/oracle.py``).

Every comparison reads the implementation only where the tree itself does (its ack queues);
pages come from the tree's model of the harness's own pools, bytes from the harness's pools.
A difference raises ``InvariantViolation`` under the invariant whose quantity diverged, naming
where (the step), the quantity, the oracle's value and the implementation's, in that order
(``specs/invariants.md``, "The oracle in lockstep"):

1. ``compare_state`` after every step: ack rows (write and load, every rank, node ids and
   order; INV-16), every node's lifecycle (INV-16) and producer slot (INV-10), every node's
   device and host pages (INV-05);
2. ``compare_final_content`` at quiescence: every content tag the oracle holds for a page a
   node owns, against the first element of the actual row there (device and host, target and
   draft, the first component of every layer; INV-06).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache_ref.device.sim import SimDevice
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.world.content import compute_row_value, describe_row
from hicache_ref.oracle.geometry import GARBAGE, compute_owned_positions, decode_token_tag
from hicache_ref.oracle.queries import get_load_ack_rows, get_write_ack_rows
from hicache_ref.oracle.state import Lifecycle, OracleState

if TYPE_CHECKING:
    from hicache_ref.harness.driver.tree import Node
    from hicache_ref.harness.steps.session import Session

_LIVE: tuple[Lifecycle, ...] = (
    "device_only",
    "backup_in_flight",
    "backed_up",
    "host_only",
    "load_queued",
    "load_in_flight",
    "loaded",
)
LIVE = frozenset(_LIVE)
"""Lifecycles of a node the tree holds (not absent, not gone)."""


def unsupported_reason(session: Session) -> str | None:
    """Why the oracle cannot follow this world (None: it can).

    Every ``HarnessConfig`` on the simulator is followed: CP worlds (logical pages, per-rank
    host slots, zero-owned ranks), every layout and io backend, drafts, and hybrid pools (their
    linear-attention layers are never cached: the controller unwraps the ``full_kv_pool``).
    """
    if not isinstance(session.world.device, SimDevice):
        return "not a SimDevice: lockstep needs the device's execution log"
    if len(session.world.ranks) != session.config.num_ranks:
        return "a rank session (one process per CP rank): the oracle steps every rank at once"
    if session.config.has_side_pools:
        group = session.config.pool_group
        return f"an independent side pool (pool_group={group!r}): the oracle has no side pools"
    return None


def fail(where: str, inv_id: str, quantity: str, oracle: object, implementation: object) -> None:
    raise InvariantViolation(
        inv_id,
        f"lockstep divergence at {where}: {quantity}: oracle {oracle}, implementation "
        f"{implementation}",
    )


def compare_state(session: Session, state: OracleState, where: str) -> None:
    """Ack rows, lifecycles and producer slots, and page holdings (see the module docstring)."""
    compare_ack_rows(session, state, where)
    compare_lifecycles(session, state, where)
    compare_holdings(session, state, where)


def compare_ack_rows(session: Session, state: OracleState, where: str) -> None:
    # Verify every rank's ack queues carry the oracle's node ids, in the oracle's order: no ack
    # lost, none extra, none early (INV-16)
    for rank in session.world.ranks:
        controller = rank.controller
        for name, queue, oracle in (
            ("ack_write_queue", controller.ack_write_queue, get_write_ack_rows(state, rank.rank)),
            ("ack_load_queue", controller.ack_load_queue, get_load_ack_rows(state, rank.rank)),
        ):
            rows = tuple(tuple(int(i) for i in ack.node_ids) for ack in queue)
            if rows != oracle:
                fail(where, "INV-16", f"{name} rows of rank {rank.rank}", oracle, rows)


def expected_lifecycles(node: Node) -> frozenset[Lifecycle]:
    """The oracle lifecycles a tree node may be in."""
    if node.loading:
        return frozenset({"load_in_flight" if node.producer_id is not None else "load_queued"})
    if node.backup == "in_flight":
        return frozenset({"backup_in_flight"})
    if node.backup == "done":
        return frozenset({"backed_up", "loaded"} if node.on_device else {"host_only"})
    return frozenset({"device_only"})


def compare_lifecycles(session: Session, state: OracleState, where: str) -> None:
    # Verify every tree node has the oracle's lifecycle and producer slot, and no other node
    # is live in the oracle: every submission settles when the oracle's does (INV-16), and a
    # load runs in the producer slot the oracle hands out (INV-10)
    tree_ids = set()
    for node in session.tree.nodes.values():
        tree_ids.add(node.node_id)
        record = state.nodes[node.node_id] if node.node_id < len(state.nodes) else None
        lifecycle = record.lifecycle if record is not None else "absent"
        expected = expected_lifecycles(node)
        if lifecycle not in expected:
            fail(where, "INV-16", f"lifecycle of node {node.node_id}", lifecycle, sorted(expected))
        if record is not None and lifecycle == "load_in_flight":
            if record.load_slot != node.producer_id:
                fail(
                    where,
                    "INV-10",
                    f"producer slot of node {node.node_id}",
                    record.load_slot,
                    node.producer_id,
                )
    for node_id, record in enumerate(state.nodes):
        if record.lifecycle in LIVE and node_id not in tree_ids:
            fail(
                where, "INV-16", f"lifecycle of node {node_id}", record.lifecycle, "not in the tree"
            )


def compare_holdings(session: Session, state: OracleState, where: str) -> None:
    # Verify every node holds the oracle's device and host pages, from the tree's model of the
    # harness's own pools: the holder of every page is the oracle's (INV-05)
    for held in session.model().nodes:
        record = state.nodes[held.node_id]
        if frozenset(record.device_pages) != held.device_pages:
            fail(
                where,
                "INV-05",
                f"device pages of node {held.node_id}",
                sorted(record.device_pages),
                sorted(held.device_pages),
            )
        ranks = len(session.world.ranks)
        oracle_host = _per_rank(record.host_pages, ranks)
        if oracle_host != held.host_pages:
            fail(
                where,
                "INV-05",
                f"host pages of node {held.node_id}",
                _show(oracle_host),
                _show(held.host_pages),
            )
        # a non-CP draft copy lives in the target's host slots of the draft host pool
        draft = held.host_pages if not session.config.uses_cp else held.draft_host_pages
        if session.config.has_draft:
            oracle_draft = _per_rank(record.draft_host_pages, ranks)
            if oracle_draft != draft:
                fail(
                    where,
                    "INV-05",
                    f"draft host pages of node {held.node_id}",
                    _show(oracle_draft),
                    _show(draft),
                )


def _per_rank(pages: tuple[tuple[int, ...], ...], ranks: int) -> tuple[frozenset[int], ...]:
    if not pages:
        return tuple(frozenset() for _ in range(ranks))
    return tuple(frozenset(p) for p in pages)


def _show(per_rank: tuple[frozenset[int], ...]) -> list[list[int]]:
    return [sorted(p) for p in per_rank]


def compare_final_content(
    session: Session, state: OracleState, handles: dict[int, int], where: str
) -> None:
    """Every tag of a held token slot against the actual row there (see the module docstring).

    Only a node's own token slots are compared: padding slots past its last token hold
    whatever reached them last (the poison of a freed page, an older node's KV), as on a GPU.
    """
    config = state.config
    for rank in session.world.ranks:
        device_slots, device_locs, host_of = _held_token_slots(state, rank.rank)
        for channel in range(config.num_channels):
            draft = channel >= config.layer_num
            layer = channel - config.layer_num if draft else channel
            device_pool = rank.draft_device_pool if draft else rank.device_pool
            host_pool = rank.draft_host_pool if draft else rank.host_pool
            assert device_pool is not None and host_pool is not None
            component = device_pool.component_names()[0]
            tags = [state.device_tags[channel][s] for s in device_slots]
            actual = _first_elements(device_pool.read_rows(component, layer, _locs(device_locs)))
            what = "device slot"
            _compare_tags(where, what, device_slots, tags, actual, handles, state, draft, layer)
            host_slots = host_of[1 if draft else 0]
            tags = [state.host_tags[channel][rank.rank][s] for s in host_slots]
            actual = _first_elements(host_pool.read_rows(component, layer, _locs(host_slots)))
            what = f"host slot (rank {rank.rank})"
            _compare_tags(where, what, host_slots, tags, actual, handles, state, draft, layer)


def _held_token_slots(
    state: OracleState, rank: int
) -> tuple[list[int], list[int], tuple[list[int], list[int]]]:
    """(logical device slots, their physical locs, (target host slots, draft host slots)) of
    every live node's tokens on ``rank``: the slots whose content the oracle predicts."""
    config = state.config
    page, cp = config.page_size, config.cp_size
    device_slots: list[int] = []
    device_locs: list[int] = []
    host_of: tuple[list[int], list[int]] = ([], [])
    for node, record in enumerate(state.nodes):
        if record.lifecycle not in LIVE:
            continue
        tokens = config.node_tokens[node]
        for position, p in enumerate(record.device_pages):
            if config.page_owner(p) != rank:
                continue
            for k in range(min(page, tokens - position * page)):
                device_slots.append(p * page + k)
                device_locs.append((p // cp if cp else p) * page + k)
        positions = compute_owned_positions(record.page_owners, rank)
        for slots, per_rank in zip(
            host_of, (record.host_pages, record.draft_host_pages), strict=True
        ):
            if not per_rank:
                continue
            for host_page, position in zip(per_rank[rank], positions, strict=True):
                slots.extend(
                    host_page * page + k for k in range(min(page, tokens - position * page))
                )
    return device_slots, device_locs, host_of


def _locs(slots: list[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def _first_elements(rows: torch.Tensor) -> list[float]:
    return [float(v) for v in rows.reshape(rows.shape[0], -1)[:, 0].tolist()] if len(rows) else []


def _compare_tags(
    where: str,
    what: str,
    slots: list[int],
    tags: list[int],
    actual: list[float],
    handles: dict[int, int],
    state: OracleState,
    draft: bool,
    layer: int,
) -> None:
    kind = "draft" if draft else "target"
    stride = state.config.token_stride
    for slot, tag, value in zip(slots, tags, actual, strict=True):
        if tag == GARBAGE:
            continue  # the oracle predicts nothing for a slot no node's KV reached
        decoded = decode_token_tag(tag, stride)
        assert decoded is not None
        node, token = decoded
        want = compute_row_value(handles[node], draft, layer, 0, token)
        # Verify the page holds the KV the oracle's copies put there (INV-06)
        if value != want:
            fail(
                where,
                "INV-06",
                f"content of {kind} layer {layer} {what} {slot}",
                f"node {node} token {token}",
                describe_row(value),
            )
