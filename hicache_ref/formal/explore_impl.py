"""Stateless model checking of an implementation's storage threads: every interleaving of a
small world, each a fresh run from the start, through the schedule points.

``bounded_storage`` exhausts the pure oracle's worlds; this module runs the same kind of
enumeration against a real tier (the reference's, a mutant's, upstream 0.5.23's own threads)
in a harness world with ``storage_points``. A *choice* is one harness step: a thread kind run to
its next point (``storage_step``), a backend call's drawn outcome (``schedule_point``: ``hole``,
``raise``, ``defer``, ... within the world's fault budget), a drain of the tree, a termination,
a reset, or issuing one of the world's operations. A run replays a prefix of choices on a fresh
``Session`` and extends it depth-first with each state's first choice until nothing is enabled
or the depth bound is reached; ``Session.finish`` then runs the quiescence checks. The next run
takes the deepest choice not tried yet, so every interleaving within the bounds is run exactly
once (determinism is checked: a replayed prefix must offer the same choices again).

Bounds, in the order they prune: the world (1-2 ranks, 1-2 operations on chains of 2 pages,
batches of ``batch_pages``), the fault budget (``max_faults`` drawn outcomes per run), the
terminations and resets, CHESS's preemption bound (a *preemption* is a switch away from a
thread kind that could still move; the tree's moves are free after it), and ``max_depth``. A
violation (any harness check, or the storage oracle in lockstep) becomes a JSONL trace that
``hicache-fuzz replay`` runs; after one is found only shorter runs are explored, so the trace
reported is a shortest one within the bounds.

Worlds (``WORLDS``): ``backup`` (one backup of a 2-page chain, a reset), ``fetch`` (one
prefetch of a 2-page chain backed up first, a termination), ``fetch_batch2`` (the same with
batches of 2 pages: a hole inside a batch), ``backup_fetch`` (both, on different chains; for
campaigns).

CLI::

    python -m hicache_ref.formal.explore_impl --impl reference --world fetch --preemptions 2
    python -m hicache_ref.formal.explore_impl --impl sglang --sglang-src TREE --world backup
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.lockstep.oracle import attach_lockstep
from hicache_ref.harness.rules import storage as rules
from hicache_ref.harness.rules.schedule import SCHEDULE_POINT
from hicache_ref.harness.schedule.points import BACKEND_POINTS, position
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace
from hicache_ref.harness.world.config import HarnessConfig

TREE = "tree"
"""The actor of every step that is no storage thread's (drains, terminations, resets, ops)."""


@dataclass(frozen=True)
class ImplWorld:
    """One small world and its bounds."""

    name: str
    ops: tuple[
        str, ...
    ]  # "backup" / "fetch" (a prefetch), each issued once (a choice like any other)
    ranks: int = 1
    batch_pages: int = 1
    outcomes: tuple[str, ...] = ("hole", "raise", "defer")
    max_faults: int = 1
    terminations: int = 0
    resets: int = 0
    preemptions: int | None = 2
    max_depth: int = 40

    def config(self) -> HarnessConfig:
        return HarnessConfig(
            host_pages=24,
            storage_ranks=self.ranks,
            storage_batch_pages=self.batch_pages,
            storage_points=True,
            seed=0,
        )


WORLDS: dict[str, ImplWorld] = {
    "backup": ImplWorld("backup", ops=("backup",), resets=1),
    "fetch": ImplWorld("fetch", ops=("fetch",), terminations=1),
    "fetch_batch2": ImplWorld("fetch_batch2", ops=("fetch",), batch_pages=2),
    "backup_fetch": ImplWorld(
        "backup_fetch", ops=("backup", "fetch"), terminations=1, resets=1, max_faults=1
    ),
}
"""The worlds the command and the tests explore (``--world``)."""

OP_STEPS = {
    "backup": Step(rule=rules.WRITE_STORAGE.name, args={"pick": 1, "new": True}),  # a 2-page chain
    "fetch": Step(rule=rules.PREFETCH.name, args={"pick": 0}),
}


@dataclass
class Exploration:
    """What one exploration did: runs, seconds, the deepest run, and the first shortest
    violation (its trace, the error's id and message)."""

    world: ImplWorld
    runs: int = 0
    steps: int = 0
    depth: int = 0
    seconds: float = 0.0
    complete: bool = True  # False: stopped at ``max_runs`` (not every interleaving was run)
    violation: Trace | None = None
    inv_id: str = ""
    message: str = ""
    lockstep_steps: int = 0
    ids: dict[str, int] = field(default_factory=dict)  # violations found, by id

    def summary(self) -> str:
        bound = "none" if self.world.preemptions is None else self.world.preemptions
        found = (
            f"violation {self.inv_id} in {len(self.violation.steps)} steps"
            if self.violation is not None
            else "no violation"
        )
        return (
            f"world {self.world.name}: {self.runs} runs ({'all' if self.complete else 'stopped'}),"
            f" {self.steps} steps, depth {self.depth}, preemption bound {bound}, "
            f"{self.seconds:.1f} s; storage steps in lockstep {self.lockstep_steps}; {found}"
        )


