"""The storage family of machine rules: one ``RuleRecord`` per L3 verb (``storage_driver.py``).

In the order a page flows: ``write_storage`` -> ``storage_step`` (one step of the hit query,
IO, sync or backup thread, drawn among the runnable ones, on every rank at once) ->
``drain_backup_acks``; ``prefetch`` -> ``storage_step``s -> ``drain_prefetch_acks`` ->
``check_prefetch`` (the policy) or ``terminate_prefetch``; and around them ``inject_fault``,
``detach_storage`` / ``attach_storage``, ``clear_storage`` (one rank's clear endpoint, at
rest) and ``reset_storage_in_flight`` (a tree reset with storage work queued). They are offered only in a storage world (``HarnessConfig.storage_ranks``)
whose implementation has the ``storage`` capability; the lockstep oracle does not model L3, so
the first storage step turns it off for the rest of the case (counted, ``lockstep.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from hicache_ref.controller.storage.records import STEP_KINDS, parse_step_kind
from hicache_ref.harness.rules.record import (
    PICK,
    Args,
    ArgType,
    Bools,
    Draw,
    Ints,
    OneOf,
    RuleRecord,
    StepContext,
)
from hicache_ref.harness.rules.reset import reset
from hicache_ref.harness.step_types import Outcome, StepArg
from hicache_ref.storage.fault_injection import FAULT_KINDS

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_driver import StorageDriver

FAMILY = "storage"
STEP_NAMES = tuple(kind.value for kind in STEP_KINDS)
ARMABLE_FAULTS = tuple(kind for kind in FAULT_KINDS if kind != "delay")
STORAGE_STEPS_CAPABILITY = "storage:batch_steps"
"""What a storage step does is the reference's thread granularity (one hit query, one page batch
of IO, one progress ack, one backup op per step); an implementation whose threads do more or
less per loop iteration replays no vector that steps them (``specs/vectors.md``)."""


REQUEST_ARG: Mapping[str, ArgType] = MappingProxyType({"request": "str"})


def driver(ctx: StepContext) -> StorageDriver | None:
    return ctx.storage


def _attached(ctx: StepContext) -> StorageDriver | None:
    d = driver(ctx)
    return d if d is not None and d.attached else None


def _needs_attached(ctx: StepContext, args: Args) -> str | None:
    if driver(ctx) is None:
        return "the world has no storage tier (storage_ranks=0)"
    return None if _attached(ctx) else "storage is detached (attach_storage first)"


def _checked(ctx: StepContext, act: Callable[[StorageDriver], Outcome]) -> Outcome:
    """Run one driver verb, then every storage check over what it left."""
    d = driver(ctx)
    assert d is not None
    outcome = act(d)
    d.check()
    return outcome


def process_write_storage(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.write_storage(int(args["pick"]), bool(args["new"])))


def process_prefetch(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.prefetch(int(args["pick"])))


def process_drain_prefetch_acks(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.drain_prefetch())


def process_drain_backup_acks(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.drain_backups())


def process_detach_storage(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.detach())


def process_attach_storage(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.attach())


def process_check_prefetch(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.check_prefetch(str(args["request"])))


def process_terminate_prefetch(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.terminate(str(args["request"])))


# -- write_storage ------------------------------------------------------------------------------
def _choose_write(ctx: StepContext, drawn: Mapping[str, Any]) -> dict[str, StepArg]:
    return {"pick": int(drawn["pick"]), "new": bool(drawn["new"])}


# -- storage_step -------------------------------------------------------------------------------
def _rule_storage_step(ctx: StepContext, args: Args) -> str | None:
    why = _needs_attached(ctx, args)
    if why is not None:
        return why
    d = _attached(ctx)
    assert d is not None
    kind = parse_step_kind(str(args.get("kind", "")))
    return None if kind in d.runnable() else f"no {kind.value} step is runnable on any rank"


def _choose_step(ctx: StepContext, drawn: Mapping[str, Any]) -> dict[str, StepArg] | None:
    d = _attached(ctx)
    runnable = d.runnable() if d is not None else []
    if not runnable:
        return None
    if d is not None and d.points is not None:  # schedule points: uniform, or PCT (campaign)
        return {"kind": d.points.choose([k.value for k in runnable], int(drawn["pick"]))}
    preferred = parse_step_kind(str(drawn["kind"]))
    kind = preferred if preferred in runnable else runnable[int(drawn["pick"]) % len(runnable)]
    return {"kind": kind.value}


def process_storage_step(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.run_step(parse_step_kind(str(args["kind"]))))


# -- prefetches ---------------------------------------------------------------------------------
def _rule_prefetch(ctx: StepContext, args: Args) -> str | None:
    why = _needs_attached(ctx, args)
    if why is None and not _attached(ctx).prefetch_candidates():  # type: ignore[union-attr]
        why = "no chain in L3 to prefetch"
    return why


def _rule_ongoing(ctx: StepContext, args: Args) -> str | None:
    d = driver(ctx)
    if d is None:
        return "the world has no storage tier (storage_ranks=0)"
    rid = str(args.get("request", ""))
    return None if rid in d.ongoing() else f"prefetch {rid!r} is not ongoing on every rank"


def _choose_ongoing(ctx: StepContext, drawn: Mapping[str, Any]) -> dict[str, StepArg] | None:
    d = driver(ctx)
    ongoing = d.ongoing() if d is not None else []
    return {"request": ongoing[int(drawn["pick"]) % len(ongoing)]} if ongoing else None


def _offered_ongoing(ctx: StepContext) -> bool:
    d = driver(ctx)
    return d is not None and bool(d.ongoing())


# -- the rest -----------------------------------------------------------------------------------
def _rule_inject(ctx: StepContext, args: Args) -> str | None:
    why = _needs_attached(ctx, args)
    if why is None and args.get("fault") not in ARMABLE_FAULTS:
        why = f"inject_fault needs a fault in {ARMABLE_FAULTS}"
    return why


def process_inject_fault(ctx: StepContext, args: Args) -> Outcome:
    d = driver(ctx)
    assert d is not None
    return d.inject_fault(str(args["fault"]), int(args["rank"]), int(args["pages"]))


def _rule_attach(ctx: StepContext, args: Args) -> str | None:
    d = driver(ctx)
    if d is None:
        return "the world has no storage tier (storage_ranks=0)"
    return "storage is attached already" if d.attached else None


def _rule_reset(ctx: StepContext, args: Args) -> str | None:
    why = _needs_attached(ctx, args)
    if why is None and not _work_in_flight(ctx):
        why = "no storage work is in flight (use reset)"
    return why


def _work_in_flight(ctx: StepContext) -> bool:
    """A step, a prefetch, or an entry of a control queue (a release, an ack) is pending."""
    d = _attached(ctx)
    return d is not None and bool(d.runnable() or d.ongoing() or not d.control_empty())


def process_reset_storage_in_flight(ctx: StepContext, args: Args) -> Outcome:
    outcome = reset(ctx.tree, ctx.storage)
    d = driver(ctx)
    assert d is not None
    d.check()
    return outcome


def _offered(ctx: StepContext) -> bool:
    return _attached(ctx) is not None


# -- clear_storage ------------------------------------------------------------------------------
def _rule_clear(ctx: StepContext, args: Args) -> str | None:
    why = _needs_attached(ctx, args)
    if why is None and _work_in_flight(ctx):
        why = "storage work is in flight (clear_storage runs at rest: drain it first)"
    if why is None:
        why = driver(ctx).why_not_clear()  # type: ignore[union-attr]
    return why


def process_clear_storage(ctx: StepContext, args: Args) -> Outcome:
    return _checked(ctx, lambda d: d.clear(int(args["rank"])))


def _no_args(ctx: StepContext, drawn: Mapping[str, Any]) -> dict[str, StepArg]:
    return {}


WRITE_STORAGE = RuleRecord(
    "write_storage",
    FAMILY,
    "back up a chain of pages to L3 on every rank (keys chained from its parent's)",
    _needs_attached,
    process_write_storage,
    draw=Draw({"pick": PICK, "new": Bools()}, _choose_write, _offered),
    refusable=True,
    args=MappingProxyType({"pick": "int", "new": "bool"}),
    walk=4.0,
)
STORAGE_STEP = RuleRecord(
    "storage_step",
    FAMILY,
    "one step of one storage thread (hit query, IO batch, sync, backup) on every rank",
    _rule_storage_step,
    process_storage_step,
    draw=Draw(
        {"kind": OneOf(STEP_NAMES), "pick": PICK},
        _choose_step,
        lambda s: bool(_attached(s) and _attached(s).runnable()),  # type: ignore[union-attr]
    ),
    args=MappingProxyType({"kind": "str"}),
    walk=6.0,
    requires=lambda ctx, args: frozenset({STORAGE_STEPS_CAPABILITY}),  # its answer pins the step
)
PREFETCH = RuleRecord(
    "prefetch",
    FAMILY,
    "prefetch a chain in L3 after its parent (a hit query, then the tree's bounce buffer)",
    _rule_prefetch,
    process_prefetch,
    draw=Draw(
        {"pick": PICK},
        lambda s, d: {"pick": int(d["pick"])},
        lambda s: bool(_attached(s) and _attached(s).prefetch_candidates()),  # type: ignore[union-attr]
    ),
    refusable=True,
    args=MappingProxyType({"pick": "int"}),
    walk=4.0,
)
CHECK_PREFETCH = RuleRecord(
    "check_prefetch",
    FAMILY,
    "check_prefetch_progress: the policy terminates a prefetch or keeps it waiting",
    _rule_ongoing,
    process_check_prefetch,
    draw=Draw({"pick": PICK}, _choose_ongoing, _offered_ongoing),
    args=REQUEST_ARG,
)
TERMINATE_PREFETCH = RuleRecord(
    "terminate_prefetch",
    FAMILY,
    "terminate a prefetch now (an aborted request): [0:completed] is settled at once",
    _rule_ongoing,
    process_terminate_prefetch,
    draw=Draw({"pick": PICK}, _choose_ongoing, _offered_ongoing),
    args=REQUEST_ARG,
)
DRAIN_PREFETCH_ACKS = RuleRecord(
    "drain_prefetch_acks",
    FAMILY,
    "drain hits (revoke or allocate) and progress acks (insert, queue the tail's release)",
    lambda s, a: None if driver(s) is not None else "the world has no storage tier",
    process_drain_prefetch_acks,
    draw=Draw({}, _no_args, lambda s: driver(s) is not None),
    walk=2.0,
)
DRAIN_BACKUP_ACKS = RuleRecord(
    "drain_backup_acks",
    FAMILY,
    "drain backup acks (each frees its source pages, its host lock) and the release queue",
    lambda s, a: None if driver(s) is not None else "the world has no storage tier",
    process_drain_backup_acks,
    draw=Draw({}, _no_args, lambda s: driver(s) is not None),
    walk=2.0,
)
INJECT_FAULT = RuleRecord(
    "inject_fault",
    FAMILY,
    "arm a one-shot backend fault on one rank (miss, hole, short read, failed/dropped write, "
    "exception)",
    _rule_inject,
    process_inject_fault,
    draw=Draw(
        {"fault": OneOf(ARMABLE_FAULTS), "rank": Ints(0, 3), "pages": Ints(1, 2)},
        lambda s, d: {"fault": str(d["fault"]), "rank": int(d["rank"]), "pages": int(d["pages"])},
        _offered,
        in_machine=False,  # the machine arms faults through storage_round_trip
    ),
    args=MappingProxyType({"fault": "str", "rank": "int", "pages": "int"}),
)
DETACH_STORAGE = RuleRecord(
    "detach_storage",
    FAMILY,
    "detach every rank's backend: terminate, finish every op, stop, drain what is left",
    _needs_attached,
    process_detach_storage,
    draw=Draw({}, _no_args, _offered, in_machine=False),  # storage_round_trip's end
)
ATTACH_STORAGE = RuleRecord(
    "attach_storage",
    FAMILY,
    "attach the backends again at runtime (a new epoch; L3 kept its pages)",
    _rule_attach,
    process_attach_storage,
    draw=Draw({}, _no_args, lambda s: driver(s) is not None and not driver(s).attached),  # type: ignore[union-attr]
)
CLEAR_STORAGE = RuleRecord(
    "clear_storage",
    FAMILY,
    "one rank's clear endpoint (clear_storage_backend): its backend drops its own namespace",
    _rule_clear,
    process_clear_storage,
    draw=Draw(
        {"rank": Ints(0, 3)},
        lambda s, d: {"rank": int(d["rank"])},
        lambda s: _rule_clear(s, {}) is None,
    ),
    args=MappingProxyType({"rank": "int"}),
    walk=0.0,  # left to its story: a walk that clears at rest only empties L3 before prefetches
)
RESET_STORAGE_IN_FLIGHT = RuleRecord(
    "reset_storage_in_flight",
    FAMILY,
    "tree reset while storage work is queued or running on every rank",
    _rule_reset,
    process_reset_storage_in_flight,
    draw=Draw({}, _no_args, _work_in_flight),
    feeds_first=True,
    resets=True,
    walk=0.5,
)

RECORDS: tuple[RuleRecord, ...] = (
    WRITE_STORAGE,
    STORAGE_STEP,
    PREFETCH,
    CHECK_PREFETCH,
    TERMINATE_PREFETCH,
    DRAIN_PREFETCH_ACKS,
    DRAIN_BACKUP_ACKS,
    INJECT_FAULT,
    DETACH_STORAGE,
    ATTACH_STORAGE,
    CLEAR_STORAGE,
    RESET_STORAGE_IN_FLIGHT,
)
