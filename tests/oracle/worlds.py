"""Small oracle worlds and helpers that the oracle tests share."""

from __future__ import annotations

from collections.abc import Iterable

from hicache_ref.oracle import (
    DrainWriteAcks,
    Insert,
    Observation,
    Op,
    OracleConfig,
    OracleState,
    Store,
    Violation,
    Write,
    initial_state,
    make_variant,
    run_ops,
)
from hicache_ref.oracle.contracts import run_until_quiet, store_all


def world(
    *,
    cp: int = 0,
    layers: int = 2,
    draft: int = 0,
    tokens: tuple[int, ...] = (2, 2),
    page_size: int = 2,
    device_pages: int = 4,
    host_pages: int = 4,
    counters: int = 5,
    bugs: tuple[str, ...] = (),
) -> OracleConfig:
    """An oracle config; ``bugs`` names planted-bug flags."""
    return OracleConfig(
        page_size=page_size,
        layer_num=layers,
        draft_layer_num=draft,
        device_pages=device_pages,
        host_pages=host_pages,
        draft_host_pages=host_pages,
        cp_size=cp,
        num_counters=counters,
        node_tokens=tokens,
        variant=make_variant(*bugs),
    )


def play(config: OracleConfig, ops: Iterable[Op]) -> tuple[OracleState, tuple[Observation, ...]]:
    """Run ``ops`` from the initial state of ``config``."""
    return run_ops(initial_state(config), ops)


def backed_up(config: OracleConfig, *nodes: int) -> OracleState:
    """Every node in ``nodes`` inserted, stored, written, copied and drained."""
    ops: list[Op] = []
    for node in nodes:
        ops += [Insert(node), *store_all(config, node), Write(node)]
    state, _ = play(config, ops)
    state = run_until_quiet(state)
    state, _ = run_ops(state, [DrainWriteAcks()])
    return state


def ids(violations: Iterable[Violation]) -> set[str]:
    """The invariant ids of a list of violations."""
    return {v.inv_id for v in violations}


__all__ = ["Store", "backed_up", "ids", "play", "world"]
