"""Broken invariants are refused with ``InvariantViolation`` naming the id, node and fix.

INV-02 (one live write per node, and the undrained-ack gate is exact), INV-18 (reset leaves
nothing behind), INV-07/INV-08 (no host or device free while a copy uses the slots), INV-10
(producer slots) and INV-15 (cancel quiesces). After each refusal the pools and queues are as
before (INV-17), and once the copy landed or the write was cancelled the same call succeeds.
"""

from __future__ import annotations

import pytest
import torch

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.operations import LayerDoneCounter
from hicache_ref.device import SimDevice, SimStream
from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.models import CpHiCacheNodeMetadata, HiCacheWriteFailure

from .rig import ack_rows, assert_rows, build_rig, drain_acks, fill_node, snapshot
from .steps import PAGE, alloc, backed_up, cp_rig, refused, reserve, sim_of, written


# -- INV-02: one live write per node ---------------------------------------------------------------
def test_second_write_of_a_node_with_an_undrained_ack_is_an_inv02_violation() -> None:
    # write n1 -> (landed, not drained) -> write n1 again -> INV-02; drain -> write again works
    rig = build_rig(SimDevice())
    locs, _ = written(rig, node_id=1)
    sim_of(rig).run_until_idle()
    error = refused(
        rig,
        lambda: rig.controller.write(locs, node_id=1),
        InvariantViolation,
        r"INV-02 violated: write\(node_id=1\) while its previous write ack is undrained",
    )
    assert isinstance(error, InvariantViolation) and error.inv_id == "INV-02"
    drain_acks(rig.controller.ack_write_queue)
    assert isinstance(rig.controller.write(locs, node_id=1), torch.Tensor)


def test_reserve_write_cp_for_a_node_with_an_undrained_write_is_refused() -> None:
    # early reservation pending -> reserve again: undrained_ack; acked, undrained: same;
    # drained -> the node can be backed up again
    rig = cp_rig()
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    reservation = reserve(rig, locs, node_id=1)
    c.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    refused = HiCacheWriteFailure(required_host_slots=0, reason="undrained_ack")
    before = snapshot(rig)
    assert c.reserve_write_cp(locs, node_id=1) == refused  # pending per-layer state
    for layer in range(3):
        rig.device_pool.notify_layer_end(layer)
    sim_of(rig).run_until_idle()
    assert c.reserve_write_cp(locs, node_id=1) == refused  # landed, ack undrained
    assert snapshot(rig).host_pages == before.host_pages
    drain_acks(c.ack_write_queue)
    c.evict_cp_host(reservation.metadata)
    again = reserve(rig, locs, node_id=1)
    c.submit_write_cp_per_layer(again)
    assert ack_rows(c.ack_write_queue) == [[1]]


def test_second_per_layer_reservation_for_a_pending_node_is_an_inv02_violation() -> None:
    rig = cp_rig()
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    first = reserve(rig, locs, node_id=1)
    second = reserve(rig, locs, node_id=1)  # both reserved before either was submitted
    c.submit_write_cp_per_layer(first, catch_up_all_layers=False)
    with pytest.raises(
        InvariantViolation, match=r"INV-02 violated: a second per-layer reservation"
    ):
        c.submit_write_cp_per_layer(second)
    c.submit_write_cp_per_layer(first)
    assert ack_rows(c.ack_write_queue) == [[1]]


def test_second_all_layer_submit_for_a_node_is_refused_before_its_copy_is_issued() -> None:
    # two reservations for n1 -> all-layer submit of the first -> of the second: INV-02, and
    # the refused submit queued no copy into the second reservation's host slots
    rig = cp_rig()
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    first = reserve(rig, locs, node_id=1)
    second = reserve(rig, locs, node_id=1)
    c.submit_write_cp_all_layer(first)
    pending_ops, inflight = sim_of(rig).pending_ops(), len(c.inflight)
    with pytest.raises(InvariantViolation, match=r"INV-02 violated"):
        c.submit_write_cp_all_layer(second)
    assert sim_of(rig).pending_ops() == pending_ops
    assert len(c.inflight) == inflight
    assert ack_rows(c.ack_write_queue) == [[1]]


def _gate_agrees_with_a_scan(c: HiCacheController, node_ids: range) -> None:
    for node_id in node_ids:
        scanned = any(node_id in ack.node_ids for ack in c.ack_write_queue)
        assert c.node_has_undrained_write_ack(node_id) == scanned, node_id


