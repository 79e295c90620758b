"""Oracle traces on implementations: the storage oracle's shortest trace of a planted protocol
bug, translated to harness steps under schedule points, fails the tier that carries the bug (the
reference's mutant, upstream 0.5.23 with the bug planted) and passes the reference."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_ref.formal.bounded_storage import explore_storage
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree, fork_tree
from hicache_ref.harness.lockstep.from_storage_oracle import (
    UntranslatableStorageTrace,
    storage_trace_for,
)
from hicache_ref.harness.steps.replay import replay
from hicache_ref.oracle.storage import (
    Advance,
    OpSpec,
    Prefetch,
    StorageConfig,
    make_storage_variant,
)
from tests.harness.sglang_bugs import BUGS_0523_WINDOWS

PLANTED: dict[str, tuple[str, dict[str, object], str]] = {
    "backup_ack_before_write": (
        "backup_acks_before_write",
        {"ops": (OpSpec("backup", 1),), "pages": 1, "preloaded": (0,)},
        "INV-32",
    ),
    "io_ignores_termination": (
        "io_ignores_termination",
        {"ops": (OpSpec("prefetch", 2),), "pages": 2, "preloaded": (2,)},
        "INV-33",
    ),
}
"""Each oracle variant with a window mutant of the catalogue (and a bug of BUGS_0523_WINDOWS of
the same name), its world, and the id the translated trace fails with on the mutant."""


@pytest.fixture(autouse=True)
def quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HICACHE_LOCKSTEP", "1")
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)
    yield
    logging.getLogger("hicache_ref").setLevel(logging.NOTSET)


def _shortest(flag: str) -> tuple[StorageConfig, tuple[object, ...]]:
    config = StorageConfig(variant=make_storage_variant(flag), **PLANTED[flag][1])  # type: ignore[arg-type]
    result = explore_storage(config, max_depth=40)
    assert result.trace, result.summary()
    return config, result.trace


@pytest.mark.parametrize("flag", sorted(PLANTED))
def test_an_oracle_trace_fails_the_mutant_and_passes_the_reference(flag: str) -> None:
    config, ops = _shortest(flag)
    trace = storage_trace_for(config, ops)  # type: ignore[arg-type]
    mutant, _, inv_id = PLANTED[flag]
    assert replay(trace, implementation=f"mutant:{mutant}").signature() == inv_id
    assert not replay(trace).failed


@pytest.mark.parametrize("flag", ["backup_ack_before_write"])
def test_an_oracle_trace_fails_0_5_23_with_the_bug_planted(flag: str, tmp_path: Path) -> None:
    # the backup thread's points are the same in 0.5.23; its hit query asks for a whole chain in
    # one batch_exists, so a trace through the reference's per-batch queries takes other grants
    config, ops = _shortest(flag)
    trace = storage_trace_for(config, ops, implementation="sglang")  # type: ignore[arg-type]
    tree = fetch_wheel_tree("0.5.23")
    bug = next(b for b in BUGS_0523_WINDOWS if b.NAME == PLANTED[flag][0])
    target = Path(bug.TARGET)
    planted = fork_tree(bug.write_patched(tree / target, tmp_path / target.name), tree, target)
    assert replay(trace, source=str(planted)).signature() in bug.INVARIANTS
    assert not replay(trace, source=str(tree)).failed


def test_an_interleaving_the_harness_cannot_take_is_named() -> None:
    config = StorageConfig(ops=(OpSpec("prefetch", 1),), pages=1, ranks=2, preloaded=(1, 0))
    with pytest.raises(UntranslatableStorageTrace, match="preloaded unlike"):
        storage_trace_for(config, (Prefetch(0), Advance(0, 0)))


def _two_ranks(shape: dict[str, object]) -> dict[str, object]:
    preloaded = tuple(shape.get("preloaded", (0,)))  # type: ignore[arg-type]
    return {**shape, "ranks": 2, "preloaded": (preloaded[0],) * 2}


LOCKSTEP_WORLDS: dict[str, tuple[dict[str, object], str | None]] = {
    "backup_ack_before_write": (
        _two_ranks(PLANTED["backup_ack_before_write"][1]),
        "backup_acks_before_write",
    ),
    "backup_skips_failed_batch": (
        {"ranks": 2, "ops": (OpSpec("backup", 2),), "pages": 2, "preloaded": (0, 0)},
        "backup_skips_failed_batch",
    ),
    "clear_wipes_every_namespace": (
        {"ranks": 2, "ops": (OpSpec("backup", 1),), "pages": 1, "preloaded": (1, 1), "clear": True},
        "keys_without_rank",
    ),
    "detach_with_work_in_flight": (
        {
            "ranks": 2,
            "ops": (OpSpec("prefetch", 1),),
            "pages": 1,
            "preloaded": (1, 1),
            "detach": True,
        },
        None,
    ),
    "hit_sync_per_batch": (
        {"ranks": 2, "ops": (OpSpec("prefetch", 2),), "pages": 2, "preloaded": (2, 2)},
        "hit_sync_per_batch",
    ),
    "io_counts_past_hole": (
        {
            "ranks": 2,
            "ops": (OpSpec("prefetch", 2),),
            "pages": 2,
            "batch_pages": 2,
            "preloaded": (2, 2),
        },
        "io_counts_past_hole",
    ),
    "io_ignores_termination": (
        _two_ranks(PLANTED["io_ignores_termination"][1]),
        "io_ignores_termination",
    ),
    "io_raise_skips_final_ack": (
        {"ranks": 2, "ops": (OpSpec("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
        "io_exception_doubles_final_ack",
    ),
    "progress_not_reduced": (
        {"ranks": 2, "ops": (OpSpec("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
        "progress_not_reduced",
    ),
    "reset_keeps_old_thread": (
        {"ranks": 2, "ops": (OpSpec("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
        "reset_forgets_parked_threads",
    ),
    "reset_keeps_release_queue": (
        {"ranks": 2, "ops": (OpSpec("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
        "reset_keeps_release_queue",
    ),
    "terminate_releases_tail": (
        {"ranks": 2, "ops": (OpSpec("prefetch", 1),), "pages": 1, "preloaded": (1, 1)},
        "terminate_releases_tail",
    ),
}
"""Every planted protocol bug of the storage oracle in a two-rank world, and the catalogue
mutant of the same bug on the reference's tier (None: the catalogue has none)."""


