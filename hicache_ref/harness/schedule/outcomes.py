"""A backend point's drawn outcome, applied through the world's fault layer.

The recording backend (``harness/world/recording_storage.py``), the outermost layer a tier
calls, parks a gated thread at every ``batch_exists`` / ``batch_get`` / ``batch_set`` before
the call runs (``at_backend_call``); the grant carries the call's outcome, which this module
turns into one-shot faults on the layer below (``FaultInjectingStorage.arm_key`` / ``evict``),
so the call then fails exactly as drawn, for any implementation. After a call whose outcome was
``defer``, the thread parks once more (``points.RETURN``) before the call returns to it.

| outcome | ``batch_exists`` | ``batch_get`` | ``batch_set`` |
| --- | --- | --- | --- |
| ``hole`` | key ``at`` absent | key ``at`` unreadable | refused from key ``at`` |
| ``gone`` | key ``at`` evicted | key ``at`` evicted | as ``ok`` |
| ``raise`` | raises at key ``at`` | raises at key ``at`` | raises at key ``at`` |
| ``short`` | as ``hole`` | half of key ``at`` lands | refused from key ``at`` |
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_ref.harness.schedule.points import (
    BATCH_EXISTS,
    BATCH_GET,
    BATCH_SET,
    DEFER,
    GONE,
    HOLE,
    OK,
    RAISE,
    RETURN,
    SHORT,
    Grant,
    schedule_point,
)
from hicache_ref.storage.fault_injection import FaultInjectingStorage, FaultKind

_FAULTS: dict[tuple[str, str], FaultKind] = {
    (BATCH_EXISTS, HOLE): "exists_miss",
    (BATCH_EXISTS, SHORT): "exists_miss",
    (BATCH_GET, HOLE): "get_fail",
    (BATCH_GET, SHORT): "short_read",
}


def at_backend_call(faults: FaultInjectingStorage | None, kind: str, keys: Sequence[str]) -> Grant:
    """Park at a backend point (if the caller is a gated thread of a world with points) and
    arm the outcome the machine drew for this call."""
    grant = schedule_point(kind, f"{len(keys)} key(s)")
    if grant.outcome == OK or faults is None or not keys:
        return grant
    key = keys[grant.at % len(keys)]
    if grant.outcome == RAISE:
        faults.arm_key("raise", key)
    elif grant.outcome == GONE and kind != BATCH_SET:
        faults.evict(key)
    elif (kind, grant.outcome) in _FAULTS:
        faults.arm_key(_FAULTS[(kind, grant.outcome)], key)
    elif kind == BATCH_SET and grant.outcome in (HOLE, SHORT):
        faults.arm_key("set_fail", key)
    return grant


def after_backend_call(grant: Grant, kind: str) -> None:
    """A deferred call ran; the thread parks before it sees the result (``points.RETURN``)."""
    if grant.outcome == DEFER:
        schedule_point(RETURN, kind)
