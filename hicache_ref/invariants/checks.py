"""One checker per invariant of ``specs/invariants.md``, over plain data, for any implementation.

Each checker raises ``InvariantViolation(inv_id, message)`` naming the page/node/op and what
would have been right, and returns None otherwise. They read values (and may synchronize a
device), so they belong in tests, the harness and debug modes, not on the hot path. The
checkers live in modules by concept; this module gathers them and maps ids to checkers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from hicache_ref.invariants.checks_acks import (
    check_ack_queues_empty,
    check_ack_rows_identical,
    check_acked_once,
    check_fifo_drain,
    check_producer_slot,
    check_producer_slot_ready,
    check_producer_slots_held,
    check_reset_clean,
    check_single_write_ack,
    check_undrained_gate_agrees,
    count_completed_prefix,
)
from hicache_ref.invariants.checks_layout import (
    check_cp_metadata,
    check_host_slot_count,
    check_owner_replay,
    check_page_aligned,
    check_rank_loads_own_pages,
    compute_round_robin_owner,
)
from hicache_ref.invariants.checks_ownership import (
    check_failure_reason,
    check_no_device_free_in_flight,
    check_no_free_in_flight,
    check_no_host_free_in_flight,
    check_pages_owned_once,
    check_slot_conservation,
    check_unchanged,
    is_same_value,
)
from hicache_ref.invariants.checks_prefetch import (
    check_prefetch_progress,
    check_prefetch_release_split,
)
from hicache_ref.invariants.checks_storage_l3 import (
    check_inv_25_one_ack,
    check_inv_26_ack_is_stored_prefix,
    check_inv_27_prefix_keys,
    check_inv_28_key_namespace,
    check_inv_30_l3_bytes,
    check_inv_31_prefix_closed,
)
from hicache_ref.invariants.checks_storage_prefetch import (
    check_inv_19_prefetch_ranges,
    check_inv_20_storage_collectives,
    check_inv_21_min_progress,
    check_inv_22_verdict_after_hit,
    check_inv_23_io_owned_pages,
    check_inv_24_storage_epochs,
    check_inv_29_hit_endpoint,
)
from hicache_ref.invariants.checks_transfer import (
    check_bytes_equal,
    check_cancel_quiesced,
    check_layer_landed_before_read,
    check_layer_write_complete,
    check_layers_submitted,
    check_load_finish_after_copies,
    check_no_stale_layer_writes,
    check_store_before_backup,
)

Checker = Callable[..., None]

CHECKERS_BY_INVARIANT: Mapping[str, tuple[Checker, ...]] = MappingProxyType(
    {
        "INV-01": (check_page_aligned,),
        "INV-02": (check_single_write_ack, check_undrained_gate_agrees),
        "INV-03": (check_owner_replay, check_rank_loads_own_pages),
        "INV-04": (
            check_layers_submitted,
            check_layer_write_complete,
            check_load_finish_after_copies,
        ),
        "INV-05": (check_slot_conservation, check_pages_owned_once),
        "INV-06": (check_bytes_equal,),
        "INV-07": (check_no_host_free_in_flight, check_no_free_in_flight),
        "INV-08": (check_no_device_free_in_flight, check_no_free_in_flight),
        "INV-09": (check_fifo_drain,),
        "INV-10": (check_producer_slot, check_producer_slot_ready, check_producer_slots_held),
        "INV-11": (check_layer_landed_before_read,),
        "INV-12": (check_store_before_backup,),
        "INV-13": (check_cp_metadata, check_host_slot_count),
        "INV-14": (check_ack_rows_identical,),
        "INV-15": (check_cancel_quiesced, check_no_stale_layer_writes),
        "INV-16": (check_acked_once, check_ack_queues_empty),
        "INV-17": (check_unchanged, check_failure_reason),
        "INV-18": (check_reset_clean, check_undrained_gate_agrees),
        "INV-19": (
            check_prefetch_progress,
            check_prefetch_release_split,
            check_inv_19_prefetch_ranges,
        ),
        # the storage tier's: one checker each over a StorageSnapshot (``STORAGE_CHECKS``)
        "INV-20": (check_inv_20_storage_collectives,),
        "INV-21": (check_inv_21_min_progress,),
        "INV-22": (check_inv_22_verdict_after_hit,),
        "INV-23": (check_inv_23_io_owned_pages,),
        "INV-24": (check_inv_24_storage_epochs,),
        "INV-25": (check_inv_25_one_ack,),
        "INV-26": (check_inv_26_ack_is_stored_prefix,),
        "INV-27": (check_inv_27_prefix_keys,),
        "INV-28": (check_inv_28_key_namespace,),
        "INV-29": (check_inv_29_hit_endpoint,),
        "INV-30": (check_inv_30_l3_bytes,),
        "INV-31": (check_inv_31_prefix_closed,),
    }
)
"""Which checkers enforce each invariant id (every id of the spec has at least one)."""

__all__ = [
    "CHECKERS_BY_INVARIANT",
    "Checker",
    "check_ack_queues_empty",
    "check_ack_rows_identical",
    "check_acked_once",
    "check_bytes_equal",
    "check_cancel_quiesced",
    "check_cp_metadata",
    "check_failure_reason",
    "check_fifo_drain",
    "check_host_slot_count",
    "check_inv_19_prefetch_ranges",
    "check_inv_20_storage_collectives",
    "check_inv_21_min_progress",
    "check_inv_22_verdict_after_hit",
    "check_inv_23_io_owned_pages",
    "check_inv_24_storage_epochs",
    "check_inv_25_one_ack",
    "check_inv_26_ack_is_stored_prefix",
    "check_inv_27_prefix_keys",
    "check_inv_28_key_namespace",
    "check_inv_29_hit_endpoint",
    "check_inv_30_l3_bytes",
    "check_inv_31_prefix_closed",
    "check_layer_landed_before_read",
    "check_layer_write_complete",
    "check_layers_submitted",
    "check_load_finish_after_copies",
    "check_no_device_free_in_flight",
    "check_no_free_in_flight",
    "check_no_host_free_in_flight",
    "check_no_stale_layer_writes",
    "check_owner_replay",
    "check_page_aligned",
    "check_pages_owned_once",
    "check_prefetch_progress",
    "check_prefetch_release_split",
    "check_producer_slot",
    "check_producer_slot_ready",
    "check_producer_slots_held",
    "check_rank_loads_own_pages",
    "check_reset_clean",
    "check_single_write_ack",
    "check_slot_conservation",
    "check_store_before_backup",
    "check_unchanged",
    "check_undrained_gate_agrees",
    "compute_round_robin_owner",
    "count_completed_prefix",
    "is_same_value",
]