def test_undrained_ack_gate_agrees_with_a_queue_scan() -> None:
    # write n3, n5, n7 -> drain n3 -> write n2 (below the max id) -> the gate is exact (INV-02)
    rig = build_rig(SimDevice())
    c = rig.controller
    for node_id in (3, 5, 7):
        written(rig, node_id, pages=1)
    _gate_agrees_with_a_scan(c, range(-1, 12))
    sim_of(rig).run_until_idle()
    c.ack_write_queue.pop(0)
    written(rig, 2, pages=1)
    assert ack_rows(c.ack_write_queue) == [[5], [7], [2]]
    _gate_agrees_with_a_scan(c, range(-1, 12))


def test_reset_forgets_every_ack_and_node_ids_restart() -> None:
    # write n5, n6 (in flight) -> reset -> streams drained, queues empty, gate False (INV-18)
    rig = build_rig(SimDevice())
    c = rig.controller
    _, host5 = written(rig, 5, pages=1)
    written(rig, 6, pages=1)
    c.reset()
    # the issued copies landed before reset forgot them
    assert isinstance(c.write_stream, SimStream) and c.write_stream.query()
    assert_rows(rig.host_pool, host5, rig.device_pool, 5)
    assert (c.write_queue, c.load_queue, c.ack_write_queue, c.ack_load_queue) == ([], [], [], [])
    assert c.pending_layer_writes == {}
    assert c.layer_done_counter.producer_index == -1
    assert c.layer_done_counter.consumer_indices == []
    assert not any(c.node_has_undrained_write_ack(i) for i in range(-1, 12))
    # tree ids restart at 0 -> n0 and n5 can be written again, the gate stays exact
    written(rig, 0, pages=1)
    written(rig, 5, pages=1)
    assert ack_rows(c.ack_write_queue) == [[0], [5]]
    _gate_agrees_with_a_scan(c, range(-1, 12))


# -- INV-07 / INV-08: no free while a copy uses the slots ------------------------------------------
def test_evict_host_refused_while_its_write_is_in_flight() -> None:
    # write n4 -> evict_host before the D2H landed -> INV-07 names n4; landed -> allowed
    rig = build_rig(SimDevice(), host_alloc_policy="fifo")
    _, host = written(rig, node_id=4)
    refused(
        rig,
        lambda: rig.controller.evict_host(host),
        InvariantViolation,
        r"INV-07 violated: evict_host frees host page\(s\) \[0, 1\] while write for "
        r"node\(s\) \[4\] still uses them",
    )
    sim_of(rig).run_until_idle()
    assert rig.controller.evict_host(host) == 2 * PAGE


def test_evict_device_refused_while_its_write_is_in_flight() -> None:
    rig = build_rig(SimDevice())
    locs, _ = written(rig, node_id=4)
    refused(
        rig,
        lambda: rig.controller.evict_device(locs),
        InvariantViolation,
        r"INV-08 violated: evict_device frees device page\(s\) \[1, 2\] while write for "
        r"node\(s\) \[4\] still uses them",
    )
    sim_of(rig).run_until_idle()
    assert rig.controller.evict_device(locs) == 2 * PAGE


def test_evict_host_and_device_refused_while_a_load_is_in_flight() -> None:
    # n4 backed up, evicted -> load + start_loading -> evict host / new device -> INV-07/08
    rig = build_rig(SimDevice())
    c = rig.controller
    locs, host = backed_up(rig, node_id=4)
    c.evict_device(locs)
    loaded = c.load(host, node_id=4)
    assert loaded is not None
    c.start_loading()
    refused(
        rig, lambda: c.evict_host(host), InvariantViolation, r"INV-07 .* load for node\(s\) \[4\]"
    )
    refused(
        rig,
        lambda: c.evict_device(loaded),
        InvariantViolation,
        r"INV-08 .* load for node\(s\) \[4\]",
    )
    sim_of(rig).run_until_idle()
    assert c.evict_host(host) == 2 * PAGE
    assert c.evict_device(loaded) == 2 * PAGE


