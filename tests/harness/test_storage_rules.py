"""The storage family of machine rules, driven through a Session like any other rule.

Each test tells one story of a storage world: a chain of pages goes to L3 and comes back as a
host-only node the tree loads to device; a trace replays with its storage world; a reset with
storage work in flight leaves nothing behind; the lockstep oracle steps aside, counted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.lockstep.oracle import attach_lockstep
from hicache_ref.harness.rules import RULES, rule_families
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.storage_config import storage_fields
from hicache_ref.invariants.checks_storage import STORAGE_CHECKS

STORAGE_IDS = sorted(STORAGE_CHECKS)


@pytest.fixture(autouse=True)
def quiet_storage_logs() -> Iterator[None]:
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)
    yield
    logging.getLogger("hicache_ref").setLevel(logging.NOTSET)


def storage_session(**fields: object) -> Session:
    config = HarnessConfig(host_pages=24, storage_ranks=2, storage_batch_pages=1, **fields)  # type: ignore[arg-type]
    return Session(config, ReferenceImplementation(), "reference")


def apply(session: Session, rule: str, **args: object) -> str:
    return session.apply(Step(rule=rule, args=args)).text  # type: ignore[arg-type]


def back_up_and_prefetch(session: Session) -> None:
    """write_storage -> backup steps -> drain -> prefetch -> steps and drains until settled."""
    apply(session, "write_storage", pick=1, new=True)  # a chain of two pages
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")  # the hit: every rank allocates its bounce buffer
    for kind in ("io", "sync", "io", "sync", "sync"):
        apply(session, "storage_step", kind=kind)
    apply(session, "drain_prefetch_acks")  # progress applied, the final ack inserts the result
    apply(session, "drain_backup_acks")  # the release queue: the (empty) tail goes back


def test_a_chain_goes_to_l3_and_comes_back_as_a_node_the_tree_loads() -> None:
    session = storage_session()
    back_up_and_prefetch(session)
    # the prefetched pages became host-only node 0 (the chain's handle): load it to device
    assert 0 in session.candidates("load")
    apply(session, "load", node=0)
    apply(session, "start_loading")
    session.finish()  # the tree's byte checks read the loaded node (INV-06)
    checks = session.stats.checks_by_id
    assert all(checks[inv_id] >= 10 for inv_id in STORAGE_IDS), dict(checks)
    assert checks["INV-06"] > 0


def test_storage_rules_are_skipped_with_their_reason_outside_a_storage_world() -> None:
    session = Session(HarnessConfig(), ReferenceImplementation(), "reference")
    assert session.apply(Step(rule="write_storage", args={"pick": 0, "new": True})).skipped
    assert session.why_disabled(Step(rule="prefetch", args={"pick": 0})) == (
        "the world has no storage tier (storage_ranks=0)"
    )


def test_a_step_of_a_thread_with_no_work_is_skipped() -> None:
    session = storage_session()
    assert session.why_disabled(Step(rule="storage_step", args={"kind": "io"})) == (
        "no io step is runnable on any rank"
    )


def test_a_storage_trace_replays_its_world_from_the_header(tmp_path: Path) -> None:
    session = storage_session(storage_backend="file", storage_faults=True)
    back_up_and_prefetch(session)
    path = tmp_path / "storage.jsonl"
    path.write_text(session.trace().to_jsonl())
    trace = Trace.read(path)
    assert trace.header.config.storage_ranks == 2
    assert trace.header.config.storage_backend == "file"
    result = replay(trace)
    assert not result.failed, result.error
    assert result.outcomes == tuple(session.outcomes)


def test_a_reset_with_storage_work_in_flight_leaves_every_queue_empty() -> None:
    # write_storage and a prefetch queued, nothing run -> reset -> INV-24 checked at once
    session = storage_session()
    apply(session, "write_storage", pick=0, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    apply(session, "prefetch", pick=0)
    before = session.stats.checks_by_id["INV-24"]
    assert apply(session, "reset_storage_in_flight") == "reset"
    assert session.stats.checks_by_id["INV-24"] > before
    storage = session.storage
    assert storage is not None and storage.control_empty() and not storage.runnable()
    session.finish()


def test_detach_then_attach_keeps_what_l3_holds() -> None:
    session = storage_session()
    back_up_and_prefetch(session)
    apply(session, "detach_storage")
    assert session.is_enabled(Step(rule="attach_storage", args={}))
    apply(session, "attach_storage")
    # the chain is still in L3: a new prefetch of it hits again
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")
    storage = session.storage
    assert storage is not None
    log = storage.log.prefetches[0]
    assert [entry.local_hit_tokens for entry in log.values()] == [8]
    session.finish()


def test_the_lockstep_oracle_steps_aside_at_the_first_storage_step_and_says_why() -> None:
    session = storage_session()
    oracle = attach_lockstep(session)
    assert oracle is not None
    apply(session, "write_storage", pick=0, new=True)
    assert session.stats.lockstep["cases_off"] == 1
    assert oracle.off_reason is not None and "write_storage" in oracle.off_reason


def test_storage_is_a_family_of_records_and_drawn_only_with_the_capability() -> None:
    assert set(rule_families()["storage"]) == {
        r.name for r in RULES.values() if r.family == "storage"
    }
    assert len(rule_families()["storage"]) == 12  # the L3 verbs, clear_storage the twelfth


@given(storage_fields(frozenset({"pool:mha", "io:direct", "layout:layer_first"})))
def test_an_implementation_without_storage_never_draws_a_storage_world(
    fields: dict[str, object],
) -> None:
    assert fields == {}


def test_a_storage_world_with_cp_or_a_draft_pool_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="a storage world has no CP"):
        HarnessConfig(storage_ranks=2, cp_size=2, pool_kind="nsa")


def test_progress_that_moves_after_terminate_prefetch_returned_is_caught() -> None:
    # an aborted request's prefetch is terminated while its IO is half done; the tree retires
    # it at once, but an IO that kept writing would move its progress past the value the tree
    # settled [0:completed] on (sglang#27550): the storage log still reads the retired
    # operation, so INV-19 sees it
    session = storage_session()
    apply(session, "write_storage", pick=1, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")
    apply(session, "storage_step", kind="io")
    driver = session.storage
    assert driver is not None
    (rid,) = driver.log.prefetches[0]
    assert "terminate" in apply(session, "terminate_prefetch", request=rid)
    log = driver.log.prefetches[0][rid]
    driver.check()  # terminated and frozen: nothing to report
    assert log.completed_now == log.terminated_at
    # the reference's own operation refuses the write (a guard citing INV-19): stand in an
    # implementation's operation without that guard, whose IO moved on
    moved = log.terminated_at + session.world.config.page_size
    log.operation = SimpleNamespace(completed_tokens=moved)
    with pytest.raises(InvariantViolation) as caught:
        driver.check()
    assert caught.value.inv_id == "INV-19"
    assert "never changes once terminate_prefetch returned" in str(caught.value)


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_a_clear_on_one_rank_leaves_another_ranks_pages_readable(backend: str) -> None:
    # a two-page chain in L3 on both ranks -> rank 1 clears -> rank 0 still reads its pages
    session = storage_session(storage_backend=backend)
    apply(session, "write_storage", pick=1, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    storage = session.storage
    assert storage is not None
    chain = storage.chains[0]
    keys = list(chain.chain_keys())
    assert (
        apply(session, "clear_storage", rank=1)
        == "clear_storage on rank 1: 2 page(s) removed (True)"
    )
    backends = [rank.controller.storage_backend for rank in storage.l3.ranks]
    assert backends[0].batch_exists(keys) == 2 and backends[1].batch_exists(keys) == 0
    # the clear removed only rank 1's own pages (INV-28 judged it), and the harness forgot them:
    # the chain is no longer in L3 on every rank, so it is backed up again before a prefetch
    (record,) = storage.snapshot().l3.clears
    assert record.rank == 1 and {writer for _, writer in record.removed} == {1}
    assert chain.state == "none" and storage.prefetch_candidates() == []
    assert not any(rank == 1 for rank, _ in storage.log.expected)
    apply(session, "write_storage", pick=0, new=False)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    # ... and comes back whole: both ranks hit both pages, and every read is checked (INV-30)
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")
    assert [log.local_hit_tokens for log in storage.log.prefetches[1].values()] == [8]
    apply(session, "drain_prefetch_acks")
    for kind in ("io", "sync", "io", "sync", "sync"):
        apply(session, "storage_step", kind=kind)
    apply(session, "drain_prefetch_acks")
    assert len(storage.log.reads) == 4  # two pages on each of two ranks, read after the clear
    session.finish()


def test_a_clear_is_drawn_at_rest_only() -> None:
    # a backup queued, not yet acked -> clear_storage is skipped, saying why
    session = storage_session()
    apply(session, "write_storage", pick=0, new=True)
    assert session.why_disabled(Step(rule="clear_storage", args={"rank": 0})) == (
        "storage work is in flight (clear_storage runs at rest: drain it first)"
    )


def test_a_storage_snapshot_that_already_passed_is_not_judged_again_but_any_change_is() -> None:
    session = storage_session()
    apply(session, "write_storage", pick=0, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")  # the backup's one ack
    storage = session.storage
    assert storage is not None
    runs, reused = session.stats.checks_by_id["INV-25"], storage.reused_checks
    storage.check()  # nothing happened since: the same snapshot
    assert storage.reused_checks == reused + 1
    assert session.stats.checks_by_id["INV-25"] == runs
    # a second ack recorded for the backup: the next check judges the new snapshot
    (backup,) = storage.log.backups[0].values()
    backup.acks += 1
    with pytest.raises(InvariantViolation) as excinfo:
        storage.check()
    assert excinfo.value.inv_id == "INV-25"
