"""INV-41 on hand-built belief views: what buffer mode's tree half hands the checker.

A healthy ``buffer_only`` world of two ranks: chain ``k1 k2 k3`` was written and acked (taught),
a hit query then found only ``k1`` on some rank (``k2``, ``k3`` refuted), and a write of ``k4``
is in flight, and the controller's last rate-limit verdict admitted a prefetch. Each bad state
changes one thing on rank 1: the tree's class believes a refuted page, believes a page whose
write is only in flight, forgot a taught page, holds an in-flight ref of no launched write, or
still stages a write at rest; or the controller's rate limit charged the write staging to
loads, or admitted a prefetch with loads at the limit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_storage import STORAGE_CHECKS
from hicache_ref.invariants.storage_snapshot import BeliefView, StorageSnapshot

PAGE = 2
IN_FLIGHT = (("k4", 1),)


def view(rank: int) -> BeliefView:
    return BeliefView(
        rank,
        believed=("k1",),
        inflight=IN_FLIGHT,
        taught=("k1",),
        launched=IN_FLIGHT,
        refuted=("k2", "k3"),
        staged_tokens=PAGE,
        admission=(False, 2 * PAGE, PAGE, 5 * PAGE),  # 2 of 10 host tokens in use, 1 staged
    )


def healthy(quiescent: bool = False, **rank1: object) -> StorageSnapshot:
    """Both ranks' views; ``rank1`` changes rank 1's."""
    return StorageSnapshot(
        page_size=PAGE,
        world_size=2,
        epoch=0,
        tiers=(),
        prefetches=((), ()),
        backups=((), ()),
        acks=((), ()),
        collectives=((), ()),
        quiescent=quiescent,
        beliefs=(view(0), replace(view(1), **rank1)),  # type: ignore[arg-type]
    )


def fires(snapshot: StorageSnapshot, match: str) -> None:
    with pytest.raises(InvariantViolation, match=match) as info:
        STORAGE_CHECKS["INV-41"](snapshot)
    assert info.value.inv_id == "INV-41"


def test_inv41_beliefs_that_follow_acks_and_queries_pass() -> None:
    STORAGE_CHECKS["INV-41"](healthy())
    STORAGE_CHECKS["INV-41"](replace(healthy(), beliefs=()))  # not a buffer world: nothing judged


def test_inv41_a_belief_outliving_the_query_that_found_it_missing_is_caught() -> None:
    # k2 was refuted by a drained hit query, but rank 1's beliefs kept it
    fires(healthy(believed=("k1", "k2")), "found it missing since")


def test_inv41_a_belief_before_the_storage_ack_is_caught() -> None:
    # k4's write is only in flight: it is covered for admission, not yet believed stored
    fires(healthy(believed=("k1", "k4")), "its write is in flight, not yet acked")


def test_inv41_a_belief_nothing_taught_is_caught() -> None:
    fires(healthy(believed=("k1", "k9")), "no acked write stored it")


def test_inv41_a_forgotten_ack_is_caught() -> None:
    fires(healthy(believed=()), "does not believe page k1")


def test_inv41_an_in_flight_ref_of_no_launched_write_is_caught() -> None:
    fires(healthy(inflight=(("k4", 2),)), "in-flight refs")


def test_inv41_staging_held_at_rest_is_caught() -> None:
    at_rest = {"inflight": (), "launched": ()}
    fires(healthy(quiescent=True, **at_rest), "still stages 2 write tokens at rest")


def test_inv41_ranks_believing_apart_are_caught() -> None:
    # both views agree with their own record, but the records differ: the ranks would admit
    # different writes
    fires(healthy(believed=("k1", "k2"), taught=("k1", "k2")), "believes 2 page")


def test_inv41_write_staging_charged_to_loads_is_caught() -> None:
    # 9 of 10 host tokens in use, 8 of them write staging: loads hold 1, the limit is 9
    fires(healthy(admission=(True, 9, 8, 10)), "refused a prefetch as rate limited")


def test_inv41_a_pool_full_of_loads_admitting_a_prefetch_is_caught() -> None:
    # 10 of 10 host tokens in use, none staged: the loads reached the limit
    fires(healthy(admission=(False, 10, 0, 10)), "admitted a prefetch")
    STORAGE_CHECKS["INV-41"](healthy(admission=(True, 10, 0, 10)))  # refused: as it should