def test_every_planted_bug_has_a_two_rank_world() -> None:
    from hicache_ref.oracle.storage import PLANTED_STORAGE_BUGS

    assert sorted(LOCKSTEP_WORLDS) == sorted(PLANTED_STORAGE_BUGS)


@pytest.mark.parametrize("flag", sorted(LOCKSTEP_WORLDS))
def test_a_two_rank_trace_found_as_the_harness_grants_runs_on_the_implementations(
    flag: str,
) -> None:
    """The search moves as the harness does (a grant advances one thread kind on every rank),
    so the shortest violation it finds translates step for step: the reference passes it, the
    mutant of the same bug fails it."""
    from hicache_ref.oracle.storage import PLANTED_STORAGE_BUGS

    shape, mutant = LOCKSTEP_WORLDS[flag]
    config = StorageConfig(variant=make_storage_variant(flag), **shape)  # type: ignore[arg-type]
    result = explore_storage(config, max_depth=60, lockstep=True)
    assert PLANTED_STORAGE_BUGS[flag] in {v.inv_id for v in result.violations}, result.summary()
    trace = storage_trace_for(config, result.trace)
    assert not replay(trace).failed
    if mutant is not None:
        assert replay(trace, implementation=f"mutant:{mutant}").failed


def test_the_correct_protocol_is_clean_as_the_harness_grants_on_two_ranks() -> None:
    config = StorageConfig(ranks=2, pages=2, ops=(OpSpec("prefetch", 2),), preloaded=(2, 2))
    result = explore_storage(config, max_depth=200, lockstep=True)
    assert result.ok and result.complete, result.summary()
    assert "harness grants" in result.summary()
