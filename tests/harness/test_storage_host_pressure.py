"""Host pressure at a prefetch's hit: the tree serves the room it has, never more (INV-29).

When the free host pages cannot hold a hit, 0.5.16 - 0.5.21's radix caches give a bounce buffer
of the free whole pages (at least the threshold) and cut the hit and its keys to it; 0.5.23's
hybrid controller decides the same cut itself (``allocate_storage_hit(allow_partial=True)``).
With ``storage_host_pressure`` the harness's tree half does so on every rank alike. The story:
a chain of three pages backed up, a second write holding three of five host pages, then a
prefetch of the first chain: on the reference, on 0.5.17 (the hit handed back, polled), on
0.5.23's plain controller and on its hybrid controller (with a draft sidecar), the hit is cut to
two pages, the bounce buffer, the keys and the progress follow, and the case ends clean.
Without host pressure the same hit is revoked. And a bug of ``BUGS_0523_HOST_PRESSURE``,
planted in 0.5.23's ``allocate_storage_hit`` at test time, is caught (INV-29) by a default gate
and its minimized trace passes on the unmodified tree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.harness.adapters.contract import ImplementationBase
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.driver.storage_driver import StorageDriver
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig

from .sglang_bugs import BUGS_0523_HOST_PRESSURE, PlantedBug
from .test_sglang_gate import check_one_small_substitution, check_planted_bug_is_caught
from .test_sglang_gate import gate_env as gate_env  # the fixture, shared with the gate tests

PAGE = 2
WORLDS = {
    "reference": ("", {}),
    "sglang-0.5.17": ("0.5.17", {}),
    "sglang-0.5.23": ("0.5.23", {}),
    "sglang-0.5.23-sidecar": ("0.5.23", {"draft_layer_num": 1, "pool_group": "sidecar"}),
}


def implementation(release: str) -> ImplementationBase:
    if not release:
        return ReferenceImplementation()
    return SglangImplementation(fetch_wheel_tree(release))


def apply(session: Session, rule: str, **args: object) -> str:
    outcome = session.apply(Step(rule=rule, args=dict(args)))  # type: ignore[arg-type]
    return outcome.text


def hold_three_of_five_host_pages(session: Session) -> None:
    """A chain of three pages backed up (its host pages given back), then a second write of
    three pages that holds three of the five host pages."""
    apply(session, "write_storage", pick=2, new=True)
    apply(session, "storage_step", kind="backup")
    apply(session, "drain_backup_acks")
    apply(session, "write_storage", pick=2, new=True)


def run_prefetches_to_idle(session: Session) -> StorageDriver:
    """Every prefetch thread stepped and every ack drained until nothing is left to run."""
    storage = session.storage
    assert storage is not None
    for _ in range(8):
        for kind in [k.value for k in storage.runnable() if k.value != "backup"]:
            apply(session, "storage_step", kind=kind)
        apply(session, "drain_prefetch_acks")
    return storage


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_a_hit_larger_than_the_host_room_is_cut_to_it_on_every_rank(world: str) -> None:
    release, extra = WORLDS[world]
    impl = implementation(release)
    config = HarnessConfig(
        page_size=PAGE, layer_num=2, storage_ranks=2, storage_batch_pages=2, host_pages=5,
        device_pages=16, storage_host_pressure=True, **extra,  # type: ignore[arg-type]
    )  # fmt: skip
    session = Session(impl.refine_config(config), impl, impl.name)
    assert session.config.storage_host_pressure  # not refined away
    hold_three_of_five_host_pages(session)
    rid = apply(session, "prefetch", pick=0).split()[1]
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")
    storage = run_prefetches_to_idle(session)
    for rank in range(2):
        log = storage.log.prefetches[rank][rid]
        # the hit thread agreed on three pages; the tree served the two it had room for
        assert log.published_hit_tokens == 3 * PAGE, log
        assert (log.cut_tokens, log.hash_pages, log.bounce_tokens) == (2 * PAGE, 2, 2 * PAGE)
        assert log.published_progress[-1] == 2 * PAGE
    session.finish()  # the quiescence checks: every bounce page inserted or given back


def test_without_host_pressure_the_same_hit_is_revoked() -> None:
    config = HarnessConfig(
        page_size=PAGE, layer_num=2, storage_ranks=2, storage_batch_pages=2, host_pages=5,
        device_pages=16,
    )  # fmt: skip
    session = Session(config, ReferenceImplementation(), "reference")
    hold_three_of_five_host_pages(session)
    rid = apply(session, "prefetch", pick=0).split()[1]
    apply(session, "storage_step", kind="hit_query")
    apply(session, "drain_prefetch_acks")
    assert session.storage is not None
    log = session.storage.log.prefetches[0][rid]
    assert log.retired and log.bounce_tokens is None and log.cut_tokens is None
    session.finish()


def test_host_pressure_is_a_storage_worlds_field_named_in_its_description() -> None:
    config = HarnessConfig(storage_ranks=1, storage_host_pressure=True)
    assert "+pressure" in config.describe()
    with pytest.raises(ValueError, match="storage_host_pressure is a storage world's"):
        HarnessConfig(storage_host_pressure=True)


@pytest.mark.parametrize("bug", BUGS_0523_HOST_PRESSURE, ids=lambda bug: bug.NAME)
def test_host_pressure_bug_is_one_small_substitution(bug: type[PlantedBug]) -> None:
    check_one_small_substitution(bug, fetch_wheel_tree("0.5.23"))


@pytest.mark.usefixtures("gate_env")
@pytest.mark.parametrize("bug", BUGS_0523_HOST_PRESSURE, ids=lambda bug: bug.NAME)
def test_host_pressure_bug_planted_in_0_5_23_is_caught(
    bug: type[PlantedBug],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_planted_bug_is_caught(bug, fetch_wheel_tree("0.5.23"), tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("pressure", [True, False], ids=["pressure", "no-pressure"])
def test_0_5_14_cuts_a_prefetch_that_does_not_fit_before_its_hit_query(pressure: bool) -> None:
    # 0.5.13 - 0.5.15 allocate a prefetch's pages up front: with three of five host pages held,
    # a three-page prefetch is cut to the two free pages before the hit query, so the keys
    # queried, the hit, the bounce buffer and the progress are two pages on every rank
    impl = SglangImplementation(fetch_wheel_tree("0.5.14"))
    config = HarnessConfig(  # fewer device than host pages: 0.5.14's prefetch capacity is the gap
        page_size=PAGE, layer_num=2, storage_ranks=2, storage_batch_pages=2, host_pages=5,
        device_pages=2, storage_host_pressure=pressure,
    )  # fmt: skip
    session = Session(impl.refine_config(config), impl, impl.name)
    hold_three_of_five_host_pages(session)
    started = apply(session, "prefetch", pick=0)
    if not pressure:  # no room for the whole prefetch: it is not started
        assert started == "refused: host full", started
        session.finish()
        return
    rid = started.split()[1]
    storage = run_prefetches_to_idle(session)
    apply(session, "check_prefetch", request=rid)
    for rank in range(2):
        log = storage.log.prefetches[rank][rid]
        assert (log.published_hit_tokens, log.hash_pages) == (2 * PAGE, 2), log
        assert log.published_progress[-1] == 2 * PAGE, log
    session.finish()
