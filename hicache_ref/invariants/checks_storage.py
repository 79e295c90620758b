"""The storage tier's checkers by invariant id: ``STORAGE_CHECKS``.

One checker per id (``check_inv_NN_<slug>``, registered with ``storage`` as its phase), each
judging a ``StorageSnapshot``; the prefetch half lives in ``checks_storage_prefetch.py``, the
backup and L3 half in ``checks_storage_l3.py``, the windows inside a thread's loop body (INV-32
.. INV-35) in ``checks_storage_windows.py``. Both tables are derived from those
registrations: the registry (``registry.REGISTERED``) holds them beside the others, and the
harness's storage driver hands each ``STORAGE_IDS`` a snapshot after each storage step and at
quiescence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from hicache_ref.invariants import (
    checks_storage_l3,
    checks_storage_prefetch,
    checks_storage_windows,
)
from hicache_ref.invariants.checker import collect, phase_ids
from hicache_ref.invariants.evidence import Evidence

StorageCheck = Callable[[Evidence], None]

_STORAGE = collect(
    [vars(checks_storage_prefetch), vars(checks_storage_l3), vars(checks_storage_windows)]
)
STORAGE_CHECKS: Mapping[str, StorageCheck] = MappingProxyType({c.inv_id: c.check for c in _STORAGE})
STORAGE_IDS = phase_ids(_STORAGE, "storage")
"""The storage phase: every storage id, in id order (after each storage step, each reset and at
quiescence, so the first violation reported is the same on every run)."""

__all__ = ["STORAGE_CHECKS", "STORAGE_IDS", "StorageCheck"]
