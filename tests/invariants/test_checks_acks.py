"""Ack-protocol checkers: INV-02, INV-09, INV-10, INV-14, INV-16, INV-18."""

from __future__ import annotations

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_acks import (
    check_ack_queues_empty,
    check_ack_rows_identical,
    check_producer_slots_held,
    check_reset_clean,
    check_single_write_ack,
    check_undrained_gate_agrees,
)


def detail(excinfo: pytest.ExceptionInfo[InvariantViolation], inv_id: str) -> str:
    assert excinfo.value.inv_id == inv_id
    return excinfo.value.detail


# --- INV-02 ------------------------------------------------------------------------------------


def test_single_write_ack_accepts_distinct_nodes_and_anonymous_writes() -> None:
    check_single_write_ack([[1, 2], [3], [-1], [-1, 4]])


def test_single_write_ack_catches_a_node_in_two_acks() -> None:
    # write n5 -> reserve n5 again before the ack drained -> two acks for one registration
    with pytest.raises(InvariantViolation) as excinfo:
        check_single_write_ack([[5], [6], [5]])
    assert detail(excinfo, "INV-02") == (
        "node_id=5 has two undrained write acks (in ack rows 0 and 2); reserve_write_cp must "
        "refuse with reason='undrained_ack' while one is queued"
    )


def test_single_write_ack_catches_a_node_twice_in_one_ack() -> None:
    with pytest.raises(
        InvariantViolation, match=r"node_id=8 has two undrained write acks \(twice in ack row 1\)"
    ):
        check_single_write_ack([[1], [8, 8]])


def test_gate_agreeing_with_the_queue_passes() -> None:
    rows = [[3, 4], [9]]
    check_undrained_gate_agrees(lambda n: n in {3, 4, 9}, rows, range(12))


def test_gate_false_negative_is_caught() -> None:
    # the max-id fast path missed node 9 (an append bypassed the helper)
    rows = [[3], [9]]
    with pytest.raises(InvariantViolation) as excinfo:
        check_undrained_gate_agrees(lambda n: n <= 3, rows, [3, 9])
    assert detail(excinfo, "INV-02") == (
        "node_has_undrained_write_ack(9) returned False but an ack in the queue carries it "
        "(false negative; the gate must agree with a scan of ack_write_queue)"
    )


def test_gate_false_positive_is_caught_under_the_given_id() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_undrained_gate_agrees(lambda n: True, [], [2], inv_id="INV-18")
    assert "returned True but no queued ack carries it (false positive" in detail(excinfo, "INV-18")


# --- INV-09 ------------------------------------------------------------------------------------


# --- INV-10 ------------------------------------------------------------------------------------


# --- INV-14 ------------------------------------------------------------------------------------


def test_identical_rows_on_every_rank_pass() -> None:
    rows = [[1], [2, 3]]
    check_ack_rows_identical([rows, [list(r) for r in rows], rows])


def test_ranks_that_appended_in_different_orders_are_caught() -> None:
    # rank 1 owns nothing of node 1 and acked it early: its rows are [1], [2] vs rank 0's [2], [1]
    with pytest.raises(InvariantViolation) as excinfo:
        check_ack_rows_identical([[[2], [1]], [[1], [2]]])
    assert detail(excinfo, "INV-14") == (
        "rank 1 ack row 0 carries node ids [1] but rank 0 carries [2] (every rank must append "
        "the same node ids in the same order)"
    )


def test_a_rank_missing_an_ack_is_caught_at_quiescence() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        check_ack_rows_identical([[[1], [2]], [[1]]])
    assert detail(excinfo, "INV-14") == (
        "rank 1 has 1 ack rows but rank 0 has 2 (a zero-owned rank still appends an ack per node)"
    )


def test_a_lagging_rank_is_allowed_mid_run_but_not_a_diverging_one() -> None:
    check_ack_rows_identical([[[1]], [[1], [2]], []], allow_lag=True)
    with pytest.raises(
        InvariantViolation, match="rank 0 ack row 0 carries node ids \\[3\\] but rank 1"
    ):
        check_ack_rows_identical([[[3]], [[1], [2]]], allow_lag=True)


# --- INV-16 ------------------------------------------------------------------------------------


# --- INV-18 ------------------------------------------------------------------------------------

CLEAN = {
    "queue_lengths": {"write_queue": 0, "ack_write_queue": 0, "host_mem_release_queue": 0},
    "pending_layer_write_ids": (),
    "producer_index": -1,
    "consumer_indices": (),
    "candidate_ids": range(8),
}


def test_clean_reset_passes() -> None:
    check_reset_clean(gate=lambda n: False, **CLEAN)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            {"queue_lengths": {"write_queue": 0, "host_mem_release_queue": 2}},
            "reset() left entries in {'host_mem_release_queue': 2} (every queue must be empty "
            "after reset)",
            id="release-queue",
        ),
        pytest.param(
            {"pending_layer_write_ids": {4}},
            "reset() left pending layer writes for node ids [4] (their hooks would copy into "
            "slots the caller is about to clear)",
            id="pending-layer-write",
        ),
        pytest.param(
            {"producer_index": 2, "consumer_indices": [2]},
            "reset() left producer_index=2, consumer_indices=[2] (expected -1 and []: call "
            "layer_done_counter.reset())",
            id="producer-slot",
        ),
    ],
)
def test_reset_leaving_state_behind_is_caught(change: dict[str, object], message: str) -> None:
    args = {**CLEAN, **change}
    with pytest.raises(InvariantViolation) as excinfo:
        check_reset_clean(gate=lambda n: False, **args)  # type: ignore[arg-type]
    assert detail(excinfo, "INV-18") == message


def test_reset_with_a_stale_gate_is_caught() -> None:
    # queue cleared but _max_write_ack_node_id kept: harmless; the reverse is a false positive
    with pytest.raises(InvariantViolation) as excinfo:
        check_reset_clean(gate=lambda n: n == 5, **CLEAN)  # type: ignore[arg-type]
    assert "node_has_undrained_write_ack(5) returned True" in detail(excinfo, "INV-18")


def test_producer_slots_held_allows_every_slot_in_use_but_not_one_more() -> None:
    check_producer_slots_held(num_undrained_load_acks=2, num_counters=2)
    with pytest.raises(InvariantViolation) as excinfo:
        check_producer_slots_held(num_undrained_load_acks=3, num_counters=2)
    assert excinfo.value.inv_id == "INV-10"
    assert "3 undrained load acks exceed num_counters=2" in excinfo.value.detail


def test_ack_left_in_a_queue_at_quiescence_is_caught() -> None:
    check_ack_queues_empty({"ack_write_queue": [], "ack_load_queue": []})
    with pytest.raises(InvariantViolation) as excinfo:
        check_ack_queues_empty({"ack_write_queue": [], "ack_load_queue": [[4]]})
    assert excinfo.value.inv_id == "INV-16"
    assert "ack_load_queue still holds 1 ack(s) [[4]]" in excinfo.value.detail
