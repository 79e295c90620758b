"""Per-pool geometry of independent side pools: an SWA pool counts a row per token at the
anchor's page size, a Mamba state pool one state slot per node, in pages of one slot.

The harness's own model of a state slot's bytes (``side_pools.state_bytes_per_slot``) is what
the world's state pools hold; a node's placement, host positions and held pages in a state
pool are its one slot, so two nodes whose slots are neighbours hold different pages (at the
anchor's page size they would share one, and INV-05 would call that a double owner).
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.driver.node_model import compute_holdings
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.side_pools import (
    MAMBA_STATE_DIM,
    MAMBA_STATE_HEADS,
    state_bytes_per_slot,
)
from hicache_ref.harness.world.world import MHA_HEAD_DIM, MHA_HEADS

PAGE = 4


def config(group: str, **fields: object) -> HarnessConfig:
    base: dict[str, object] = {
        "page_size": PAGE,
        "layer_num": 2,
        "draft_layer_num": 3,
        "pool_group": group,
        "side_device_pages": 5,
        "draft_host_pages": 6,
    }
    return HarnessConfig.model_validate({**base, **fields})


def test_a_state_pool_pages_by_single_slots_and_holds_one_per_node() -> None:
    mamba, swa = config("mamba"), config("swa")
    assert mamba.side_page_size == 1 and swa.side_page_size == PAGE
    assert [mamba.side_rows(n) for n in (1, 4, 9)] == [1, 1, 1]
    assert [swa.side_rows(n) for n in (1, 4, 9)] == [1, 4, 9]
    assert "side=5slot/6hslot" in mamba.describe() and "side=5p/6hp" in swa.describe()


def test_a_state_pool_s_storage_world_stores_a_window_of_one_page() -> None:
    # one state per node, stored under the node's last page key: the window is one page
    stored = config("mamba", storage_ranks=1, storage_swa_window=1)
    assert stored.uses_storage and "+state" in stored.describe()
    with pytest.raises(ValidationError, match="trailing window is one page"):
        config("mamba", storage_ranks=1, storage_swa_window=2)
    with pytest.raises(ValidationError, match="storage_swa_window"):
        config("mamba", storage_ranks=1)  # a storage world names its window


def test_the_state_pool_holds_the_bytes_the_harness_models_per_slot() -> None:
    cfg = config("mamba")
    rank = Session(cfg, ReferenceImplementation(), "reference").world.ranks[0]
    device, host, allocator = rank.draft_device_pool, rank.draft_host_pool, rank.side_allocator
    assert device is not None and host is not None and allocator is not None
    assert device.page_size == host.page_size == allocator.page_size == 1
    assert host.num_pages == cfg.draft_host_pages  # host slots, one page each
    assert len(allocator.free_page_ids()) == cfg.side_device_pages  # device slots
    per_slot = state_bytes_per_slot(cfg)
    assert per_slot == 3 * 2 * MAMBA_STATE_HEADS * MAMBA_STATE_DIM * 8  # layers, conv+temporal
    assert host.size_per_token == per_slot
    # a state slot's row is not a token's: a slot read as a KV row cannot pass
    assert (MAMBA_STATE_HEADS, MAMBA_STATE_DIM) != (MHA_HEADS, MHA_HEAD_DIM)


def test_a_node_holds_one_state_slot_placed_and_backed_up_at_position_zero() -> None:
    session = Session(config("mamba"), ReferenceImplementation(), "reference")
    for rule, args in (("prefill", {"tokens": 8}), ("prefill", {"tokens": 4})):
        session.apply(Step(rule=rule, args=args))  # type: ignore[arg-type]
    first, second = session.tree.nodes[0], session.tree.nodes[1]
    assert first.side_value is not None and second.side_value is not None
    assert first.side_value.numel() == second.side_value.numel() == 1
    positions, locs = session.tree.geometry.placement(0, first, draft=True)
    assert positions.tolist() == [0] and locs.tolist() == first.side_value.tolist()
    # neighbouring slots are different pages of the state pool
    slots = {int(first.side_value[0]), int(second.side_value[0])}
    held = [compute_holdings(n, PAGE, 1, False, 1).side_device_pages for n in (first, second)]
    assert held[0] | held[1] == slots and not held[0] & held[1]
    for rule in ("forward_layer", "forward_layer", "forward_layer"):
        session.apply(Step(rule=rule, args={}))
    session.apply(Step(rule="write", args={"node": 0}))
    host_positions, host_slots = session.tree.geometry.host_positions(0, first, draft=True)
    assert host_positions.tolist() == [0] and host_slots.numel() == 1
    assert first.side_host[0] is not None and torch.equal(host_slots, first.side_host[0])
    session.finish()
