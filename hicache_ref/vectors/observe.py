"""What a step produced, read from the session the way the harness checks it: never from the
implementation's word, never by parsing a rule's outcome text.

capture (the state before a step: node lifecycles, ack rows) -> observe (after it: accepted or
refused from the tree's model, the normalized indices the call returned, ack rows drained and
queued, every rank's holdings, and the bytes of every copy whose ack drained) -> ``final`` (the
same at quiescence, with every resident copy's bytes).

Bytes are digested per page of a node, over its logical rows in a fixed order (pool, layer,
component, token), so the digest does not depend on the host layout, the slots the
implementation chose or which CP rank holds the page; ``expected_digests`` computes the same
from the content oracle (``harness/world/content.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hicache_ref.harness.driver.node_model import Node
from hicache_ref.harness.rules import RULES
from hicache_ref.harness.step_types import Outcome
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.content import expected_rows
from hicache_ref.vectors.models import (
    Acked,
    AckRows,
    CopyBytes,
    Expect,
    Final,
    Holding,
    RefusalReason,
    Returned,
)

NodeState = tuple[bool, str, bool]  # on device, backup, loading
CopyKind = Literal["device", "host"]
NO_NODE: NodeState = (False, "", False)


@dataclass(frozen=True)
class Before:
    """The harness's view just before a step."""

    nodes: dict[int, NodeState]
    write_rows: list[list[int]]
    load_rows: list[list[int]]


def _rows(queue: object) -> list[list[int]]:
    return [list(map(int, ack.node_ids)) for ack in queue]  # type: ignore[attr-defined]


def capture(session: Session) -> Before:
    tree = session.tree
    controller = session.world.ranks[0].controller
    nodes = {h: (n.on_device, n.backup, n.loading) for h, n in tree.nodes.items()}
    return Before(nodes, _rows(controller.ack_write_queue), _rows(controller.ack_load_queue))


def _drained(before: list[list[int]], after: list[list[int]]) -> list[list[int]]:
    """The rows a step popped from the front: the shortest prefix whose removal leaves a
    queue that ``after`` starts with (a step drains a prefix, then may append)."""
    for popped in range(len(before) + 1):
        rest = before[popped:]
        if after[: len(rest)] == rest:
            return before[:popped]
    return before


def holdings(session: Session) -> list[Holding]:
    """Every rank's allocated pages, from the harness's own pools."""
    out = []
    for rank in session.world.ranks:
        draft = rank.draft_host_pool if session.config.uses_cp else None
        out.append(
            Holding(
                device_pages=len(rank.allocator.allocated_page_ids()),
                host_pages=len(rank.host_pool.allocated_pages()),
                draft_host_pages=None if draft is None else len(draft.allocated_pages()),
            )
        )
    return out


# -- bytes ------------------------------------------------------------------------------------
RowsOf = Callable[[int, bool, int, int], tuple[torch.Tensor, torch.Tensor]]
"""(rank, draft, layer, component) -> (positions, rows at those positions)."""


