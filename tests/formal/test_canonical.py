"""Symmetry reduction: states that differ by node or page names share one representative."""

from __future__ import annotations

from hicache_ref.formal.canonical import canonicalize, node_groups
from hicache_ref.oracle import (
    Insert,
    OracleConfig,
    Store,
    Write,
    initial_state,
    run_ops,
)


def _config() -> OracleConfig:
    return OracleConfig(
        page_size=2, layer_num=1, device_pages=4, host_pages=4, cp_size=0, node_tokens=(2, 2, 4)
    )


def test_swapping_interchangeable_nodes_gives_one_representative() -> None:
    config = _config()
    groups = node_groups(config)
    assert groups == ((0, 1), (2,))
    first, _ = run_ops(initial_state(config), [Insert(0), Store(0, 0), Write(0)])
    second, _ = run_ops(initial_state(config), [Insert(1), Store(1, 0), Write(1)])
    assert first != second
    assert canonicalize(first, groups) == canonicalize(second, groups)


def test_renamed_pages_give_one_representative() -> None:
    config = _config()
    groups = node_groups(config)
    low, _ = run_ops(initial_state(config), [Insert(0, device_pages=(0,))])
    high, _ = run_ops(initial_state(config), [Insert(0, device_pages=(3,))])
    assert canonicalize(low, groups) == canonicalize(high, groups)


def test_nodes_of_different_sizes_stay_apart() -> None:
    config = _config()
    groups = node_groups(config)
    small, _ = run_ops(initial_state(config), [Insert(0)])
    large, _ = run_ops(initial_state(config), [Insert(2)])
    assert canonicalize(small, groups) != canonicalize(large, groups)


def test_canonicalize_is_idempotent() -> None:
    config = _config()
    groups = node_groups(config)
    state, _ = run_ops(initial_state(config), [Insert(1), Insert(0), Store(1, 0), Write(1)])
    once = canonicalize(state, groups)
    assert canonicalize(once, groups) == once
