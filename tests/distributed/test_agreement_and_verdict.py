"""What the ranks agree on before a step, how they compare after it, and the verdict they share.

Each rank computes the decision and the verdict from the same gathered list, so these are pure
functions of that list: a step enabled on some ranks only is left out everywhere; the first
differing field is named with both values; the lowest failing rank's error is the message.
"""

from __future__ import annotations

import dataclasses

import pytest

from hicache_ref.distributed.agreement import StepPlan, agree, plan_step
from hicache_ref.distributed.compare import RankDigest, find_divergence
from hicache_ref.distributed.rank_session import open_rank_session
from hicache_ref.distributed.verdict import RankError, RankFailure, decide
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig

DIGEST = RankDigest(
    outcome="drained 1 write ack(s)",
    write_rows=((3,),),
    load_rows=(),
    device_pages=(1, 2),
    producer_index=0,
    pending_layer_writes=(),
    nodes=((0, 3, "in_flight", True, False, -1),),
    expected_host_slots=(4, 0),
    finished=None,
    host_slots=(2, 0),
)


def test_a_step_enabled_on_some_ranks_only_is_left_out_everywhere() -> None:
    plans = [StepPlan(True, (1, 0), True), StepPlan(False, (0, 0), True)]
    decision = agree(plans)
    assert not decision.apply
    assert decision.why == "enabled on ranks [0] only"


def test_a_reservation_that_fits_on_some_ranks_only_is_left_out() -> None:
    plans = [StepPlan(True, (0, 0), True), StepPlan(True, (0, 0), False)]
    assert agree(plans).why == "the reservation fits on ranks [0] only"
    assert agree([StepPlan(True, (2, 1), True), StepPlan(True, (1, 1), True)]).apply


def test_an_early_reservation_inside_prefill_cannot_be_agreed() -> None:
    config = HarnessConfig(pool_kind="nsa", cp_size=2, device_pages=12)
    rank_session = open_rank_session(config, get_implementation("reference"), "reference", 0)
    step = Step(rule="prefill", args={"tokens": 2, "early_reserve": True})
    with pytest.raises(ValueError, match="record it as prefill then reserve"):
        plan_step(rank_session, step)


def test_identical_ranks_do_not_diverge() -> None:
    assert find_divergence([DIGEST, dataclasses.replace(DIGEST, host_slots=(2, 0))]) is None


def test_ack_rows_that_differ_name_the_field_and_both_ranks() -> None:
    # a zero-owned rank dropped its ack of node 3: its rows are empty
    other = dataclasses.replace(DIGEST, write_rows=())
    assert find_divergence([DIGEST, DIGEST, other]) == (
        "INV-14",
        "write_rows differ: rank 0 ((3,),) vs rank 2 () (every rank appends the same write "
        "acks in order, zero-owned ranks included)",
    )


def test_host_slots_must_add_up_to_the_padded_spans() -> None:
    # 4 slots of backed-up nodes, but both ranks hold 2 + 1
    found = find_divergence([DIGEST, dataclasses.replace(DIGEST, host_slots=(1, 0))])
    assert found is not None and found[0] == "INV-05"
    assert "host slots held per rank [2, 1] add up to 3" in found[1]


def test_the_lowest_failing_rank_names_the_verdict() -> None:
    errors = [
        None,
        RankError(1, "INV-02", "per-layer write for node 1 while its ack is undrained"),
        RankError(3, "KeyError", "KeyError: 7"),
        None,
    ]
    verdict = decide("step 9 write(node=1)", errors, [None] * 4)
    assert verdict is not None and verdict.signature == "INV-02"
    assert verdict.line == (
        "INV-02 violated: rank 1 of 4 at step 9 write(node=1): per-layer write for node 1 "
        "while its ack is undrained (ranks [3] failed too)"
    )
    exc = verdict.as_exception()
    assert isinstance(exc, InvariantViolation) and exc.inv_id == "INV-02"


def test_an_exception_that_is_no_violation_keeps_its_type_as_signature() -> None:
    error = RankError.of(0, KeyError(7))
    verdict = decide("quiescence", [error, None], [None, DIGEST])
    assert verdict is not None
    exc = verdict.as_exception()
    assert isinstance(exc, RankFailure) and exc.inv_id == "KeyError"
    assert str(exc) == "rank 0 of 2 at quiescence: KeyError: 7"


def test_a_divergence_is_an_inv_14_verdict() -> None:
    other = dataclasses.replace(DIGEST, producer_index=-1)
    verdict = decide("step 4 start_loading()", [None, None], [DIGEST, other])
    assert verdict is not None and verdict.signature == "INV-14"
    assert verdict.line == (
        "INV-14 violated: CP ranks diverge at step 4 start_loading(): producer_index differ: "
        "rank 0 0 vs rank 1 -1 (every rank takes the same producer slot)"
    )
