"""The storage tier's checkers by invariant id: ``STORAGE_CHECKS``.

One checker per id (``check_inv_NN_<slug>``, registered with ``storage`` as its phase), each
judging a ``StorageSnapshot``, in a module named ``checks_storage_<concept>.py``
(``STORAGE_MODULES``, found by that name: a new one needs no line here): the prefetch half in
``checks_storage_prefetch.py``, the backup and L3 half in ``checks_storage_l3.py``, the windows
inside a thread's loop body (INV-32 .. INV-35) in ``checks_storage_windows.py``. Both tables
are derived from those registrations: the registry (``registry.REGISTERED``) holds them beside the others, and the
harness's storage driver hands each ``STORAGE_IDS`` a snapshot after each storage step and at
quiescence.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType, ModuleType

from hicache_ref.invariants.checker import collect, phase_ids
from hicache_ref.invariants.evidence import Evidence

StorageCheck = Callable[[Evidence], None]

STORAGE_MODULE_PREFIX = "checks_storage_"
STORAGE_MODULES: tuple[ModuleType, ...] = tuple(
    importlib.import_module(f"{__package__}.{found.name}")
    for found in pkgutil.iter_modules([str(Path(__file__).parent)])
    if found.name.startswith(STORAGE_MODULE_PREFIX)
)
"""Every module of this package named ``checks_storage_<concept>``: the storage checkers."""
_STORAGE = collect(vars(module) for module in STORAGE_MODULES)
STORAGE_CHECKS: Mapping[str, StorageCheck] = MappingProxyType({c.inv_id: c.check for c in _STORAGE})
STORAGE_IDS = phase_ids(_STORAGE, "storage")
"""The storage phase: every storage id, in id order (after each storage step, each reset and at
quiescence, so the first violation reported is the same on every run)."""

__all__ = ["STORAGE_CHECKS", "STORAGE_IDS", "STORAGE_MODULES", "StorageCheck"]
