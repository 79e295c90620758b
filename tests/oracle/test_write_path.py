"""Write side of the oracle: write -> D2H -> write ack -> writing_check, and the CP per-layer path."""

from __future__ import annotations

import pytest

from hicache_ref.oracle import (
    Advance,
    CancelLayerWrite,
    DrainWriteAcks,
    EvictHost,
    Insert,
    OnLayerEnd,
    ReserveWriteCp,
    Store,
    SubmitLayer,
    Write,
    check_invariants,
    get_host_page_owner,
    get_lifecycle,
    get_lock_ref,
    get_write_ack_rows,
    initial_state,
    is_enabled,
    run_ops,
    step,
)
from hicache_ref.oracle.contracts import run_until_quiet, store_all

from .worlds import ids, play, world


def test_write_reserves_owned_host_pages_and_queues_one_ack_per_rank() -> None:
    config = world(cp=2, tokens=(4,), device_pages=4)
    # insert n0 on two pages (one per rank) -> store -> write
    state, seen = play(config, [Insert(0), *store_all(config, 0), Write(0)])
    assert seen[-2].kind == "write" and seen[-2].pages == ((0,), (0,))
    assert get_lifecycle(state, 0) == "backup_in_flight" and get_lock_ref(state, 0) == 1
    assert get_host_page_owner(state, 0, rank=1).kind == "reserved"
    assert get_write_ack_rows(state, 0) == get_write_ack_rows(state, 1) == ((0,),)  # INV-14
    assert check_invariants(state) == []


def test_write_that_does_not_fit_changes_nothing() -> None:
    config = world(tokens=(4, 4), device_pages=4, host_pages=3)
    state, _ = play(config, [Insert(0), Insert(1), *store_all(config, 0), *store_all(config, 1)])
    state, _ = step(state, Write(0))
    # n1 needs 2 host pages, 1 is left -> a shortfall value, nothing half-allocated (INV-17)
    after, seen = step(state, Write(1))
    assert seen[0].kind == "write_failure" and seen[0].reason == "host_capacity"
    assert after == state


def test_drain_pops_only_the_completed_prefix_and_unlocks() -> None:
    config = world(tokens=(2, 2))
    state, _ = play(
        config,
        [Insert(0), Insert(1), *store_all(config, 0), *store_all(config, 1), Write(0), Write(1)],
    )
    # nothing copied yet -> drain pops nothing (INV-09)
    assert step(state, DrainWriteAcks())[0] == state
    # the forward runs every store; the write stream runs n0's two copies, not n1's
    state, _ = run_ops(state, [Advance("forward")] * 4 + [Advance("write")] * 2)
    assert len(state.streams[1]) == 3  # n1: two copies and the finish record
    state, seen = step(state, DrainWriteAcks())
    assert seen[0].values == (0,)
    assert get_lifecycle(state, 0) == "backed_up" and get_lock_ref(state, 0) == 0
    assert get_host_page_owner(state, 0).kind == "owned"
    assert get_write_ack_rows(state) == ((1,),)
    assert check_invariants(state) == []


def test_per_layer_write_acks_after_the_last_draft_layer() -> None:
    config = world(cp=2, layers=2, draft=1, tokens=(2,), device_pages=2, host_pages=2)
    state, _ = play(config, [Insert(0), ReserveWriteCp(0)])
    # target layers 0 and 1 submitted -> no ack yet: the draft layer is missing (INV-04)
    for layer in range(2):
        state, _ = run_ops(state, [Store(0, layer), OnLayerEnd(layer)])
    assert get_write_ack_rows(state) == ()
    state, _ = run_ops(state, [Store(0, 0, "draft"), SubmitLayer(0, 0, "draft")])
    assert get_write_ack_rows(state, 0) == get_write_ack_rows(state, 1) == ((0,),)
    state = run_until_quiet(state)
    state, _ = step(state, DrainWriteAcks())
    assert get_lifecycle(state, 0) == "backed_up"
    assert check_invariants(state) == []


def test_reserve_write_cp_refuses_a_node_with_an_undrained_ack() -> None:
    # the free_host_before_write_ack bug leaves n0 device-only with its ack still queued
    config = world(cp=1, tokens=(2,), bugs=("free_host_before_write_ack",))
    state, _ = play(config, [Insert(0), *store_all(config, 0), Write(0), EvictHost(0)])
    assert "INV-07" in ids(check_invariants(state))
    # a second reservation would be a second ack for one node -> refused (INV-02)
    after, seen = step(state, ReserveWriteCp(0))
    assert seen[0].reason == "undrained_ack" and after == state


def test_cancel_synchronizes_then_frees_the_reservation() -> None:
    config = world(cp=2, layers=2, tokens=(4,), device_pages=4, host_pages=2)
    state, _ = play(config, [Insert(0), ReserveWriteCp(0), Store(0, 0), OnLayerEnd(0)])
    # layer 0's D2H is queued -> cancel runs it to completion before freeing (INV-07, INV-15)
    state, _ = step(state, CancelLayerWrite(0))
    assert not state.streams[1] and not state.pending_layer_writes
    assert get_lifecycle(state, 0) == "device_only" and get_lock_ref(state, 0) == 0
    assert all(
        get_host_page_owner(state, p, rank=r).kind == "free" for p in range(2) for r in (0, 1)
    )
    assert not is_enabled(state, Write(0))
    assert check_invariants(state) == []


@pytest.mark.parametrize("cp", [0, 2])
def test_write_is_refused_before_every_layer_was_stored(cp: int) -> None:
    config = world(cp=cp, layers=2, tokens=(2,))
    state, _ = play(config, [Insert(0), Store(0, 0)])
    assert not is_enabled(state, Write(0))
    assert is_enabled(initial_state(config), Insert(0))
