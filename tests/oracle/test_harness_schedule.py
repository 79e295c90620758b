"""What a harness stepping the oracle in lockstep needs: a universe that grows as the tree
inserts, drains of the count the tree drained, forward ops reported as they run, and the
harness's looser (still correct) schedule, under which an op the device ran before the event
it waits on is a fault (INV-11, INV-12, INV-09)."""

from __future__ import annotations

import pytest

from hicache_ref.errors import HiCacheInputError
from hicache_ref.oracle import (
    CopyLanded,
    DrainWriteAcks,
    EvictDevice,
    ForwardRan,
    ForwardRead,
    Insert,
    Load,
    OracleConfig,
    StartLoading,
    Store,
    Write,
    check_invariants,
    initial_state,
    is_enabled,
    run_ops,
    step,
    why_disabled,
)
from hicache_ref.oracle.geometry import compute_token_tag

from .worlds import ids


def grown(**changes: object) -> OracleConfig:
    """A world with no node yet (the harness inserts them) and the harness's schedule."""
    values: dict[str, object] = {
        "page_size": 2,
        "layer_num": 2,
        "device_pages": 6,
        "host_pages": 6,
        "node_tokens": (),
        "max_tokens": 8,
        "harness_schedule": True,
    }
    values.update(changes)
    return OracleConfig(**values)  # type: ignore[arg-type]


def test_the_universe_grows_one_sized_insert_at_a_time() -> None:
    state = initial_state(grown())
    state, _ = step(state, Insert(0, device_pages=(1, 2), tokens=3))
    state, _ = step(state, Insert(1, device_pages=(3,), tokens=2))
    assert state.config.node_tokens == (3, 2) and len(state.nodes) == 2
    # a hole in the universe, or more tokens than the fixed tag stride, is refused
    assert why_disabled(state, Insert(3, tokens=2)) == "node 3 is outside the universe [0, 2)"
    assert "max_tokens=8" in str(why_disabled(state, Insert(2, tokens=9)))


def test_tags_keep_their_meaning_as_the_universe_grows() -> None:
    state = initial_state(grown())
    state, _ = step(state, Insert(0, device_pages=(1,), tokens=2))
    state, _ = run_ops(state, [Store(0, 0), ForwardRan()])
    before = state.device_tags[0][2]
    state, _ = step(state, Insert(1, device_pages=(2, 3), tokens=4))
    assert state.device_tags[0][2] == before == compute_token_tag(0, 0, 8)


def test_a_growing_universe_needs_a_fixed_stride() -> None:
    with pytest.raises(HiCacheInputError, match="max_tokens >= 1 for a universe that grows"):
        OracleConfig(node_tokens=())
    with pytest.raises(HiCacheInputError, match="a growing universe needs max_tokens"):
        OracleConfig(node_tokens=(2,)).with_node_tokens(1, 2)


def _written(config: OracleConfig) -> object:
    state = initial_state(config)
    ops = [Insert(0, device_pages=(1, 2), tokens=4), Store(0, 0), Store(0, 1)]
    state, _ = run_ops(state, [*ops, Write(0, host_pages=((0, 1),))])
    return state


def test_a_d2h_run_before_its_store_is_an_inv12_fault_at_once() -> None:
    state = _written(grown())
    # the device ran layer 0's D2H while the forward had not run the stores (no fence waited)
    state, _ = step(state, CopyLanded("d2h", 0, (0, 1, 2, 3), (2, 3, 4, 5)))  # type: ignore[arg-type]
    assert "INV-12" in ids(check_invariants(state))


def test_reported_forward_work_lets_the_copies_land_cleanly() -> None:
    state = _written(grown())
    state, _ = run_ops(state, [ForwardRan(), ForwardRan()])  # type: ignore[arg-type]
    for layer in (0, 1):
        state, _ = step(state, CopyLanded("d2h", layer, (0, 1, 2, 3), (2, 3, 4, 5)))
    state, seen = step(state, DrainWriteAcks(count=1))
    assert seen[0].values == (0,) and check_invariants(state) == []


def test_draining_what_the_tree_drained_flags_an_ack_whose_copies_had_not_landed() -> None:
    state = _written(grown())
    state, _ = run_ops(state, [ForwardRan(), ForwardRan()])  # type: ignore[arg-type]
    state, _ = step(state, DrainWriteAcks(count=1))  # the tree saw a completed finish event
    assert "INV-09" in ids(check_invariants(state))


def test_a_read_that_passed_its_layer_gate_early_is_an_inv11_fault() -> None:
    config = grown()
    state = initial_state(config)
    ops = [Insert(0, device_pages=(1, 2), tokens=4), Store(0, 0), Store(0, 1), ForwardRan()]
    ops += [ForwardRan(), Write(0, host_pages=((0, 1),))]
    ops += [CopyLanded("d2h", layer, (0, 1, 2, 3), (2, 3, 4, 5)) for layer in (0, 1)]
    state, _ = run_ops(state, [*ops, DrainWriteAcks(count=1), EvictDevice(0)])
    state, _ = run_ops(state, [Load(0, device_pages=(3, 4)), StartLoading(), ForwardRead(0, 1)])
    # the device ran the read of layer 1 before any H2D landed
    state, _ = step(state, ForwardRan())
    assert "INV-11" in ids(check_invariants(state))


def test_the_harness_schedule_admits_reads_of_stored_layers_and_frees_behind_the_forward() -> None:
    strict, loose = grown(harness_schedule=False, node_tokens=(2,)), grown()
    for config in (strict, loose):
        insert = Insert(0, device_pages=(1,), tokens=2 if config.harness_schedule else None)
        state, _ = run_ops(initial_state(config), [insert])
        state, _ = step(state, Store(0, 0))
        read = ForwardRead(0, 0)  # a read of a node never loaded back: the harness's forward
        assert is_enabled(state, read) == config.harness_schedule
        assert is_enabled(state, Store(0, 0)) == config.harness_schedule  # stored again
        # an aborted request: its page is freed while its own store is still queued
        assert is_enabled(state, EvictDevice(0)) == config.harness_schedule
    state, _ = run_ops(state, [read, EvictDevice(0), ForwardRan(), ForwardRan()])
    assert check_invariants(state) == []
