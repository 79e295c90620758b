"""Machines that must fail: each planted bug (a ProtocolVariant flag) and the trace that exposes it.

Each row is the shortest trace the bounded checker found for that bug. Under the planted bug the
trace breaks the named invariant; under the correct protocol the same trace is either refused by
the tree's discipline (an op is not enabled) or runs clean.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from hicache_ref.oracle import (
    PLANTED_BUGS,
    Advance,
    CancelLayerWrite,
    DrainWriteAcks,
    EvictDevice,
    EvictHost,
    ForwardRead,
    Insert,
    Load,
    Op,
    OracleConfig,
    ProtocolVariant,
    ReserveWriteCp,
    Reset,
    StartLoading,
    Store,
    SubmitLayer,
    Write,
    check_invariants,
    initial_state,
    is_enabled,
    step,
)

from .worlds import ids, play, world

BACKED_UP_AND_EVICTED: tuple[Op, ...] = (
    Insert(0),
    Store(0, 0),
    Write(0),
    Advance("forward"),
    Advance("write"),
    DrainWriteAcks(),
    EvictDevice(0),
)


@dataclass(frozen=True)
class Planted:
    flag: str
    config: OracleConfig
    trace: tuple[Op, ...]


def _one(flag: str, cp: int = 0, draft: int = 0) -> OracleConfig:
    """One node of one page, one target layer: enough for most bugs."""
    return world(
        cp=cp, layers=1, draft=draft, tokens=(2,), device_pages=2, host_pages=2, bugs=(flag,)
    )


CASES = [
    Planted(
        "free_host_before_write_ack",
        _one("free_host_before_write_ack"),
        (Insert(0), Store(0, 0), Write(0), EvictHost(0)),
    ),
    Planted("duplicate_write_ack", _one("duplicate_write_ack"), (Insert(0), Store(0, 0), Write(0))),
    Planted(
        "load_ack_before_last_layer",
        _one("load_ack_before_last_layer"),
        (*BACKED_UP_AND_EVICTED, Load(0), StartLoading()),
    ),
    Planted(
        "skip_owner_replay",
        world(
            cp=2, layers=1, tokens=(2, 2), device_pages=2, host_pages=2, bugs=("skip_owner_replay",)
        ),
        (*BACKED_UP_AND_EVICTED, Insert(1), Load(0)),
    ),
    Planted(
        "no_fence_before_d2h",
        _one("no_fence_before_d2h"),
        (Insert(0), Store(0, 0), Write(0), Advance("write")),
    ),
    Planted(
        "skip_draft_layers",
        _one("skip_draft_layers", cp=2, draft=1),
        (Insert(0), Store(0, 0), ReserveWriteCp(0), SubmitLayer(0, 0)),
    ),
    Planted(
        "reuse_busy_producer_slot",
        world(
            layers=1,
            tokens=(2, 2),
            device_pages=2,
            host_pages=2,
            counters=1,
            bugs=("reuse_busy_producer_slot",),
        ),
        (
            Insert(0),
            Insert(1),
            Store(0, 0),
            Store(1, 0),
            Write(0),
            Write(1),
            Advance("forward"),
            Advance("forward"),
            Advance("write"),
            Advance("write"),
            DrainWriteAcks(),
            EvictDevice(0),
            EvictDevice(1),
            Load(0),
            StartLoading(),
            Load(1),
            StartLoading(),
        ),
    ),
    Planted(
        "skip_layer_gate",
        _one("skip_layer_gate"),
        (*BACKED_UP_AND_EVICTED, Load(0), StartLoading(), ForwardRead(0, 0), Advance("forward")),
    ),
    Planted(
        "zero_owned_rank_drops_load",
        _one("zero_owned_rank_drops_load", cp=2),
        (*BACKED_UP_AND_EVICTED, Load(0)),
    ),
    Planted(
        "cancel_keeps_layer_state",
        _one("cancel_keeps_layer_state", cp=2),
        (Insert(0), ReserveWriteCp(0), CancelLayerWrite(0)),
    ),
    Planted(
        "cancel_without_sync",
        world(
            cp=2, layers=2, tokens=(2,), device_pages=2, host_pages=2, bugs=("cancel_without_sync",)
        ),
        (Insert(0), Store(0, 0), ReserveWriteCp(0), SubmitLayer(0, 0), CancelLayerWrite(0)),
    ),
    Planted(
        "reset_keeps_acks", _one("reset_keeps_acks"), (Insert(0), Store(0, 0), Write(0), Reset())
    ),
    Planted(
        "drain_ignores_finish",
        _one("drain_ignores_finish"),
        (Insert(0), Store(0, 0), Write(0), DrainWriteAcks()),
    ),
    Planted(
        "evict_device_while_loading",
        _one("evict_device_while_loading"),
        (*BACKED_UP_AND_EVICTED, Load(0), StartLoading(), EvictDevice(0)),
    ),
]


def test_every_planted_bug_has_a_case() -> None:
    assert sorted(c.flag for c in CASES) == sorted(PLANTED_BUGS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.flag)
def test_planted_bug_breaks_its_invariant(case: Planted) -> None:
    state, _ = play(case.config, case.trace)
    assert PLANTED_BUGS[case.flag] in ids(check_invariants(state))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.flag)
def test_same_trace_is_refused_or_clean_without_the_bug(case: Planted) -> None:
    state = initial_state(replace(case.config, variant=ProtocolVariant()))
    for op in case.trace:
        if not is_enabled(state, op):
            return
        state, _ = step(state, op)
        assert check_invariants(state) == []
