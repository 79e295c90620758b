"""Exhaustive small storage worlds: the correct protocol stays clean over every interleaving,
and every planted bug is found by construction with a shortest trace that replays."""

from __future__ import annotations

import pytest

from hicache_ref.formal.bounded_storage import explore_storage, main
from hicache_ref.oracle.storage import (
    PLANTED_STORAGE_BUGS,
    OpSpec,
    StorageConfig,
    check_storage_invariants,
    initial_storage_state,
    make_storage_variant,
    run_storage_ops,
)

ONE_PAGE = (OpSpec("prefetch", 1),)

BUG_WORLDS: dict[str, dict[str, object]] = {
    "backup_ack_before_write": {"ops": (OpSpec("backup", 1),), "pages": 1, "preloaded": (0,)},
    "io_ignores_termination": {"ops": ONE_PAGE, "pages": 1, "preloaded": (1,)},
    "io_counts_past_hole": {"ops": (OpSpec("prefetch", 2),), "pages": 2, "preloaded": (2,)},
    "io_raise_skips_final_ack": {"ops": ONE_PAGE, "pages": 1, "preloaded": (1,)},
    "reset_keeps_old_thread": {"ops": ONE_PAGE, "pages": 1, "preloaded": (1,)},
    "progress_not_reduced": {"ranks": 2, "ops": ONE_PAGE, "pages": 1, "preloaded": (1, 1)},
    "hit_sync_per_batch": {
        "ranks": 2,
        "ops": (OpSpec("prefetch", 2),),
        "pages": 2,
        "preloaded": (2, 1),
    },
    "terminate_releases_tail": {"ops": ONE_PAGE, "pages": 1, "preloaded": (1,)},
    "backup_skips_failed_batch": {"ops": (OpSpec("backup", 2),), "pages": 2, "preloaded": (0,)},
    "reset_keeps_release_queue": {"ops": ONE_PAGE, "pages": 1, "preloaded": (1,)},
    "clear_wipes_every_namespace": {
        "ranks": 2,
        "ops": (OpSpec("backup", 1),),
        "pages": 1,
        "preloaded": (1, 1),
        "clear": True,
    },
    "detach_with_work_in_flight": {"ops": ONE_PAGE, "pages": 1, "preloaded": (1,), "detach": True},
}

SHORTEST: dict[str, int] = {
    "backup_ack_before_write": 4,
    "io_ignores_termination": 10,
    "io_counts_past_hole": 13,
    "io_raise_skips_final_ack": 9,
    "reset_keeps_old_thread": 3,
    "progress_not_reduced": 21,
    "hit_sync_per_batch": 6,
    "terminate_releases_tail": 7,
    "backup_skips_failed_batch": 4,
    "reset_keeps_release_queue": 18,
    "clear_wipes_every_namespace": 1,
    "detach_with_work_in_flight": 2,
}
"""The length of each planted bug's shortest trace in its world (breadth-first: minimal)."""


def _world(flag: str | None, **shape: object) -> StorageConfig:
    variant = make_storage_variant(flag) if flag else make_storage_variant()
    return StorageConfig(variant=variant, **shape)  # type: ignore[arg-type]


def test_every_planted_bug_has_a_world() -> None:
    assert sorted(BUG_WORLDS) == sorted(PLANTED_STORAGE_BUGS) == sorted(SHORTEST)


@pytest.mark.parametrize("flag", sorted(PLANTED_STORAGE_BUGS))
def test_the_checker_finds_each_planted_bug_with_a_shortest_replayable_trace(flag: str) -> None:
    config = _world(flag, **BUG_WORLDS[flag])
    result = explore_storage(config, max_depth=40)
    assert PLANTED_STORAGE_BUGS[flag] in {v.inv_id for v in result.violations}, result.summary()
    assert len(result.trace) == result.depth == SHORTEST[flag]
    final = run_storage_ops(initial_storage_state(config), result.trace)
    assert {v.inv_id for v in check_storage_invariants(final)} == {
        v.inv_id for v in result.violations
    }


@pytest.mark.parametrize("flag", sorted(PLANTED_STORAGE_BUGS))
def test_the_correct_protocol_is_exhausted_clean_in_each_bug_world(flag: str) -> None:
    shape = BUG_WORLDS[flag]
    bound = 0 if shape.get("ranks", 1) == 2 else None  # two ranks: CHESS k=0 keeps it seconds
    result = explore_storage(_world(None, **shape), max_depth=200, preemptions=bound)
    assert result.ok and result.complete, result.summary()


def test_one_rank_with_a_prefetch_and_a_backup_is_exhausted_clean() -> None:
    config = StorageConfig(
        ranks=1, pages=1, ops=(OpSpec("prefetch", 1), OpSpec("backup", 1)), preloaded=(0,)
    )
    result = explore_storage(config, max_depth=200)
    assert result.ok and result.complete and result.states > 1_000, result.summary()


def test_two_ranks_are_clean_to_a_depth_and_a_preemption_bound() -> None:
    config = StorageConfig(ranks=2, pages=2, ops=(OpSpec("prefetch", 2),), preloaded=(2, 1))
    result = explore_storage(config, max_depth=200, preemptions=0)
    assert result.ok and result.complete, result.summary()


def test_renaming_ranks_keeps_the_verdict_with_fewer_states() -> None:
    config = StorageConfig(ranks=2, pages=2, ops=(OpSpec("prefetch", 2),), preloaded=(2, 2))
    reduced = explore_storage(config, max_depth=200, preemptions=0)
    full = explore_storage(config, max_depth=200, preemptions=0, symmetry=False)
    assert reduced.ok and full.ok and reduced.complete and full.complete
    assert reduced.states < full.states
    planted = _world("progress_not_reduced", **BUG_WORLDS["progress_not_reduced"])
    found = explore_storage(planted, max_depth=40, symmetry=False)
    assert len(found.trace) == SHORTEST["progress_not_reduced"]


