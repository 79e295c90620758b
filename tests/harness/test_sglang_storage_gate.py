"""The gate on upstream's storage tier: its own threads, one loop iteration a step.

``adapters/sglang_storage.py`` runs the tree's ``prefetch_thread_func``, ``prefetch_io_aux_func``,
``prefetch_sync_thread_func`` and ``backup_thread_func`` on real threads whose queue gets the
harness serves, with their collectives on the storage world's rank group. A bounded gate over
the unmodified tree draws the storage rules and finds nothing new but F24 (its file backend's
clear wipes every rank's pages, baselined); each storage bug of ``sglang_bugs.BUGS_0523_STORAGE``,
planted in a copy of the controller (or of the file it names: the tree's hash helpers, its file
backend) at test time, is caught by an invariant it declares, and its minimized trace passes on
the unmodified tree: backup acks (INV-26, INV-25), the collectives (INV-20), rank-local progress
(INV-23; through the ack, INV-21), a verdict before the hit (INV-22), a tail released under the IO
(INV-23), state that outlives reset (INV-24), keys (INV-27, INV-28) and hit endpoints (INV-29).
Two stories show why the storage log judges inserts and verdicts by the progress the tree
drained, never by the operation's own field. 0.5.10's threads (hit query, IO, backup) are
driven the same way under the tree half of its own polling protocol
(``driver/storage_tree_0510.py``), where the gate finds F22, F23, F24, F25 and F26, each baselined
only for the releases read to have it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache_ref.cli import EXIT_OK
from hicache_ref.controller.storage.collectives import RankGroup
from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import SRC_ENV, fetch_wheel_tree
from hicache_ref.harness.campaigns.known_findings import KNOWN_FINDINGS, match_known_finding
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace
from hicache_ref.harness.world.config import HarnessConfig

from .sglang_bugs import (
    BUGS_0510_STORAGE,
    BUGS_0523_STORAGE,
    PlantedBug,
    PrefetchIoSetsLocalProgress,
)
from .test_sglang_gate import (
    check_one_small_substitution,
    check_planted_bug_is_caught,
    plant,
    run_gate,
)

STORAGE_GATE_BUDGET = "8s"
CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus" / "sglang"
SGLANG_CORPUS = CORPUS
F22_TRACE = CORPUS / "f22_backend_exception_kills_the_backup_thread.jsonl"
F23_TRACE = CORPUS / "f23_reset_leaves_the_old_prefetch_io_thread_alive.jsonl"
F23_IO_BODY_TRACE = CORPUS / "f23_reset_leaves_the_old_io_body_running.jsonl"
F24_TRACE = CORPUS / "f24_file_backend_clear_wipes_other_ranks.jsonl"
F25_TRACE = CORPUS / "f25_reset_keeps_the_prefetch_occupancy.jsonl"
F26_TRACE = CORPUS / "f26_backend_exception_kills_the_prefetch_io_thread.jsonl"


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


def apply(session: Session, rule: str, **args: Any) -> str:
    outcome = session.apply(Step(rule=rule, args=args))
    assert not outcome.skipped, (rule, outcome)
    return outcome.text


def test_upstream_threads_take_one_queue_item_per_step_and_reduce_over_the_harness_group(
    tree_0523: Path,
) -> None:
    impl = SglangImplementation(tree_0523)
    assert "storage" in impl.capabilities  # 0.5.23 has the four storage threads
    config = impl.refine_config(
        HarnessConfig(host_pages=24, storage_ranks=3, storage_batch_pages=1)
    )
    session = Session(config, impl, "sglang")
    # a chain of two pages goes to L3 through upstream's backup thread, on every rank
    apply(session, "write_storage", pick=1, new=True)
    assert apply(session, "storage_step", kind="backup") == "backup step: [8, 8, 8]"
    apply(session, "drain_backup_acks")
    # ... and comes back: hit query (MIN over ranks), one IO iteration (two batch acks and the
    # final ack on the sync queue), then three sync iterations, each one MIN reduction or none
    apply(session, "prefetch", pick=0)
    assert apply(session, "storage_step", kind="hit_query") == "hit_query step: [8, 8, 8]"
    apply(session, "drain_prefetch_acks")
    assert apply(session, "storage_step", kind="io") == "io step: [8, 8, 8]"
    for tokens in ("4", "8", "0"):
        assert (
            apply(session, "storage_step", kind="sync") == f"sync step: [{', '.join([tokens] * 3)}]"
        )
    storage = session.storage
    assert storage is not None and not storage.runnable()  # every thread parked, queues empty
    group = storage.l3.group
    assert isinstance(group, RankGroup)
    logs = group.logs()
    assert [(r.group, r.result) for r in logs[0]] == [
        ("prefetch_hits", (8,)),
        ("prefetch_completion", (4,)),
        ("prefetch_completion", (8,)),
    ]
    assert all(len(log) == 3 for log in logs)  # every rank issued the same collectives
    apply(session, "drain_prefetch_acks")  # the final ack inserts the fetched chain
    apply(session, "detach_storage")
    assert all(not tier.alive_threads() for tier in storage.l3.tiers)  # detach joined them all
    session.finish()


@pytest.mark.usefixtures("gate_env")
def test_the_gate_draws_storage_on_0_5_23_and_finds_nothing_new(
    tree_0523: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report, stdout = run_gate(tree_0523, tmp_path, STORAGE_GATE_BUDGET, capsys)
    assert status == EXIT_OK, stdout
    assert report["rules"].get("storage_step", 0) > 0, report["rules"]
    assert report["rule_families"]["storage"]["steps"] > 0


@pytest.fixture
def gate_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SRC_ENV, raising=False)  # --sglang-src sets it; restored at teardown


@pytest.mark.parametrize("bug", BUGS_0523_STORAGE, ids=lambda bug: bug.NAME)
def test_storage_bug_is_one_small_substitution_in_one_file(
    bug: type[PlantedBug], tree_0523: Path
) -> None:
    check_one_small_substitution(bug, tree_0523)


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523_STORAGE, ids=lambda bug: bug.NAME)
def test_storage_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug],
    tree_0523: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, tree_0523, tmp_path, monkeypatch, capsys)


def fetch_then_step_the_io(session: Session) -> None:
    """A chain to L3 and a prefetch of it up to one IO iteration, whose acks wait for sync."""
    apply(session, "write_storage", pick=1, new=True)  # a chain of two pages
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")  # the hit: every rank allocates its bounce buffer
    apply(session, "storage_step", kind="io")  # both pages land; no progress is published yet


@pytest.mark.usefixtures("gate_env")
def test_an_insert_is_judged_by_the_progress_the_tree_drained_not_by_the_operation(
    tree_0523: Path, tmp_path: Path
) -> None:
    # plant sglang#27010's class: the IO thread writes its rank-local progress onto the op
    tree = plant(PrefetchIoSetsLocalProgress, tree_0523, tmp_path)
    config = HarnessConfig(host_pages=24, storage_ranks=2, storage_batch_pages=1)
    session = Session(config, SglangImplementation(tree), "sglang")
    fetch_then_step_the_io(session)
    # terminate before any sync step: the tree inserts [0:8] of the op's own count, while the
    # progress it drained (INV-23's evidence, never the op's field) is still 0
    with pytest.raises(InvariantViolation, match="inserted bounce page 0 with only 0 tokens"):
        apply(session, "terminate_prefetch", request="q0")
    # the unmodified tree: terminate inserts nothing, the IO's tail goes back at the final ack
    config = HarnessConfig(host_pages=24, storage_ranks=2, storage_batch_pages=1)
    session = Session(config, SglangImplementation(tree_0523), "sglang")
    fetch_then_step_the_io(session)
    assert apply(session, "terminate_prefetch", request="q0") == "terminate q0 at [0, 0]"
    session.finish()


@pytest.mark.usefixtures("gate_env")
def test_a_verdict_is_judged_by_the_progress_the_tree_drained_not_by_the_operation(
    tree_0523: Path, tmp_path: Path
) -> None:
    tree = plant(PrefetchIoSetsLocalProgress, tree_0523, tmp_path)
    config = HarnessConfig(
        host_pages=24, storage_ranks=2, storage_batch_pages=1, storage_policy="wait_complete"
    )
    session = Session(config, SglangImplementation(tree), "sglang")
    fetch_then_step_the_io(session)
    # the op's own count reached the hit, so the tree calls it complete: INV-22 reads the
    # progress drained off ack_prefetch_queue (0), not the op's field (8)
    with pytest.raises(InvariantViolation, match="judged complete with hit 8 and 0 tokens"):
        apply(session, "check_prefetch", request="q0")


def test_0_5_10_prefetch_threads_take_one_queue_item_per_step_and_the_tree_reduces_the_min() -> (
    None
):
    impl = SglangImplementation(fetch_wheel_tree())  # 0.5.10
    config = impl.refine_config(
        HarnessConfig(host_pages=24, device_pages=8, storage_ranks=2, storage_batch_pages=1)
    )
    session = Session(config, impl, "sglang")
    storage = session.storage
    assert storage is not None and storage.polled is not None  # no PrefetchAck: polled
    # a chain of two pages goes to L3 through upstream's backup thread, on both ranks
    apply(session, "write_storage", pick=1, new=True)
    assert apply(session, "storage_step", kind="backup") == "backup step: [8, 8]"
    apply(session, "drain_backup_acks")
    # the tree allocates host pages for the whole prefetch up front; the hit thread takes the
    # one queued operation, reduces the hit over the ranks and leaves it in hash_value
    apply(session, "prefetch", pick=0)
    assert storage.runnable() == [StorageStepKind.HIT_QUERY]
    assert apply(session, "storage_step", kind="hit_query") == "hit_query step: [8, 8]"
    # ... then the IO thread takes that operation: the whole transfer is one iteration
    assert storage.runnable() == [StorageStepKind.IO]
    assert apply(session, "storage_step", kind="io") == "io step: [8, 8]"
    assert not storage.runnable()  # every thread parked again, its queue empty
    # the policy terminates it; the tree's MIN over the ranks is the progress it inserts
    rid = storage.ongoing()[0]
    apply(session, "check_prefetch", request=rid)
    logs = storage.l3.group.logs()
    assert [(r.group, r.op, r.result) for r in logs[0]] == [
        ("prefetch_hits", "min", (8,)),  # upstream's hit thread, on its gloo group
        ("prefetch_completion", "min", (8,)),  # the tree's reduction of completed_tokens
    ]
    assert all(len(log) == 2 for log in logs)
    record = storage.log.prefetches[0][rid]
    assert (record.published_hit_tokens, record.bounce_tokens) == (8, 8)
    assert record.published_progress == (8,) and record.landed_pages == (2,)
    assert record.released == ((0, 8, "inserted"),) and record.final_acks == 1
    apply(session, "detach_storage")
    assert all(not tier.alive_threads() for tier in storage.l3.tiers)
    session.finish()


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0510_STORAGE, ids=lambda bug: bug.NAME)
def test_prefetch_bug_planted_in_0_5_10_is_caught(
    bug: type[PlantedBug],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, fetch_wheel_tree(), tmp_path, monkeypatch, capsys)


@pytest.mark.usefixtures("gate_env")
def test_f22_a_backend_exception_kills_0_5_10s_backup_thread_and_0_5_23_acks_it(
    tree_0523: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = Trace.read(F22_TRACE)
    on_0510 = replay(trace)  # the header names no tree: the default 0.5.10 wheel
    assert on_0510.signature() == "INV-25", on_0510.error
    assert "upstream's backup_thread_func died of InjectedBackendError" in str(on_0510.error)
    monkeypatch.setenv(SRC_ENV, str(tree_0523))  # 0.5.23 logs the exception and acks the op
    assert not replay(trace).failed
    assert not replay(trace, implementation="reference").failed


@pytest.mark.usefixtures("gate_env")
def test_f24_upstreams_file_backend_clear_wipes_another_ranks_pages_and_is_baselined(
    tree_0523: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two ranks back a chain up into upstream's HiCacheFile directory -> rank 1 clears
    trace = Trace.read(F24_TRACE)
    assert trace.header.config.storage_backend == "upstream_file"
    monkeypatch.setenv(SRC_ENV, str(tree_0523))
    on_0523 = replay(trace)
    assert on_0523.signature() == "INV-28", on_0523.error
    message = str(on_0523.error)
    assert "rank 1's clear() removed 2 pages of other ranks" in message and "of rank 0" in message
    # the default gate counts it as F24, a known finding, and keeps going
    findings = tuple(KNOWN_FINDINGS.values())
    found = match_known_finding(findings, "sglang", "INV-28", message, "0.5.23")
    assert found is not None and found.id == "F24"
    # scoped to the releases read to have it: a tree of unknown release is reported, not baselined
    assert match_known_finding(findings, "sglang", "INV-28", message, None) is None
    # 0.5.10's own HiCacheFile (the gated tree's file backend) clears the same way
    monkeypatch.delenv(SRC_ENV)
    assert replay(trace).signature() == "INV-28"
    monkeypatch.setenv(SRC_ENV, str(tree_0523))
    # the same controller over the reference's file backend clears only rank 1's namespace: the
    # wipe is the backend's, not the controller's
    own_files = trace.header.config.model_copy(update={"storage_backend": "file"})
    on_own_files = Trace(
        header=trace.header.model_copy(update={"config": own_files}), steps=trace.steps
    )
    assert not replay(on_own_files).failed
    assert not replay(on_own_files, implementation="reference").failed


def test_a_gated_tree_runs_its_own_file_backend_and_the_reference_runs_0_5_23s(
    tree_0523: Path,
) -> None:
    # upstream_file in a 0.5.10 gate is 0.5.10's HiCacheFile (a fork's is the fork's); the
    # reference, which has no tree, gets 0.5.23's
    tree_0510 = fetch_wheel_tree()
    for impl, tree in (
        (SglangImplementation(tree_0510), tree_0510),
        (ReferenceImplementation(), tree_0523),
    ):
        config = impl.refine_config(
            HarnessConfig(host_pages=24, storage_ranks=2, storage_backend="upstream_file")
        )
        session = Session(config, impl, impl.name)
        storage = session.storage
        assert storage is not None
        clients = [rank.faults.inner for rank in storage.l3.ranks if rank.faults is not None]
        assert [client.tree for client in clients] == [tree, tree]  # type: ignore[attr-defined]
        session.finish()


@pytest.mark.usefixtures("gate_env")
def test_the_gate_draws_storage_on_0_5_10_with_its_findings_baselined(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report, stdout = run_gate(fetch_wheel_tree(), tmp_path, STORAGE_GATE_BUDGET, capsys)
    assert status == EXIT_OK, stdout
    assert report["rules"].get("write_storage", 0) > 0, report["rules"]
    assert report["rules"].get("prefetch", 0) > 0, report["rules"]  # its prefetch protocol too


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize(
    ("trace", "fails_on", "passes_on"),
    [
        (F23_TRACE, ("0.5.10",), ("0.5.20", "0.5.23")),  # 0.5.19 joins the IO thread
        # the unjoined IO thread finishes its body after reset, on a draft release as on 0.5.10
        (F23_IO_BODY_TRACE, ("0.5.10", "0.5.17"), ("0.5.19",)),
        (F25_TRACE, ("0.5.10", "0.5.13"), ("0.5.14", "0.5.23")),  # 0.5.14 zeroes the occupancy
        # storage on the draft releases: the up-front (0.5.13) and the at-hit (0.5.17) protocol
        (F26_TRACE, ("0.5.10", "0.5.13", "0.5.17", "0.5.20"), ("0.5.22", "0.5.23")),
    ],
    ids=["F23", "F23-io-body", "F25", "F26"],
)
def test_a_0_5_10_prefetch_finding_fails_in_its_releases_and_passes_after_the_fix(
    trace: Path,
    fails_on: tuple[str, ...],
    passes_on: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded = Trace.read(trace)
    finding = KNOWN_FINDINGS[loaded.header.note.split()[0]]
    for release in fails_on:
        monkeypatch.setenv(SRC_ENV, str(fetch_wheel_tree(release)))
        result = replay(loaded)
        # one root cause, several faces: the trace fails under one of the finding's ids, and the
        # finding's pattern for that id matches the message (so the gate baselines it there)
        faces = (finding.invariant, *(inv_id for inv_id, _ in finding.also))
        assert result.signature() in faces, (release, result.error)
        assert finding.matches("sglang", result.signature(), str(result.error), release)
    for release in passes_on:
        monkeypatch.setenv(SRC_ENV, str(fetch_wheel_tree(release)))
        assert not replay(loaded).failed, release
    assert not replay(loaded, implementation="reference").failed


def test_a_finding_outside_its_releases_is_reported_not_baselined() -> None:
    # F23's symptom on 0.5.23 (whose reset joins every thread) would be a new bug: not F23
    message = "INV-24 violated: rank 0 after detach: 1 storage threads alive, attached=False"
    known = tuple(KNOWN_FINDINGS.values())
    assert match_known_finding(known, "sglang", "INV-24", message, "0.5.10").id == "F23"  # type: ignore[union-attr]
    assert match_known_finding(known, "sglang", "INV-24", message, "0.5.23") is None
    assert match_known_finding(known, "sglang", "INV-24", message, "") is None  # a checkout
    # an unscoped finding (F8, every release) still matches any release
    assert match_known_finding(known, "sglang", "INV-18", "reset() left producer_index=0", "0.5.23")


@pytest.mark.usefixtures("gate_env")
def test_a_page_dropped_while_a_reset_runs_a_queued_backup_is_lost_not_a_hole(
    tree_0523: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two chains backed up, a reset with one queued, rank 1 clears, both rewritten and a second
    # reset with a backup queued: upstream's stopping backup thread runs it (no step sees it)
    # and the faulty backend drops its first page; that is the backend's fault, excused like a
    # drop inside a step, never an INV-31 hole (the 0.5.10 gate reported one at 60 s)
    trace = Trace.read(Path(__file__).with_name("reset_drops_a_page_unobserved_no_hole.jsonl"))
    assert trace.header.config.storage_faults
    assert not replay(trace).failed  # 0.5.10
    monkeypatch.setenv(SRC_ENV, str(tree_0523))
    assert not replay(trace).failed
    assert not replay(trace, implementation="reference").failed
