"""The storage oracle in lockstep: it follows the reference's storage verbs step by step without
a divergence, and every storage mutant of the catalogue diverges from it, with the id of the
quantity that differs, even with the storage driver's own checks switched off."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.driver.storage_driver import StorageDriver
from hicache_ref.harness.lockstep.storage import (
    STORAGE_LOCKSTEP_ENV,
    VERBS,
    StorageLockstep,
    attach_storage_lockstep,
)
from hicache_ref.harness.lockstep.storage_walk import run_walk, storage_case, walk_session
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.oracle.storage import check_storage_invariants, run_storage_ops

REPO = Path(__file__).resolve().parents[2]
STEPS = 80

MUTANTS: dict[str, tuple[str, int]] = {
    "backup_acks_every_page": ("INV-26", 0),
    "backup_exception_drops_ack": ("INV-25", 0),
    "backup_pages_off_by_one": ("INV-30", 1),
    "backup_skips_failed_batch": ("INV-31", 2),
    "complete_before_hit": ("INV-22", 2),
    "hit_shortened": ("INV-29", 3),
    "hit_sync_per_batch": ("INV-20", 0),
    "increment_before_page_data": ("INV-19", 4),
    "keys_restart_at_node": ("INV-27", 1),
    "keys_without_rank": ("INV-30", 1),
    "progress_not_reduced": ("INV-21", 1),
    "reset_keeps_release_queue": ("INV-24", 1),
    "terminate_releases_tail": ("INV-23", 1),
}
"""Each storage mutant: the id its lockstep divergence names, and the first walk that shows it.
The id is the one the mutant is pinned to, but for ``keys_without_rank``: the oracle has no key
namespaces to compare (the driver's INV-28 catches it first), it sees the bytes another rank
wrote over a page (INV-30)."""


POINT_STEPS = 150
WINDOW_MUTANTS: dict[str, tuple[str, int]] = {
    "backup_acks_before_write": ("INV-32", 0),
    "io_counts_past_hole": ("INV-34", 9),
    "io_exception_doubles_final_ack": ("INV-25", 112),
    "io_ignores_termination": ("INV-33", 0),
    "increment_before_page_data": ("INV-34", 9),
    "reset_forgets_parked_threads": ("INV-35", 0),
}
"""Each window mutant (and each other mutant pinned to INV-32..35): the id of its lockstep
divergence in a world with schedule points, and the first walk of ``POINT_STEPS`` that shows it
(the windows need a drawn outcome at one point: a hole, a raise, a termination between
batches)."""


@pytest.fixture(autouse=True)
def lockstep_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HICACHE_LOCKSTEP", "1")
    monkeypatch.delenv(STORAGE_LOCKSTEP_ENV, raising=False)
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)
    yield
    logging.getLogger("hicache_ref").setLevel(logging.NOTSET)


def _follow(session: Session) -> StorageLockstep:
    follower = attach_storage_lockstep(session)
    assert follower is not None and follower.off_reason is None
    return follower


def apply(session: Session, rule: str, **args: object) -> str:
    return session.apply(Step(rule=rule, args=args)).text  # type: ignore[arg-type]


def test_a_round_trip_is_followed_step_by_step_and_its_trace_replays() -> None:
    config = HarnessConfig(host_pages=24, storage_ranks=2, storage_batch_pages=1)
    session = Session(config, ReferenceImplementation(), "reference")
    follower = _follow(session)
    apply(session, "write_storage", pick=1, new=True)  # a chain of two pages
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")
    for kind in ("io", "sync", "io", "sync", "sync"):
        apply(session, "storage_step", kind=kind)
    apply(session, "drain_prefetch_acks")
    assert follower.steps == 7 and session.stats.lockstep["storage_steps_in_lockstep"] == 7
    view = follower.state.ranks[1].prefetches[1]
    assert view.published == 2 and view.final_drained == 1 and not view.current
    replayed = run_storage_ops(follower.start, follower.trace)
    assert replayed == follower.state and not check_storage_invariants(replayed)


def test_the_reference_never_diverges_over_random_storage_walks() -> None:
    compared = 0
    for seed in range(24):
        session = walk_session(ReferenceImplementation(), "reference", seed)
        follower = _follow(session)
        run_walk(session, seed, STEPS)
        compared += follower.steps
    assert compared > 200


def test_the_reference_never_diverges_point_by_point_under_schedule_points() -> None:
    compared = 0
    for seed in range(12):
        session = walk_session(ReferenceImplementation(), "reference", seed, points=True)
        follower = _follow(session)
        run_walk(session, seed, STEPS)
        compared += follower.steps
    assert compared > 300  # point steps: a grant of one thread kind to its next point


@pytest.mark.parametrize(
    "finer",
    [
        {"storage_page_points": True},
        {"storage_lock_points": True},
        {"storage_page_points": True, "storage_lock_points": True},
    ],
    ids=["pages", "locks", "pages+locks"],
)
def test_the_reference_never_diverges_under_page_and_lock_points(finer: dict[str, bool]) -> None:
    compared = 0
    for seed in range(8):
        config = storage_case(seed, points=True).model_copy(update=finer)
        session = Session(config, ReferenceImplementation(), "reference")
        follower = _follow(session)
        assert follower.state.config.page_points == config.storage_page_points
        assert follower.state.config.lock_points == config.storage_lock_points
        run_walk(session, seed, STEPS)
        compared += follower.steps
    assert compared > 200


def test_a_termination_at_the_ios_look_is_followed_grant_by_grant() -> None:
    config = HarnessConfig(
        host_pages=24,
        storage_ranks=1,
        storage_batch_pages=2,
        storage_points=True,
        storage_lock_points=True,
    )
    session = Session(config, ReferenceImplementation(), "reference")
    follower = _follow(session)
    apply(session, "write_storage", pick=1, new=True)  # a chain of two pages, one batch
    for _ in range(3):  # wait, batch_set, put ack_backup_queue
        apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    apply(session, "prefetch", pick=0)
    for _ in range(5):  # wait, its look at termination, batch_exists, all_reduce, put
        apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")
    apply(session, "storage_step", kind="io")  # the get: parked before its look
    apply(session, "storage_step", kind="io")  # the look, then parked at batch_get
    apply(session, "storage_step", kind="io")  # the read: parked before the first page's look
    assert follower.state.ranks[0].threads[1].point == "recheck"
    apply(session, "terminate_prefetch", request=1)
    session.finish()
    view = follower.state.ranks[0].prefetches[1]
    assert view.published == 0 and view.final_drained == 1 and view.terminated
    replayed = run_storage_ops(follower.start, follower.trace)
    assert replayed == follower.state and not check_storage_invariants(replayed)


def test_a_round_trip_under_points_is_followed_grant_by_grant() -> None:
    config = HarnessConfig(host_pages=24, storage_ranks=2, storage_batch_pages=1)
    session = Session(
        config.model_copy(update={"storage_points": True}), ReferenceImplementation(), "reference"
    )
    follower = _follow(session)
    apply(session, "write_storage", pick=1, new=True)  # a chain of two pages
    for _ in range(4):  # wait, batch_set, batch_set, put ack_backup_queue
        apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")  # the get
    apply(session, "schedule_point", thread="hit_query", outcome="defer", rank=1, at=0)
    for _ in range(4):  # the deferred call returns, the second batch, all_reduce, put
        apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")
    apply(session, "storage_step", kind="io")  # the get and the termination check
    apply(session, "schedule_point", thread="io", outcome="hole", rank=0, at=0)
    session.finish()
    assert follower.steps >= 12 and follower.collectives["hits"] == 1
    view = follower.state.ranks[0].prefetches[1]
    assert view.first_hole == 0 and view.published == 0 and view.final_drained == 1
    replayed = run_storage_ops(follower.start, follower.trace)
    assert replayed == follower.state and not check_storage_invariants(replayed)


@pytest.mark.parametrize("mutant", sorted(WINDOW_MUTANTS))
def test_every_window_mutant_diverges_point_by_point(
    mutant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StorageDriver, "check", lambda self, quiescent=False: None)
    inv_id, seed = WINDOW_MUTANTS[mutant]
    name = f"mutant:{mutant}"
    session = walk_session(get_implementation(name), name, seed, points=True)
    _follow(session)
    with pytest.raises(InvariantViolation, match="storage lockstep divergence") as caught:
        run_walk(session, seed, POINT_STEPS)
    assert caught.value.inv_id == inv_id, str(caught.value)


PAGE_WINDOW_MUTANTS: dict[str, tuple[str, int]] = {"io_acks_before_page_write": ("INV-19", 0)}
"""Window mutants only page points open (the IO parks before each page it writes): the id of
the lockstep divergence (a progress ack put while the oracle's IO is still at ``land``) and the
first walk that shows it."""


@pytest.mark.parametrize("mutant", sorted(PAGE_WINDOW_MUTANTS))
def test_every_page_window_mutant_diverges_point_by_point(
    mutant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StorageDriver, "check", lambda self, quiescent=False: None)
    inv_id, seed = PAGE_WINDOW_MUTANTS[mutant]
    name = f"mutant:{mutant}"
    config = storage_case(seed, points=True).model_copy(update={"storage_page_points": True})
    session = Session(config, get_implementation(name), name)
    _follow(session)
    with pytest.raises(InvariantViolation, match="storage lockstep divergence") as caught:
        run_walk(session, seed, POINT_STEPS)
    assert caught.value.inv_id == inv_id, str(caught.value)


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_every_storage_mutant_diverges_from_the_oracle_on_its_own(
    mutant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StorageDriver, "check", lambda self, quiescent=False: None)
    inv_id, seed = MUTANTS[mutant]
    session = walk_session(get_implementation(f"mutant:{mutant}"), f"mutant:{mutant}", seed)
    _follow(session)
    with pytest.raises(InvariantViolation, match="storage lockstep divergence") as caught:
        run_walk(session, seed, STEPS)
    assert caught.value.inv_id == inv_id, str(caught.value)


def test_an_mla_world_is_not_followed_and_says_why() -> None:
    config = HarnessConfig(host_pages=24, storage_ranks=2, pool_kind="mla")
    session = Session(config, ReferenceImplementation(), "reference")
    follower = attach_storage_lockstep(session)
    assert follower is not None and follower.off_reason is not None
    assert "MLA" in follower.off_reason
    assert session.stats.lockstep[f"storage off: {follower.off_reason}"] == 1


def test_every_verb_the_lockstep_wraps_is_a_storage_driver_verb() -> None:
    # a verb renamed or gone would leave the oracle blind to it: it must be named here too
    assert all(callable(getattr(StorageDriver, name, None)) for name in VERBS)


def test_the_storage_oracle_can_be_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STORAGE_LOCKSTEP_ENV, "0")
    config = HarnessConfig(host_pages=24, storage_ranks=1)
    assert attach_storage_lockstep(Session(config, ReferenceImplementation(), "reference")) is None


def test_every_storage_mutant_of_the_catalogue_is_shown_to_diverge() -> None:
    from hicache_ref.harness.adapters.registry import list_mutants

    storage = {
        name
        for name in list_mutants()
        if "storage_focus" in (REPO / "fuzz" / "mutants" / f"{name}.py").read_text()
    }
    shown = set(MUTANTS) | set(WINDOW_MUTANTS) | set(PAGE_WINDOW_MUTANTS)
    assert storage and storage <= shown | set(UNFOLLOWED_MUTANTS), sorted(storage - shown)


UNFOLLOWED_MUTANTS: dict[str, str] = {
    "sidecar_hits_ignored": "a sidecar pool",
    "heal_keeps_first_missing_page": "buffer mode",
}
"""Storage mutants whose world the oracle does not follow (the reason it gives): the driver's
own check (the mutant's pinned id) is what catches them, shown in their own tests."""


@pytest.mark.parametrize("mutant", sorted(UNFOLLOWED_MUTANTS))
def test_a_mutant_in_a_world_the_oracle_cannot_follow_is_said_to_be_unfollowed(
    mutant: str,
) -> None:
    name = f"mutant:{mutant}"
    implementation = get_implementation(name)
    config = implementation.refine_config(storage_case(0, points=True))
    follower = attach_storage_lockstep(Session(config, implementation, name), enabled=True)
    assert follower is not None and follower.off_reason is not None
    assert follower.off_reason.startswith(UNFOLLOWED_MUTANTS[mutant]), follower.off_reason
