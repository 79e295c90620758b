"""Buffer mode on upstream 0.5.19+: host memory as staging, beliefs of what L3 holds (INV-41).

In a storage world with ``storage_buffer_only`` the gate builds upstream's own
``HybridCacheController`` over the KV pool alone in ``buffer_only`` host memory, and the
harness's tree half is the buffer pipeline's (``harness/driver/storage_buffer.py``), with each
rank's storage existence beliefs held by upstream's own ``StorageExistenceCache`` (one release
of each shape: 0.5.19's flat beliefs, 0.5.23's per pool). The stories:
the controller's buffer-mode capacity and rate limit (write staging is not charged to loads); a
write's staging freed at its storage ack, where its pages are taught; a write the backend
failed on every rank is still believed (upstream's stale positive), so writing it again is
skipped; a page the backend lost is forgotten by every rank once a hit query's rank-agreed
verdict says so; the capability on the releases whose tree has per-pool beliefs; and each bug
of ``sglang_bugs.BUGS_0523_BUFFER``, planted in 0.5.23 at test time, is caught (INV-41) by a
default 60 s gate, whose unmodified tree draws buffer worlds and finds nothing new.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, find, settings
from hypothesis.errors import NoSuchExample

from hicache_ref.cli import EXIT_OK
from hicache_ref.harness.adapters.base import STORAGE_BUFFER_CAPABILITY
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_buffer import beliefs_shape
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.campaigns.machine import harness_configs
from hicache_ref.harness.driver.storage_driver import StorageDriver
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.invariants.storage_snapshot import BeliefView

from .sglang_bugs import BUGS_0523_BUFFER, PlantedBug
from .test_sglang_gate import SNIPPET_LINES_MAX, check_planted_bug_is_caught, run_gate
from .test_sglang_gate import gate_env as gate_env  # the fixture, shared with the gate tests

PAGE = 2
GATE_BUDGET = "60s"
SEARCH = settings(
    max_examples=400, database=None, suppress_health_check=list(HealthCheck), deadline=None
)


BELIEF_SHAPES = ("0.5.19", "0.5.23")
"""One release of each shape of beliefs: flat (0.5.19 - 0.5.21), per pool (0.5.22+)."""


@pytest.fixture(scope="module")
def tree_0523() -> Path:
    return fetch_wheel_tree("0.5.23")


@pytest.fixture(scope="module", params=BELIEF_SHAPES)
def tree(request: pytest.FixtureRequest) -> Path:
    return fetch_wheel_tree(str(request.param))


def buffer_session(tree: Path, host_pages: int = 8, ranks: int = 2) -> Session:
    impl = SglangImplementation(tree)
    config = HarnessConfig(
        page_size=PAGE, layer_num=2, storage_ranks=ranks, storage_batch_pages=1,
        host_pages=host_pages, device_pages=16, pool_group="anchor", storage_buffer_only=True,
    )  # fmt: skip
    session = Session(impl.refine_config(config), impl, impl.name)
    assert session.config.storage_buffer_only and session.config.uses_storage  # kept
    return session


def apply(session: Session, rule: str, **args: object) -> str:
    outcome = session.apply(Step(rule=rule, args=dict(args)))  # type: ignore[arg-type]
    return outcome.text


def storage_of(session: Session) -> StorageDriver:
    assert session.storage is not None
    return session.storage


def views(session: Session) -> tuple[BeliefView, ...]:
    """Every rank's beliefs beside the harness's record (what INV-41 judges)."""
    book = storage_of(session).buffer
    assert book is not None
    return book.views()


def believed(session: Session, rank: int) -> tuple[str, ...]:
    return views(session)[rank].believed


def back_up_one_chain(session: Session) -> list[str]:
    """A chain of three pages written, backed up and acked on every rank; its page keys."""
    assert apply(session, "write_storage", pick=2, new=True).startswith("write_storage chain")
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    chain = next(iter(storage_of(session).chains.values()))
    return list(chain.keys)


def test_the_controller_runs_buffer_mode_and_leaves_write_staging_out_of_its_rate_limit(
    tree: Path,
) -> None:
    # three host pages of two tokens: the buffer mode's load fraction is int(0.9 * 6) = 5
    session = buffer_session(tree, host_pages=3)
    storage = storage_of(session)
    cc = storage.l3.ranks[0].controller
    assert cc.host_memory_mode == "buffer_only" and cc.prefetch_capacity_limit == 5
    # write a three-page chain: all six host tokens are write staging, none is a load's
    apply(session, "write_storage", pick=2, new=True)
    assert cc.mem_pool_host.available_size() == 0 and not cc.prefetch_rate_limited()
    # the storage ack frees the staging: the host pool is whole again, nothing staged
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    assert cc.mem_pool_host.available_size() == 6
    assert all(view.staged_tokens == 0 and not view.inflight for view in views(session))
    session.finish()


def test_a_write_is_in_flight_until_its_storage_ack_and_believed_from_it(
    tree: Path,
) -> None:
    session = buffer_session(tree)
    apply(session, "write_storage", pick=2, new=True)
    in_flight = views(session)
    assert all(len(v.inflight) == 3 and not v.believed for v in in_flight)  # covered only
    apply(session, "storage_step", kind="backup")
    assert not believed(session, 0)  # the backup ran, its ack is not drained yet
    apply(session, "drain_backup_acks")
    assert all(len(v.believed) == 3 and not v.inflight for v in views(session))
    session.finish()


def test_a_write_the_backend_failed_is_still_believed_so_writing_it_again_is_skipped(
    tree: Path,
) -> None:
    # every rank's backend fails the chain's three pages: each acks 0 tokens, but the buffer
    # pipeline teaches the write's pages unconditionally (TP-deterministic admission)
    session = buffer_session(tree)
    storage = storage_of(session)
    for rank in storage.l3.ranks:
        assert rank.faults is not None
        rank.faults.arm("set_fail", 3)
    keys = back_up_one_chain(session)
    assert [c.state for c in storage.chains.values()] == ["none"]  # L3 holds none of it
    assert believed(session, 0) == believed(session, 1) == tuple(sorted(keys))
    # so a second write of the chain is skipped: every page is believed stored
    again = apply(session, "write_storage", pick=0, new=False)
    assert again == "refused: every page believed stored or in flight (buffer mode skips it)"
    session.finish()


def test_a_page_the_backend_lost_is_forgotten_once_an_agreed_hit_query_misses_it(
    tree: Path,
) -> None:
    session = buffer_session(tree)
    keys = back_up_one_chain(session)
    storage = storage_of(session)
    # rank 1's backend evicts the chain's last two pages; rank 0's keeps them
    faults = storage.l3.ranks[1].faults
    assert faults is not None
    for key in keys[1:]:
        faults.evict(key)
    apply(session, "prefetch", pick=0)
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")  # the drained hit: MIN(3, 1) = 1 page on every rank
    for rank in range(2):
        assert believed(session, rank) == (keys[0],), rank
        assert set(views(session)[rank].refuted) == set(keys[1:])
    session.finish()


def test_buffer_mode_is_a_capability_of_the_releases_with_existence_beliefs() -> None:
    for release, shape in (
        ("0.5.18", None), ("0.5.19", "flat"), ("0.5.21", "flat"), ("0.5.22", "pools"),
        ("0.5.23", "pools"),
    ):  # fmt: skip
        tree = fetch_wheel_tree(release)
        impl = SglangImplementation(tree)
        assert (STORAGE_BUFFER_CAPABILITY in impl.capabilities) is bool(shape), release
        assert beliefs_shape(tree) == shape, release


def test_an_anchor_storage_world_is_drawn_in_buffer_mode_where_it_is_a_capability(
    tree_0523: Path,
) -> None:
    capabilities = frozenset(SglangImplementation(tree_0523).capabilities)
    found = find(harness_configs(capabilities), lambda c: c.storage_buffer_only, settings=SEARCH)
    assert found.pool_group == "anchor" and found.uses_storage and not found.storage_pp
    # every anchor storage world is (its cache mode is refined away), and no other is
    with pytest.raises(NoSuchExample):
        find(harness_configs(capabilities), is_anchor_storage_in_cache_mode, settings=SEARCH)
    # 0.5.18 lacks the capability: no world of it is drawn in buffer mode
    older = frozenset(SglangImplementation(fetch_wheel_tree("0.5.18")).capabilities)
    with pytest.raises(NoSuchExample):
        find(harness_configs(older), lambda c: c.storage_buffer_only, settings=SEARCH)
    with pytest.raises(ValueError, match="storage_buffer_only is a storage world"):
        HarnessConfig(storage_buffer_only=True)  # no storage tier
    with pytest.raises(ValueError, match="storage_buffer_only is a storage world"):
        HarnessConfig(storage_ranks=1, draft_layer_num=1, storage_buffer_only=True)  # a draft
    # the KV pool alone without a group is the reference's buffer world
    assert HarnessConfig(storage_ranks=1, storage_buffer_only=True).may_run_buffer_only
    world = HarnessConfig(storage_ranks=1, pool_group="anchor", storage_buffer_only=True)
    assert "+buffer" in world.describe()


def is_anchor_storage_in_cache_mode(config: HarnessConfig) -> bool:
    return (
        config.uses_storage
        and config.pool_group == "anchor"
        and not config.storage_pp
        and not config.storage_buffer_only
    )


@pytest.mark.parametrize("bug", BUGS_0523_BUFFER, ids=lambda bug: bug.NAME)
def test_buffer_bug_is_one_small_substitution(bug: type[PlantedBug], tree_0523: Path) -> None:
    source = (tree_0523 / bug.TARGET).read_text()
    assert bug.apply(source) != source
    assert bug.OLD.count("\n") <= SNIPPET_LINES_MAX and bug.NEW.count("\n") <= SNIPPET_LINES_MAX
    assert bug.INVARIANTS == ("INV-41",)


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523_BUFFER, ids=lambda bug: bug.NAME)
def test_buffer_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug],
    tree_0523: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, tree_0523, tmp_path, monkeypatch, capsys)


@pytest.mark.usefixtures("gate_env")
def test_the_gate_draws_buffer_worlds_on_0_5_23_and_finds_nothing_new(
    tree_0523: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report, stdout = run_gate(tree_0523, tmp_path, GATE_BUDGET, capsys)
    assert status == EXIT_OK, stdout
    buffer = report["worlds"]["storage buffer"]  # what the pass covered
    assert buffer["cases"] > 0 and 0 < buffer["share_of_storage"] < 1, buffer
    assert report["checks_by_id"].get("INV-41", 0) > 0
