"""The tree's discipline (is_enabled), misuse errors, reset and the fresh epoch (INV-18)."""

from __future__ import annotations

import pytest

from hicache_ref.errors import HiCacheInputError, UnknownOptionError
from hicache_ref.oracle import (
    Advance,
    EvictDevice,
    EvictHost,
    Insert,
    Load,
    Noop,
    OpNotEnabledError,
    Reset,
    Store,
    Write,
    all_ops,
    check_invariants,
    enabled_ops,
    get_lifecycle,
    initial_state,
    is_enabled,
    make_variant,
    run_ops,
    step,
    why_disabled,
)
from hicache_ref.oracle.contracts import store_all

from .worlds import backed_up, play, world


def test_step_refuses_a_disabled_op_and_names_the_rule() -> None:
    state = initial_state(world(tokens=(2,)))
    with pytest.raises(OpNotEnabledError, match="load_back needs an evicted, backed-up node"):
        step(state, Load(0))


def test_ops_on_nodes_outside_the_universe_are_refused() -> None:
    state = initial_state(world(tokens=(2,)))
    assert why_disabled(state, Insert(5)) == "node 5 is outside the universe [0, 1)"


def test_a_blocked_stream_cannot_advance() -> None:
    state = initial_state(world(tokens=(2,)))
    assert not is_enabled(state, Advance("write"))


def test_explicit_pages_that_are_not_free_are_misuse() -> None:
    config = world(tokens=(2, 2))
    state, _ = play(config, [Insert(0, device_pages=(1,))])
    with pytest.raises(HiCacheInputError, match="not 1 distinct free device pages"):
        step(state, Insert(1, device_pages=(1,)))
    state, _ = play(config, [Insert(0), *store_all(config, 0)])
    with pytest.raises(HiCacheInputError, match="do not match the per-rank demand"):
        step(state, Write(0, host_pages=((0, 1),)))


def test_explicit_pages_are_followed() -> None:
    config = world(tokens=(2,))
    _, seen = play(
        config,
        [Insert(0, device_pages=(3,)), Store(0, 0), Store(0, 1), Write(0, host_pages=((2,),))],
    )
    assert seen[0].pages == ((3,),) and seen[-2].pages == ((2,),)


def test_unknown_variant_flags_are_rejected() -> None:
    with pytest.raises(UnknownOptionError, match="unknown protocol variant 'skip_fense'"):
        make_variant("skip_fense")


def test_reset_of_a_busy_world_starts_a_clean_epoch() -> None:
    config = world(tokens=(2, 2))
    state, _ = play(config, [Insert(0), Insert(1), *store_all(config, 0), Write(0)])
    state, _ = step(state, Reset())
    assert state.fresh_epoch and check_invariants(state) == []  # INV-18
    assert state == initial_state(config)


def test_noop_changes_nothing_and_keeps_the_epoch_fresh() -> None:
    state = initial_state(world())
    assert step(state, Noop()) == (state, ())


def test_a_deleted_node_is_not_inserted_again_this_epoch() -> None:
    config = world(layers=1, tokens=(2,))
    state = backed_up(config, 0)
    # evict_device keeps the host copy; evict_host deletes the node; its id is spent until reset
    state, _ = run_ops(state, [EvictDevice(0), EvictHost(0)])
    assert get_lifecycle(state, 0) == "gone"
    assert Insert(0) not in enabled_ops(state, all_ops(config))
    state, _ = step(state, Reset())
    assert is_enabled(state, Insert(0))
