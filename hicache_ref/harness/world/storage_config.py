"""How a case draws its storage world: ranks, backend, faults, batch size, stop policy, points.

Only an implementation with the ``storage`` capability gets one (about half of its cases);
the fields go into ``HarnessConfig``, so a trace header carries them and a replay rebuilds the
same world. Upstream's ``HiCacheFile`` is drawn only when its wheel tree is already unpacked
(``hicache-fuzz setup`` or an earlier gate fetched it): a draw never reaches the network.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from hicache_ref.harness.adapters.sglang_tree import is_tree, wheel_tree_path
from hicache_ref.harness.world.storage_world import UPSTREAM_FILE_VERSION

STORAGE = "storage"


def storage_backends() -> list[str]:
    backends = ["memory", "memory", "file"]
    if is_tree(wheel_tree_path(UPSTREAM_FILE_VERSION)):
        backends.append("upstream_file")
    return backends


# built once (a strategy built per case is validated per case)
_RANKS = st.sampled_from([0, 0, 0, 1, 2, 3, 4])
_BACKENDS = {
    tuple(backends): st.sampled_from(backends)
    for backends in (["memory", "memory", "file"], ["memory", "memory", "file", "upstream_file"])
}
_FAULTS = st.booleans()
_BATCH_PAGES = st.sampled_from([1, 2, 4])
_POLICIES = st.sampled_from(["best_effort", "wait_complete", "timeout"])
_POINTS = st.booleans()
_PAGE_POINTS = st.booleans()
"""Under schedule points, half the worlds also park the IO before each host page write."""
_POINT_BATCH_PAGES = st.sampled_from([1, 1, 2])
"""Under schedule points batches of one or two pages, so an operation has several and a
termination, reset or detach lands between them (issue 32)."""


@st.composite
def storage_fields(draw: st.DrawFn, capabilities: frozenset[str]) -> dict[str, Any]:
    """``HarnessConfig`` fields of a storage world, or none (no storage tier this case)."""
    if capabilities and STORAGE not in capabilities:
        return {}
    ranks = draw(_RANKS)
    if not ranks:
        return {}
    backend = draw(_BACKENDS[tuple(storage_backends())])
    faults = draw(_FAULTS)
    points = draw(_POINTS)
    fields: dict[str, Any] = {
        "storage_ranks": ranks,
        "storage_backend": backend,
        "storage_faults": faults,
        "storage_batch_pages": draw(_POINT_BATCH_PAGES if points else _BATCH_PAGES),
        "storage_policy": draw(_POLICIES),
        "storage_points": points,
    }
    if points and draw(_PAGE_POINTS):
        fields["storage_page_points"] = True
    return fields


def storage_focus(**fields: Any) -> Any:
    """A mutant's ``refine_config``: a storage world (no CP, no draft, no side pool: a drawn
    side-pool world's pool and window are dropped) in cache host memory, unless ``fields`` ask
    for ``storage_buffer_only`` (a drawn buffer world is kept only there), with ``fields``
    set."""
    from hicache_ref.harness.world.config import HarnessConfig

    def focus(config: HarnessConfig) -> HarnessConfig:
        update: dict[str, object] = {"cp_size": 0, "draft_layer_num": 0, "draft_host_pages": 0}
        update["storage_ranks"] = 2
        update["storage_buffer_only"] = False
        if config.has_side_pools:
            update |= {"pool_group": "none", "side_device_pages": 0, "storage_swa_window": 0}
            update["state_cow"] = False
        return config.model_copy(update={**update, **fields})

    return focus