def _actor(step: Step) -> str:
    if step.rule == rules.STORAGE_STEP.name:
        return str(step.args["kind"])
    if step.rule == SCHEDULE_POINT.name:
        return str(step.args["thread"])
    return TREE


def _setup(session: Session, world: ImplWorld) -> None:
    """A prefetch needs its chain in L3 first: one backup run to its end and drained (not
    explored: its interleavings are the ``backup`` world's)."""
    if "fetch" not in world.ops:
        return
    driver = session.storage
    assert driver is not None
    session.apply(OP_STEPS["backup"])
    for _ in range(200):
        runnable = driver.runnable()
        if not runnable:
            break
        session.apply(Step(rule=rules.STORAGE_STEP.name, args={"kind": runnable[0].value}))
    session.apply(Step(rule=rules.DRAIN_BACKUP_ACKS.name))


@dataclass(frozen=True)
class Choice:
    """One step of a run, and whether taking it was a preemption."""

    step: Step
    preempts: bool = False


def choices(session: Session, world: ImplWorld, path: Sequence[Choice]) -> list[Choice]:
    """Every step this world may take next after ``path``, within its bounds; the last actor's
    first (so a run's first interleaving has no preemption)."""
    driver = session.storage
    assert driver is not None
    taken = [c.step for c in path]
    used = {rule: sum(1 for s in taken if s.rule == rule) for rule in RULE_BUDGETS}
    steps = [OP_STEPS[op] for op in world.ops if OP_STEPS[op] not in taken]
    if driver.attached:
        runnable = driver.runnable()
        steps += [Step(rule=rules.STORAGE_STEP.name, args={"kind": k.value}) for k in runnable]
        if used[SCHEDULE_POINT.name] < world.max_faults:
            for kind in runnable:
                for rank, tier in enumerate(driver.l3.tiers):
                    at = position(tier, kind)
                    if at is None or at.kind not in BACKEND_POINTS:
                        continue
                    for outcome in world.outcomes:
                        for index in range(world.batch_pages if outcome == "hole" else 1):
                            args = {"thread": kind.value, "outcome": outcome, "rank": rank}
                            steps.append(Step(rule=SCHEDULE_POINT.name, args={**args, "at": index}))
    ranks = driver.storage_tree.ranks
    if min(r.cc.prefetch_hit_queue.qsize() + r.cc.ack_prefetch_queue.qsize() for r in ranks):
        steps.append(Step(rule=rules.DRAIN_PREFETCH_ACKS.name))
    if min(r.cc.ack_backup_queue.qsize() + r.cc.host_mem_release_queue.qsize() for r in ranks):
        steps.append(Step(rule=rules.DRAIN_BACKUP_ACKS.name))
    if used[rules.TERMINATE_PREFETCH.name] < world.terminations:
        steps += [
            Step(rule=rules.TERMINATE_PREFETCH.name, args={"request": r}) for r in driver.ongoing()
        ]
    if used[rules.RESET_STORAGE_IN_FLIGHT.name] < world.resets and driver.attached:
        step = Step(rule=rules.RESET_STORAGE_IN_FLIGHT.name)
        if session.is_enabled(step):
            steps.append(step)
    return _bounded(steps, world, path)


RULE_BUDGETS = (
    SCHEDULE_POINT.name,
    rules.TERMINATE_PREFETCH.name,
    rules.RESET_STORAGE_IN_FLIGHT.name,
)


def _bounded(steps: list[Step], world: ImplWorld, path: Sequence[Choice]) -> list[Choice]:
    """CHESS: switching away from a thread kind that could still move is a preemption."""
    last = _actor(path[-1].step) if path else TREE
    same = [Choice(s) for s in steps if _actor(s) == last]
    if last == TREE or not same:
        return [Choice(s) for s in steps]  # after the tree's move, or a blocked thread: free
    spent = sum(1 for c in path if c.preempts)
    if world.preemptions is not None and spent >= world.preemptions:
        return same
    return same + [Choice(s, preempts=True) for s in steps if _actor(s) != last]


class NondeterminismError(HiCacheInputError):
    """A replayed prefix offered other choices than the run that chose it (the run depends on
    something outside its steps)."""


