"""An SWA side pool's L3 window on upstream 0.5.19+: the independent pool's trailing pages.

In a storage world with ``pool_group="swa"`` and ``storage_swa_window`` the gate builds
upstream's own ``HybridCacheController`` with its storage threads (served step by step) over a
``HostPoolGroup`` whose ``SWA`` entry has its own host slots. A backup names the chain's SWA
host pages with its page keys, a prefetch a window of placeholder keys, which the tree stages
at the hit, as 0.5.23's hybrid radix cache does (``harness/driver/storage_side.py``); upstream's
``_sync_trailing_keys`` re-aligns the window to the served hit and ``_page_transfer_sidecar``
reads it after the KV pages. The stories: a prefetched chain's window lands with the bytes
written for its trailing pages on every rank; under host pressure a hit cut below the staged
window keeps the trailing window of the pages served and gives the rest back; a bounded gate
of the unmodified tree draws such worlds and finds nothing new; and each bug of
``sglang_bugs.BUGS_0523_SIDE_STORAGE``, planted in 0.5.23 at test time, is caught (INV-39).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.cli import EXIT_OK
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import SRC_ENV, fetch_wheel_tree
from hicache_ref.harness.campaigns.known_findings import KNOWN_FINDINGS, match_known_finding
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.invariants.storage_snapshot import SideWindowRecord

from .sglang_bugs import BUGS_0523_SIDE_STORAGE, PlantedBug
from .test_sglang_gate import check_one_small_substitution, check_planted_bug_is_caught, run_gate
from .test_sglang_gate import gate_env as gate_env  # the fixture, shared with the gate tests

SIDE_GATE_BUDGET = "15s"  # the 60 s runs are in specs/upstream_findings.md


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


def swa_session(tree: Path, window: int, *, host_pages: int, pressure: bool) -> Session:
    impl = SglangImplementation(tree)
    config = HarnessConfig(
        page_size=2, layer_num=2, draft_layer_num=2, pool_group="swa", storage_ranks=2,
        storage_batch_pages=2, host_pages=host_pages, device_pages=16, side_device_pages=8,
        draft_host_pages=16, storage_swa_window=window, storage_host_pressure=pressure,
    )  # fmt: skip
    refined = impl.refine_config(config)
    assert refined.storage_swa_window == window  # an SWA storage world, not refined away
    return Session(refined, impl, impl.name)


def apply(session: Session, rule: str, **args: object) -> str:
    outcome = session.apply(Step(rule=rule, args=dict(args)))  # type: ignore[arg-type]
    assert not outcome.skipped, (rule, outcome)
    return outcome.text


def prefetch_to_the_end(session: Session, pick: int = 0) -> None:
    """Prefetch the first chain, then run its hit query, IO and sync steps and drain each."""
    apply(session, "prefetch", pick=pick)
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")
    for _ in range(6):  # the IO's batches and the window read, their acks, then the final one
        for kind in ("io", "sync"):
            if kind in {k.value for k in session.storage.runnable()}:  # type: ignore[union-attr]
                apply(session, "storage_step", kind=kind)
        apply(session, "drain_prefetch_acks")
    apply(session, "drain_backup_acks")  # the SWA release queue too


def windows_judged(session: Session) -> list[SideWindowRecord]:
    assert session.storage is not None
    return list(session.storage.log.side_windows)


def test_a_prefetched_chain_lands_with_its_trailing_window_on_every_rank(tree_0523: Path) -> None:
    # a 3-page chain backed up with its SWA pages, prefetched whole with a 2-page window
    session = swa_session(tree_0523, 2, host_pages=16, pressure=False)
    apply(session, "write_storage", pick=2, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    prefetch_to_the_end(session)
    judged = windows_judged(session)
    assert [(w.rank, w.hit_pages, w.window_pages, w.published_pages) for w in judged] == [
        (0, 3, 2, 2),
        (1, 3, 2, 2),
    ]
    # pages 2 and 3's SWA bytes at the window's slots, the result kept, the slots back
    assert all(w.accepted and w.landed == (True, True) for w in judged)
    assert session.stats.checks_by_id["INV-39"] > 0
    assert session.storage is not None and not any(session.storage.side.held)
    session.finish()


def test_a_cut_hit_keeps_the_trailing_window_of_the_served_pages_on_0_5_23(
    tree_0523: Path,
) -> None:
    # a 3-page window staged for a 3-page hit; other requests hold every rank's host room but
    # 2 pages while the query runs (the prefetch's pick 8), so allocate_storage_hit serves 2:
    # _sync_trailing_keys shrinks the window to pages 1-2 and gives the third staged page back
    # on the SWA release queue
    session = swa_session(tree_0523, 3, host_pages=16, pressure=True)
    apply(session, "write_storage", pick=2, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    prefetch_to_the_end(session, pick=8)
    judged = windows_judged(session)
    assert [(w.hit_pages, w.staged_pages, w.released_pages, w.window_pages) for w in judged] == [
        (2, 3, 1, 2),
        (2, 3, 1, 2),
    ]
    assert all(w.accepted and w.landed == (True, True) for w in judged)
    session.finish()


def test_a_window_covering_the_whole_chain_becomes_its_node_s_side_slots_and_loads(
    tree_0523: Path,
) -> None:
    # a 2-page chain at the root with a 3-page window: the window is the whole chain, so the
    # prefetched node keeps it as its side host slots, and a load brings its SWA rows back
    session = swa_session(tree_0523, 3, host_pages=16, pressure=False)
    apply(session, "write_storage", pick=1, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    prefetch_to_the_end(session)
    judged = [(w.hit_pages, w.window_pages, w.accepted) for w in windows_judged(session)]
    assert judged == [(2, 2, True)] * 2  # on both ranks
    node = session.tree.nodes[0]  # rank 0's prefetched node, the chain's handle
    assert node.side_host and node.side_host[0] is not None and node.side_host[0].numel() == 4
    assert session.storage is not None and not session.storage.side.held[0]  # the node's now
    apply(session, "load", node=0)
    apply(session, "start_loading")
    session.finish()  # the tree's byte checks read the node's rows, the side pool's too
    assert session.stats.checks_by_id["INV-06"] > 0 and session.stats.checks_by_id["INV-36"] > 0


def test_the_window_is_read_on_0_5_19_too() -> None:
    # 0.5.19's _page_transfer_sidecar (no _trailing_chain_groups yet) reads the same window
    session = swa_session(fetch_wheel_tree("0.5.19"), 2, host_pages=16, pressure=False)
    apply(session, "write_storage", pick=2, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    prefetch_to_the_end(session)
    assert [(w.accepted, w.landed) for w in windows_judged(session)] == [(True, (True, True))] * 2
    session.finish()


F28_TRACE = (
    Path(__file__).resolve().parents[2]
    / "fuzz/corpus/sglang"
    / ("f28_trailing_hit_min_picks_an_unrestorable_prefix.jsonl")
)


def test_f28_a_trailing_hit_agreed_as_the_min_is_baselined_only_before_0_5_23(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # three ranks restore {1}, {1, 2}, {2} pages of the chain: 0.5.19 - 0.5.22 publish MIN(1, 2,
    # 2) = 1, which rank 2 cannot restore; 0.5.23 reduces a flag per prefix and publishes 0
    trace = Trace.read(F28_TRACE)
    known = tuple(KNOWN_FINDINGS.values())
    for release in ("0.5.19", "0.5.20", "0.5.21", "0.5.22"):
        monkeypatch.setenv(SRC_ENV, str(fetch_wheel_tree(release)))
        result = replay(trace)
        assert result.signature() == "INV-29", (release, result.error)
        found = match_known_finding(known, "sglang", "INV-29", str(result.error), release)
        assert found is not None and found.id == "F28", release
    assert match_known_finding(known, "sglang", "INV-29", str(result.error), "0.5.23") is None
    monkeypatch.setenv(SRC_ENV, str(fetch_wheel_tree("0.5.23")))
    assert not replay(trace).failed


@pytest.mark.usefixtures("gate_env")
def test_the_gate_draws_swa_storage_on_0_5_23_and_finds_nothing_new(
    tree_0523: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report, stdout = run_gate(tree_0523, tmp_path, SIDE_GATE_BUDGET, capsys)
    assert status == EXIT_OK, stdout
    swa = report["worlds"]["storage swa"]  # what the pass covered
    assert swa["cases"] > 0 and 0 < swa["share_of_storage"] < 1, swa
    mamba = report["worlds"]["storage mamba"]  # a Mamba state pool's page in L3, named apart
    assert mamba["cases"] > 0 and 0 < mamba["share_of_storage"] < 1, mamba
    assert report["checks_by_id"].get("INV-39", 0) > 0


@pytest.mark.parametrize("bug", BUGS_0523_SIDE_STORAGE, ids=lambda bug: bug.NAME)
def test_side_storage_bug_is_one_small_substitution(bug: type[PlantedBug], tree_0523: Path) -> None:
    check_one_small_substitution(bug, tree_0523)
    assert bug.INVARIANTS == ("INV-39",)


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523_SIDE_STORAGE, ids=lambda bug: bug.NAME)
def test_side_storage_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug],
    tree_0523: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, tree_0523, tmp_path, monkeypatch, capsys)
