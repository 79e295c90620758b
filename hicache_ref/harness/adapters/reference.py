"""Our reference controller as an implementation under test (it supports everything, side
pools and their L3 windows included).

In a world with an independent side pool (``config.has_side_pools``) the draft pools the world
built are that side pool, attached with its own allocator (``attach_side_pool``), not a draft
pair riding along on the anchor's indices. In a storage world with the side pool's window in
L3 (``config.storage_swa_window``) the controller's ``write_storage`` and ``prefetch`` name the
window as the tree names it (``reference_windows.with_window_names``). In a ``buffer_only``
storage world (``config.storage_buffer_only``) the controller is built in that host memory mode
and hands the tree half the beliefs it holds for the tree
(``reference_beliefs.with_tree_beliefs``)."""

from __future__ import annotations

from typing import cast

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.buffer_mode import BUFFER_ONLY, CACHE
from hicache_ref.controller.storage.collectives import Collectives
from hicache_ref.harness.adapters.base import (
    CAPABILITIES,
    HOST_PRESSURE_CAPABILITY,
    SIDE_POOL_CAPABILITY,
    STATE_POOL_CAPABILITY,
    STORAGE_BUFFER_CAPABILITY,
    STORAGE_MAMBA_CAPABILITY,
    STORAGE_SIDECAR_CAPABILITY,
    STORAGE_SWA_CAPABILITY,
    BuildRequest,
)
from hicache_ref.harness.adapters.contract import ImplementationBase
from hicache_ref.harness.adapters.reference_beliefs import with_tree_beliefs
from hicache_ref.harness.adapters.reference_windows import name_windows, with_window_names
from hicache_ref.harness.schedule.reference import gated_executor


class ReferenceImplementation(ImplementationBase):
    """``HiCacheController`` from this package; subclasses swap the class (mutants)."""

    name = "reference"
    # it holds a side pool itself and stores its window (SWA pages, a Mamba state) in L3,
    # stores its draft pair's pages beside the KV's, serves a hit the tree cut to a shorter
    # bounce buffer, and runs in buffer_only host memory
    capabilities = CAPABILITIES | {
        SIDE_POOL_CAPABILITY,
        STATE_POOL_CAPABILITY,
        STORAGE_SIDECAR_CAPABILITY,
        STORAGE_SWA_CAPABILITY,
        STORAGE_MAMBA_CAPABILITY,
        HOST_PRESSURE_CAPABILITY,
        STORAGE_BUFFER_CAPABILITY,
    }
    controller_class: type[HiCacheController] = HiCacheController

    def build_controller(self, request: BuildRequest) -> HiCacheController:
        side = request.side_allocator
        window = request.config.storage_swa_window
        buffer = request.config.storage_buffer_only
        controller_class = self.controller_class
        if window:
            controller_class = with_window_names(controller_class)
        if buffer:
            controller_class = with_tree_beliefs(controller_class)
        controller = controller_class(
            request.allocator,
            request.host_pool,
            request.config.page_size,
            io_backend=request.config.io_backend,
            write_policy="write_through",
            cp_shared_kv_layout=request.cp_layout,
            draft_mem_pool_host=None if side else request.draft_host_pool,
            draft_mem_pool_device=None if side else request.draft_device_pool,
            device_module=request.device_module,
            num_counters=request.config.num_counters,
            # the harness steps the storage threads' loop bodies, or (schedule points) grants
            # the tier's own gated threads one point at a time
            storage_executor=(
                gated_executor(
                    page_points=request.config.storage_page_points,
                    lock_points=request.config.storage_lock_points,
                )
                if request.config.storage_points
                else "manual"
            ),
            storage_collectives=cast(Collectives | None, request.storage_collectives),
            host_memory_mode=BUFFER_ONLY if buffer else CACHE,
        )
        if side is not None:
            assert request.draft_device_pool is not None and request.draft_host_pool is not None
            controller.attach_side_pool(
                request.draft_device_pool,
                request.draft_host_pool,
                side,
                name=request.config.pool_group,  # swa, or mamba (a state pool)
            )
        if window:
            name_windows(controller, window)
        return controller
