"""Checks that close mutants the stateful suite let survive (benchmarks/mutation.py, issue 8).

Each test names the mutant class it kills (module, function, the mutated line). They are the
direct calls the tree never makes on its own: ``evict_host`` on a rank with a pending CP
per-layer write, a consumer set given as a list, a consumer id one past the last slot, a
per-layer submit after an all-layer one, an allocator that does not replay the owner pattern,
a draft host copy in flight at ``evict_cp_host``, every producer slot held at ``start_loading``,
two queued ops of one node reaching the write-ack funnel, an ack queue at its bound.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
import torch

from hicache_ref.controller.base import ACK_QUEUE_BOUND, ControllerState
from hicache_ref.controller.operations import CacheOperation, LayerDoneCounter
from hicache_ref.device import SimDevice
from hicache_ref.errors import InvariantViolation, LayerRangeError, MissingCpMetadataError
from hicache_ref.pools import CpSharedKVLayout

from .rig import CpNodeView, build_rig, drain_acks
from .steps import PAGE, alloc, backed_up, cp_rig, refused, reserve, sim_of


# -- cache_controller.evict_host: _check_no_pending_layer_write("host", None | "XX...XX") -------
def test_evict_host_refused_while_a_per_layer_write_of_its_slots_is_pending() -> None:
    # early reservation n4 -> layer 0 submitted -> plain evict_host of its host slots: INV-15
    # naming evict_host -> cancel -> the same evict_host frees them
    rig = cp_rig()
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    reservation = reserve(rig, locs, node_id=4)
    c.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    rig.device_pool.notify_layer_end(0)
    refused(
        rig,
        lambda: c.evict_host(reservation.host_indices),
        InvariantViolation,
        r"INV-15 violated: evict_host frees host slots of node 4 whose per-layer write is "
        r"still pending \(cancel_layer_write_state\(node_id\) first\)",
    )
    assert c.cancel_layer_write_state(4)
    assert c.evict_host(reservation.host_indices) == 2 * PAGE
    assert rig.host_pool.allocated_pages() == set()


# -- operations.LayerDoneCounter.set_consumer: int(None) in the list form; `>=` -> `>` ---------
def test_set_consumer_takes_a_list_of_producer_ids_and_drops_the_idle_marker() -> None:
    counter = LayerDoneCounter(2, SimDevice(), num_counters=3)
    counter.set_consumer([2, -1, 0])
    assert counter.consumer_indices == [2, 0] and counter.consumer_index == 2
    counter.set_consumer((-1,))
    assert counter.consumer_indices == [] and counter.consumer_index == -1


@pytest.mark.parametrize("index", [3, [0, 3]])
def test_set_consumer_refuses_the_id_one_past_the_last_slot(index: int | list[int]) -> None:
    counter = LayerDoneCounter(2, SimDevice(), num_counters=3)
    with pytest.raises(LayerRangeError, match=r"consumer index 3 is outside \[0, 3\)"):
        counter.set_consumer(index)


# -- cp_write._get_or_create_layer_write_state: the undrained-ack INV-02 (id -> None / "XX..XX") -
def test_per_layer_write_of_a_node_whose_all_layer_ack_is_undrained_is_an_inv02_violation() -> None:
    # two reservations for n1 -> all-layer submit of the first -> per-layer submit of the
    # second: INV-02 names the undrained ack, and no per-layer state is left pending
    rig = cp_rig()
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    first = reserve(rig, locs, node_id=1)
    second = reserve(rig, locs, node_id=1)
    c.submit_write_cp_all_layer(first)
    with pytest.raises(InvariantViolation) as caught:
        c.submit_write_cp_per_layer(second)
    assert caught.value.inv_id == "INV-02"
    assert str(caught.value) == (
        "INV-02 violated: per-layer write for node 1 while its previous write ack is undrained "
        "(drain it with writing_check first)"
    )
    assert 1 not in c.pending_layer_writes


# -- cp_load._verify_owner_replay: InvariantViolation("INV-03" -> dropped / "XX..XX", ...) ------
def test_load_cp_refuses_pages_whose_owners_differ_from_the_recorded_pattern() -> None:
    # rank 0 of CP 2 backs up n1 over 10 pages of both owners -> the allocator answers load_cp
    # with the pattern reversed -> INV-03 names the first 8 owners of both patterns, and the
    # pages go back (INV-17)
    rig = build_rig(
        SimDevice(), kind="nsa", cp_layout=CpSharedKVLayout(2, 0, PAGE), device_pages=32
    )
    c = rig.controller
    reservation = reserve(rig, alloc(rig, 10 * PAGE), node_id=1)
    c.submit_write_cp_all_layer(reservation)
    sim_of(rig).run_until_idle()
    assert drain_acks(c.ack_write_queue) == [[1]]
    meta = reservation.metadata
    recorded = meta.page_owners.tolist()
    assert sorted(recorded) == [0] * 5 + [1] * 5 and recorded != recorded[::-1]
    replay = c.mem_pool_device_allocator.alloc_pages_with_owners

    def swapped_owners(page_owners: Sequence[int]) -> torch.Tensor | None:
        return replay(list(reversed(page_owners)))

    c.mem_pool_device_allocator.alloc_pages_with_owners = swapped_owners  # type: ignore[method-assign]
    error = refused(
        rig,
        lambda: c.load_cp([CpNodeView(1, 10 * PAGE, meta)], node_id=1),
        InvariantViolation,
        re.escape(
            f"INV-03 violated: allocated pages have owners {recorded[::-1][:8]}, the recorded "
            f"pattern is {recorded[:8]} (alloc_pages_with_owners must replay page_owners, or each "
            "rank loads its bytes into pages another rank owns)"
        ),
    )
    assert isinstance(error, InvariantViolation) and error.inv_id == "INV-03"


# -- cp_load.evict_cp_host: the draft-host INV-07 ("inv-07"), the missing-draft message; and
# -- cp_write._append_layer_write_ack: the draft-host pages tracked under "draft_host" ----------
@pytest.mark.parametrize("submit", ["all_layer", "per_layer"])
def test_evict_cp_host_refused_while_the_draft_copy_is_in_flight(submit: str) -> None:
    # CP rank with a draft pool -> n2 backed up (all-layer, or every layer hooked: acked) ->
    # copies not run -> evict_cp_host: INV-07 names the draft host slots, checked first
    rig = cp_rig(draft_layer_num=2)
    c = rig.controller
    reservation = reserve(rig, alloc(rig, 2 * PAGE), node_id=2)
    if submit == "all_layer":
        c.submit_write_cp_all_layer(reservation)
    else:
        c.submit_write_cp_per_layer(reservation)
    assert c.ack_write_queue and 2 not in c.pending_layer_writes
    refused(
        rig,
        lambda: c.evict_cp_host(reservation.metadata),
        InvariantViolation,
        r"INV-07 violated: evict_cp_host frees draft_host page\(s\) \[\d+, \d+\] while ",
    )
    sim_of(rig).run_until_idle()
    assert c.evict_cp_host(reservation.metadata) == 2 * PAGE


def test_evict_cp_host_without_draft_slots_on_a_draft_rank_is_refused() -> None:
    plain, drafted = cp_rig(), cp_rig(draft_layer_num=2)
    metadata = reserve(plain, alloc(plain, PAGE), node_id=1).metadata
    refused(
        drafted,
        lambda: drafted.controller.evict_cp_host(metadata),
        MissingCpMetadataError,
        r"^a draft pool is attached but the metadata has no draft_host_indices$",
    )


# -- cache_controller.start_loading: the INV-10 message ("XX...XX" in its fix) -----------------
def test_start_loading_with_every_producer_slot_held_by_an_undrained_ack_names_the_fix() -> None:
    # num_counters=2 -> n1 backed up -> two loads started, acks landed but undrained -> a
    # third start_loading: INV-10 with the count, the bound and upstream's predicate
    rig = build_rig(SimDevice(), num_counters=2)
    c = rig.controller
    _, host = backed_up(rig, 1)
    for node_id in (11, 12):
        assert c.load(host, node_id=node_id) is not None
        c.start_loading()
    sim_of(rig).run_until_idle()
    assert c.load(host, node_id=13) is not None
    refused(
        rig,
        c.start_loading,
        InvariantViolation,
        re.escape(
            "INV-10 violated: start_loading with 2 undrained load acks and num_counters=2: a "
            "slot would be reused while its ack is undrained (drain with loading_check first; "
            "upstream's has_free_load_back_slot)"
        )
        + "$",
    )


# -- operations.LayerDoneCounter.__init__: the num_counters message (-> None) -----------------
def test_a_layer_done_counter_needs_two_slots_for_overlap() -> None:
    with pytest.raises(LayerRangeError, match=r"^num_counters=1 must be >= 2 \(overlap mode\)$"):
        LayerDoneCounter(2, SimDevice(), num_counters=1)


# -- base.ControllerState._append_write_ack: the funnel's INV-02 ("INV-02" -> "inv-02") --------
def test_two_queued_writes_of_one_node_are_refused_at_the_write_ack_funnel() -> None:
    # a caller that bypasses write() queues two ops of n5 -> start_writing merges them -> the
    # ack funnel refuses the second ack of n5 (INV-02, bug class 1) and appends no ack
    rig = build_rig(SimDevice())
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    host = rig.host_pool.alloc(2 * PAGE)
    assert host is not None
    c.write_queue.extend(
        [
            CacheOperation(host[:PAGE], locs[:PAGE], 5),
            CacheOperation(host[PAGE:], locs[PAGE:], 5),
        ]
    )
    with pytest.raises(InvariantViolation) as caught:
        c.start_writing()
    assert caught.value.inv_id == "INV-02"
    assert str(caught.value).startswith(
        "INV-02 violated: a second write ack for node 5 while one is undrained"
    )
    assert c.ack_write_queue == []


# -- base.ControllerState._check_queue_bound: `>=` -> `>`, the INV-16 id and message ----------
def test_an_ack_queue_at_its_bound_is_an_inv16_violation() -> None:
    ControllerState._check_queue_bound([None] * (ACK_QUEUE_BOUND - 1), "ack_load_queue")
    with pytest.raises(InvariantViolation) as caught:
        ControllerState._check_queue_bound([None] * ACK_QUEUE_BOUND, "ack_load_queue")
    assert caught.value.inv_id == "INV-16"
    assert str(caught.value) == (
        f"INV-16 violated: ack_load_queue holds {ACK_QUEUE_BOUND} undrained acks: the tree is not "
        "draining them (call writing_check/loading_check every scheduler step)"
    )
