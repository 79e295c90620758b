"""Load side of the oracle: load -> start_loading -> per-layer H2D + events -> loading_check."""

from __future__ import annotations

from hicache_ref.oracle import (
    Advance,
    DrainLoadAcks,
    EvictDevice,
    ForwardRead,
    Insert,
    Load,
    StartLoading,
    check_invariants,
    get_device_page_owner,
    get_device_pages,
    get_lifecycle,
    get_load_ack_rows,
    get_lock_ref,
    is_enabled,
    run_ops,
    step,
)
from hicache_ref.oracle.contracts import run_until_quiet
from hicache_ref.oracle.state import CopyPages, RecordEvent

from .worlds import backed_up, world


def test_load_replays_the_owner_pattern_of_the_write() -> None:
    config = world(cp=2, layers=1, tokens=(2, 2), device_pages=2, host_pages=2)
    # n0 written from page 0 (rank 0), evicted; n1 takes page 0 -> n0 must reload onto rank 0
    state = backed_up(config, 0)
    state, _ = run_ops(state, [EvictDevice(0), Insert(1)])
    assert get_device_pages(state, 1) == (0,)
    after, seen = step(state, Load(0))
    # the only free page is owned by rank 1 -> the load fails closed instead (INV-03)
    assert seen[0].kind == "load_failure" and after == state


def test_load_pins_the_node_until_its_ack_drains() -> None:
    config = world(layers=2, tokens=(2,))
    state = backed_up(config, 0)
    state, _ = run_ops(state, [EvictDevice(0), Load(0)])
    assert get_lifecycle(state, 0) == "load_queued" and get_lock_ref(state, 0) == 1
    assert not is_enabled(state, EvictDevice(0))
    state, seen = step(state, StartLoading())
    assert seen[0].values == (0,)  # producer slot 0
    assert get_lifecycle(state, 0) == "load_in_flight" and get_load_ack_rows(state) == ((0,),)
    state = run_until_quiet(state)
    state, _ = step(state, DrainLoadAcks())
    assert get_lifecycle(state, 0) == "loaded" and get_lock_ref(state, 0) == 0
    assert get_device_page_owner(state, get_device_pages(state, 0)[0]).node == 0
    assert check_invariants(state) == []


def test_load_finish_event_follows_the_draft_tail() -> None:
    # 1 target layer, 2 draft layers: the seed's finish event (last target layer) would be early
    config = world(layers=1, draft=2, tokens=(2,))
    state = backed_up(config, 0)
    state, _ = run_ops(state, [EvictDevice(0), Load(0), StartLoading()])
    load_stream = state.streams[2]
    finish = max(
        i
        for i, op in enumerate(load_stream)
        if isinstance(op, RecordEvent) and op.event[0] == "lfin"
    )
    copies = [i for i, op in enumerate(load_stream) if isinstance(op, CopyPages)]
    assert len(copies) == 3 and max(copies) < finish  # INV-04
    assert check_invariants(state) == []


def test_forward_read_waits_for_its_layer_to_land() -> None:
    config = world(layers=2, tokens=(2,))
    state = backed_up(config, 0)
    state, _ = run_ops(state, [EvictDevice(0), Load(0), StartLoading(), ForwardRead(0, 0)])
    # the forward's head waits on layer 0's load event (INV-11)
    assert not is_enabled(state, Advance("forward"))
    state, _ = step(state, Advance("load"))  # H2D of layer 0 -> its event records
    state, seen = step(state, Advance("forward"))
    assert seen[0].kind == "read" and seen[0].values == (1, 2)
    assert check_invariants(state) == []


def test_forward_reads_layers_in_order() -> None:
    config = world(layers=2, tokens=(2,))
    state = backed_up(config, 0)
    state, _ = run_ops(state, [EvictDevice(0), Load(0), StartLoading()])
    assert not is_enabled(state, ForwardRead(0, 1))
    assert is_enabled(state, ForwardRead(0, 0))


def test_zero_owned_rank_still_queues_the_node() -> None:
    # n0 sits on page 0, owned by rank 0; rank 1 owns nothing of it but must queue it (INV-14)
    config = world(cp=2, layers=1, tokens=(2,), device_pages=2, host_pages=2)
    state = backed_up(config, 0)
    state, _ = run_ops(state, [EvictDevice(0), Load(0)])
    assert state.load_queue == ((0,), (0,))
    state, _ = step(state, StartLoading())
    assert get_load_ack_rows(state, 0) == get_load_ack_rows(state, 1) == ((0,),)


def test_start_loading_is_refused_without_a_free_producer_slot() -> None:
    config = world(layers=1, tokens=(2, 2), counters=1)
    state = backed_up(config, 0, 1)
    state, _ = run_ops(state, [EvictDevice(0), EvictDevice(1), Load(0), StartLoading(), Load(1)])
    # one producer slot, one undrained load ack -> has_free_load_back_slot is False (INV-10)
    assert not is_enabled(state, StartLoading())
    state = run_until_quiet(state)
    state, _ = step(state, DrainLoadAcks())
    state, seen = step(state, StartLoading())
    assert seen[0].values == (0,)
    assert check_invariants(state) == []
