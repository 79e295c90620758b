"""CopyLanded: a harness reports executed copies and the oracle predicts the bytes they moved."""

from __future__ import annotations

from hicache_ref.oracle import (
    Advance,
    CopyLanded,
    DrainWriteAcks,
    Insert,
    OracleConfig,
    OracleState,
    Store,
    Write,
    check_invariants,
    decode_tag,
    get_host_tag,
    get_write_ack_rows,
    run_ops,
    step,
)
from hicache_ref.oracle.contracts import landed_copies_match_advance, store_all

from .worlds import ids, play, world


def _written() -> tuple[OracleConfig, OracleState]:
    config = world(layers=2, tokens=(3,), device_pages=2, host_pages=2)
    state, _ = play(config, [Insert(0), *store_all(config, 0), Write(0)])
    return config, state


def test_reported_d2h_moves_the_node_tags_to_host() -> None:
    config, state = _written()
    state, _ = run_ops(state, [Advance("forward"), Advance("forward")])
    # the device ran layer 0's D2H of pages 0..1 into host pages 0..1
    state, _ = step(state, CopyLanded("d2h", 0, (0, 1, 2, 3), (0, 1, 2, 3)))
    assert [decode_tag(config, get_host_tag(state, s, 0)) for s in range(3)] == [
        (0, 0),
        (0, 1),
        (0, 2),
    ]
    # then layer 1's D2H
    state, _ = step(state, CopyLanded("d2h", 1, (0, 1, 2, 3), (0, 1, 2, 3)))
    assert not state.streams[1]  # the finish record settled behind the last copy
    state, seen = step(state, DrainWriteAcks())
    assert seen[0].values == (0,) and get_write_ack_rows(state) == ()
    assert check_invariants(state) == []


def test_a_copy_the_oracle_did_not_queue_is_flagged() -> None:
    _, state = _written()
    # host pages 2..3 were never reserved for this node
    state, _ = step(state, CopyLanded("d2h", 0, (4, 5, 6, 7), (0, 1, 2, 3)))
    assert "INV-06" in ids(check_invariants(state))


def test_a_copy_of_partial_pages_breaks_page_alignment() -> None:
    _, state = _written()
    state, _ = step(state, CopyLanded("d2h", 0, (1, 2), (0, 1)))
    assert "INV-01" in ids(check_invariants(state))


def test_a_copy_reported_before_its_store_ran_is_flagged() -> None:
    # without the fence the D2H does not wait, so the device may run it before the store
    config = world(
        layers=1, tokens=(2,), device_pages=2, host_pages=2, bugs=("no_fence_before_d2h",)
    )
    state, _ = play(config, [Insert(0), Store(0, 0), Write(0)])
    state, _ = step(state, CopyLanded("d2h", 0, (0, 1), (0, 1)))
    assert "INV-12" in ids(check_invariants(state))


def test_the_fence_makes_a_reported_copy_see_the_store() -> None:
    # with the fence the device passed the wait, so the store ran first: no INV-12
    config = world(layers=1, tokens=(2,), device_pages=2, host_pages=2)
    state, _ = play(config, [Insert(0), Store(0, 0), Write(0)])
    state, _ = step(state, CopyLanded("d2h", 0, (0, 1), (0, 1)))
    assert check_invariants(state) == []
    assert decode_tag(config, get_host_tag(state, 1, 0)) == (0, 1)


def test_reporting_every_copy_predicts_what_advancing_predicts() -> None:
    for cp in (0, 1, 2):
        assert landed_copies_match_advance(2, 3, 2, 1, cp)


def test_an_all_layer_report_lands_every_layer_of_the_pool() -> None:
    _, state = _written()
    state, _ = step(state, Advance("forward"))
    state, _ = step(state, CopyLanded("d2h", None, (0, 1, 2, 3), (0, 1, 2, 3)))
    assert not state.streams[1]
    state, seen = step(state, DrainWriteAcks())
    assert seen[0].values == (0,)
    assert check_invariants(state) == []


def test_cp_ranks_land_their_pages_independently() -> None:
    # n0 spans pages 0 (rank 0) and 1 (rank 1): each rank reports its own half of each copy
    config = world(cp=2, layers=1, tokens=(4,), device_pages=2, host_pages=1)
    state, _ = play(config, [Insert(0), Store(0, 0), Write(0), Advance("forward")])
    state, _ = step(state, CopyLanded("d2h", 0, (0, 1), (0, 1), rank=0))
    state, seen = step(state, DrainWriteAcks())
    assert seen == ()  # rank 1's half is still in flight: the ack is not complete
    state, _ = step(state, CopyLanded("d2h", 0, (0, 1), (2, 3), rank=1))
    state, seen = step(state, DrainWriteAcks())
    assert seen[0].values == (0,)
    assert [decode_tag(config, get_host_tag(state, s, 0, rank=1)) for s in (0, 1)] == [
        (0, 2),
        (0, 3),
    ]
    assert check_invariants(state) == []