def test_a_preemption_bound_explores_fewer_states_and_finds_depth_one_bugs() -> None:
    config = _world("io_ignores_termination", **BUG_WORLDS["io_ignores_termination"])
    unbounded = explore_storage(_world(None, **BUG_WORLDS["io_ignores_termination"]), 200)
    bounded = explore_storage(
        _world(None, **BUG_WORLDS["io_ignores_termination"]), 200, preemptions=0
    )
    assert bounded.ok and unbounded.ok and bounded.states < unbounded.states
    assert not explore_storage(config, 40, preemptions=1).ok


def test_cli_reports_the_bound_and_the_counts_and_fails_on_a_violation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--ranks", "1", "--ops", "1", "--pages", "1", "--max-depth", "60"]) == 0
    out = capsys.readouterr().out
    assert "states explored:" in out and "preemption bound: none" in out and "exhausted" in out
    argv = ["--pages", "1", "--preemptions", "1", "--variant", "io_raise_skips_final_ack"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "INV-25 violated" in out and "shortest trace:" in out and "outcome='raise'" in out
    replay = out.splitlines()[-1]
    assert replay.startswith("replay: python -m hicache_ref.formal.bounded_storage --pages 1")
    assert main(replay.split()[4:]) == 1 and capsys.readouterr().out.splitlines()[-1] == replay


def test_cli_refuses_a_world_it_cannot_hold_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--ranks", "9"]) == 2
    assert capsys.readouterr().err.startswith("error: ranks=9 must be in [1, 4]")


@pytest.mark.campaign
@pytest.mark.parametrize(
    ("ranks", "ops", "pages", "preemptions"),
    [(1, 2, 2, None), (1, 2, 3, None), (2, 1, 3, 1), (2, 2, 2, 1)],
    ids=["1r-2ops-2p-all", "1r-2ops-3p-all", "2r-1op-3p-k1", "2r-2ops-2p-k1"],
)
def test_the_brief_worlds_are_clean(
    ranks: int, ops: int, pages: int, preemptions: int | None
) -> None:
    specs = (OpSpec("prefetch", pages), OpSpec("backup", pages))[:ops]
    config = StorageConfig(ranks=ranks, pages=pages, ops=specs, preloaded=(pages,) * ranks)
    result = explore_storage(config, max_depth=200, preemptions=preemptions)
    assert result.ok and result.complete, result.summary()


POINT_WORLDS = {
    "page points": {"page_points": True},
    "lock points": {"lock_points": True},
    "page and lock points": {"page_points": True, "lock_points": True},
}
"""Finer points of the IO and hit-query threads: each page lands at its own point, each look at
termination under the operation's lock is a point of its own."""


@pytest.mark.parametrize("points", sorted(POINT_WORLDS))
def test_finer_points_keep_the_correct_protocol_clean_and_open_more_states(points: str) -> None:
    shape: dict[str, object] = {
        "ops": (OpSpec("prefetch", 2),),
        "pages": 2,
        "batch_pages": 2,
        "preloaded": (2,),
    }
    coarse = explore_storage(_world(None, **shape), max_depth=200)
    fine = explore_storage(_world(None, **shape, **POINT_WORLDS[points]), max_depth=200)
    assert fine.ok and fine.complete, fine.summary()
    assert fine.states > coarse.states, (fine.summary(), coarse.summary())


@pytest.mark.parametrize("points", sorted(POINT_WORLDS))
@pytest.mark.parametrize("flag", ["io_counts_past_hole", "io_ignores_termination"])
def test_the_io_window_bugs_are_found_under_finer_points(flag: str, points: str) -> None:
    config = _world(flag, **BUG_WORLDS[flag], **POINT_WORLDS[points])
    result = explore_storage(config, max_depth=40)
    assert PLANTED_STORAGE_BUGS[flag] in {v.inv_id for v in result.violations}, result.summary()
    final = run_storage_ops(initial_storage_state(config), result.trace)
    assert PLANTED_STORAGE_BUGS[flag] in {v.inv_id for v in check_storage_invariants(final)}


def test_with_lock_points_a_termination_between_a_read_and_a_page_cuts_the_batch() -> None:
    from hicache_ref.oracle.storage import (
        HIT_QUERY,
        IO,
        Advance,
        Collective,
        DrainHits,
        Prefetch,
        Terminate,
    )

    config = StorageConfig(
        ops=(OpSpec("prefetch", 2),), pages=2, batch_pages=2, preloaded=(2,), lock_points=True
    )
    hit_query = [Advance(0, HIT_QUERY)] * 3  # its get, its look at termination, its query
    hit_query += [Collective("hits"), Advance(0, HIT_QUERY), DrainHits()]  # agreed, published
    io = [Advance(0, IO)] * 3  # its get, its look before the batch, the read of both pages
    state = run_storage_ops(initial_storage_state(config), [Prefetch(0), *hit_query, *io])
    thread = state.ranks[0].threads[IO]
    assert (thread.point, [page for page, _ in thread.landing]) == ("recheck", [0, 1])
    state = run_storage_ops(state, [Terminate(0), Advance(0, IO)])  # its look sees it
    thread = state.ranks[0].threads[IO]
    assert (thread.point, thread.value, thread.ok) == ("progress", 0, False)
    assert not check_storage_invariants(state)
