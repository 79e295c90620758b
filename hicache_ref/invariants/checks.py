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
        "INV-19": (check_prefetch_progress, check_prefetch_release_split),
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
