"""Planted bugs in upstream's controller: what the gate must catch in code nobody here wrote.

Each bug is one literal substitution in a copy of sglang 0.5.10's (``BUGS``) or 0.5.23's
(``BUGS_0523``) ``sglang/srt/managers/cache_controller.py``, or of another file of the tree a
bug names as its ``TARGET`` (the old snippet must occur exactly once). Only the few lines needed to find and change a line live here, never upstream's code. A test builds the
patched tree at run time (``sglang_tree.fork_tree``), gates it and replays the minimized trace.

Per bug: ``NAME``, ``TARGET`` (the file, relative to the tree; default the controller),
``BUG_CLASS`` (stream order, acks, slot lifetime, index permutation, layer
events, merging), ``DESCRIPTION`` (one line), ``OLD`` -> ``NEW``, ``INVARIANTS`` (the harness
check ids that must fire), ``STREAM_ORDER`` (the bug is a missing happens-before between
streams: the GPU issue re-runs these on a real device with timing perturbation), and
``EXPECTED_UNCAUGHT`` (a reason, when the harness is known to miss the bug; such a bug is kept
but left out of the must-catch assertion).
"""

from __future__ import annotations

from pathlib import Path

CONTROLLER = "sglang/srt/managers/cache_controller.py"


class PlantedBug:
    """One substitution in a file of upstream's tree, and the invariants that must catch it."""

    NAME = ""
    TARGET = CONTROLLER
    BUG_CLASS = ""
    DESCRIPTION = ""
    OLD = ""
    NEW = ""
    INVARIANTS: tuple[str, ...] = ()
    STREAM_ORDER = False
    EXPECTED_UNCAUGHT = ""

    @classmethod
    def apply(cls, source: str) -> str:
        """``source`` with the bug planted; the old snippet must occur exactly once."""
        count = source.count(cls.OLD)
        # Verify the snippet locates one line (a new upstream version may move or repeat it)
        assert count == 1, f"{cls.NAME}: the old snippet occurs {count} times, expected once"
        return source.replace(cls.OLD, cls.NEW)

    @classmethod
    def write_patched(cls, target: Path, into: Path) -> Path:
        """Write the patched copy of ``target`` (the tree's ``TARGET``) to ``into``; return it."""
        into.write_text(cls.apply(target.read_text()))
        return into


# -- stream order ----------------------------------------------------------------------------
class WriteSkipsStartWait(PlantedBug):
    NAME = "write_skips_start_wait"
    BUG_CLASS = "stream order"
    DESCRIPTION = "the D2H copy no longer waits for the forward stream's start event"
    OLD = "            start_event.wait(self.write_stream)\n"
    NEW = "            pass  # BUG: no start_event.wait\n"
    INVARIANTS = (
        "INV-09",
        "INV-06",
        "INV-12",
    )  # INV-12: the lockstep oracle sees the copy pass its fence
    STREAM_ORDER = True


class WriteStartRecordedOnWriteStream(PlantedBug):
    NAME = "write_start_recorded_on_write_stream"
    BUG_CLASS = "stream order"
    DESCRIPTION = "the write's start event is recorded on the write stream, so its wait is empty"
    OLD = "        start_event.record()\n        with device_module.stream(self.write_stream):\n"
    NEW = (
        "        with device_module.stream(self.write_stream):\n"
        "            start_event.record()  # BUG: on the write stream, not the forward\n"
    )
    INVARIANTS = (
        "INV-09",
        "INV-06",
        "INV-12",
    )  # INV-12: the lockstep oracle sees the copy pass its fence
    STREAM_ORDER = True


class LoadSkipsStartWait(PlantedBug):
    NAME = "load_skips_start_wait"
    BUG_CLASS = "stream order"
    DESCRIPTION = "the H2D copy no longer waits for the forward stream's start event"
    OLD = "            producer_event.start_event.wait(self.load_stream)\n"
    NEW = "            pass  # BUG: no start_event.wait\n"
    INVARIANTS = ("INV-09", "INV-06", "INV-11")
    STREAM_ORDER = True


# -- acks ------------------------------------------------------------------------------------
class WriteAckAppendedTwice(PlantedBug):
    NAME = "write_ack_appended_twice"
    BUG_CLASS = "acks"
    DESCRIPTION = "start_writing appends its write ack twice"
    OLD = (
        "        self.ack_write_queue.append(HiCacheAck(start_event, finish_event, op.node_ids))\n"
    )
    NEW = OLD + OLD
    INVARIANTS = ("INV-02",)


class MergeKeepsFirstNodeIds(PlantedBug):
    NAME = "merge_keeps_first_node_ids"
    BUG_CLASS = "acks"
    DESCRIPTION = "merge_ops keeps only the first op's node ids: merged loads never ack the rest"
    OLD = "            node_ids.extend(op.node_ids)\n"
    NEW = "            node_ids.extend(ops[0].node_ids if op is ops[0] else [])\n"
    INVARIANTS = ("INV-16", "INV-10")  # never acked, or its producer slot handed out again


# -- slot lifetime ---------------------------------------------------------------------------
class WriteFreesHostSlots(PlantedBug):
    NAME = "write_frees_host_slots"
    BUG_CLASS = "slot lifetime"
    DESCRIPTION = "write() frees the host slots it hands out right after queueing the copy"
    OLD = "        self.start_writing()\n        return host_indices\n"
    NEW = (
        "        self.start_writing()\n"
        "        self.mem_pool_host.free(host_indices)  # BUG: a staging-buffer mix-up\n"
        "        return host_indices\n"
    )
    INVARIANTS = ("INV-05",)


class EvictHostFreesFirstPage(PlantedBug):
    NAME = "evict_host_frees_first_page"
    BUG_CLASS = "slot lifetime"
    DESCRIPTION = "evict_host frees only the first page of the node's host slots (a leak)"
    OLD = "        self.mem_pool_host.free(host_indices)\n        return len(host_indices)\n"
    NEW = (
        "        self.mem_pool_host.free(host_indices[: self.page_size])  # BUG\n"
        "        return len(host_indices)\n"
    )
    INVARIANTS = ("INV-05",)


# -- index permutation -----------------------------------------------------------------------
class MoveIndicesSortsHostOnly(PlantedBug):
    NAME = "move_indices_sorts_host_only"
    BUG_CLASS = "index permutation"
    DESCRIPTION = "direct/layer_first sorts the host indices but not the device indices alike"
    OLD = "                return host_indices, device_indices.index_select(0, idx)\n"
    NEW = "                return host_indices, device_indices  # BUG: not permuted by idx\n"
    INVARIANTS = ("INV-09", "INV-06", "INV-11")


