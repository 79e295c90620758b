"""The session's checks come from one registry, read snapshots and the harness's own model, and
never trust what an implementation says about itself: each new external check fires on a
controller that misreports, with the right invariant id."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.invariants.evidence import (
    BackupRead,
    DrainedAck,
    PoolIndices,
    RankValues,
    Refusal,
    ReturnedIndices,
    Rows,
    SlotReuse,
    StateSlots,
    StateView,
)
from hicache_ref.invariants.models import HiCacheWriteReservation
from hicache_ref.invariants.registry import REGISTERED, STEP_IDS
from hicache_ref.invariants.snapshot import AckRow, HarnessModel, NodeHoldings, RankSnapshot

PLAIN = HarnessConfig(page_size=2, layer_num=2, device_pages=12, host_pages=8)
CP = HarnessConfig(
    page_size=2, layer_num=2, pool_kind="nsa", cp_size=2, device_pages=16, host_pages=16
)


def run(config: HarnessConfig, controller_class: type[HiCacheController], *rules: Any) -> Session:
    """A session on the reference with its controller class swapped, after ``rules``."""

    class Impl(ReferenceImplementation):
        pass

    Impl.controller_class = controller_class
    session = Session(config, Impl(), "reference")
    for rule in rules:
        name, args = (rule, {}) if isinstance(rule, str) else rule
        session.apply(Step(rule=name, args=args))
    return session


COMPUTED_NODE = (("prefill", {"tokens": 5}), "forward_layer", "forward_layer")


def fires(inv_id: str, excinfo: pytest.ExceptionInfo[InvariantViolation]) -> str:
    assert excinfo.value.inv_id == inv_id, str(excinfo.value)
    return excinfo.value.detail


# --- fake controllers that misreport ------------------------------------------------------------


class _RecordsTooFewHostSlots(HiCacheController):
    def reserve_write_cp(self, *args: Any, **kwargs: Any) -> Any:
        result = super().reserve_write_cp(*args, **kwargs)
        if isinstance(result, HiCacheWriteReservation) and len(result.host_indices):
            meta = result.metadata
            short = meta.model_copy(update={"host_indices": meta.host_indices[:-2]})
            return result.model_copy(update={"metadata": short})
        return result


class _ClaimsOtherOwnedPositions(HiCacheController):
    def reserve_write_cp(self, *args: Any, **kwargs: Any) -> Any:
        result = super().reserve_write_cp(*args, **kwargs)
        if isinstance(result, HiCacheWriteReservation):
            meta = result.metadata
            lie = meta.model_copy(update={"owned_positions": meta.owned_positions.flip(0)})
            return result.model_copy(update={"metadata": lie})
        return result


class _ClaimsOtherPageOwners(HiCacheController):
    def reserve_write_cp(self, *args: Any, **kwargs: Any) -> Any:
        result = super().reserve_write_cp(*args, **kwargs)
        if isinstance(result, HiCacheWriteReservation):
            meta = result.metadata
            lie = meta.model_copy(update={"page_owners": (1 - meta.page_owners).to(torch.int8)})
            return result.model_copy(update={"metadata": lie})
        return result


class _RefusalKeepsHostSlots(HiCacheController):
    def write(self, device_indices: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.mem_pool_host.alloc(self.page_size)  # taken, then the write is "refused"
        return None


class _ResetKeepsWriteAcks(HiCacheController):
    def reset(self) -> None:
        acks = list(self.ack_write_queue)
        super().reset()
        self.ack_write_queue.extend(acks)


def test_metadata_with_fewer_host_slots_than_the_layout_owns_is_inv13() -> None:
    # write on CP -> rank metadata records 2 slots fewer than the harness's layout owns -> INV-13
    with pytest.raises(InvariantViolation) as excinfo:
        run(CP, _RecordsTooFewHostSlots, *COMPUTED_NODE, ("write", {"node": 0}))
    # the record contradicts itself before it contradicts the harness's layout
    text = fires("INV-13", excinfo)
    assert text == "node 0 rank 0: len(host_indices)=0 but len(owned_positions)=2 (they must match)"


def test_metadata_that_breaks_its_own_rules_is_inv13() -> None:
    # the metadata's owned positions come back reversed: the harness never uses them (its
    # byte checks read the positions its own layout gives), but the record breaks INV-13
    with pytest.raises(InvariantViolation) as excinfo:
        run(CP, _ClaimsOtherOwnedPositions, *COMPUTED_NODE, ("write", {"node": 0}))
    text = fires("INV-13", excinfo)
    assert text.startswith("node 0 rank 0: owned_positions is not sorted")


def test_owner_replay_is_checked_against_the_owners_the_harness_recorded() -> None:
    # the metadata claims flipped page owners -> load_cp faithfully replays the lie -> the
    # harness compares with the owners its own layout gave at write time -> INV-03
    steps = (*COMPUTED_NODE, ("write", {"node": 0}), ("synchronize", {"stream": "write"}))
    session = run(CP, _ClaimsOtherPageOwners, *steps, "drain_write", ("evict_device", {"node": 0}))
    with pytest.raises(InvariantViolation) as excinfo:
        session.apply(Step(rule="load", args={"node": 0}))
    assert fires("INV-03", excinfo).startswith("node 0: load_cp put page 0 of the node")


def test_a_refusal_that_kept_host_slots_is_inv17() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        run(PLAIN, _RefusalKeepsHostSlots, *COMPUTED_NODE, ("write", {"node": 0}))
    text = fires("INV-17", excinfo)
    assert text.startswith("rank 0: write (refused: host full) was refused or failed but changed")
    assert "'host pages'" in text


def test_a_reset_that_keeps_write_acks_is_inv18() -> None:
    steps = (*COMPUTED_NODE, ("write", {"node": 0}))
    with pytest.raises(InvariantViolation) as excinfo:
        run(PLAIN, _ResetKeepsWriteAcks, *steps, "reset")
    assert fires("INV-18", excinfo).startswith("rank 0: reset() left entries in {'ack_write_queue'")


def test_the_session_counts_every_check_by_id() -> None:
    session = run(PLAIN, HiCacheController, *COMPUTED_NODE, ("write", {"node": 0}), "reset")
    session.finish()
    counts, stats = session.stats.checks_by_id, session.stats
    # a round whose evidence had already passed is counted as a round, not as a run
    assert (
        counts["INV-02"]
        == counts["INV-05"] - 1
        == stats.invariant_checks - stats.step_checks_reused
    )
    assert counts["INV-18"] == 1 and counts["INV-16"] == 1 and counts["INV-15"] == 1


def test_evidence_that_already_passed_is_not_judged_again_but_any_change_is() -> None:
    # a node written and its copy run: its ack waits, undrained, while the host waits on idle
    # streams, which leaves the ranks and the tree's model as they were
    session = run(PLAIN, HiCacheController, *COMPUTED_NODE, ("write", {"node": 0}), "start_writing")
    session.world.device.run_until_idle()
    session.apply(Step(rule="synchronize", args={"stream": "write"}))
    stats = session.stats
    reused, runs = stats.step_checks_reused, stats.checks_by_id["INV-02"]
    session.apply(Step(rule="synchronize", args={"stream": "write"}))
    session.apply(Step(rule="synchronize", args={"stream": "load"}))
    assert stats.step_checks_reused == reused + 2
    assert stats.checks_by_id["INV-02"] == runs
    # the same ack queued twice behind the session's back: the next round judges it
    queue = session.world.ranks[0].controller.ack_write_queue
    assert len(queue) == 1
    queue.append(queue[0])
    with pytest.raises(InvariantViolation) as excinfo:
        session.check_step_invariants()
    assert fires("INV-02", excinfo).startswith("rank 0: node_id=")


# --- the registry over hand-built snapshots -----------------------------------------------------


def snap(rank: int = 0, **fields: Any) -> RankSnapshot:
    base: dict[str, Any] = {
        "rank": rank,
        "write_acks": (),
        "load_acks": (),
        "device_pages": frozenset({1}),
        "host_pages": frozenset({0}),
        "draft_host_pages": None,
        "pending_layer_writes": frozenset(),
        "producer_slots": 2,
    }
    return RankSnapshot(**{**base, **fields})


NODE = NodeHoldings(0, 7, frozenset({1}), (frozenset({0}),) * 2, (frozenset(),) * 2, "in_flight")
MODEL = HarnessModel(num_counters=2, nodes=(NODE,))


def check(inv_id: str, evidence: Any) -> str:
    with pytest.raises(InvariantViolation) as excinfo:
        REGISTERED[inv_id](evidence)
    return fires(inv_id, excinfo)


def view(*snapshots: RankSnapshot, model: HarnessModel = MODEL) -> StateView:
    return StateView(snapshots, model)


def test_a_consistent_state_passes_every_step_check() -> None:
    for inv_id in STEP_IDS:
        REGISTERED[inv_id](view(snap(0), snap(1)))


def test_step_checks_name_the_rank_and_the_broken_rule() -> None:
    ack = AckRow((7,), finished=False)
    assert "rank 1: node_id=7 has two undrained write acks" in check(
        "INV-02", view(snap(0), snap(1, write_acks=(ack, ack)))
    )
    assert "returned False but an ack in the queue carries it" in check(
        "INV-02", view(snap(0, write_acks=(ack,), gate_answers=((7, False),)))
    )
    assert check("INV-14", view(snap(0, write_acks=(ack,)), snap(1))).startswith(
        "ack_write_queue: rank 1 has 0 ack rows but rank 0 has 1"
    )
    three = (AckRow((1,), True), AckRow((2,), True), AckRow((3,), False))
    assert "rank 0: 3 undrained load acks exceed num_counters=2" in check(
        "INV-10", view(snap(0, load_acks=three))
    )
    assert "rank 1 host pool: pages allocated but owned by no node [5]" in check(
        "INV-05", view(snap(0), snap(1, host_pages=frozenset({0, 5})))
    )


def test_a_write_ack_before_the_forward_stored_every_layer_is_inv04() -> None:
    # node 7 has stored 1 of 3 layers (draft deeper than target) -> its write ack is queued
    early = NodeHoldings(0, 7, frozenset({1}), (frozenset({0}),), (frozenset(),), "in_flight", 1)
    model = HarnessModel(num_counters=2, nodes=(early,), layer_num=2, draft_layer_num=3)
    text = check("INV-04", view(snap(0, write_acks=(AckRow((7,), False),)), model=model))
    assert text.startswith("rank 0: write ack for node_id=7 appended while target layers [1]")
    assert "draft layers [1, 2] were not submitted" in text
    done = NodeHoldings(0, 7, frozenset({1}), (frozenset({0}),), (frozenset(),), "in_flight", 3)
    REGISTERED["INV-04"](
        view(
            snap(0, write_acks=(AckRow((7,), False),)),
            model=model.__class__(num_counters=2, nodes=(done,), layer_num=2, draft_layer_num=3),
        )
    )


def test_a_busy_node_whose_device_page_is_free_is_inv08() -> None:
    # node 7 is loading (its H2D writes page 1) -> the allocator reports page 1 free -> INV-08
    loading = NodeHoldings(
        0, 7, frozenset({1}), (frozenset({0}),), (frozenset(),), "done", 1, "loading"
    )
    model = HarnessModel(num_counters=2, nodes=(loading,))
    text = check("INV-08", view(snap(0, device_pages=frozenset()), model=model))
    assert text.startswith("rank 0: the allocator releases device slot 1 while node 7 (loading)")


def test_drained_acks_and_returned_indices_are_judged_by_their_ids() -> None:
    assert "write ack for node_id 4, which has no backup in flight" in check(
        "INV-02", DrainedAck("ack_write_queue", 4, in_flight=False)
    )
    assert "load ack for node_id 4, which has no load in flight" in check(
        "INV-16", DrainedAck("ack_load_queue", 4, in_flight=False)
    )
    assert "write of node 0" in check(
        "INV-01", ReturnedIndices(torch.tensor([1, 2]), 2, "write of node 0")
    )
    REGISTERED["INV-01"](ReturnedIndices(torch.tensor([2, 3]), 2, "write of node 0"))


def test_ranks_that_report_different_values_are_inv14() -> None:
    pages = RankValues("the producer slots", [[[0]], [[1]]], ack_rows=False)
    assert check("INV-14", pages).startswith("the producer slots differ: rank 0 [[0]] vs rank 1")
    REGISTERED["INV-14"](RankValues("the producer slots", [[[1]], [[1]]], ack_rows=False))


def test_a_slot_reused_under_an_undrained_load_is_inv10() -> None:
    assert "still held by the undrained load of node(s) [3]" in check("INV-10", SlotReuse(0, [3]))
    REGISTERED["INV-10"](SlotReuse(0, []))


def test_a_backup_that_read_unstored_rows_is_inv12() -> None:
    text = check("INV-12", BackupRead((2,), 1, "target", (6, 7)))
    assert text.startswith("a D2H of target layer 1 (node(s) 2) read device rows [6, 7]")
    REGISTERED["INV-12"](BackupRead((2,), 1, "target", ()))


def test_a_checker_refuses_evidence_of_another_kind() -> None:
    # evidence of a kind the id is not judged from is a harness bug, not a finding
    with pytest.raises(TypeError, match="INV-12 is not checked from StateView evidence"):
        REGISTERED["INV-12"](view(snap(0)))


def test_quiescence_checks_catch_a_leftover_ack_and_a_stale_pending_write() -> None:
    assert "rank 0: ack_write_queue still holds 1 ack(s)" in check(
        "INV-16", view(snap(0, write_acks=(AckRow((7,), True),)))
    )
    assert "rank 0: per-layer write states still pending for node ids [9]" in check(
        "INV-15", view(snap(0, pending_layer_writes=frozenset({7, 9})))
    )


def test_reset_check_catches_a_claimed_producer_slot_and_a_stale_gate() -> None:
    assert "producer_index=1" in check("INV-18", view(snap(0, producer_index=1)))
    assert "node_has_undrained_write_ack(3) returned True" in check(
        "INV-18", view(snap(0, gate_answers=((3, True),)))
    )


def test_refusal_check_allows_only_the_named_parts_to_change() -> None:
    before, after = [snap(0)], [snap(0, device_pages=frozenset({1, 2}))]
    REGISTERED["INV-17"](Refusal(before, after, "early reservation", ("device pages",)))
    text = check("INV-17", Refusal(before, after, "load (refused: device full)", ()))
    assert "changed 'device pages': before [1], after [1, 2]" in text


@pytest.mark.parametrize("inv_id", ["INV-06", "INV-07", "INV-09", "INV-11", "INV-18"])
def test_bytes_read_back_are_judged_under_the_id_of_the_moment(inv_id: str) -> None:
    # a drain (INV-09), a read (INV-11), rest (INV-06), a poisoned free slot (INV-07, INV-18):
    # the same comparison, reported under the id of the moment, naming the first wrong row
    expected = torch.full((2, 4), 7.0)
    actual = expected.clone()
    REGISTERED[inv_id](Rows(actual, expected, "node 0 layer 1"))
    actual[1, 2] = 0.0
    text = check(inv_id, Rows(actual, expected, "node 0 layer 1"))
    assert text.startswith("node 0 layer 1") and "row 1" in text


def test_inv36_side_slots_free_in_their_own_pool_are_caught() -> None:
    # a write handed node 3 side host slots 8..11 (page 2 of 4); the side pool's own allocator
    # has only page 1 out: the slots came from the anchor's allocator
    slots = torch.arange(8, 12)
    REGISTERED["INV-36"](
        PoolIndices("side host", slots, 4, frozenset({1, 2}), frozenset(), "write of node 3")
    )
    text = check(
        "INV-36", PoolIndices("side host", slots, 4, frozenset({1}), frozenset(), "write of node 3")
    )
    assert "write of node 3: side host pages [2] are free in the side host pool's own" in text


def test_inv36_side_rows_another_node_holds_are_caught() -> None:
    # a load handed node 5 side rows on page 3, which node 1 still holds in the side pool
    rows = torch.arange(12, 16)
    evidence = PoolIndices("side device", rows, 4, frozenset({1, 3}), frozenset({3}), "load")
    assert "side device pages [3] are held by another node" in check("INV-36", evidence)


def test_inv40_a_state_counted_per_token_is_caught() -> None:
    # a load handed node 2 four state slots (a page of the anchor's size) for its one state
    REGISTERED["INV-40"](StateSlots("side device", torch.tensor([5]), 1, "load of node 2"))
    text = check("INV-40", StateSlots("side device", torch.arange(1, 5), 1, "load of node 2"))
    assert "load of node 2: the side device pool handed the node 4 state slot(s)" in text


def test_inv40_a_backup_with_no_state_slot_or_a_repeated_one_is_caught() -> None:
    # a write that resolved no state slot, and a copy that pairs one slot twice
    empty = torch.empty(0, dtype=torch.int64)
    assert "handed the node 0 state slot(s)" in check(
        "INV-40", StateSlots("side host", empty, 1, "write of node 0")
    )
    assert "handed the node 2 state slot(s) [3, 3]" in check(
        "INV-40", StateSlots("side host", torch.tensor([3, 3]), 2, "backup")
    )
