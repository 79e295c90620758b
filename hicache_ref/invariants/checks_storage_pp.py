"""Checker of the PP prefetch tickets of a PP storage world (INV-38).

In a PP world (``HarnessConfig.storage_pp``) PP rank 0 submits a prefetch ticket and every PP
rank's command thread takes it off the command group's broadcast, queries it and stages the
rank-agreed hit into host slots of its own (0.5.23+). On 0.5.21 - 0.5.22 the ticket carries the
hit: PP rank 0 queried every PP rank's shard when it submitted, and the command threads stage
that hit without a query of their own, so a rank's staged hit is judged against what its own
shard held at that query (``PpTicketRecord.shard_tokens``). A ticket whose spec names an
independent side pool (an SWA window, a Mamba state page) holds window slots of that pool's
own: never more than its spec's window, and none once retired (``PpTicketRecord.side_held_tokens``). On every release a ticket's IO
writes its pages only into host slots the ticket holds at that moment
(``PpTicketRecord.stray_writes``: the harness watches the host pool's page writes). The snapshot's ``pp_tickets`` is the harness's record
of that per rank (``harness/driver/pp_tree.py``); it is empty in every other world, where the
checker has nothing to judge.
"""

from __future__ import annotations

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checker import registered
from hicache_ref.invariants.evidence import Evidence, storage_snapshot_of
from hicache_ref.invariants.storage_snapshot import (
    PpTicketRecord,
    PpVerdictRecord,
    StorageSnapshot,
)


def _agree(
    rank: int, mine: PpTicketRecord, first: PpTicketRecord, position: int, at_rest: bool
) -> None:
    where = f"PP rank {rank}'s ticket #{position} of epoch {mine.epoch}"
    if mine.request_id != first.request_id:
        raise InvariantViolation(
            "INV-38",
            f"{where} is {mine.request_id!r} but PP rank 0's is {first.request_id!r} (every rank "
            "takes the same tickets off the command group in the same order)",
        )
    if not (mine.ended and first.ended):
        return  # under schedule points a body is judged once it ended on both ranks
    if mine.keys != first.keys:
        raise InvariantViolation(
            "INV-38",
            f"{where} ({mine.request_id!r}) queried page keys {list(mine.keys)} but PP rank 0 "
            f"queried {list(first.keys)} (every rank queries the ticket's chain: its tokens "
            "after its last_hash)",
        )
    if None not in (mine.hit_tokens, first.hit_tokens) and mine.hit_tokens != first.hit_tokens:
        raise InvariantViolation(
            "INV-38",
            f"{where} ({mine.request_id!r}) staged a hit of {mine.hit_tokens} tokens but PP rank "
            f"0 staged {first.hit_tokens} (the hit is the MIN over the PP ranks)",
        )
    if first.ready and not mine.ready and at_rest:
        raise InvariantViolation(
            "INV-38",
            f"{where} ({mine.request_id!r}) is not ready while PP rank 0's is, with every "
            "thread at rest (each rank's sync thread publishes it from the same synchronized "
            "acks; the rank's take_ready_pp_prefetch would wait for it forever)",
        )