# -- layer events ----------------------------------------------------------------------------
class FinishEventFromFirstLayer(PlantedBug):
    NAME = "finish_event_from_first_layer"
    BUG_CLASS = "layer events"
    DESCRIPTION = "a load's finish event is the first layer's, so it acks before the last lands"
    OLD = "        return self.load_events[-1]\n"
    NEW = "        return self.load_events[0]  # BUG: the first layer, not the last\n"
    INVARIANTS = ("INV-09", "INV-11")


class LayerEventOffByOne(PlantedBug):
    NAME = "layer_event_off_by_one"
    BUG_CLASS = "layer events"
    DESCRIPTION = "complete(i) records layer i+1's event: layer 0's event is never recorded"
    OLD = "        self.load_events[layer_index].record()\n"
    NEW = "        self.load_events[min(layer_index + 1, self._num_layers - 1)].record()  # BUG\n"
    INVARIANTS = ("INV-11",)


# -- merging ---------------------------------------------------------------------------------
class MergeReversesHostOrder(PlantedBug):
    NAME = "merge_reverses_host_order"
    BUG_CLASS = "merging"
    DESCRIPTION = "merge_ops concatenates host indices in reverse op order, device in op order"
    OLD = "        host_indices = torch.cat([op.host_indices for op in ops])\n"
    NEW = "        host_indices = torch.cat([op.host_indices for op in reversed(ops)])  # BUG\n"
    INVARIANTS = ("INV-09", "INV-06", "INV-11")


BUGS: tuple[type[PlantedBug], ...] = (
    WriteSkipsStartWait,
    WriteStartRecordedOnWriteStream,
    LoadSkipsStartWait,
    WriteAckAppendedTwice,
    MergeKeepsFirstNodeIds,
    WriteFreesHostSlots,
    EvictHostFreesFirstPage,
    MoveIndicesSortsHostOnly,
    FinishEventFromFirstLayer,
    LayerEventOffByOne,
    MergeReversesHostOrder,
)
BUGS_BY_NAME = {bug.NAME: bug for bug in BUGS}


# -- 0.5.23's fence streams (the forward on its own stream) ------------------------------------
class WriteFenceDropped(PlantedBug):
    NAME = "write_fence_dropped"
    BUG_CLASS = "stream order"
    DESCRIPTION = "the D2H no longer waits for write_fence_stream (the forward's own stream)"
    OLD = (
        "self.l2_transfer_engine.device_to_host_stream.wait_stream(\n"
        "                self.write_fence_stream\n            )"
    )
    NEW = "pass  # BUG: no write fence"
    INVARIANTS = ("INV-12", "INV-09", "INV-06")
    STREAM_ORDER = True


class LoadFenceDropped(PlantedBug):
    NAME = "load_fence_dropped"
    BUG_CLASS = "stream order"
    DESCRIPTION = "the H2D no longer waits for load_fence_stream: reused pages race the forward"
    OLD = (
        "self.l2_transfer_engine.host_to_device_stream.wait_stream(\n"
        "                self.load_fence_stream\n            )"
    )
    NEW = "pass  # BUG: no load fence"
    INVARIANTS = ("INV-08", "INV-09", "INV-11", "INV-06")  # INV-08: the lockstep oracle sees
    # the H2D land in pages the forward is still writing
    STREAM_ORDER = True


BUGS_0523: tuple[type[PlantedBug], ...] = (WriteFenceDropped, LoadFenceDropped)
"""Planted in 0.5.23's controller: caught only when the forward runs on its own stream."""


# -- 0.5.23's storage tier: caught in the storage world ------------------------------------------
class BackupIgnoresFailedBatch(PlantedBug):
    NAME = "backup_ignores_failed_batch"
    BUG_CLASS = "storage acks"
    DESCRIPTION = "a backup batch the backend refused is counted as stored (sglang#39701)"
    OLD = "            if not success:\n                logger.warning(\n"
    NEW = "            if False:  # BUG: a failed batch is acked as stored\n                logger.warning(\n"
    INVARIANTS = ("INV-26", "INV-30", "INV-31")


class BackupAckDroppedOnFailure(PlantedBug):
    NAME = "backup_ack_dropped_on_failure"
    BUG_CLASS = "storage acks"
    DESCRIPTION = "a backup that stored nothing is never acked, so its host lock leaks (#38427)"
    OLD = "                    self._page_backup_or_log(operation)\n                self.ack_backup_queue.put(operation)\n"
    NEW = (
        "                    self._page_backup_or_log(operation)\n"
        "                if operation.completed_tokens:  # BUG: no ack for a failed backup\n"
        "                    self.ack_backup_queue.put(operation)\n"
    )
    # INV-24 too: an MLA rank that skips the backup stores nothing and never acks, so the tree
    # (which drains every rank's acks by their MIN) leaves rank 0's ack queued past a reset
    INVARIANTS = ("INV-25", "INV-24")


class PrefetchIoStopsAcking(PlantedBug):
    NAME = "prefetch_io_stops_acking"
    BUG_CLASS = "storage collectives"
    DESCRIPTION = (
        "the IO thread stops acking at a rank's first short batch, so ranks issue different "
        "numbers of completion reductions (sglang#30760)"
    )
    OLD = "                if hit_pages != len(batch_hashes):\n                    all_success = False\n"
    NEW = (
        "                if hit_pages != len(batch_hashes):\n"
        "                    break  # BUG: no ack for this and later batches on this rank\n"
    )
    INVARIANTS = ("INV-20", "INV-25", "INV-21")  # INV-21: under schedule points the tree drains
    # the acks the ranks did publish, and they differ before a collective is missed


# -- 0.5.23's storage tier: prefetch progress, verdicts, bounce ownership, reset (INV-21..24) -----
class PrefetchIoSetsLocalProgress(PlantedBug):
    NAME = "prefetch_io_sets_local_progress"
    BUG_CLASS = "storage rank progress"
    DESCRIPTION = (
        "the IO thread writes its rank-local progress onto the operation, so the tree inserts "
        "and frees bounce pages by it, not by the MIN over ranks (sglang#27010, plan #22607)"
    )
    OLD = "                completed_pages += hit_pages\n"
    NEW = OLD + (
        "                operation.completed_tokens = completed_pages * self.page_size  # BUG\n"
    )
    INVARIANTS = ("INV-23", "INV-22", "INV-19")  # INV-19: the split leaks [published:own)