def explore(
    implementation: Callable[[], Implementation],
    impl_name: str,
    world: ImplWorld,
    *,
    lockstep: bool = True,
    max_runs: int | None = None,
    stop_at_first: bool = False,
) -> Exploration:
    """Run every interleaving of ``world`` against ``implementation()`` (a fresh one per run)."""
    result = Exploration(world)
    start = time.perf_counter()
    frames: list[list[Choice]] = []  # per depth: the choices offered there
    picks: list[int] = []  # per depth: the one this run takes
    depth_bound = world.max_depth
    while True:
        if max_runs is not None and result.runs >= max_runs:
            result.complete = False
            break
        error, session, taken = _run(
            implementation, impl_name, world, frames, picks, depth_bound, lockstep
        )
        result.runs += 1
        result.steps += len(taken)
        result.depth = max(result.depth, len(taken))
        result.lockstep_steps += session.stats.lockstep.get("storage_steps_in_lockstep", 0)
        if error is not None:
            inv_id = str(getattr(error, "inv_id", type(error).__name__))
            result.ids[inv_id] = result.ids.get(inv_id, 0) + 1
            if result.violation is None or len(session.steps) < len(result.violation.steps):
                result.violation = session.trace(note=f"explore_impl {world.name}: {inv_id}")
                result.inv_id, result.message = inv_id, str(error)
            if stop_at_first:
                break
            depth_bound = min(depth_bound, len(taken) - 1)  # only shorter runs from now on
        session.close()
        # backtrack: the deepest depth with a choice not taken yet, within the depth bound
        del frames[depth_bound:], picks[depth_bound:]
        while picks and picks[-1] + 1 >= len(frames[-1]):
            frames.pop()
            picks.pop()
        if not picks:
            break
        picks[-1] += 1
    result.seconds = time.perf_counter() - start
    return result


def _run(
    implementation: Callable[[], Implementation],
    impl_name: str,
    world: ImplWorld,
    frames: list[list[Choice]],
    picks: list[int],
    depth_bound: int,
    lockstep: bool,
) -> tuple[BaseException | None, Session, list[Choice]]:
    """One run: the prefix ``picks`` names, then each state's first choice (appended to
    ``frames``/``picks``) until none is left or the depth bound; then the quiescence checks."""
    session = Session(world.config(), implementation(), impl_name)
    if lockstep:
        attach_lockstep(session, enabled=True)
    taken: list[Choice] = []
    try:
        _setup(session, world)
        depth = 0
        while depth < depth_bound:
            offered = choices(session, world, taken)
            if depth < len(picks):
                # Verify the run is deterministic: a replayed prefix offers what it offered
                if offered != frames[depth]:
                    raise NondeterminismError(
                        f"explore_impl: at depth {depth} the replayed run offers "
                        f"{[c.step.render() for c in offered]}, the first run offered "
                        f"{[c.step.render() for c in frames[depth]]} (a run must depend on its "
                        "steps only)"
                    )
            elif offered:
                frames.append(offered)
                picks.append(0)
            else:
                break
            choice = frames[depth][picks[depth]]
            taken.append(choice)
            session.apply(choice.step)
            depth += 1
        session.finish()
    except NondeterminismError:
        raise
    except Exception as error:  # a violation: the run's trace is the finding
        return error, session, taken
    return None, session, taken


def implementation_factory(impl: str, source: str = "") -> Callable[[], Implementation]:
    """A fresh implementation per run: ``reference``, ``mutant:<name>``, or ``sglang`` (the
    tree ``source``, by default 0.5.23's wheel)."""
    from hicache_ref.harness.adapters.registry import get_implementation

    if impl == "sglang" and not source:
        from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree

        source = str(fetch_wheel_tree("0.5.23"))
    get_implementation(impl, source)  # an unknown name fails here, once
    return lambda: get_implementation(impl, source)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hicache_ref.formal.explore_impl",
        description="Every interleaving of a small storage world, run against an implementation "
        "through the schedule points (each a fresh run from the start).",
    )
    parser.add_argument("--impl", default="reference", help="reference | sglang | mutant:<name>")
    parser.add_argument("--sglang-src", default="", help="the sglang tree (--impl sglang)")
    parser.add_argument("--world", default="fetch", help=f"one of {sorted(WORLDS)}")
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--preemptions", type=int, default=None, help="-1: unbounded")
    parser.add_argument("--max-depth", type=int, default=None)
    parser.add_argument("--max-faults", type=int, default=None)
    parser.add_argument("--max-runs", type=int, default=None)
    parser.add_argument("--no-lockstep", action="store_true", help="leave the storage oracle out")
    parser.add_argument(
        "--out", default="explore_impl_traces", help="where a violation's trace goes"
    )
    args = parser.parse_args(argv)
    world = WORLDS.get(args.world)
    if world is None:
        print(f"error: unknown --world {args.world!r}; legal: {sorted(WORLDS)}", file=sys.stderr)
        return 2
    if args.ranks is not None:
        world = replace(world, ranks=args.ranks)
    if args.preemptions is not None:
        world = replace(world, preemptions=None if args.preemptions < 0 else args.preemptions)
    if args.max_depth is not None:
        world = replace(world, max_depth=args.max_depth)
    if args.max_faults is not None:
        world = replace(world, max_faults=args.max_faults)
    try:
        factory = implementation_factory(args.impl, args.sglang_src)
    except HiCacheInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)  # the threads log each fault
    result = explore(
        factory, args.impl, world, lockstep=not args.no_lockstep, max_runs=args.max_runs
    )
    print(result.summary())
    if result.violation is None:
        return 0
    name = f"{args.impl.replace(':', '_')}_{world.name}_{result.inv_id}.jsonl"
    path = result.violation.write(Path(args.out) / name)
    print(f"{result.inv_id}: {result.message}")
    for index, step in enumerate(result.violation.steps):
        print(f"  {index:2d} {step.render()}")
    print(f"replay: hicache-fuzz replay {path}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
