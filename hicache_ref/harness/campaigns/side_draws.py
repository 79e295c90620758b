"""The side of a drawn world past its pools' kinds: side pools, stored windows, storage
sidecars and buffer mode (``machine.harness_configs`` calls them after every other draw, each
drawn last so no other world's draws move).

In the order a configuration meets them:

- ``side_pool_fields``: half the single-pool worlds gain an independent side pool (``side_pool``:
  SWA, or half of them a Mamba state pool, with its window in L3 where stored);
- ``storage_sidecar_fields``: half the storage worlds of an implementation that stores a draft
  pool gain one;
- ``stored_side_pool_fields``: half the reference's storage worlds without a draft sidecar gain a
  side pool whose window its tier stores;
- ``buffer_world``: a storage world over the KV pool alone runs in ``buffer_only`` host memory
  where the implementation has it (upstream's every one, the reference's half).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hypothesis import strategies as st

from hicache_ref.harness.adapters.base import (
    HOST_PRESSURE_CAPABILITY,
    STATE_POOL_CAPABILITY,
    STORAGE_BUFFER_CAPABILITY,
    STORAGE_MAMBA_CAPABILITY,
    STORAGE_SIDECAR_CAPABILITY,
    STORAGE_SWA_CAPABILITY,
)
from hicache_ref.harness.rules.record import integers_once
from hicache_ref.harness.world.config import SIDE_POOL_GROUPS

_BOOLS = st.booleans()
_SWA_POLICIES = st.sampled_from(["best_effort", "wait_complete", "wait_complete", "timeout"])


def side_pool_fields(
    draw: st.DrawFn, capabilities: frozenset[str], fields: dict[str, Any]
) -> dict[str, Any]:
    """Half the single-pool worlds gain an independent side pool (``pool_group="swa"``, or,
    where the implementation holds one, half of them a Mamba state pool, ``"mamba"``): its
    layers, its own device pages and host pages (state slots), often scarce (drawn after every
    other field, so no other world's draws move). Upstream's come from the anchor-only worlds
    of its ``HostPoolGroup``; an implementation that holds side pools without a group (the
    reference) takes them from the worlds without CP, draft pool or storage here, and from its
    storage worlds last (``stored_side_pool_fields``). A side-pool world keeps its storage tier
    where the implementation stores the side pool's window (``storage:swa``: its window is drawn
    last) or a Mamba node's state page (``storage:mamba``: a window of one page); elsewhere it
    has none."""
    if "pool_group:swa" not in capabilities:
        return {}
    if "pool_group" in capabilities:
        eligible = fields["pool_group"] == "anchor"
    else:
        eligible = not (fields["cp_size"] or fields["draft_layer_num"] or "storage_ranks" in fields)
    if not eligible or not draw(_BOOLS):
        return {}
    return side_pool(draw, capabilities, fields)


def side_pool(
    draw: st.DrawFn, capabilities: frozenset[str], fields: dict[str, Any]
) -> dict[str, Any]:
    """The fields of a side pool (SWA, or half of them a Mamba state pool), its window in L3
    where the world has storage and the implementation stores it."""
    side = {
        "pool_group": SIDE_POOL_GROUPS[0],
        "draft_layer_num": draw(integers_once(1, 3)),
        "side_device_pages": draw(integers_once(2, 24)),
        "draft_host_pages": draw(integers_once(1, 24)),
        "storage_ranks": 0,
    }
    if fields.get("storage_ranks") and STORAGE_SWA_CAPABILITY in capabilities:
        side["storage_ranks"] = fields["storage_ranks"]
        side["storage_swa_window"] = draw(integers_once(1, 3))
        # mostly waiting for the window's read: a best-effort check terminates it before
        side["storage_policy"] = draw(_SWA_POLICIES)
    if STATE_POOL_CAPABILITY in capabilities and draw(_BOOLS):
        # half the side-pool worlds hold a Mamba state pool instead: the same sizes, counted
        # in state slots (one per node); its storage tier kept where the implementation stores
        # a node's state in L3 (``storage:mamba``: a window of one page), else none; drawn
        # last, so no other world's draws move
        side.update(pool_group="mamba")
        if not (side.get("storage_ranks") and STORAGE_MAMBA_CAPABILITY in capabilities):
            side.update(storage_ranks=0, storage_swa_window=0)
        else:
            side["storage_swa_window"] = 1
        side["state_cow"] = draw(_BOOLS)  # half: loads copy the state into a request's slot
    return side


def stored_side_pool_fields(
    draw: st.DrawFn, capabilities: frozenset[str], fields: dict[str, Any]
) -> dict[str, Any]:
    """An implementation that holds side pools without a group and stores their windows (the
    reference, ``storage:swa``): half its storage worlds without a draft sidecar gain a side
    pool with its window in L3 (or, half of those, a Mamba state pool's page), under host
    pressure as upstream's are; drawn last, so no other world's draws move."""
    if "pool_group" in capabilities or "pool_group:swa" not in capabilities:
        return {}
    if STORAGE_SWA_CAPABILITY not in capabilities or not fields.get("storage_ranks"):
        return {}
    if fields["cp_size"] or fields["draft_layer_num"] or not draw(_BOOLS):
        return {}
    side = side_pool(draw, capabilities, fields)
    if side.get("storage_swa_window") and HOST_PRESSURE_CAPABILITY in capabilities:
        side["storage_host_pressure"] = True  # the cut _sync_trailing_keys re-aligns to
    return side


def storage_sidecar_fields(
    draw: st.DrawFn, capabilities: frozenset[str], fields: dict[str, Any]
) -> dict[str, Any]:
    """Half the storage worlds of an implementation that stores a draft pool
    (``storage:sidecar``) gain one: its layers (drawn last, so no other world's draws move).
    Upstream's rides in its ``HostPoolGroup`` as the ``DRAFT`` sidecar (``pool_group=
    "sidecar"``); the reference's is a draft pair."""
    if not fields.get("storage_ranks") or STORAGE_SIDECAR_CAPABILITY not in capabilities:
        return {}
    if fields["pool_group"] != "none" or not draw(_BOOLS):
        return {}
    grouped = "pool_group:sidecar" in capabilities
    return {
        "draft_layer_num": draw(integers_once(1, 3)),
        "pool_group": "sidecar" if grouped else "none",
    }


def buffer_world(capabilities: frozenset[str], fields: Mapping[str, Any]) -> bool:
    """A storage world over the KV pool alone (not PP) runs in ``buffer_only`` host memory
    where the implementation has it (``storage:buffer_only``): upstream's every one over its
    group's KV pool (``pool_group="anchor"``; its cache mode is refined away,
    ``SglangImplementation.refine_config``), an implementation without pool groups (the
    reference) half of those with no draft or side pool (``pool_group="none"``), by the seed's
    second bit. No draw, so no other world's draws move."""
    if STORAGE_BUFFER_CAPABILITY not in capabilities or not fields.get("storage_ranks"):
        return False
    if fields.get("storage_pp"):
        return False
    if fields.get("pool_group") == "anchor":
        return True
    kv_alone = fields.get("pool_group") == "none" and not fields.get("draft_layer_num")
    return kv_alone and "pool_group" not in capabilities and bool(int(fields["seed"]) & 2)
