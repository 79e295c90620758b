"""The adapter contract: capabilities are detected from the class, per_layer_write is honoured,
and a snapshot reads ack rows from the implementation but pages from the harness's own pools."""

from __future__ import annotations

from typing import Any

import pytest

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.base import (
    CAPABILITIES,
    BuildRequest,
    CpControllerLike,
    PerLayerWriteLike,
    check_declared_capabilities,
    detect_capabilities,
    snapshot_rank,
)
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig

CP_CONFIG = HarnessConfig(
    page_size=2, layer_num=2, pool_kind="nsa", cp_size=2, device_pages=16, host_pages=16
)


class PlainController:
    """The 0.5.10 surface: write/load/evict/reset and the ack queues, no CP, no drafts."""

    def __init__(self, allocator: Any, host_pool: Any, page_size: int) -> None: ...
    def write(self, device_indices: Any, priority: Any = None, node_id: int = -1) -> Any: ...
    def start_writing(self) -> None: ...
    def load(self, host_indices: Any, priority: Any = None, node_id: int = -1) -> Any: ...
    def start_loading(self) -> int: ...
    def evict_device(self, device_indices: Any) -> int: ...
    def evict_host(self, host_indices: Any, backup_only: bool = True) -> int: ...
    def reset(self) -> None: ...


class WithoutPerLayerWrite(ReferenceImplementation):
    """The reference, declared without per_layer_write: CP backups are all-layer writes."""

    name = "reference-without-per-layer-write"
    capabilities = CAPABILITIES - {"storage", "per_layer_write"}


class _AllLayerOnly(HiCacheController):
    """Refuses every per-layer verb, so a test sees the tree never uses one."""

    def submit_write_cp_per_layer(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("per-layer submit used without per_layer_write")

    def submit_write_cp_layer(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("per-layer submit used without per_layer_write")


class AllLayerOnly(WithoutPerLayerWrite):
    controller_class = _AllLayerOnly


# --- capability detection -----------------------------------------------------------------------


def test_a_controller_without_reserve_write_cp_is_detected_as_non_cp() -> None:
    assert detect_capabilities(PlainController) == frozenset()


def test_the_reference_controller_has_every_detectable_capability() -> None:
    assert detect_capabilities(HiCacheController) == {"cp", "draft", "per_layer_write"}


def test_draft_constructor_arguments_count_as_the_draft_capability() -> None:
    class DraftByConstructor(PlainController):
        def __init__(
            self, allocator: Any, host_pool: Any, page_size: int,
            draft_mem_pool_host: Any = None, draft_mem_pool_device: Any = None,
        ) -> None: ...  # fmt: skip

    assert detect_capabilities(DraftByConstructor) == {"draft"}


def test_declaring_cp_for_a_class_without_it_names_the_missing_method() -> None:
    with pytest.raises(HiCacheInputError) as excinfo:
        check_declared_capabilities(frozenset({"cp", "io:direct"}), PlainController, "plain")
    assert str(excinfo.value).startswith(
        "implementation 'plain' declares capability 'cp' but PlainController has no "
        "reserve_write_cp"
    )


def test_an_adapter_overclaiming_per_layer_write_is_refused_when_its_world_is_built() -> None:
    class NoLayerHooks(HiCacheController):
        submit_write_cp_layer = None  # type: ignore[assignment]

    class Overclaiming(ReferenceImplementation):
        controller_class = NoLayerHooks

    with pytest.raises(HiCacheInputError, match="NoLayerHooks has no submit_write_cp_layer"):
        Session(CP_CONFIG, Overclaiming(), "overclaiming")


# --- per_layer_write honoured -------------------------------------------------------------------


def test_without_per_layer_write_cp_backups_are_all_layer_writes() -> None:
    session = Session(CP_CONFIG, AllLayerOnly(), "all-layer-only")
    rank = session.world.ranks[0]
    assert isinstance(rank.cp, CpControllerLike) and rank.per_layer is None
    # prefill with an early reservation -> the reservation is skipped (no per-layer hooks)
    assert session.apply(Step(rule="prefill", args={"tokens": 5, "early_reserve": True})).text == (
        "node 0 (5 tokens)"
    )
    # the per-layer rules are refused, so a trace stays replayable
    assert session.apply(Step(rule="reserve", args={"node": 0})).text == "skipped"
    assert (
        session.apply(Step(rule="layer_end", args={"layer": 0, "draft": False})).text == "skipped"
    )
    session.apply(Step(rule="forward_layer"))
    session.apply(Step(rule="forward_layer"))
    # write -> one all-layer D2H per rank -> the ack drains with the right host bytes
    assert session.apply(Step(rule="write", args={"node": 0})).text.startswith("reserve node 0")
    session.finish()
    assert session.tree.acked_writes == 1


def test_with_per_layer_write_an_early_reservation_is_taken() -> None:
    session = Session(CP_CONFIG, ReferenceImplementation(), "reference")
    assert isinstance(session.world.ranks[0].per_layer, PerLayerWriteLike)
    outcome = session.apply(Step(rule="prefill", args={"tokens": 5, "early_reserve": True}))
    assert outcome.text == "node 0 (5 tokens); reserve node 0 on 2 rank(s)"
    assert outcome.reservation == "made" and not outcome.refused


# --- snapshots ----------------------------------------------------------------------------------


def test_snapshot_reads_ack_rows_and_the_harness_pools() -> None:
    session = Session(CP_CONFIG, ReferenceImplementation(), "reference")
    for step in (
        Step(rule="prefill", args={"tokens": 6}),
        Step(rule="forward_layer"),
        Step(rule="forward_layer"),
        Step(rule="write", args={"node": 0}),
    ):
        session.apply(step)
    node = session.tree.nodes[0]
    for rank in session.world.ranks:
        snap = snapshot_rank(rank, [node.node_id])
        assert [row.node_ids for row in snap.write_acks] == [(node.node_id,)]
        assert snap.device_pages == rank.allocator.allocated_page_ids()
        assert snap.host_pages == rank.host_pool.allocated_pages()
        assert snap.gate_answers == ((node.node_id, True),)
        assert snap.pending_layer_writes == frozenset()  # caught up at once
        assert snap.producer_slots == CP_CONFIG.num_counters


def test_an_implementation_may_supply_its_own_snapshot() -> None:
    calls: list[int] = []

    class SelfReporting(ReferenceImplementation):
        def snapshot(self, rank: Any, gate_ids: Any) -> Any:
            calls.append(rank.rank)
            return snapshot_rank(rank, gate_ids)

    session = Session(HarnessConfig(), SelfReporting(), "reference")
    session.apply(Step(rule="noop"))
    assert calls == [0]


def test_build_request_carries_the_harness_pools() -> None:
    seen: list[BuildRequest] = []

    class Recording(ReferenceImplementation):
        def build_controller(self, request: BuildRequest) -> HiCacheController:
            seen.append(request)
            return super().build_controller(request)

    session = Session(CP_CONFIG, Recording(), "reference")
    assert [r.allocator for r in seen] == [rank.allocator for rank in session.world.ranks]
