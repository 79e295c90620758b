"""The schedule family: one machine rule that grants a parked storage thread, with an outcome.

In a world with ``storage_points`` (``HarnessConfig.storage_points``) every storage thread
parks at each schedule point (``harness/schedule/points.py``). ``storage_step`` (the storage
family) then runs one thread kind, on every rank, to its next point with every call ``ok``;
``schedule_point`` does the same for a thread parked at a backend call and draws that call's
outcome on one rank (``hole``, ``gone``, ``raise``, ``short``, ``defer``, or ``ok``), so a
failure's minimal trace reads as the interleaving: "backup: batch_set (raise @0 on rank 1) ->
put ack_backup_queue; drain_backup_acks; ...". Each step is an ordinary trace step, replayed
without Hypothesis and shrunk by the minimizer like any other.

Draws: the thread is uniform over those that can move (``pick``); under the ``campaign``
profile a PCT-style bias picks it (``harness/schedule/pct.py``: random priorities per case, a
few priority changes).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from hicache_ref.controller.storage.records import parse_step_kind
from hicache_ref.harness.rules.record import (
    PICK,
    Args,
    Draw,
    Ints,
    OneOf,
    RuleRecord,
    StepContext,
)
from hicache_ref.harness.schedule.points import AT_MAX, BACKEND_POINTS, OUTCOMES, Grant
from hicache_ref.harness.step_types import Outcome, StepArg

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_driver import StorageDriver

FAMILY = "schedule"


def _driver(ctx: StepContext) -> StorageDriver | None:
    d = ctx.storage
    return d if d is not None and d.attached and d.points is not None else None


def _at_backend(ctx: StepContext) -> list[str]:
    """The thread kinds parked at a backend call on some rank, that can move now."""
    from hicache_ref.harness.schedule.points import position

    d = _driver(ctx)
    if d is None:
        return []
    runnable = d.runnable()
    kinds: list[str] = []
    for kind in runnable:
        at = [position(t, kind) for t in d.l3.tiers]
        if any(p is not None and p.kind in BACKEND_POINTS for p in at):
            kinds.append(kind.value)
    return kinds


def _why_not(ctx: StepContext, args: Args) -> str | None:
    if _driver(ctx) is None:
        return "no storage world with schedule points is attached (storage_points=false)"
    thread = str(args.get("thread", ""))
    if thread not in _at_backend(ctx):
        return f"no {thread!r} thread is parked at a backend call that can run"
    if str(args.get("outcome", "")) not in OUTCOMES:
        return f"schedule_point needs an outcome in {OUTCOMES}"
    return None


def _choose(ctx: StepContext, drawn: Mapping[str, Any]) -> dict[str, StepArg] | None:
    kinds = _at_backend(ctx)
    if not kinds:
        return None
    d = _driver(ctx)
    assert d is not None
    assert d.points is not None
    return {
        "thread": d.points.choose(kinds, int(drawn["pick"])),
        "outcome": str(drawn["outcome"]),
        "rank": int(drawn["rank"]) % d.n,
        "at": int(drawn["at"]),
    }


def process_schedule_point(ctx: StepContext, args: Args) -> Outcome:
    d = _driver(ctx)
    assert d is not None
    grant = Grant(str(args["outcome"]), int(args.get("at", 0)))
    outcome = d.run_step(parse_step_kind(str(args["thread"])), grant, int(args.get("rank", 0)))
    d.check()
    return outcome


SCHEDULE_POINT = RuleRecord(
    "schedule_point",
    FAMILY,
    "run a storage thread parked at a backend call to its next point, the call's outcome drawn "
    "on one rank (ok, hole, gone, raise, short, defer)",
    _why_not,
    process_schedule_point,
    draw=Draw(
        {"pick": PICK, "outcome": OneOf(OUTCOMES), "rank": Ints(0, 3), "at": Ints(0, AT_MAX)},
        _choose,
        lambda s: bool(_at_backend(s)),
    ),
    args=MappingProxyType({"thread": "str", "outcome": "str", "rank": "int", "at": "int"}),
)

RECORDS: tuple[RuleRecord, ...] = (SCHEDULE_POINT,)
