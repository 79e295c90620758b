"""INV-38 on hand-built PP ticket records: what the PP tree half hands the checker after a step.

A healthy PP world: both PP ranks took tickets ``a`` (a 3-page hit, taken and freed) and ``b``
(released before its completion, then freed by the sync thread) in the same order, with the
same keys and hits. Each bad state changes one thing on one rank.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_storage import STORAGE_CHECKS
from hicache_ref.invariants.storage_snapshot import PpTicketRecord, StorageSnapshot

PAGE = 2
KEYS_A = ("k1", "k2", "k3")
KEYS_B = ("k2", "k3")


def tickets() -> tuple[PpTicketRecord, ...]:
    return (
        PpTicketRecord("a", 0, KEYS_A, 6, held_tokens=0, ready=True, retired=True),
        PpTicketRecord("b", 0, KEYS_B, 4, held_tokens=4, ready=False, retired=True),
    )


def healthy(**rank1: object) -> StorageSnapshot:
    """Both ranks' records; ``rank1`` changes rank 1's ticket ``b`` (the second)."""
    mine = list(tickets())
    mine[1] = replace(mine[1], **rank1)  # type: ignore[arg-type]
    return StorageSnapshot(
        page_size=PAGE,
        world_size=2,
        epoch=0,
        tiers=(),
        prefetches=((), ()),
        backups=((), ()),
        acks=((), ()),
        collectives=((), ()),
        pp_tickets=(tickets(), tuple(mine)),
    )


def fires(snapshot: StorageSnapshot, match: str) -> None:
    with pytest.raises(InvariantViolation, match=match) as info:
        STORAGE_CHECKS["INV-38"](snapshot)
    assert info.value.inv_id == "INV-38"


def test_inv38_ranks_agreeing_on_every_ticket_pass() -> None:
    STORAGE_CHECKS["INV-38"](healthy())
    STORAGE_CHECKS["INV-38"](replace(healthy(), pp_tickets=()))  # not a PP world: nothing judged


def test_inv38_a_follower_querying_another_chain_is_caught() -> None:
    fires(healthy(keys=("k1", "k2")), "queried page keys")


def test_inv38_tickets_taken_in_another_order_are_caught() -> None:
    snapshot = healthy()
    swapped = tuple(reversed(snapshot.pp_tickets[1]))
    fires(replace(snapshot, pp_tickets=(snapshot.pp_tickets[0], swapped)), "same order")


def test_inv38_a_skipped_ticket_is_caught() -> None:
    snapshot = healthy()
    fires(replace(snapshot, pp_tickets=(snapshot.pp_tickets[0], tickets()[:1])), "took 1 ticket")


def test_inv38_a_hit_that_is_not_the_min_is_caught() -> None:
    fires(healthy(hit_tokens=2, held_tokens=2), "MIN over the PP ranks")


def ready_first_of(snapshot: StorageSnapshot) -> tuple[PpTicketRecord, ...]:
    """PP rank 0's tickets with ``b``'s completion published (and its slots freed)."""
    b_ready = replace(snapshot.pp_tickets[0][1], ready=True, held_tokens=0)
    return (snapshot.pp_tickets[0][0], b_ready)


def test_inv38_a_follower_not_ready_while_rank_0_is_is_caught() -> None:
    snapshot = healthy()
    ready_first = replace(snapshot, pp_tickets=(ready_first_of(snapshot), snapshot.pp_tickets[1]))
    fires(ready_first, "not ready")
    # under storage points the follower's sync thread may still be on its way: judged at rest
    STORAGE_CHECKS["INV-38"](replace(ready_first, pp_at_rest=False))


def test_inv38_slots_kept_past_the_agreed_hit_are_caught() -> None:
    fires(healthy(held_tokens=6), "past the agreed hit")


def test_inv38_a_released_ticket_holding_slots_is_caught() -> None:
    # both ranks published b's completion; rank 1 still holds its 4 slots after the release
    snapshot = healthy()
    done = tuple(replace(t, ready=True, held_tokens=0) for t in snapshot.pp_tickets[0])
    leaked = (done[0], replace(done[1], held_tokens=4))
    fires(replace(snapshot, pp_tickets=(done, leaked)), "still holds 4 host slot")


def test_inv38_a_body_still_running_is_judged_only_by_its_order() -> None:
    # under schedule points: rank 1 has taken b but not queried it yet, nor taken a third
    snapshot = healthy(keys=(), hit_tokens=None, held_tokens=0, ended=False)
    third = PpTicketRecord("c", 0, (), None, ended=False)
    ahead = replace(
        snapshot, pp_tickets=(snapshot.pp_tickets[0] + (third,), snapshot.pp_tickets[1])
    )
    STORAGE_CHECKS["INV-38"](replace(ahead, pp_at_rest=False))
    fires(ahead, "took 2 ticket")  # at rest, every rank took every ticket


def test_inv38_an_io_write_into_a_slot_the_ticket_no_longer_held_is_caught() -> None:
    # under storage points: b was released while rank 1's IO waited at a page write, its slots
    # were freed at once, and the page landed in them (free by then)
    fires(healthy(stray_writes=((4, "free"), (5, "free"))), r"slot\(s\) 4, 5, which the ticket")
    fires(healthy(stray_writes=((6, "c"),)), r"holders then: c\)")