def _page_digests(
    session: Session, node: Node, layers: dict[bool, int], rows_of: RowsOf
) -> list[str]:
    page = session.config.page_size
    pages = -(-node.logical_len // page)
    hashes = [hashlib.sha256() for _ in range(pages)]
    for draft in (False, True):
        if draft and not session.config.has_draft:
            continue
        # each pool's own components (a Mamba state pool: conv and temporal, beside MLA's kv)
        names = session.tree.geometry.pools(0, draft)[0].component_names()
        for layer in range(layers.get(draft, 0)):
            for component in range(len(names)):
                full: torch.Tensor | None = None
                for rank in range(len(session.world.ranks)):
                    positions, rows = rows_of(rank, draft, layer, component)
                    rows = rows.detach().to("cpu", torch.float64)
                    if full is None:
                        full = torch.zeros((node.logical_len, *rows.shape[1:]), dtype=torch.float64)
                    if len(positions):
                        full[positions.to("cpu", torch.int64)] = rows
                assert full is not None
                for j, digest in enumerate(hashes):
                    digest.update(full[j * page : (j + 1) * page].contiguous().numpy().tobytes())
    return [h.hexdigest()[:16] for h in hashes]


def _layer_counts(session: Session, node: Node, copy_kind: CopyKind) -> dict[bool, int]:
    config = session.config
    stored = (
        node.layers_stored
        if copy_kind == "device"
        else max(config.layer_num, config.draft_layer_num)
    )
    counts = {False: min(config.layer_num, stored)}
    if config.has_draft:
        counts[True] = min(config.draft_layer_num, stored)
    return counts


def actual_bytes(session: Session, node: Node, copy_kind: CopyKind) -> CopyBytes:
    """The digests of a node's device or host copy as the harness's pools hold it."""
    g = session.tree.geometry

    def device_rows(
        rank: int, draft: bool, layer: int, c: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions, locs = g.placement(rank, node, draft)  # a side pool's rows are its own
        pool, _ = g.pools(rank, draft)
        return positions, pool.layer_buffers(layer)[c][locs]

    def host_rows(rank: int, draft: bool, layer: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions, slots = g.host_positions(rank, node, draft)
        _, host_pool = g.pools(rank, draft)
        name = host_pool.device_pool.component_names()[c]
        return positions, host_pool.read_rows(name, layer, slots)

    rows_of = device_rows if copy_kind == "device" else host_rows
    layers = _layer_counts(session, node, copy_kind)
    return CopyBytes(
        node=node.handle,
        copy_kind=copy_kind,
        pages=_page_digests(session, node, layers, rows_of),
    )


def expected_bytes(session: Session, node: Node, copy_kind: CopyKind) -> CopyBytes:
    """The digests the content oracle predicts for the same copy."""
    config, geometry = session.config, session.tree.geometry

    def oracle_rows(
        rank: int, draft: bool, layer: int, c: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # each pool's rows at its own shape; a state pool's node holds one slot (position 0)
        pool = geometry.pools(0, draft)[0]
        shapes = [tuple(s) for s in pool.component_row_shapes().values()]
        held = config.side_rows(node.logical_len) if draft else node.logical_len
        positions = torch.arange(held) if rank == 0 else torch.empty(0, dtype=torch.int64)
        return positions, expected_rows(node.handle, draft, layer, c, positions, shapes[c])

    layers = _layer_counts(session, node, copy_kind)
    return CopyBytes(
        node=node.handle,
        copy_kind=copy_kind,
        pages=_page_digests(session, node, layers, oracle_rows),
    )


# -- one step ---------------------------------------------------------------------------------
def _returned(
    indices: Sequence[torch.Tensor | None], page: int, side_page: int | None = None
) -> Returned | None:
    """The count and alignment of returned indices; ``side_page``: the page size of the
    second tensor's pool (an independent side pool's; the first's elsewhere)."""
    pages = [page, page if side_page is None else side_page, *[page] * len(indices)]
    held = [(t, p) for t, p in zip(indices, pages, strict=False) if t is not None]
    if not held:
        return None
    count = sum(int(t.numel()) for t, _ in held)
    aligned = all(_is_aligned(t, p) for t, p in held)
    return Returned(count=count, aligned=aligned)


def _is_aligned(indices: torch.Tensor, page: int) -> bool:
    if indices.numel() % page:
        return False
    if not indices.numel():
        return True
    rows = indices.to("cpu", torch.int64).reshape(-1, page)
    return bool((rows == rows[:, :1] + torch.arange(page)).all() and (rows[:, 0] % page == 0).all())


def _host_indices(session: Session, node: Node) -> list[torch.Tensor | None]:
    if session.config.uses_cp:
        return [meta.host_indices if meta is not None else None for meta in node.cp_meta]
    return [*node.host_value, *(node.side_host or [])]  # an independent side pool's slots too


def _reason_for_backup(session: Session, node: Node) -> RefusalReason:
    """Why a backup of ``node`` was refused, by the harness's own accounting of free slots."""
    world = session.world
    if node.value is None:
        return "refused"
    if not session.config.uses_cp:
        rank = world.ranks[0]
        if node.value.numel() > rank.host_pool.available_size():
            return "host_capacity"
        side, side_rows = rank.draft_host_pool, node.side_value
        if session.config.has_side_pools and side is not None and side_rows is not None:
            short = side_rows.numel() > side.available_size()  # the side pool's own host slots
            return "draft_host_capacity" if short else "refused"
        return "refused"
    padded = session.tree.geometry.padded_locs(node.value)
    draft_short = False
    for rank in world.ranks:
        assert rank.cp_layout is not None
        owned = int(rank.cp_layout.owned_by_this_rank(padded).sum())
        if owned > rank.host_pool.available_size():
            return "host_capacity"
        if rank.draft_host_pool is not None and owned > rank.draft_host_pool.available_size():
            draft_short = True
    if draft_short:
        return "draft_host_capacity"
    controller = world.ranks[0].controller
    if any(node.node_id in ack.node_ids for ack in controller.ack_write_queue):
        return "undrained_ack"
    return "refused"


def _owners(session: Session, node: Node) -> list[int] | None:
    if not session.config.uses_cp or node.value is None:
        return None
    layout = session.world.ranks[0].cp_layout
    assert layout is not None
    page = session.config.page_size
    padded = session.tree.geometry.padded_locs(node.value)
    pages = torch.div(padded[::page], page, rounding_mode="floor")
    return [int(o) for o in layout.owner_for_logical_pages(pages).tolist()]


def observe(session: Session, before: Before, step: Step, outcome: Outcome) -> Expect:
    """The observation of ``step``, just applied to ``session`` with ``outcome``: accepted or
    refused from the outcome's typed facts, why from the harness's own accounting."""
    tree = session.tree
    record = RULES[step.rule]
    status: Literal["applied", "refused"] = "applied"
    returned, owners = None, None
    handle = int(step.args.get("node", step.args.get("handle", -1)))
    node = tree.nodes.get(handle)
    page = session.config.page_size
    reason: RefusalReason | None = None
    # what the step hands back is its record's ``returns``: a new node, device pages, host slots
    if outcome.refused:
        status = "refused"
        if record.returns == "new_node":
            reason = "forward_batch_midway" if tree.batch_layer > 0 else "device_capacity"
        elif record.returns == "device_pages":
            reason = "device_capacity"
        else:
            reason = "refused" if node is None else _reason_for_backup(session, node)
    elif record.returns == "new_node" and node is not None:
        owners = _owners(session, node)
        if outcome.reservation == "refused":
            reason = _reason_for_backup(session, node)
        elif outcome.reservation == "made":
            returned = _returned(_host_indices(session, node), page)
    elif record.refusable and node is not None:
        if record.returns == "device_pages" and node.value is not None:
            side_page = session.config.side_page_size  # each pool at its own page size
            returned = _returned([node.value, node.side_value], page, side_page)
        elif node.backup != "none":
            side_page = session.config.side_page_size  # each pool at its own page size
            returned = _returned(_host_indices(session, node), page, side_page)
    refusal = reason
    after = capture(session)
    if record.resets:
        drained = AckRows()
    else:
        drained = AckRows(
            write=_drained(before.write_rows, after.write_rows),
            load=_drained(before.load_rows, after.load_rows),
        )
    return Expect(
        status=status,
        refusal=refusal,
        returned=returned,
        owners=owners,
        drained=drained,
        queued=AckRows(write=after.write_rows, load=after.load_rows),
        held=holdings(session),
        bytes=_landed_bytes(session, before),
    )


def _landed_bytes(session: Session, before: Before) -> list[CopyBytes]:
    """The copies whose ack drained in this step: host copies of acked writes, device copies
    of acked loads (the bytes the harness has just checked)."""
    out = []
    for handle, node in sorted(session.tree.nodes.items()):
        was = before.nodes.get(handle)
        if was is None:
            continue
        if was[1] == "in_flight" and node.backup == "done":
            out.append(actual_bytes(session, node, "host"))
        if was[2] and not node.loading and node.on_device:
            out.append(actual_bytes(session, node, "device"))
    return out


def resident_nodes(session: Session) -> list[tuple[Node, CopyKind]]:
    """Every resident copy at quiescence: fully stored device copies, backed-up host copies."""
    tree = session.tree
    out: list[tuple[Node, CopyKind]] = []
    for _, node in sorted(tree.nodes.items()):
        if node.on_device and node.layers_stored == tree.total_layers:
            out.append((node, "device"))
        if node.backup == "done":
            out.append((node, "host"))
    return out


def observe_final(session: Session, before: Before) -> Final:
    """After ``session.finish()``: what the drains completed, what is held, every resident
    copy's bytes."""
    nodes = session.tree.nodes
    written = [
        n.node_id
        for h, n in nodes.items()
        if before.nodes.get(h, NO_NODE)[1] == "in_flight" and n.backup == "done"
    ]
    loaded = [
        n.node_id for h, n in nodes.items() if before.nodes.get(h, NO_NODE)[2] and not n.loading
    ]
    return Final(
        acked=Acked(write=sorted(written), load=sorted(loaded)),
        held=holdings(session),
        bytes=[actual_bytes(session, node, kind) for node, kind in resident_nodes(session)],
    )
