"""A draft sidecar in L3 on upstream 0.5.23: its ``HostPoolGroup``'s ``DRAFT`` entry stored too.

In a storage world with ``pool_group="sidecar"`` the gate builds upstream's own
``HybridCacheController`` with its storage threads (served step by step); every prefetch and
backup names the ``DRAFT`` transfer riding on the KV's slots, as the hybrid radix cache does, so
upstream's ``batch_set_v2`` / ``batch_exists_v2`` / ``batch_get_v2`` calls reach the harness's
backend. The stories: a chain backed up and prefetched lands with its draft bytes on every rank,
on upstream and on the reference; a bounded gate of the unmodified tree draws such worlds and
finds nothing new; and each bug of ``sglang_bugs.BUGS_0523_SIDECAR_STORAGE``, planted in 0.5.23
at test time, is caught by an invariant it declares (INV-37: progress counts a page only with
its draft page's bytes) and its minimized trace passes on the unmodified tree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.cli import EXIT_OK
from hicache_ref.harness.adapters.contract import ImplementationBase
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig

from .sglang_bugs import BUGS_0523_SIDECAR_STORAGE, PlantedBug
from .test_sglang_gate import check_one_small_substitution, check_planted_bug_is_caught, run_gate
from .test_sglang_gate import gate_env as gate_env  # the fixture, shared with the gate tests

SIDECAR_GATE_BUDGET = "15s"


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


def sidecar_session(impl: ImplementationBase, pool_group: str) -> Session:
    config = HarnessConfig(
        page_size=2, layer_num=2, draft_layer_num=2, pool_group=pool_group,  # type: ignore[arg-type]
        storage_ranks=2, storage_batch_pages=2, host_pages=16, device_pages=16,
    )  # fmt: skip
    return Session(impl.refine_config(config), impl, impl.name)


def apply(session: Session, rule: str, **args: object) -> str:
    outcome = session.apply(Step(rule=rule, args=dict(args)))  # type: ignore[arg-type]
    assert not outcome.skipped, (rule, outcome)
    return outcome.text


def back_up_and_prefetch(session: Session) -> str:
    """Back a new chain up on every rank, then prefetch it whole: the prefetch's id."""
    apply(session, "write_storage", pick=0, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    text = apply(session, "prefetch", pick=0)
    for kind in ("hit_query",):
        apply(session, "storage_step", kind=kind)
    apply(session, "drain_prefetch_acks")
    for _ in range(6):  # the IO's batches and their acks, then the final one
        for kind in ("io", "sync"):
            if kind in {k.value for k in session.storage.runnable()}:  # type: ignore[union-attr]
                apply(session, "storage_step", kind=kind)
        apply(session, "drain_prefetch_acks")
    return text.split()[1]


@pytest.mark.parametrize("where", ["sglang-0.5.23", "reference"])
def test_a_prefetched_chain_lands_with_its_draft_bytes_on_every_rank(
    where: str, tree_0523: Path
) -> None:
    if where == "reference":
        session = sidecar_session(ReferenceImplementation(), "none")
    else:
        session = sidecar_session(SglangImplementation(tree_0523), "sidecar")
    assert session.config.uses_storage and session.config.has_draft  # not refined away
    rid = back_up_and_prefetch(session)
    storage = session.storage
    assert storage is not None
    for rank in range(2):
        log = storage.log.prefetches[rank][rid]
        pages = log.published_progress[-1] // 2
        # the harness read the draft pool back at every published page: all the oracle's
        assert pages >= 1 and log.sidecar_pages and log.sidecar_pages[-1] == pages, log
    assert session.stats.checks_by_id["INV-37"] > 0
    session.finish()


@pytest.mark.usefixtures("gate_env")
def test_the_gate_draws_sidecar_storage_on_0_5_23_and_finds_nothing_new(
    tree_0523: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report, stdout = run_gate(tree_0523, tmp_path, SIDECAR_GATE_BUDGET, capsys)
    assert status == EXIT_OK, stdout
    sidecar = report["worlds"]["storage sidecar"]  # what the pass covered
    assert sidecar["cases"] > 0 and 0 < sidecar["share_of_storage"] < 1, sidecar
    assert report["checks_by_id"].get("INV-37", 0) > 0


@pytest.mark.parametrize("bug", BUGS_0523_SIDECAR_STORAGE, ids=lambda bug: bug.NAME)
def test_sidecar_storage_bug_is_one_small_substitution(
    bug: type[PlantedBug], tree_0523: Path
) -> None:
    check_one_small_substitution(bug, tree_0523)
    assert "INV-37" in bug.INVARIANTS


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523_SIDECAR_STORAGE, ids=lambda bug: bug.NAME)
def test_sidecar_storage_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug],
    tree_0523: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, tree_0523, tmp_path, monkeypatch, capsys)