def _holds(rank: int, ticket: PpTicketRecord) -> None:
    where = f"PP rank {rank}'s ticket {ticket.request_id!r} (epoch {ticket.epoch})"
    if ticket.ended and ticket.held_tokens > (ticket.hit_tokens or 0):
        raise InvariantViolation(
            "INV-38",
            f"{where} holds {ticket.held_tokens} host slot(s) for a staged hit of "
            f"{ticket.hit_tokens} tokens (the slots past the agreed hit go back at once)",
        )
    if ticket.ended and ticket.shard_tokens is not None:
        # Verify a hit PP rank 0 carried on the ticket is no longer than this rank's shard held
        if (ticket.hit_tokens or 0) > ticket.shard_tokens:
            raise InvariantViolation(
                "INV-38",
                f"{where} staged PP rank 0's hit of {ticket.hit_tokens} tokens but its own "
                f"shard held only the first {ticket.shard_tokens} of the ticket's tokens when "
                "PP rank 0 decided it (the carried hit is the MIN over every PP rank's shard: "
                "query each rank's keys, extra_info pp_rank; past its shard a rank reads a hole)",
            )
    # Verify the IO wrote the ticket's pages only into slots the ticket held (#27550's class)
    if ticket.stray_writes:
        slots = ", ".join(str(slot) for slot, _ in ticket.stray_writes)
        holders = ", ".join(holder for _, holder in ticket.stray_writes)
        raise InvariantViolation(
            "INV-38",
            f"{where}: its IO wrote the ticket's pages into host slot(s) {slots}, which the "
            f"ticket no longer held (holders then: {holders}) (the IO owns a ticket's slots "
            "until its sync thread publishes the completion: a release before that only marks "
            "the ticket, release_requested, and the sync thread frees it after the last write)",
        )
    pool = ticket.side_pool.upper() or "side"
    # Verify a ticket's window holds no more of its side pool (SWA, Mamba) than its spec names
    if ticket.ended and ticket.side_held_tokens > ticket.side_window_tokens:
        raise InvariantViolation(
            "INV-38",
            f"{where} holds {ticket.side_held_tokens} {pool} side-pool slot(s) for a window of "
            f"{ticket.side_window_tokens} slot(s) (a rank allocates at most min(the spec's "
            "keys, its hit) window pages of the pool's own page size, one slot for a Mamba "
            "state, all pools or none: _allocate_pp_prefetch_buffers)",
        )
    if ticket.retired and ticket.ready and ticket.side_held_tokens:
        raise InvariantViolation(
            "INV-38",
            f"{where} was released and its completion published, but it still holds "
            f"{ticket.side_held_tokens} {pool} window slot(s) of its side pool (retiring a ticket "
            "frees every pool's staging: the KV's and each independent pool's own slots, "
            "_free_pp_prefetch_state, or buffer mode's once taken)",
        )
    if ticket.retired and ticket.ready and ticket.held_tokens:
        raise InvariantViolation(
            "INV-38",
            f"{where} was released and its completion published, but it still holds "
            f"{ticket.held_tokens} host slot(s) (a retired ticket's slots are freed exactly "
            "once: by the release, or by the sync thread when the release came first)",
        )


def _verdict(record: PpVerdictRecord) -> None:
    where = f"the timeout verdict on {record.request_id!r} (no PP ticket, poll {record.poll})"
    clocks = ", ".join(f"PP rank {r}: {t:.2f} s" for r, t in enumerate(record.clocks))
    first = record.verdicts[0]
    for rank, mine in enumerate(record.verdicts[1:], start=1):
        # Verify every rank returns PP rank 0's verdict (a rank cutting alone desyncs the trees)
        if mine != first:
            raise InvariantViolation(
                "INV-38",
                f"{where}: PP rank {rank} {'terminates' if mine else 'keeps loading'} but PP "
                f"rank 0 {'terminates' if first else 'keeps loading'} (elapsed {clocks}) (wall "
                "clocks differ across ranks: PP rank 0 alone reads its deadline and _all_reduce "
                "hands its verdict along PP, _pp_sync; no rank decides on its own clock)",
            )
    if first != record.deadline_passed:
        raise InvariantViolation(
            "INV-38",
            f"{where}: PP rank 0 {'terminates' if first else 'keeps loading'} but its own "
            f"clock says the deadline {'passed' if record.deadline_passed else 'has not passed'} "
            f"(elapsed {clocks}) (PP rank 0 terminates exactly when its elapsed time exceeds "
            "prefetch_timeout_base + pages * prefetch_timeout_per_page, its KV not all landed)",
        )


# -- INV-38 ---------------------------------------------------------------------------------------
@registered("INV-38", StorageSnapshot, storage=0)
def check_inv_38_pp_ticket_agreement(evidence: Evidence) -> None:
    """PP ranks take, query and stage the same tickets in the same order; a retired ticket
    holds no host slot; a ticket's IO writes only slots the ticket holds; every rank returns PP
    rank 0's timeout verdict on a prefetch without a ticket, as its clock says."""
    snapshot = storage_snapshot_of("INV-38", evidence)
    for record in snapshot.pp_verdicts:  # a cache-mode PP group's prefetch (no ticket)
        _verdict(record)
    if not snapshot.pp_tickets:
        return
    first = snapshot.pp_tickets[0]
    for rank, tickets in enumerate(snapshot.pp_tickets):
        for position, (mine, theirs) in enumerate(zip(tickets, first, strict=False)):
            _agree(rank, mine, theirs, position, snapshot.pp_at_rest)
        if snapshot.pp_at_rest and len(tickets) != len(first):
            raise InvariantViolation(
                "INV-38",
                f"PP rank {rank} took {len(tickets)} ticket(s) off the command group but PP "
                f"rank 0 broadcast {len(first)} (every rank takes each ticket in the same step)",
            )
        for ticket in tickets:
            _holds(rank, ticket)
