"""Each structural check of ``check_invariants`` fires on a state corrupted the way its bug would."""

from __future__ import annotations

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.oracle import (
    EvictDevice,
    Insert,
    Load,
    StartLoading,
    Write,
    assert_invariants,
    check_invariants,
    run_ops,
)
from hicache_ref.oracle.contracts import store_all
from hicache_ref.oracle.geometry import FREE
from hicache_ref.oracle.state import Ack, OracleState, evolve, replace_at, with_node

from .worlds import backed_up, ids, play, world


def _writing() -> OracleState:
    config = world(cp=2, layers=1, tokens=(4,), device_pages=2, host_pages=2)
    state, _ = play(config, [Insert(0), *store_all(config, 0), Write(0)])
    return state


def _loading() -> OracleState:
    config = world(layers=1, tokens=(2,), device_pages=2, host_pages=2)
    state, _ = run_ops(backed_up(config, 0), [EvictDevice(0), Load(0), StartLoading()])
    return state


def test_a_clean_write_passes_every_check() -> None:
    assert check_invariants(_writing()) == []
    assert_invariants(_writing())


def test_slot_conservation_sees_a_page_held_by_nobody_who_lists_it() -> None:
    state = _writing()
    stolen = evolve(state, device_holders=(1, *state.device_holders[1:]))
    assert "INV-05" in ids(check_invariants(stolen))


def test_host_slot_freed_under_a_queued_d2h_is_seen() -> None:
    state = _writing()
    freed = replace_at(state.host_holders[0], 0, (FREE, *state.host_holders[0][0][1:]))
    assert "INV-07" in ids(
        check_invariants(evolve(state, host_holders=(freed, *state.host_holders[1:])))
    )


def test_device_page_freed_under_a_queued_h2d_is_seen() -> None:
    state = _loading()
    page = state.nodes[0].device_pages[0]
    freed = evolve(state, device_holders=replace_at(state.device_holders, page, FREE))
    assert "INV-08" in ids(check_invariants(freed))


def test_two_write_acks_for_one_node_are_seen() -> None:
    state = _writing()
    doubled = tuple(q + q for q in state.write_acks)
    assert "INV-02" in ids(check_invariants(evolve(state, write_acks=doubled)))


def test_rank_divergent_ack_rows_are_seen() -> None:
    state = _writing()
    divergent = (state.write_acks[0], ())
    assert "INV-14" in ids(check_invariants(evolve(state, write_acks=divergent)))


def test_two_load_acks_on_one_producer_slot_are_seen() -> None:
    state = _loading()
    ack = state.load_acks[0][0]
    doubled = ((ack, Ack((0,), ack.finish, ack.slot)),)
    assert "INV-10" in ids(check_invariants(evolve(state, load_acks=doubled)))


def test_a_wrong_owner_pattern_is_seen() -> None:
    state = _writing()
    record = state.nodes[0]
    assert "INV-03" in ids(
        check_invariants(with_node(state, 0, evolve(record, page_owners=(1, 0))))
    )


def test_a_corrupted_resident_copy_is_seen() -> None:
    config = world(layers=1, tokens=(2,), device_pages=2, host_pages=2)
    state = backed_up(config, 0)
    corrupted = evolve(state, device_tags=((0, 0, 0, 0),))
    assert "INV-06" in ids(check_invariants(corrupted))


def test_a_lost_ack_is_seen_at_quiescence() -> None:
    state = _writing()
    lost = evolve(state, streams=((), (), ()), write_acks=((), ()))
    assert "INV-16" in ids(check_invariants(lost))


def test_a_reset_that_left_acks_is_seen() -> None:
    state = _writing()
    assert "INV-18" in ids(check_invariants(evolve(state, fresh_epoch=True)))


def test_assert_invariants_raises_the_first_violation() -> None:
    state = _writing()
    with pytest.raises(InvariantViolation, match="INV-02 violated"):
        assert_invariants(evolve(state, write_acks=tuple(q + q for q in state.write_acks)))