class AckPublishesRankProgress(PlantedBug):
    NAME = "ack_publishes_rank_progress"
    BUG_CLASS = "storage rank progress"
    DESCRIPTION = (
        "the sync thread reduces the ack's completed tokens over the ranks but publishes the "
        "rank's own count, so ranks insert different prefixes (sglang#27010 through the ack)"
    )
    OLD = "            ack.completed_tokens = completed_tokens_tensor.item()\n"
    NEW = "            pass  # BUG: the MIN is computed and dropped\n"
    INVARIANTS = ("INV-21",)


class BounceAllocatedBeforeHit(PlantedBug):
    NAME = "bounce_allocated_before_hit"
    BUG_CLASS = "storage verdicts"
    DESCRIPTION = (
        "prefetch() allocates the hit-sized bounce before the hit query (0 tokens), so the "
        "tree's verdict, guarded by host_indices, counts 0 == 0 as complete (sglang#9397)"
    )
    OLD = "        self.prefetch_queue.put(operation)\n        return operation\n"
    NEW = (
        "        operation.host_indices = self.mem_pool_host.alloc(operation.storage_hit_count)  # BUG\n"
        + OLD
    )
    INVARIANTS = ("INV-22",)


class TerminateReleasesIoPages(PlantedBug):
    NAME = "terminate_releases_io_pages"
    BUG_CLASS = "storage bounce ownership"
    DESCRIPTION = (
        "terminate_prefetch releases the bounce tail at once, while the IO thread may still "
        "write it and the tree releases it again (sglang#27550, #31668)"
    )
    OLD = "        operation.mark_terminate()\n        return operation.completed_tokens"
    NEW = (
        "        operation.mark_terminate()\n"
        "        if operation.host_indices is not None:  # BUG: the IO still owns the tail\n"
        "            self.append_host_mem_release(operation.host_indices[operation.completed_tokens :])\n"
        "        return operation.completed_tokens"
    )
    INVARIANTS = ("INV-23", "INV-19", "INV-05")


class ResetKeepsReleaseQueueAndOccupancy(PlantedBug):
    NAME = "reset_keeps_release_queue_and_occupancy"
    BUG_CLASS = "storage epochs"
    DESCRIPTION = (
        "reset() no longer clears host_mem_release_queue nor zeroes prefetch_tokens_occupied, "
        "as before sglang#26009: old releases and occupancy outlive the reset"
    )
    OLD = "            self.host_mem_release_queue.queue.clear()\n            self.prefetch_tokens_occupied = 0\n"
    NEW = "            pass  # BUG: the release queue and the occupancy survive reset\n"
    INVARIANTS = ("INV-24",)


BUGS_0523_STORAGE: tuple[type[PlantedBug], ...] = (
    BackupIgnoresFailedBatch,
    BackupAckDroppedOnFailure,
    PrefetchIoStopsAcking,
    # prefetch progress, verdicts, bounce ownership, reset (INV-21..24)
    PrefetchIoSetsLocalProgress,
    AckPublishesRankProgress,
    BounceAllocatedBeforeHit,
    TerminateReleasesIoPages,
    ResetKeepsReleaseQueueAndOccupancy,
)
"""Planted in 0.5.23's storage threads: caught once the gate drives upstream's storage tier."""


# -- 0.5.10's prefetch threads: caught once the gate drives 0.5.10's prefetch protocol -----------
class TerminateDoesNotMark(PlantedBug):
    NAME = "terminate_does_not_mark"
    BUG_CLASS = "storage progress"
    DESCRIPTION = (
        "terminate_prefetch returns the progress without marking the operation, so its IO goes "
        "on counting pages after the tree settled it (bug class 13)"
    )
    OLD = "        operation.mark_terminate()\n        return operation.completed_tokens, operation.hash_value\n"
    NEW = "        return operation.completed_tokens, operation.hash_value  # BUG: never marked\n"
    INVARIANTS = ("INV-19",)


class IncrementBeforePageSet(PlantedBug):
    NAME = "increment_before_page_set"
    BUG_CLASS = "storage windows"
    DESCRIPTION = (
        "the generic page get counts a page before it sets the page's bytes, so a termination "
        "between the two hands the tree a page still to be written (sglang#8901)"
    )
    OLD = (
        "            self.mem_pool_host.set_from_flat_data_page(\n"
        "                host_indices[i * self.page_size],\n"
        "                page_data[i],\n"
        "            )\n"
        "            if not operation.increment(self.page_size):\n"
    )
    NEW = (
        "            counted = operation.increment(self.page_size)  # BUG: before the bytes\n"
        "            self.mem_pool_host.set_from_flat_data_page(host_indices[i * self.page_size], "
        "page_data[i])\n"
        "            if not counted:\n"
    )
    INVARIANTS = ("INV-19",)


BUGS_0510_STORAGE: tuple[type[PlantedBug], ...] = (TerminateDoesNotMark, IncrementBeforePageSet)
"""Planted in 0.5.10's prefetch threads: caught once the gate drives its polling protocol."""


# -- 0.5.23's storage keys, namespaces and hit endpoints (issue 17): one per bug class ----------
class KeysRestartTheChain(PlantedBug):
    NAME = "keys_restart_the_chain"
    TARGET = "sglang/srt/mem_cache/utils.py"
    BUG_CLASS = "storage keys"
    DESCRIPTION = (
        "a node's page keys ignore the parent's last hash, so chains restart and two prefixes "
        "that end alike share a key (sglang#35269)"
    )
    OLD = "    return get_hash_str(key, prior_hash, page_size=page_size)\n"
    NEW = "    return get_hash_str(key, None, page_size=page_size)  # BUG: the chain restarts\n"
    INVARIANTS = ("INV-27",)


class KeysWithoutTheRank(PlantedBug):
    NAME = "keys_without_the_rank"
    BUG_CLASS = "storage namespaces"
    DESCRIPTION = (
        "every rank's storage config names TP rank 0, so the ranks' keys collide and they "
        "overwrite each other's shards (sglang#10969)"
    )
    OLD = "            tp_rank=tp_rank,\n            tp_size=tp_size,\n"
    NEW = "            tp_rank=0,  # BUG: keys without the rank\n            tp_size=tp_size,\n"
    INVARIANTS = ("INV-28", "INV-30")  # INV-30: a rank reads the shard another rank overwrote


