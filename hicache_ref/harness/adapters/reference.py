"""Our reference controller as an implementation under test (it supports everything)."""

from __future__ import annotations

from typing import cast

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.storage.collectives import Collectives
from hicache_ref.harness.adapters.base import CAPABILITIES, BuildRequest
from hicache_ref.harness.adapters.contract import ImplementationBase
from hicache_ref.harness.schedule.reference import gated_executor


class ReferenceImplementation(ImplementationBase):
    """``HiCacheController`` from this package; subclasses swap the class (mutants)."""

    name = "reference"
    capabilities = CAPABILITIES
    controller_class: type[HiCacheController] = HiCacheController

    def build_controller(self, request: BuildRequest) -> HiCacheController:
        return self.controller_class(
            request.allocator,
            request.host_pool,
            request.config.page_size,
            io_backend=request.config.io_backend,
            write_policy="write_through",
            cp_shared_kv_layout=request.cp_layout,
            draft_mem_pool_host=request.draft_host_pool,
            draft_mem_pool_device=request.draft_device_pool,
            device_module=request.device_module,
            num_counters=request.config.num_counters,
            # the harness steps the storage threads' loop bodies, or (schedule points) grants
            # the tier's own gated threads one point at a time
            storage_executor=gated_executor() if request.config.storage_points else "manual",
            storage_collectives=cast(Collectives | None, request.storage_collectives),
        )
