"""After each step, every rank's state as plain data, and the first way two ranks differ.

``digest_rank`` reads what must be the same on every CP rank after the same step: the step's
outcome (but for what is rank-local: an advance's op counts, and which host pool refused a
reservation, not that it was refused), the ack rows (node ids, in order: INV-14), the logical
device pages the allocator handed out (ranks allocate in lockstep),
the producer slot, the pending per-layer writes and the tree's node table (what each rank's
radix tree believes: ids, backups, loads). Host slots differ by design (a rank holds only the
pages it owns), so the comparison checks what they must add up to: every page of a backed-up
node's padded span is held by exactly one rank (INV-05 across ranks). At quiescence the
finished flags are compared too (mid-run they are rank-local progress).

``find_divergence`` names the first field, in a fixed order, on which a rank differs from
rank 0, with both values, so every rank raises the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from hicache_ref.distributed.rank_session import RankSession
from hicache_ref.harness.step_types import Outcome

Rows = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RankDigest:
    """What must agree across CP ranks after a step (``host_slots`` must add up instead)."""

    outcome: str
    write_rows: Rows
    load_rows: Rows
    device_pages: tuple[int, ...]
    producer_index: int
    pending_layer_writes: tuple[int, ...]
    nodes: tuple[tuple[int, int, str, bool, bool, int], ...]  # handle, id, backup, device, ...
    expected_host_slots: tuple[int, int]  # (target, draft) slots summed over ranks
    finished: tuple[tuple[bool, ...], tuple[bool, ...]] | None  # at quiescence only
    host_slots: tuple[int, int]  # this rank's (target, draft) host slots in use


COMPARED = tuple(f.name for f in fields(RankDigest) if f.name != "host_slots")
RULE_OF: dict[str, str] = {
    "outcome": "every rank decides the same step the same way",
    "write_rows": "every rank appends the same write acks in order, zero-owned ranks included",
    "load_rows": "every rank appends the same load acks in order, zero-owned ranks included",
    "device_pages": "every rank's allocator hands out the same logical pages",
    "producer_index": "every rank takes the same producer slot",
    "pending_layer_writes": "every rank holds the same per-layer write states",
    "nodes": "every rank's tree unlocks and acks the same nodes",
    "expected_host_slots": "every rank's tree backs up the same nodes",
    "finished": "at quiescence every rank's acks finished",
}
"""What each compared field must satisfy (the message's fix)."""


def digest_rank(
    rank_session: RankSession, outcome: Outcome, *, quiescent: bool = False
) -> RankDigest:
    session = rank_session.session
    (snap,) = session.snapshots()
    config = session.config
    page = config.page_size
    nodes = tuple(
        (
            n.handle,
            n.node_id,
            n.backup,
            n.on_device,
            n.loading,
            -1 if n.producer_id is None else n.producer_id,
        )
        for n in sorted(session.tree.nodes.values(), key=lambda n: n.handle)
    )
    held = sum(
        -(-n.logical_len // page) * page for n in session.tree.nodes.values() if n.backup != "none"
    )
    draft_pages = snap.draft_host_pages
    finished = None
    if quiescent:
        finished = (
            tuple(a.finished for a in snap.write_acks),
            tuple(a.finished for a in snap.load_acks),
        )
    return RankDigest(
        outcome=outcome.shared,  # the outcome without its rank-local detail
        write_rows=tuple(a.node_ids for a in snap.write_acks),
        load_rows=tuple(a.node_ids for a in snap.load_acks),
        device_pages=tuple(sorted(snap.device_pages)),
        producer_index=snap.producer_index,
        pending_layer_writes=tuple(sorted(snap.pending_layer_writes)),
        nodes=nodes,
        expected_host_slots=(held, held if draft_pages is not None else 0),
        finished=finished,
        host_slots=(
            len(snap.host_pages) * page,
            0 if draft_pages is None else len(draft_pages) * page,
        ),
    )


def find_divergence(digests: Sequence[RankDigest]) -> tuple[str, str] | None:
    """The first difference between ranks: (invariant id, one line naming field and values)."""
    first = digests[0]
    # Verify every rank's outcome, ack rows, pages and tree equal rank 0's (INV-14)
    for name in COMPARED:
        for rank, digest in enumerate(digests[1:], start=1):
            ours, theirs = getattr(first, name), getattr(digest, name)
            if ours != theirs:
                detail = (
                    f"{name} differ: rank 0 {_short(ours)} vs rank {rank} {_short(theirs)} "
                    f"({RULE_OF[name]})"
                )
                return "INV-14", detail
    # Verify every page of each backed-up node is held on exactly one rank's host (INV-05)
    for index, pool in enumerate(("host", "draft host")):
        held = [d.host_slots[index] for d in digests]
        expected = first.expected_host_slots[index]
        if sum(held) != expected:
            return "INV-05", (
                f"{pool} slots held per rank {held} add up to {sum(held)}, but the backed-up "
                f"nodes' padded spans need {expected} (each page on exactly its owner rank)"
            )
    return None


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