class FileKeysWithoutTheRank(PlantedBug):
    NAME = "file_keys_without_the_rank"
    TARGET = "sglang/srt/mem_cache/hicache_storage.py"
    BUG_CLASS = "storage namespaces"
    DESCRIPTION = (
        "upstream's file backend names its files without the TP rank, so ranks sharing its "
        "directory overwrite each other's pages (sglang#10969, in HiCacheFile itself)"
    )
    OLD = '        self.tp_config_suffix = f"_{model_name}_{tp_rank}_{tp_size}{shard_suffix}"\n'
    NEW = (
        '        self.tp_config_suffix = f"_{model_name}_{tp_size}{shard_suffix}"  # BUG: no rank\n'
    )
    INVARIANTS = ("INV-28", "INV-30")


class FullHitShortened(PlantedBug):
    NAME = "full_hit_shortened"
    BUG_CLASS = "storage hit endpoints"
    DESCRIPTION = (
        "a full L3 hit is published one page short of what every rank holds (sglang#40193)"
    )
    OLD = "                operation.hash_value = hash_value[\n"
    NEW = (
        "                if storage_hit_count == len(operation.token_ids) > self.page_size:\n"
        "                    storage_hit_count -= self.page_size  # BUG: a full hit shortened\n"
        "                operation.hash_value = hash_value[\n"
    )
    INVARIANTS = ("INV-29",)


BUGS_0523_STORAGE_KEYS: tuple[type[PlantedBug], ...] = (
    KeysRestartTheChain,
    KeysWithoutTheRank,
    FileKeysWithoutTheRank,
    FullHitShortened,
)
"""Planted in 0.5.23's key, namespace and hit paths (INV-27 .. INV-29); appended below."""
BUGS_0523_STORAGE += BUGS_0523_STORAGE_KEYS


# -- 0.5.23's independent side pools (issue 27): caught in pool_group="swa" worlds -------------
GROUP = "sglang/srt/mem_cache/pool_host/group.py"
HYBRID = "sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py"


class SideSlotsFromTheAnchor(PlantedBug):
    NAME = "side_slots_from_the_anchor"
    TARGET = GROUP
    BUG_CLASS = "side pool allocators"
    DESCRIPTION = (
        "resolve_host_transfers allocates a side pool's host slots from the anchor's pool, so "
        "the SWA slots a node records are KV slots"
    )
    OLD = "                pool=transfer.name,\n"
    NEW = "                pool=None,  # BUG: the anchor's allocator\n"
    INVARIANTS = ("INV-36", "INV-05")


class SideReleaseFreesTheAnchor(PlantedBug):
    NAME = "side_release_frees_the_anchor"
    TARGET = GROUP
    BUG_CLASS = "side pool allocators"
    DESCRIPTION = "HostPoolGroup.free ignores the pool it is given and frees the anchor's slots"
    OLD = "        return self.get_entry(pool).host_pool.free(indices)\n"
    NEW = "        return self.get_entry(None).host_pool.free(indices)  # BUG: pool ignored\n"
    INVARIANTS = ("INV-05", "INV-07", "INV-36", "INV-01")
    """INV-01 where the side pool's pages are narrower than the anchor's: a Mamba state page is
    one slot, and the anchor's free refuses a slot list that is no whole anchor page."""


class SideShortfallKeepsAnchorSlots(PlantedBug):
    NAME = "side_shortfall_keeps_anchor_slots"
    TARGET = HYBRID
    BUG_CLASS = "side pool rollback"
    DESCRIPTION = (
        "a write refused because the side host pool is short keeps the anchor's host slots "
        "(allocate_host_transfers no longer rolls them back)"
    )
    OLD = "        if pool_transfers is None and extra_pools:\n            self.mem_pool_host.free(host_indices)\n"
    NEW = "        if pool_transfers is None and extra_pools:\n            pass  # BUG: anchor slots kept\n"
    INVARIANTS = ("INV-17", "INV-05")


class SideDeviceShortfallKeepsKvRows(PlantedBug):
    NAME = "side_device_shortfall_keeps_kv_rows"
    TARGET = HYBRID
    BUG_CLASS = "side pool rollback"
    DESCRIPTION = (
        "a load refused because the side pool's device allocator is short keeps the KV rows "
        "it already allocated"
    )
    OLD = "                full_allocator.free(device_indices)\n            return None\n"
    NEW = "                pass  # BUG: KV rows kept\n            return None\n"
    INVARIANTS = ("INV-17", "INV-05")


class SideLayersByTheAnchorsMapper(PlantedBug):
    NAME = "side_layers_by_the_anchors_mapper"
    TARGET = HYBRID
    BUG_CLASS = "side pool layer mapping"
    DESCRIPTION = (
        "every L2 transfer maps transfer layer ids with the anchor's layer_mapper, so a side "
        "pool's layers load at the anchor's ids (or not at all where the anchor has none)"
    )
    OLD = "                    layer_mapper=entry.layer_mapper,\n"
    NEW = "                    layer_mapper=anchor.layer_mapper,  # BUG: the anchor's mapping\n"
    INVARIANTS = ("INV-11", "INV-09", "INV-06")


class SideMovedWithAnchorSlots(PlantedBug):
    NAME = "side_moved_with_anchor_slots"
    TARGET = HYBRID
    BUG_CLASS = "side pool indices"
    DESCRIPTION = (
        "move_hybrid_indices hands a side transfer the anchor's host slots, so its copies "
        "land in (or read from) slots of the wrong pool's numbering (past the side pool's "
        "end, the transfer itself is refused: INV-05)"
    )
    OLD = (
        "                        self.mem_pool_host.entry_map[transfer.name].host_pool,\n"
        "                        transfer.host_indices,\n"
    )
    NEW = (
        "                        self.mem_pool_host.entry_map[transfer.name].host_pool,\n"
        "                        operation.host_indices,  # BUG: the anchor's slots\n"
    )
    INVARIANTS = ("INV-09", "INV-06", "INV-11", "INV-07", "INV-05")


BUGS_0523_SIDES: tuple[type[PlantedBug], ...] = (
    SideSlotsFromTheAnchor,
    SideReleaseFreesTheAnchor,
    SideShortfallKeepsAnchorSlots,
    SideDeviceShortfallKeepsKvRows,
    SideLayersByTheAnchorsMapper,
    SideMovedWithAnchorSlots,
)
"""Planted in 0.5.23's side-pool code (``HostPoolGroup``, ``HybridCacheController``): caught
once the gate draws independent side pools (``pool_group="swa"``)."""