def test_evict_device_refused_while_a_per_layer_write_still_reads_the_pages() -> None:
    # early reservation n4 -> layer 0 stored, its D2H queued -> evict_device(n4) -> INV-08
    rig = cp_rig()
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    reservation = reserve(rig, locs, node_id=4)
    c.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    rig.device_pool.notify_layer_end(0)
    refused(rig, lambda: c.evict_device(locs), InvariantViolation, r"INV-08 violated")


def test_evict_device_refused_while_an_acked_per_layer_write_is_in_flight() -> None:
    rig = cp_rig()
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    c.submit_write_cp_per_layer(reserve(rig, locs, node_id=4))
    refused(
        rig,
        lambda: c.evict_device(locs),
        InvariantViolation,
        r"INV-08 violated: .* while per-layer write for node\(s\) \[4\]",
    )
    sim_of(rig).run_until_idle()
    assert c.evict_device(locs) == 2 * PAGE


# -- INV-10: producer slots --------------------------------------------------------------------------
def test_start_loading_with_every_producer_slot_pending_is_an_inv10_violation() -> None:
    # (the slot-level guard in LayerDoneCounter.update_producer is tested in
    # test_update_producer_refuses_a_slot_whose_load_is_in_flight)
    # two slots, two loads in flight -> a third start_loading -> INV-10; landed -> it runs
    rig = build_rig(SimDevice(), num_counters=2)
    c = rig.controller
    hosts = []
    for node_id in (1, 2, 3):
        locs, host = backed_up(rig, node_id)
        c.evict_device(locs)
        hosts.append(host)
    for node_id, host in zip((1, 2), hosts, strict=False):
        assert c.load(host, node_id=node_id) is not None
        c.start_loading()
    assert c.load(hosts[2], node_id=3) is not None
    with pytest.raises(
        InvariantViolation,
        match=r"INV-10 violated: start_loading with 2 undrained load acks and num_counters=2",
    ):
        c.start_loading()
    assert ack_rows(c.ack_load_queue) == [[1], [2]]
    # landed but undrained -> still refused: the undrained acks hold both slots
    sim_of(rig).run_until_idle()
    with pytest.raises(InvariantViolation, match="INV-10"):
        c.start_loading()
    drain_acks(c.ack_load_queue)
    assert c.start_loading() == 0
    assert ack_rows(c.ack_load_queue) == [[3]]


def test_update_producer_refuses_a_slot_whose_load_is_in_flight() -> None:
    # a counter used directly: slot 0 recorded, still pending -> wrapping around to it -> INV-10
    device = SimDevice()
    counter = LayerDoneCounter(1, device, num_counters=2)
    assert counter.update_producer() == 0
    counter.events[0].finish_event.record()
    assert counter.update_producer() == 1
    with pytest.raises(InvariantViolation, match="INV-10 violated: producer slot 0 reused"):
        counter.update_producer()
    device.run_until_idle()
    assert counter.update_producer() == 0


# -- INV-15: cancel quiesces -----------------------------------------------------------------------
def test_evict_cp_host_refused_while_a_per_layer_write_is_pending_until_cancelled() -> None:
    # early reservation n4 -> layer 0 submitted -> evict_cp_host: INV-15 -> cancel -> write
    # stream idle -> evict_cp_host frees -> later hooks copy nothing, no ack for n4
    rig = cp_rig()
    c = rig.controller
    locs = alloc(rig, 2 * PAGE)
    fill_node(rig.device_pool, locs, 4)
    reservation = reserve(rig, locs, node_id=4)
    c.submit_write_cp_per_layer(reservation, catch_up_all_layers=False)
    rig.device_pool.notify_layer_end(0)
    metadata: CpHiCacheNodeMetadata = reservation.metadata
    refused(
        rig,
        lambda: c.evict_cp_host(metadata),
        InvariantViolation,
        r"INV-15 violated: evict_cp_host frees host slots of node 4 whose per-layer write is "
        r"still pending \(cancel_layer_write_state\(node_id\) first\)",
    )
    assert c.cancel_layer_write_state(4)
    assert isinstance(c.write_stream, SimStream) and c.write_stream.query()
    assert c.evict_cp_host(metadata) == 2 * PAGE
    assert rig.host_pool.allocated_pages() == set()
    for layer in (1, 2):
        rig.device_pool.notify_layer_end(layer)
    assert c.write_stream.query()
    assert c.ack_write_queue == []
    assert not c.cancel_layer_write_state(4)
