"""Checkers for the ack protocol: one ack per node (INV-02), FIFO drain (INV-09), producer slots
(INV-10), identical rows across ranks (INV-14), acked exactly once (INV-16), reset (INV-18).

An ack queue is given as rows of node ids, one row per ``HiCacheAck`` in queue order
(``[list(ack.node_ids) for ack in ctrl.ack_write_queue]``), so any implementation can be checked.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Literal

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants._convert import shorten

AckRows = Sequence[Sequence[int]]
"""An ack queue as node-id rows, front of the queue first."""


def check_single_write_ack(ack_node_id_rows: AckRows) -> None:
    """Raise INV-02 if a node id appears twice among the undrained write acks.

    Two acks for one radix registration mean one ``inc_lock_ref`` and two completions: a
    ``KeyError`` in ``writing_check`` or a negative lock count (bug class 1). Negative ids
    (``node_id=-1``, writes with no node) are not tracked and may repeat.
    """
    first_row: dict[int, int] = {}
    for row_index, row in enumerate(ack_node_id_rows):
        for node_id in row:
            if node_id < 0:
                continue
            # Verify no earlier ack (or earlier slot of this ack) carries the node
            if node_id in first_row:
                where = (
                    f"twice in ack row {row_index}"
                    if first_row[node_id] == row_index
                    else f"in ack rows {first_row[node_id]} and {row_index}"
                )
                raise InvariantViolation(
                    "INV-02",
                    f"node_id={node_id} has two undrained write acks ({where}); "
                    "reserve_write_cp must refuse with reason='undrained_ack' while one is queued",
                )
            first_row[node_id] = row_index


def check_undrained_gate_agrees(
    gate: Callable[[int], bool],
    rows: AckRows,
    candidate_ids: Iterable[int],
    *,
    inv_id: Literal["INV-02", "INV-18"] = "INV-02",
) -> None:
    """Raise ``inv_id`` unless ``gate(id)`` (``node_has_undrained_write_ack``) equals a queue scan.

    A false negative lets a duplicate reservation through (bug class 2: an append that
    bypassed the max-id bookkeeping, or a reset that cleared one but not the other).
    """
    queued = {node_id for row in rows for node_id in row}
    for node_id in candidate_ids:
        expected = node_id in queued
        answer = gate(node_id)
        # Verify the fast-path gate and the queue agree for this id
        if answer != expected:
            truth = "an ack in the queue carries it" if expected else "no queued ack carries it"
            kind = "false negative" if expected else "false positive"
            raise InvariantViolation(
                inv_id,
                f"node_has_undrained_write_ack({node_id}) returned {answer} but {truth} "
                f"({kind}; the gate must agree with a scan of ack_write_queue)",
            )


def check_producer_slots_held(num_undrained_load_acks: int, num_counters: int) -> None:
    """Raise INV-10 if more load acks are undrained than there are producer slots.

    Call it after a step: each undrained load ack holds one slot, so one more than
    ``num_counters`` means ``start_loading`` handed out a slot still in use (bug class 7).
    """
    # Verify no more loads are undrained than there are producer slots
    if num_undrained_load_acks > num_counters:
        raise InvariantViolation(
            "INV-10",
            f"{num_undrained_load_acks} undrained load acks exceed num_counters={num_counters}"
            " (a producer slot was handed out twice; start_loading only while fewer than "
            "num_counters load acks are undrained)",
        )


def _describe_rows(rows: Sequence[Sequence[int]], index: int) -> str:
    return str(list(rows[index])) if index < len(rows) else "nothing"


def check_ack_rows_identical(rows_per_rank: Sequence[AckRows], *, allow_lag: bool = False) -> None:
    """Raise INV-14 unless every CP/TP rank's ack queue carries the same node-id rows.

    Ranks drain ``MIN(ready count)`` acks each and pop node ids by position, so different rows
    make their radix trees diverge (bug class 19). With ``allow_lag`` (mid-run) a rank may be
    behind: its rows must then be a prefix of the longest rank's rows; at quiescence use the
    default, which also requires equal lengths. Zero-owned ranks are included.
    """
    if not rows_per_rank:
        return
    reference_rank = max(range(len(rows_per_rank)), key=lambda r: len(rows_per_rank[r]))
    if not allow_lag:
        reference_rank = 0
    reference = rows_per_rank[reference_rank]
    for rank, rows in enumerate(rows_per_rank):
        # Verify each row equals the reference rank's row at the same position
        for index, row in enumerate(rows):
            if index >= len(reference) or list(row) != list(reference[index]):
                raise InvariantViolation(
                    "INV-14",
                    f"rank {rank} ack row {index} carries node ids {list(row)} but rank "
                    f"{reference_rank} carries {_describe_rows(reference, index)} "
                    "(every rank must append the same node ids in the same order)",
                )
        # Verify no rank is missing rows at quiescence
        if not allow_lag and len(rows) != len(reference):
            raise InvariantViolation(
                "INV-14",
                f"rank {rank} has {len(rows)} ack rows but rank {reference_rank} has "
                f"{len(reference)} (a zero-owned rank still appends an ack per node)",
            )


def check_ack_queues_empty(rows_by_queue: Mapping[str, AckRows]) -> None:
    """Raise INV-16 if an ack is still queued at quiescence, after every submission was acked.

    ``rows_by_queue`` maps a queue's name to its node-id rows. At quiescence the tree has
    drained one ack per submission, so anything left is an extra ack for some node.
    """
    for name, rows in sorted(rows_by_queue.items()):
        # Verify the queue is empty once every submission was acked
        if rows:
            raise InvariantViolation(
                "INV-16",
                f"{name} still holds {len(rows)} ack(s) {shorten(list(r) for r in rows)} at "
                "quiescence, after every submission was acked (an extra ack for some node: "
                "each submission is acked exactly once)",
            )


def check_reset_clean(
    queue_lengths: Mapping[str, int],
    pending_layer_write_ids: Collection[int],
    producer_index: int,
    consumer_indices: Sequence[int],
    gate: Callable[[int], bool],
    candidate_ids: Iterable[int],
) -> None:
    """Raise INV-18 unless ``reset()`` left nothing queued, pending or claimed.

    ``queue_lengths`` names every queue the implementation has (write/load/draft queues, both
    ack queues, storage queues including ``host_mem_release_queue``, bug class 15). The
    undrained-ack gate must answer False for every id once the queue is empty (bug class 2).
    """
    # Verify every queue is empty
    leftovers = {name: length for name, length in queue_lengths.items() if length != 0}
    if leftovers:
        raise InvariantViolation(
            "INV-18",
            f"reset() left entries in {leftovers} (every queue must be empty after reset)",
        )
    # Verify no per-layer write state survives
    if pending_layer_write_ids:
        raise InvariantViolation(
            "INV-18",
            f"reset() left pending layer writes for node ids {shorten(sorted(pending_layer_write_ids))}"
            " (their hooks would copy into slots the caller is about to clear)",
        )
    # Verify no producer or consumer slot is still claimed
    if producer_index != -1 or list(consumer_indices):
        raise InvariantViolation(
            "INV-18",
            f"reset() left producer_index={producer_index}, consumer_indices="
            f"{list(consumer_indices)} (expected -1 and []: call layer_done_counter.reset())",
        )
    # Verify the duplicate-ack gate agrees with the empty queue
    check_undrained_gate_agrees(gate, [], candidate_ids, inv_id="INV-18")