# -- 0.5.23's Mamba state pool (issue 27): caught in pool_group="mamba" worlds -------------------
class MambaDeviceSlotsPerKvToken(PlantedBug):
    NAME = "mamba_device_slots_per_kv_token"
    TARGET = HYBRID
    BUG_CLASS = "state pool geometry"
    DESCRIPTION = (
        "_resolve_device_transfers sizes a side pool's device allocation by the KV's host "
        "indices, so a load takes a Mamba state slot per KV token (an SWA pool, one row per "
        "token, cannot tell)"
    )
    OLD = "            size = len(pool.host_indices)\n"
    NEW = "            size = len(kv_host_indices)  # BUG: the KV's length\n"
    INVARIANTS = ("INV-40",)


class MambaHostSlotsPerKvToken(PlantedBug):
    NAME = "mamba_host_slots_per_kv_token"
    TARGET = GROUP
    BUG_CLASS = "state pool geometry"
    DESCRIPTION = (
        "resolve_host_transfers sizes a side pool's host allocation by the anchor's device "
        "indices, so a backup takes a Mamba host state slot per KV token"
    )
    OLD = "                len(transfer.device_indices),\n"
    NEW = "                len(primary_device_indices),  # BUG: the anchor's length\n"
    INVARIANTS = ("INV-40",)


class MambaRequestSlotAllocatedOver(PlantedBug):
    NAME = "mamba_request_slot_allocated_over"
    TARGET = HYBRID
    BUG_CLASS = "state pool copy-on-write"
    DESCRIPTION = (
        "_resolve_device_transfers allocates device slots for a side transfer the caller "
        "already gave its slot (the per-request copy-on-write load), so the request's slot "
        "never receives the state and the fresh slot leaks"
    )
    OLD = "            if pool.device_indices is not None or pool.host_indices is None:\n"
    NEW = "            if pool.host_indices is None:  # BUG: a caller's slot allocated over\n"
    INVARIANTS = ("INV-05", "INV-09")  # the leaked slot at the load, or the empty request slot


BUGS_0523_MAMBA: tuple[type[PlantedBug], ...] = (
    MambaDeviceSlotsPerKvToken,
    MambaHostSlotsPerKvToken,
    MambaRequestSlotAllocatedOver,
)
"""Planted in 0.5.23's side-pool sizing and copy-on-write (``HybridCacheController``,
``HostPoolGroup``): harmless where a side pool holds a row per token and no caller-owned slot
(SWA), caught once the gate draws Mamba state pools (``pool_group="mamba"``: one slot per
node; ``state_cow``: a load also fills a request's slot)."""


# -- 0.5.23's storage of a KV-derived sidecar (issue 27): caught in sidecar storage worlds ----------
class SidecarHitsIgnored(PlantedBug):
    NAME = "sidecar_hits_ignored"
    BUG_CLASS = "sidecar storage"
    DESCRIPTION = (
        "_page_transfer_kv_batch counts the KV pages it read, not the fewest of the KV's and "
        "the sidecar's, so a page whose draft page was not read is inserted"
    )
    OLD = "        return min([kv_hits, *sidecar_hits.values()])\n"
    NEW = "        return kv_hits  # BUG: the sidecar's hits ignored\n"
    INVARIANTS = ("INV-37", "INV-06", "INV-09")


class SidecarKeysOfTheFirstBatch(PlantedBug):
    NAME = "sidecar_keys_of_the_first_batch"
    BUG_CLASS = "sidecar storage"
    DESCRIPTION = (
        "the sidecar read of every batch asks the keys of the prefetch's first batch, so a "
        "later batch's draft pages hold an earlier page's bytes"
    )
    OLD = "                    keys=batch_hashes,\n"
    NEW = "                    keys=operation.hash_value[: len(batch_hashes)],  # BUG\n"
    INVARIANTS = ("INV-37", "INV-06", "INV-09")


class PartialBounceReportedAsTheHit(PlantedBug):
    NAME = "partial_bounce_reported_as_the_hit"
    TARGET = HYBRID
    BUG_CLASS = "storage host pressure"
    DESCRIPTION = (
        "allocate_storage_hit gives a bounce buffer shorter than the hit but reports the whole "
        "hit, so the tree cuts nothing and the IO reads past the buffer"
    )
    OLD = "        return host_indices, alloc_len\n"
    NEW = "        return host_indices, hit_tokens  # BUG: the partial length not reported\n"
    INVARIANTS = ("INV-29", "INV-05", "INV-23")


BUGS_0523_SIDECAR_STORAGE: tuple[type[PlantedBug], ...] = (
    SidecarHitsIgnored,
    SidecarKeysOfTheFirstBatch,
)
"""Planted in 0.5.23's storage of a KV-derived sidecar (the ``DRAFT`` entry of a
``HostPoolGroup``, read through ``batch_get_v2`` beside each KV batch): caught once the gate
draws storage worlds with a sidecar (``pool_group="sidecar"``, ``storage:sidecar``)."""

BUGS_0523_HOST_PRESSURE: tuple[type[PlantedBug], ...] = (PartialBounceReportedAsTheHit,)
"""Planted in 0.5.23's hybrid controller's bounce under host pressure (``allocate_storage_hit``):
caught once the gate draws hits cut to the host room (``storage_host_pressure``) in sidecar
storage worlds (the plain controller has no ``allocate_storage_hit``)."""


# -- 0.5.23's L3 window of an independent SWA side pool (issue 27): caught in SWA storage worlds ---
class TrailingKeysOfTheQueriedHit(PlantedBug):
    NAME = "trailing_keys_of_the_queried_hit"
    TARGET = HYBRID
    BUG_CLASS = "side pool storage"
    DESCRIPTION = (
        "_page_transfer_sidecar re-aligns the SWA window's keys to the hit the query found, not "
        "to the hit served after a host-pressure cut, so the window holds the SWA pages of "
        "pages that were never read"
    )
    OLD = (
        "            sidecar_hashes = operation.sidecar_hash_values or operation.hash_value\n"
        "            sidecar_hit_pages = (\n"
        "                operation.sidecar_hit_pages\n"
        "                if operation.sidecar_hash_values is not None\n"
        "                else kv_completed_pages\n"
    )
    NEW = (
        "            sidecar_hashes = operation.sidecar_hash_values or operation.all_hash_values\n"
        "            sidecar_hit_pages = (  # BUG: the query's hit, not the served one\n"
        "                operation.sidecar_hit_pages\n"
        "                if operation.sidecar_hash_values is not None\n"
        "                else operation.pool_storage_result.kv_hit_pages\n"
    )
    INVARIANTS = ("INV-39",)


