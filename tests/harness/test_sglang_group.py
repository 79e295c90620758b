"""0.5.19+'s ``HybridCacheController`` over the harness's pools grouped as a ``HostPoolGroup``.

The group is upstream's own class; its entries hold this project's pools (``sglang_group.py``),
so the same session checks every byte. The stories: each grouping round-trips on 0.5.23; a
packed draft or a sidecar that is not transferred is caught (so both are really exercised);
a packed MTP chain deeper than the target loads fully on 0.5.22+ and not on 0.5.19 - 0.5.21.
"""

from __future__ import annotations

import pytest

from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters import sglang_group
from hicache_ref.harness.adapters.base import GROUP_CAPABILITIES
from hicache_ref.harness.adapters.sglang import SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
from hicache_ref.harness.lockstep.oracle import attach_lockstep
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig, PoolGroup


@pytest.fixture(scope="module")
def upstream_0523() -> SglangImplementation:
    return SglangImplementation(fetch_wheel_tree("0.5.23"))


def round_trip(impl: SglangImplementation, group: PoolGroup, draft_layers: int) -> str:
    """write -> ack -> evict -> load -> reads of every draft layer and the target, then the
    quiescence checks; returns the last outcome (raises on any broken invariant)."""
    config = HarnessConfig(page_size=4, layer_num=2, draft_layer_num=draft_layers, pool_group=group)
    session = Session(impl.refine_config(config), impl, "sglang")
    attach_lockstep(session)
    steps = [
        Step(rule="prefill", args={"tokens": 8}),
        *[Step(rule="forward_layer") for _ in range(max(2, draft_layers))],
        Step(rule="write", args={"node": 0}),
        Step(rule="synchronize", args={"stream": "write"}),
        Step(rule="drain_acks"),
        Step(rule="evict_device", args={"node": 0}),
        Step(rule="load", args={"node": 0}),
        Step(rule="start_loading"),
        *[
            Step(rule="forward_read", args={"node": 0, "layer": layer, "draft": True})
            for layer in range(draft_layers)
        ],
        Step(rule="forward_read", args={"node": 0, "layer": 1, "draft": False}),
    ]
    outcomes = [session.apply(step) for step in steps]
    session.finish()
    return outcomes[-1].text


def test_0523_declares_the_groupings_and_the_reference_only_side_pools(
    upstream_0523: SglangImplementation,
) -> None:
    from hicache_ref.harness.adapters.reference import ReferenceImplementation

    assert GROUP_CAPABILITIES <= upstream_0523.capabilities
    # the reference holds its independent side pools (SWA, Mamba) itself, never a HostPoolGroup
    assert GROUP_CAPABILITIES & ReferenceImplementation.capabilities == {
        "pool_group:swa",
        "pool_group:mamba",
    }


@pytest.mark.parametrize(
    ("group", "draft_layers"),
    [("anchor", 0), ("packed", 1), ("packed", 3), ("sidecar", 1), ("sidecar", 3)],
)
def test_every_grouping_round_trips_on_0523(
    upstream_0523: SglangImplementation, group: PoolGroup, draft_layers: int
) -> None:
    assert round_trip(upstream_0523, group, draft_layers).startswith("read layer 1")


def test_a_packed_draft_that_is_never_loaded_is_caught(
    upstream_0523: SglangImplementation, monkeypatch: pytest.MonkeyPatch
) -> None:
    # drop every is_draft H2D -> the draft read sees untouched rows (INV-11)
    shim = sglang_group.PackedHostPoolShim
    load = shim.load_to_device_per_layer

    def skip_drafts(self: object, device_pool: object, *args: object, **kw: object) -> None:
        if not isinstance(device_pool, sglang_group.DraftLayerView):
            load(self, device_pool, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(shim, "load_to_device_per_layer", skip_drafts)
    with pytest.raises(
        InvariantViolation, match=r"INV-11 violated: forward read of node 0 draft layer 0"
    ):
        round_trip(upstream_0523, "packed", 1)


def test_a_sidecar_the_tree_does_not_name_is_caught(
    upstream_0523: SglangImplementation, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no extra_pools on write/load -> the draft side pool is never backed up (INV-09)
    monkeypatch.setattr(sglang_group, "_name_sidecar_on_every_transfer", lambda *args: None)
    with pytest.raises(
        InvariantViolation, match=r"INV-09 violated: write ack drained: host copy of node 0 draft"
    ):
        round_trip(upstream_0523, "sidecar", 1)


@pytest.mark.parametrize(("release", "complete"), [("0.5.21", False), ("0.5.22", True)])
def test_a_packed_mtp_chain_deeper_than_the_target_loads_fully_from_0522(
    release: str, complete: bool
) -> None:
    # three packed drafts over two target layers: 0.5.21 never loads depth 2 (F21)
    impl = SglangImplementation(fetch_wheel_tree(release))
    if complete:
        assert round_trip(impl, "packed", 3).startswith("read layer 1")
    else:
        with pytest.raises(
            InvariantViolation, match=r"INV-11 violated: forward read of node 0 draft layer 2"
        ):
            round_trip(impl, "packed", 3)


def test_a_grouped_config_is_drawn_without_cp() -> None:
    with pytest.raises(ValueError, match="without CP"):
        HarnessConfig(pool_kind="nsa", cp_size=2, draft_layer_num=1, pool_group="packed")
    with pytest.raises(ValueError, match="carries a draft pool"):
        HarnessConfig(pool_group="sidecar")
