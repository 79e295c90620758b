"""The storage tier's checkers by invariant id: ``STORAGE_CHECKS``.

One checker per id (``check_inv_NN_<slug>``), each judging a ``StorageSnapshot``; the prefetch
half lives in ``checks_storage_prefetch.py``, the backup and L3 half in ``checks_storage_l3.py``,
the windows inside a thread's loop body (INV-32 .. INV-35) in ``checks_storage_windows.py``.
The registry (``registry.REGISTERED``) holds them beside the others; the harness's storage
driver hands each ``STORAGE_IDS`` a snapshot after each storage step and at quiescence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

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
from hicache_ref.invariants.checks_storage_windows import (
    check_inv_32_acked_pages_readable,
    check_inv_33_no_read_after_termination,
    check_inv_34_no_progress_past_a_hole,
    check_inv_35_no_old_epoch_thread,
)
from hicache_ref.invariants.evidence import Evidence

StorageCheck = Callable[[Evidence], None]

STORAGE_CHECKS: Mapping[str, StorageCheck] = MappingProxyType(
    {
        "INV-19": check_inv_19_prefetch_ranges,
        "INV-20": check_inv_20_storage_collectives,
        "INV-21": check_inv_21_min_progress,
        "INV-22": check_inv_22_verdict_after_hit,
        "INV-23": check_inv_23_io_owned_pages,
        "INV-24": check_inv_24_storage_epochs,
        "INV-25": check_inv_25_one_ack,
        "INV-26": check_inv_26_ack_is_stored_prefix,
        "INV-27": check_inv_27_prefix_keys,
        "INV-28": check_inv_28_key_namespace,
        "INV-29": check_inv_29_hit_endpoint,
        "INV-30": check_inv_30_l3_bytes,
        "INV-31": check_inv_31_prefix_closed,
        "INV-32": check_inv_32_acked_pages_readable,
        "INV-33": check_inv_33_no_read_after_termination,
        "INV-34": check_inv_34_no_progress_past_a_hole,
        "INV-35": check_inv_35_no_old_epoch_thread,
    }
)
STORAGE_IDS = tuple(STORAGE_CHECKS)
"""The storage phase: every storage id, in id order (after each storage step, each reset and at
quiescence, so the first violation reported is the same on every run)."""

__all__ = ["STORAGE_CHECKS", "STORAGE_IDS", "StorageCheck"]