class TrailingWindowNotShrunk(PlantedBug):
    NAME = "trailing_window_not_shrunk"
    TARGET = HYBRID
    BUG_CLASS = "side pool storage"
    DESCRIPTION = (
        "_sync_trailing_keys re-aligns the keys but keeps the whole staged window when the "
        "served hit is shorter, so the read's keys and slots disagree and the window is lost"
    )
    OLD = "            if transfer.host_indices.numel() > needed:\n"
    NEW = "            if False and transfer.host_indices.numel() > needed:  # BUG: never shrunk\n"
    INVARIANTS = ("INV-39",)


BUGS_0523_SIDE_STORAGE: tuple[type[PlantedBug], ...] = (
    TrailingKeysOfTheQueriedHit,
    TrailingWindowNotShrunk,
)
"""Planted in 0.5.23's L3 window of an independent SWA side pool (``_page_transfer_sidecar``,
``_sync_trailing_keys``): caught once the gate draws SWA storage worlds (``storage:swa``) whose
hits are cut to the host room (``storage_host_pressure``)."""


# -- 0.5.23's L3 page of a Mamba state pool (issue 27): caught in Mamba storage worlds ------------
class SingleStateKeyNotRealigned(PlantedBug):
    NAME = "single_state_key_not_realigned"
    TARGET = HYBRID
    BUG_CLASS = "side pool storage"
    DESCRIPTION = (
        "_sync_trailing_keys re-aligns only windows of more than one page, taking a single "
        "state's key as final, so a Mamba prefetch reads its placeholder key and the state "
        "L3 holds for the served hit's last page is lost"
    )
    OLD = "            trailing_n = len(transfer.keys) if transfer.keys else 1\n"
    NEW = (
        "            trailing_n = len(transfer.keys) if transfer.keys else 1\n"
        "            if trailing_n == 1:  # BUG: a single state's key taken as final\n"
        "                continue\n"
    )
    INVARIANTS = ("INV-39",)


BUGS_0523_MAMBA_STORAGE: tuple[type[PlantedBug], ...] = (SingleStateKeyNotRealigned,)
"""Planted in 0.5.23's L3 page of a Mamba state pool (the last-hit-page form of
``_sync_trailing_keys``): caught once the gate draws Mamba storage worlds (``storage:mamba``).
SWA's ``trailing_keys_of_the_queried_hit`` also loads a cut hit's wrong state in a Mamba world
(``test_sglang_mamba_storage.py``)."""


# -- 0.5.23's storage threads inside one loop body (issue 32): caught under schedule points -------
class BackupAcksBeforeWrite(PlantedBug):
    NAME = "backup_acks_before_write"
    BUG_CLASS = "storage windows"
    DESCRIPTION = (
        "the backup thread puts its ack before it writes the pages, so the tree drains it and "
        "frees the source pages while the write has not run (sglang#39701's window)"
    )
    OLD = (
        "                if not self.backup_skip:\n"
        "                    self._page_backup_or_log(operation)\n"
        "                self.ack_backup_queue.put(operation)\n"
    )
    NEW = (
        "                self.ack_backup_queue.put(operation)  # BUG: acked before the write\n"
        "                if not self.backup_skip:\n"
        "                    self._page_backup_or_log(operation)\n"
    )
    INVARIANTS = ("INV-26", "INV-32")  # INV-26: drained before the body ended, nothing stored


class IoIgnoresTermination(PlantedBug):
    NAME = "io_ignores_termination"
    BUG_CLASS = "storage windows"
    DESCRIPTION = (
        "the IO loop never looks at termination between batches, so an aborted prefetch goes "
        "on reading into the bounce buffer the tree settled (sglang#16747, #31296)"
    )
    OLD = "            if all_success and operation.is_terminated():\n                all_success = False\n"
    NEW = "            if False:  # BUG: termination is never looked at\n                all_success = False\n"
    INVARIANTS = ("INV-33",)


class IoCountsPastHole(PlantedBug):
    NAME = "io_counts_past_hole"
    BUG_CLASS = "storage windows"
    DESCRIPTION = (
        "the generic page get goes on past a page that did not come back and counts the pages "
        "after it (LMCache #2966's class)"
    )
    OLD = (
        "                )\n"
        "                break\n"
        "            if operation.is_terminated():\n"
        "                break\n"
    )
    NEW = OLD.replace(
        "                )\n                break\n",
        "                )\n                continue  # BUG\n",
        1,
    )
    INVARIANTS = ("INV-34", "INV-19")  # INV-19: the counted page's bytes never landed


class IoExceptionDoublesFinalAck(PlantedBug):
    NAME = "io_exception_doubles_final_ack"
    BUG_CLASS = "storage windows"
    DESCRIPTION = (
        "a backend exception inside the IO loop also sends the final ack from its handler, so "
        "the prefetch gets two (the finally sends the other; sglang#9971's class)"
    )
    OLD = "                    hit_pages = 0\n                # Check termination\n"
    NEW = (
        "                    hit_pages = 0\n"
        "                    self.prefetch_sync_queue.put(PrefetchAck(rid=operation.request_id, "
        "completed_req=True, operation=operation))  # BUG\n"
        "                # Check termination\n"
    )
    INVARIANTS = ("INV-25", "INV-23", "INV-19", "INV-20", "INV-21")  # INV-20/21: one rank
    # raised, and its sync thread publishes the extra final ack where a peer reduces progress


class ResetLeavesBackupThread(PlantedBug):
    NAME = "reset_leaves_backup_thread"
    BUG_CLASS = "storage windows"
    DESCRIPTION = (
        "reset() stops but never joins the backup thread, so one parked inside its loop body "
        "runs again in the next epoch (sglang#36882's class)"
    )
    OLD = '        if hasattr(self, "backup_thread"):\n            threads.append(self.backup_thread)\n'
    NEW = '        if hasattr(self, "backup_thread"):\n            pass  # BUG: never joined\n'
    INVARIANTS = ("INV-35", "INV-24")


BUGS_0523_WINDOWS: tuple[type[PlantedBug], ...] = (
    BackupAcksBeforeWrite,
    IoIgnoresTermination,
    IoCountsPastHole,
    IoExceptionDoublesFinalAck,
    ResetLeavesBackupThread,
)
"""Planted inside one loop body of 0.5.23's storage threads: caught once the gate draws schedule
points (``storage_points``), each window class of issue 32."""


