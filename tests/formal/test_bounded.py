"""Bounded model checking: the correct protocol stays clean, every planted bug is caught."""

from __future__ import annotations

import pytest

from hicache_ref.formal.bounded import explore, main
from hicache_ref.oracle import (
    PLANTED_BUGS,
    Advance,
    DrainWriteAcks,
    EvictDevice,
    Insert,
    OracleConfig,
    Store,
    Write,
    check_invariants,
    initial_state,
    make_variant,
    run_ops,
)


def _config(flag: str | None = None, **shape: int) -> OracleConfig:
    """The smallest world each planted bug needs (cp / layers / draft / nodes / counters)."""
    nodes = shape.get("nodes", 1)
    return OracleConfig(
        page_size=2,
        layer_num=shape.get("layers", 1),
        draft_layer_num=shape.get("draft", 0),
        device_pages=2,
        host_pages=2,
        draft_host_pages=2,
        cp_size=shape.get("cp", 0),
        num_counters=shape.get("counters", 5),
        node_tokens=(2,) * nodes,
        variant=make_variant(flag) if flag else make_variant(),
    )


BUG_WORLDS: dict[str, dict[str, int]] = {
    "free_host_before_write_ack": {},
    "duplicate_write_ack": {},
    "load_ack_before_last_layer": {},
    "skip_owner_replay": {"cp": 2, "nodes": 2},
    "no_fence_before_d2h": {},
    "skip_draft_layers": {"cp": 2, "draft": 1},
    "reuse_busy_producer_slot": {"nodes": 2, "counters": 1},
    "skip_layer_gate": {},
    "zero_owned_rank_drops_load": {"cp": 2},
    "cancel_keeps_layer_state": {"cp": 2},
    "cancel_without_sync": {"cp": 2, "layers": 2},
    "reset_keeps_acks": {},
    "drain_ignores_finish": {},
    "evict_device_while_loading": {},
}


def test_every_planted_bug_has_a_world() -> None:
    assert sorted(BUG_WORLDS) == sorted(PLANTED_BUGS)


@pytest.mark.parametrize("flag", sorted(PLANTED_BUGS))
def test_bounded_checker_catches_planted_bug_with_a_replayable_shortest_trace(flag: str) -> None:
    config = _config(flag, **BUG_WORLDS[flag])
    result = explore(config, max_depth=30)
    # Verify the planted bug breaks its invariant (the PLANTED_BUGS table names it)
    assert PLANTED_BUGS[flag] in {v.inv_id for v in result.violations}, result.summary()
    assert len(result.trace) == result.depth
    # the trace is data: it replays from the initial state to the same violation
    final, _ = run_ops(initial_state(config), result.trace)
    assert {v.inv_id for v in check_invariants(final)} == {v.inv_id for v in result.violations}


@pytest.mark.parametrize(
    "shape",
    [{"nodes": 2}, {"nodes": 2, "cp": 2}, {"nodes": 1, "cp": 2, "layers": 2, "draft": 1}],
    ids=["plain-2-nodes", "cp2-2-nodes", "cp2-draft"],
)
def test_correct_protocol_is_exhausted_without_a_violation(shape: dict[str, int]) -> None:
    result = explore(_config(None, **shape), max_depth=200)
    assert result.ok and result.complete, result.summary()


def test_brief_world_is_clean_to_a_bounded_depth() -> None:
    # the CLI example world: 2 nodes, 2 layers, 1 draft layer, 2 pages, CP over 2 ranks
    config = OracleConfig(
        page_size=2, layer_num=2, draft_layer_num=1, device_pages=2, host_pages=2,
        draft_host_pages=2, cp_size=2, node_tokens=(2, 2),
    )  # fmt: skip
    result = explore(config, max_depth=7)
    assert result.ok and result.depth == 7 and result.states > 1000


def test_symmetry_reduction_keeps_the_verdict_with_fewer_states() -> None:
    config = _config(None, nodes=2)
    reduced = explore(config, max_depth=10)
    full = explore(config, max_depth=10, symmetry=False)
    assert reduced.ok and full.ok
    assert reduced.states < full.states


def test_exploration_can_start_from_a_prefix() -> None:
    config = _config("skip_owner_replay", cp=2, nodes=2)
    prefix = (Insert(0), Store(0, 0), Write(0), Advance("forward"), Advance("write"))
    start, _ = run_ops(initial_state(config), (*prefix, DrainWriteAcks(), EvictDevice(0)))
    result = explore(config, max_depth=4, start=start)
    assert "INV-03" in {v.inv_id for v in result.violations}
    assert len(result.trace) <= 4


def test_cli_reports_counts_and_fails_on_a_violation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nodes", "1", "--layers", "1", "--max-depth", "40"]) == 0
    out = capsys.readouterr().out
    assert "states explored:" in out and "states/s:" in out and "no invariant violated" in out
    assert main(["--nodes", "1", "--layers", "1", "--variant", "duplicate_write_ack"]) == 1
    out = capsys.readouterr().out
    assert "INV-02 violated" in out and "shortest trace:" in out and "Write(node=0" in out
