"""A Mamba state pool's L3 page on upstream 0.5.19+: one state per node, the hit's last page.

In a storage world with ``pool_group="mamba"`` (``storage_swa_window=1``, capability
``storage:mamba``) the gate builds upstream's own ``HybridCacheController`` with its storage
threads over a ``HostPoolGroup`` whose ``MAMBA`` entry is the harness's state pool. A backup
names the chain's one state slot with its last page key (``<key>.mamba``), a prefetch one
placeholder key, which the tree stages as one state slot at the hit; upstream's
``_sync_trailing_keys`` keys it by the served hit's last page and ``_page_transfer_sidecar``
reads it after the KV pages (``harness/driver/storage_side.py``). The stories: L3 holds one
state page per node, under its last page key; a prefetched chain's state lands with the bytes
written for it and becomes its node's state slot, which a load brings back; a hit cut below the
chain's end has no state in L3 and is discarded whole; a state keyed by the query's hit instead
of the served one is caught; and the bug of ``sglang_bugs.BUGS_0523_MAMBA_STORAGE``, planted in
0.5.23 at test time, is caught by a gate (INV-39).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.world.config import HarnessConfig

from .sglang_bugs import BUGS_0523_MAMBA_STORAGE, PlantedBug, TrailingKeysOfTheQueriedHit
from .test_sglang_gate import check_one_small_substitution, check_planted_bug_is_caught, plant
from .test_sglang_gate import gate_env as gate_env  # the fixture, shared with the gate tests
from .test_sglang_side_storage import apply, prefetch_to_the_end, windows_judged


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


def mamba_session(tree: Path, *, pressure: bool, ranks: int = 2) -> Session:
    impl = SglangImplementation(tree)
    config = HarnessConfig(
        page_size=2, layer_num=2, draft_layer_num=2, pool_group="mamba", storage_ranks=ranks,
        storage_batch_pages=2, host_pages=16, device_pages=16, side_device_pages=8,
        draft_host_pages=16, storage_swa_window=1, storage_host_pressure=pressure,
    )  # fmt: skip
    refined = impl.refine_config(config)
    assert refined.storage_swa_window == 1  # a Mamba storage world, not refined away
    return Session(refined, impl, impl.name)


def back_up(session: Session, pick: int) -> None:
    apply(session, "write_storage", pick=pick, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")


def state_keys(session: Session) -> list[str]:
    """The stored Mamba pages, by content key (the store's keys carry each rank's suffix)."""
    assert session.storage is not None
    stored = session.storage.l3.store.keys()
    return sorted({k.split("_harness")[0] for k in stored if ".mamba" in k})


def test_l3_holds_one_state_page_per_node_under_its_last_page_key(tree_0523: Path) -> None:
    # a 3-page chain and a 2-page chain: five KV pages, two state pages, each the chain's last
    session = mamba_session(tree_0523, pressure=False)
    back_up(session, pick=2)
    back_up(session, pick=1)
    assert session.storage is not None
    last_keys = sorted(f"{c.keys[-1]}.mamba" for c in session.storage.chains.values())
    assert state_keys(session) == last_keys
    session.finish()


def test_a_prefetched_chain_s_state_lands_and_becomes_its_node_s_state_slot(
    tree_0523: Path,
) -> None:
    session = mamba_session(tree_0523, pressure=False)
    back_up(session, pick=2)
    prefetch_to_the_end(session)
    judged = windows_judged(session)
    assert [(w.rank, w.hit_pages, w.staged_pages, w.window_pages) for w in judged] == [
        (0, 3, 1, 1),
        (1, 3, 1, 1),
    ]
    # the state written for the chain's whole prefix, at the one staged slot, on every rank
    assert all(w.accepted and w.published_pages == 1 and w.landed == (True,) for w in judged)
    node = session.tree.nodes[0]  # rank 0's prefetched node: its one state slot
    assert node.side_host and node.side_host[0] is not None and node.side_host[0].numel() == 1
    apply(session, "load", node=0)
    apply(session, "start_loading")
    session.finish()  # the byte checks read the loaded state back (INV-09) and count it (INV-40)
    assert session.stats.checks_by_id["INV-39"] > 0 and session.stats.checks_by_id["INV-40"] > 0


def test_a_hit_cut_below_the_chain_s_end_has_no_state_in_l3_and_is_discarded(
    tree_0523: Path,
) -> None:
    # other requests hold all but 2 host pages while the query runs (pick 8), so the 3-page hit
    # is served as 2 pages; no node ends at page 2, so L3 holds no state for it: the read finds
    # none and the tree discards the result whole (INV-39: nothing is lost that L3 held)
    session = mamba_session(tree_0523, pressure=True)
    back_up(session, pick=2)
    prefetch_to_the_end(session, pick=8)
    judged = windows_judged(session)
    assert [(w.hit_pages, w.window_pages, w.stored, w.accepted) for w in judged] == [
        (2, 1, False, False)
    ] * 2
    assert 0 not in session.tree.nodes
    assert session.storage is not None and not any(session.storage.side.held)
    session.finish()


def test_a_state_keyed_by_the_query_s_hit_after_a_cut_is_caught(
    tree_0523: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the same cut on a tree whose _page_transfer_sidecar keys the state by the hit the query
    # found: it reads the chain's end state into a node that ends a page earlier (INV-39)
    tree = plant(TrailingKeysOfTheQueriedHit, tree_0523, tmp_path)
    session = mamba_session(tree, pressure=True)
    back_up(session, pick=2)
    with pytest.raises(InvariantViolation, match="INV-39"):
        prefetch_to_the_end(session, pick=8)


def test_a_skipped_mla_rank_still_stores_its_sharded_state_and_acks_the_span(
    tree_0523: Path,
) -> None:
    # MLA: rank 1 skips the replicated KV pages but stores its own state (should_backup keeps
    # MAMBA on every rank) and acks the span (INV-26 counts its state, not KV it never wrote)
    impl = SglangImplementation(tree_0523)
    config = HarnessConfig(
        page_size=2, layer_num=1, draft_layer_num=2, pool_kind="mla", pool_group="mamba",
        storage_ranks=2, storage_batch_pages=2, host_pages=16, device_pages=16,
        side_device_pages=8, draft_host_pages=16, storage_swa_window=1,
    )  # fmt: skip
    session = Session(impl.refine_config(config), impl, impl.name)
    back_up(session, pick=1)
    assert session.storage is not None
    rank_1 = next(iter(session.storage.log.backups[1].values()))
    assert rank_1.skipped and rank_1.state_stored and rank_1.acked_tokens == 4
    session.finish()


def test_the_state_is_read_on_0_5_19_too() -> None:
    session = mamba_session(fetch_wheel_tree("0.5.19"), pressure=False)
    back_up(session, pick=2)
    prefetch_to_the_end(session)
    assert [(w.accepted, w.landed) for w in windows_judged(session)] == [(True, (True,))] * 2
    session.finish()


@pytest.mark.parametrize("bug", BUGS_0523_MAMBA_STORAGE, ids=lambda bug: bug.NAME)
def test_mamba_storage_bug_is_one_small_substitution(
    bug: type[PlantedBug], tree_0523: Path
) -> None:
    check_one_small_substitution(bug, tree_0523)
    assert bug.INVARIANTS == ("INV-39",)


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523_MAMBA_STORAGE, ids=lambda bug: bug.NAME)
def test_mamba_storage_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug],
    tree_0523: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, tree_0523, tmp_path, monkeypatch, capsys)