# -- 0.5.23's PP prefetch tickets (issue 27): caught in PP storage worlds (storage:pp) --------------
class PpFollowerDropsLastHash(PlantedBug):
    NAME = "pp_follower_drops_last_hash"
    TARGET = HYBRID
    BUG_CLASS = "pp tickets"
    DESCRIPTION = (
        "a PP follower rebuilds the ticket's operation without its last_hash, so it queries the "
        "chain from the root instead of after the request's prefix (and the MIN hit is lost)"
    )
    OLD = "                            ticket.last_hash,\n"
    NEW = "                            None,  # BUG: the ticket's last_hash dropped\n"
    INVARIANTS = ("INV-38",)


class PpReleasedTicketKeepsSlots(PlantedBug):
    NAME = "pp_released_ticket_keeps_slots"
    TARGET = HYBRID
    BUG_CLASS = "pp tickets"
    DESCRIPTION = (
        "the sync thread retires a ticket released before its completion without freeing its "
        "staged host slots, so they leak"
    )
    OLD = "                        self._free_pp_prefetch_state(state)\n"
    NEW = "                        pass  # BUG: the released ticket's slots are not freed\n"
    INVARIANTS = ("INV-38",)


class PpShardsShareOneNamespace(PlantedBug):
    NAME = "pp_shards_share_one_namespace"
    BUG_CLASS = "pp tickets"
    DESCRIPTION = (
        "the storage config says PP size 1, so the PP ranks' shards share one key namespace "
        "and a rank reads back the pages another rank's layers wrote"
    )
    OLD = "            pp_size=parallel.pp_size,\n"
    NEW = "            pp_size=1,  # BUG: the PP ranks' shards in one namespace\n"
    INVARIANTS = ("INV-30", "INV-28")


class PpRankZeroAssumesStored(PlantedBug):
    NAME = "pp_rank_zero_assumes_stored"
    TARGET = HYBRID
    BUG_CLASS = "pp tickets"
    DESCRIPTION = (
        "PP rank 0's submit_prefetch keeps assume_stored on its own operation (as the non-PP "
        "path does) but the ticket does not carry it: PP rank 0 skips its query and votes the "
        "whole span while the followers query theirs"
    )
    OLD = (
        "            prefix_keys=ticket.prefix_keys,\n            pool_transfers=pool_transfers,\n"
    )
    NEW = (
        "            prefix_keys=ticket.prefix_keys,\n"
        "            pool_transfers=pool_transfers,\n"
        "            assume_stored=assume_stored,  # BUG: PP rank 0's alone\n"
    )
    INVARIANTS = ("INV-38",)


BUGS_0523_PP: tuple[type[PlantedBug], ...] = (
    PpFollowerDropsLastHash,
    PpReleasedTicketKeepsSlots,
    PpShardsShareOneNamespace,
    PpRankZeroAssumesStored,
)
"""Planted in 0.5.23's PP ticket protocol (``pp_prefetch_command_thread_func``, the sync thread's
ticket completion) and its PP storage shards (the storage config's PP rank): caught by the PP
gate (``harness/campaigns/pp_gate.py``)."""


class PpReleaseFreesUnderTheIo(PlantedBug):
    NAME = "pp_release_frees_under_the_io"
    TARGET = HYBRID
    BUG_CLASS = "pp tickets"
    DESCRIPTION = (
        "release_pp_prefetch frees a staged ticket's host slots at once, trusting the IO thread "
        "to stop at its next termination check; an IO parked past its check still writes a page "
        "into the freed slots (#27550 / #31668's class, on the PP release path)"
    )
    OLD = "            state.release_requested = True\n            if state.ready_event.is_set():\n"
    NEW = (
        "            state.release_requested = True\n"
        "            if state.ready_event.is_set() or state.operation.host_indices is not None:\n"
        "                state.operation.mark_terminate()  # BUG: freed under a running IO\n"
    )
    INVARIANTS = ("INV-38",)


BUGS_0523_PP_WINDOWS: tuple[type[PlantedBug], ...] = (PpReleaseFreesUnderTheIo,)
"""Planted in 0.5.23's PP tickets where only a point inside a storage thread's loop body shows
it (the IO parked before a page write, between its termination check and the bytes): caught by
the PP gate with the storage threads under points, never with whole bodies."""


# -- 0.5.21 - 0.5.22's hit-carrying PP tickets: caught in PP storage worlds (storage:pp) ----------
class PpRankZeroQueriesOnlyItsShard(PlantedBug):
    NAME = "pp_rank_zero_queries_only_its_shard"
    TARGET = HYBRID
    BUG_CLASS = "pp tickets"
    DESCRIPTION = (
        "PP rank 0's submit_prefetch asks every PP rank's hit without naming the rank "
        "(extra_info pp_rank), so it queries its own shard each time and the ticket carries a "
        "hit a follower's shard may not hold"
    )
    OLD = (
        "                _, rank_hit_count = self._storage_hit_query(operation, pp_rank=pp_rank)\n"
    )
    NEW = (
        "                _, rank_hit_count = self._storage_hit_query(operation)  # BUG: own shard\n"
    )
    INVARIANTS = ("INV-38",)


class PpFollowerStagesTheWholeKey(PlantedBug):
    NAME = "pp_follower_stages_the_whole_key"
    TARGET = HYBRID
    BUG_CLASS = "pp tickets"
    DESCRIPTION = (
        "a PP command thread stages the ticket's whole key instead of the hit PP rank 0 "
        "carried, so it reads pages past the MIN over the shards"
    )
    OLD = "                operation.storage_hit_count = ticket.storage_hit_count\n"
    NEW = (
        "                operation.storage_hit_count = ticket.storage_hit_count = len(\n"
        "                    ticket.prefetch_key.token_ids\n"
        "                )  # BUG: the whole key, not the carried hit\n"
    )
    INVARIANTS = ("INV-38",)


BUGS_0522_PP: tuple[type[PlantedBug], ...] = (
    PpRankZeroQueriesOnlyItsShard,
    PpFollowerStagesTheWholeKey,
)
"""Planted in 0.5.22's hit-carrying PP tickets (``submit_prefetch``'s query of every PP rank's
shard, the command thread's staging of the carried hit): caught by the PP gate."""


# -- 0.5.23's PP tickets with an independent SWA side pool (issue 27): caught in SWA PP worlds ----
UNIFIED = "sglang/srt/mem_cache/unified_radix_cache.py"


class PpEachRankDecidesOnItsOwnClock(PlantedBug):
    NAME = "pp_each_rank_decides_on_its_own_clock"
    TARGET = UNIFIED
    BUG_CLASS = "pp verdict"
    DESCRIPTION = (
        "under the timeout stop policy every PP rank reads its own deadline and reduces the "
        "verdict over its TP group alone, so a follower whose clock runs ahead cuts a "
        "cache-mode prefetch PP rank 0 keeps loading (the verdict is not handed along PP)"
    )
    OLD = "            self._all_reduce(should_terminate_tensor, torch.distributed.ReduceOp.MAX)\n"
    NEW = (
        "            should_terminate_tensor.fill_(int(self._prefetch_deadline_expired(operation)))\n"
        "            self._all_reduce_attn_groups(  # BUG: its own clock, no PP hand-along\n"
        "                should_terminate_tensor, torch.distributed.ReduceOp.MAX\n"
        "            )\n"
    )
    INVARIANTS = ("INV-38",)


BUGS_0523_PP_VERDICT: tuple[type[PlantedBug], ...] = (PpEachRankDecidesOnItsOwnClock,)
"""Planted in 0.5.23's unified radix cache (``_can_terminate_prefetch``): caught by the PP gate's
cache-mode prefetch polls (``driver/pp_verdict.py``)."""


class PpRetiredTicketKeepsItsWindow(PlantedBug):
    NAME = "pp_retired_ticket_keeps_its_window"
    TARGET = HYBRID
    BUG_CLASS = "pp tickets"
    DESCRIPTION = (
        "_free_pp_prefetch_state frees a retired ticket's KV slots but not the window it "
        "allocated from an independent side pool, so the SWA window's slots leak"
    )
    OLD = (
        "            if transfer.indices_from_pool is None and transfer.host_indices is not None:\n"
    )
    NEW = "            if False:  # BUG: the side pool's window is never freed\n"
    INVARIANTS = ("INV-38",)


BUGS_0523_PP_SIDE: tuple[type[PlantedBug], ...] = (
    PpRetiredTicketKeepsItsWindow,
    TrailingKeysOfTheQueriedHit,
)
"""Planted in 0.5.23's PP tickets whose spec names an independent SWA side pool (the window's
slots on retirement, ``_free_pp_prefetch_state``; its keys on the PP path, the same
``_page_transfer_sidecar`` as a non-PP world's): caught by the PP gate in its SWA worlds."""


# -- 0.5.23's PP tickets with a Mamba state pool (issue 27): caught in Mamba PP worlds ----------
class PpStateWindowSizedByKvPage(PlantedBug):
    NAME = "pp_state_window_sized_by_kv_page"
    TARGET = HYBRID
    BUG_CLASS = "pp tickets"
    DESCRIPTION = (
        "_allocate_pp_prefetch_buffers sizes an independent pool's window by the KV's page "
        "instead of the pool's own, so a Mamba state (a page of one slot) takes a KV page of "
        "state slots per ticket; an SWA window's page is the KV's, so only a state pool shows it"
    )
    OLD = "                    size = num_pages * self.mem_pool_host.get_pool(name).page_size\n"
    NEW = "                    size = num_pages * self.page_size  # BUG: the KV's page\n"
    INVARIANTS = ("INV-38",)


BUGS_0523_PP_MAMBA: tuple[type[PlantedBug], ...] = (PpStateWindowSizedByKvPage,)
"""Planted in 0.5.23's PP tickets whose spec names a Mamba state pool (the window's allocation on
each rank's command thread, ``_allocate_pp_prefetch_buffers``): caught by the PP gate in its Mamba
worlds only (an SWA pool's page is the KV's, so the same line sizes an SWA window right)."""


# -- 0.5.23's buffer mode (issue 27): caught in buffer_only storage worlds ---------------------------
EXISTENCE = "sglang/srt/mem_cache/buffer_mode/storage_existence_cache.py"


class PoolVerdictsNotReduced(PlantedBug):
    NAME = "pool_verdicts_not_reduced"
    TARGET = HYBRID
    BUG_CLASS = "buffer mode"
    DESCRIPTION = (
        "_sync_prefetch_hit_query reduces the folded hit but hands each rank its own per-pool "
        "query verdicts, so a rank whose shard held more keeps beliefs the agreed hit refuted"
    )
    OLD = "            for pool, pages in zip(pools, reduced[len(hits) :], strict=True)\n"
    NEW = (
        "            for pool, pages in zip(  # BUG: this rank's own verdicts, not the MIN\n"
        "                pools, [local.get(p, _NO_POOL_VERDICT) for p in pools], strict=True\n"
        "            )\n"
    )
    INVARIANTS = ("INV-41",)


class BeliefHealKeepsTheFirstMissingPage(PlantedBug):
    NAME = "belief_heal_keeps_the_first_missing_page"
    TARGET = EXISTENCE
    BUG_CLASS = "buffer mode"
    DESCRIPTION = (
        "invalidate_beyond discards the beliefs past the first page beyond the kept ones, so "
        "the first page a hit query found missing stays believed and its backup is skipped"
    )
    OLD = "        for h in hashes[keep_pages:]:\n"
    NEW = "        for h in hashes[keep_pages + 1 :]:  # BUG: off by one\n"
    INVARIANTS = ("INV-41",)


class WriteStagingChargedToLoads(PlantedBug):
    NAME = "write_staging_charged_to_loads"
    BUG_CLASS = "buffer mode"
    DESCRIPTION = (
        "prefetch_rate_limited in buffer_only mode adds the tree's write staging to the pool's "
        "usage instead of leaving it out, so pending writes park every hit"
    )
    OLD = "                used -= self.host_write_staged_tokens_fn()\n"
    NEW = "                used += self.host_write_staged_tokens_fn()  # BUG: charged to loads\n"
    INVARIANTS = ("INV-41",)


BUGS_0523_BUFFER: tuple[type[PlantedBug], ...] = (
    PoolVerdictsNotReduced,
    BeliefHealKeepsTheFirstMissingPage,
    WriteStagingChargedToLoads,
)
"""Planted in 0.5.23's buffer mode: the hybrid controller's per-pool query verdicts (reduced with
the hit, ``_sync_prefetch_hit_query``), the controller's buffer-mode rate limit and the tree's
``StorageExistenceCache``, which the harness runs unmodified: caught once the gate draws
``buffer_only`` storage worlds (``storage:buffer_only``)."""
