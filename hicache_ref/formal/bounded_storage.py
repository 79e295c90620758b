"""Exhaustive small worlds of the storage tier: every interleaving of every rank's storage
threads, the tree and the faults, breadth-first, every invariant in every reachable state.

From ``initial_storage_state`` (or a given state), ``explore_storage`` applies every enabled op
of the world's universe (``oracle.storage.all_storage_ops``: each thread's next schedule point
with each outcome its backend call may draw, the collectives, the tree's calls, lost pages, a
reset) and runs ``check_storage_invariants`` on every new state. States are hashed (one visit
per state, or per state and running thread under a preemption bound; ranks that start alike are
renamed into one representative, ``canonical_key``), and breadth-first order
makes the first violation a shortest one: ``explore_storage`` returns it as a concrete op trace
that replays with ``oracle.storage.run_storage_ops``.

With ``lockstep=True`` the search moves as the harness grants (``lockstep_moves``): one move is
a thread kind advancing on every rank whose thread of that kind can move, with at most one
rank's call drawing another outcome than ``ok`` (the IO's ``get`` takes its termination check
with it, as the harness's wait grant does), so each trace it finds translates to harness steps
on any number of ranks (``harness/lockstep/from_storage_oracle``) and runs against an
implementation. Ranks are not renamed in that mode.

The preemption bound is CHESS's: a *preemption* is a switch away from a storage thread (or a
collective) that could still run, to any other actor; with ``preemptions=k`` only schedules of
at most k preemptions are explored (switches away from a blocked thread, and the tree's and the
faults' own moves, are free). ``None`` explores every interleaving.

CLI::

    python -m hicache_ref.formal.bounded_storage --ranks 2 --ops 2 --pages 3 --max-depth 30 \\
        --preemptions 2 [--variant io_ignores_termination]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hicache_ref.oracle.state import Violation, evolve
from hicache_ref.oracle.storage import (
    IO,
    THREADS,
    Advance,
    Collective,
    OpSpec,
    StorageConfig,
    StorageOp,
    StorageState,
    check_storage_invariants,
    initial_storage_state,
    make_storage_variant,
    run_storage_ops,
    storage_step,
)
from hicache_ref.oracle.storage.hit_query import collective_rule
from hicache_ref.oracle.storage.step import successor_ops, thread_ops

Actor = tuple[object, ...]
"""Who moves in an op: ``(rank, thread)``, ``("collective", group)``, ``("tree",)``, or in a
lockstep search ``("lockstep", thread)`` (that thread on every rank)."""
TREE: Actor = ("tree",)
Move = tuple[StorageOp, ...]
"""The ops one step of the search applies, in order (one op, or a lockstep grant)."""


def lockstep_moves(state: StorageState) -> list[Move]:
    """The moves of a search that grants as the harness does: each tree, fault or collective
    op alone; per thread kind, every rank whose thread of that kind can move advances, all
    ``ok`` or one rank's call with another outcome; an IO that takes a prefetch from its queue
    also takes the termination check after it (one grant runs both, unless lock points make
    the check a point of its own)."""
    moves: list[Move] = [(op,) for op in successor_ops(state) if not isinstance(op, Advance)]
    if not state.attached:
        return moves
    fused = not state.config.lock_points
    for thread in range(len(THREADS)):
        options = {r: thread_ops(state, r, thread) for r in range(len(state.ranks))}
        movers = [r for r, ops in options.items() if ops]
        if not movers:
            continue
        checks = tuple(
            Advance(r, IO)
            for r in movers
            if fused and thread == IO and state.ranks[r].threads[IO].point == "idle"
        )
        plain = {r: Advance(r, thread) for r in movers}
        moves.append((*plain.values(), *checks))
        for rank in movers:
            for op in options[rank]:
                if isinstance(op, Advance) and op.outcome != "ok":
                    drawn = tuple(op if r == rank else plain[r] for r in movers)
                    moves.append((*drawn, *checks))
    return moves


def actor_of(op: StorageOp) -> Actor:
    if isinstance(op, Advance):
        return (op.rank, op.thread)
    if isinstance(op, Collective):
        return ("collective", op.group)
    return TREE


def _actor_of_move(move: Move, lockstep: bool) -> Actor:
    op = move[0]
    if lockstep and isinstance(op, Advance):
        return ("lockstep", op.thread)
    return actor_of(op)


def _can_run(state: StorageState, actor: Actor) -> bool:
    """Whether the storage thread or collective ``actor`` has a next point it can take."""
    if actor == TREE:
        return False  # the tree and the faults are the test's driver: never preempted
    if actor[0] == "collective":
        return collective_rule(state, Collective(str(actor[1]))) is None
    if actor[0] == "lockstep":
        thread = int(str(actor[1]))
        return any(thread_ops(state, r, thread) for r in range(len(state.ranks)))
    return bool(thread_ops(state, int(str(actor[0])), int(str(actor[1]))))


@dataclass(frozen=True)
class StorageBoundedResult:
    """What one exploration found; ``trace`` replays ``violations`` from the start state."""

    config: StorageConfig
    states: int
    transitions: int
    depth: int
    preemptions: int | None
    elapsed_s: float
    complete: bool
    violations: tuple[Violation, ...] = ()
    trace: tuple[StorageOp, ...] = ()
    lockstep: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def states_per_s(self) -> float:
        return self.states / self.elapsed_s if self.elapsed_s > 0 else float(self.states)

    def summary(self) -> str:
        """The report the CLI prints: world, bound, counts, rate, and the shortest trace."""
        status = "exhausted" if self.complete else "bounded"
        status += ", harness grants" if self.lockstep else ""
        bound = "none" if self.preemptions is None else str(self.preemptions)
        lines = [
            f"world: {self.config.describe()}",
            f"preemption bound: {bound}  depth reached: {self.depth} ({status})",
            f"states explored: {self.states}  transitions: {self.transitions}",
            f"time: {self.elapsed_s:.2f} s  states/s: {self.states_per_s:.0f}",
        ]
        if self.ok:
            lines.append("no invariant violated")
        else:
            lines.append(f"VIOLATION after {len(self.trace)} ops:")
            lines += [f"  {v}" for v in self.violations]
            lines.append("shortest trace:")
            lines += [f"  {i:3d}. {op!r}" for i, op in enumerate(self.trace, start=1)]
        return "\n".join(lines)


Key = tuple[StorageState, Actor]


def rank_symmetric(config: StorageConfig) -> bool:
    """Whether the ranks start alike, so renaming them maps reachable states onto each other
    (every rule treats ranks alike: collectives and drains take the MIN, the rest is per rank)."""
    return config.ranks > 1 and len(set(config.preloaded or (0,))) == 1


def canonical_key(state: StorageState, actor: Actor) -> Key:
    """One representative per class of states equal up to renaming ranks: the ranks sorted
    (field by field, so the representative is the same in every process), the lost pages and
    the running thread renamed alike (a thread of one of several equal ranks: the first's). Only states without faults are stored (the search stops at
    the first), so fault messages naming ranks never need renaming."""
    ranks = state.ranks
    order = sorted(range(len(ranks)), key=ranks.__getitem__)  # records order field by field
    new_of = {old: new for new, old in enumerate(order)}
    if actor != TREE and actor[0] != "collective":  # among equal ranks, the first one runs
        rank = int(str(actor[0]))
        actor = (min(new_of[r] for r in range(len(ranks)) if ranks[r] == ranks[rank]), actor[1])
    if order == list(range(len(ranks))):
        return state, actor
    renamed = evolve(
        state,
        ranks=tuple(state.ranks[old] for old in order),
        lost=tuple(sorted((new_of[r], page) for r, page in state.lost)),
    )
    return renamed, actor


def explore_storage(
    config: StorageConfig,
    max_depth: int,
    *,
    preemptions: int | None = None,
    symmetry: bool = True,
    start: StorageState | None = None,
    max_states: int | None = None,
    on_level: Callable[[int, int, int], None] | None = None,
    lockstep: bool = False,
) -> StorageBoundedResult:
    """Breadth-first to ``max_depth`` moves under the preemption bound; stops at the first
    violating state. ``on_level(depth, frontier, states)`` reports each finished level; with
    ``symmetry`` (and ranks that start alike) states equal up to renaming ranks are one; with
    ``lockstep`` a move is a harness grant (``lockstep_moves``) and ranks keep their names."""
    result = _explore(
        config, max_depth, preemptions, symmetry, start, max_states, on_level, lockstep
    )
    return replace(result, lockstep=lockstep)


def _explore(
    config: StorageConfig,
    max_depth: int,
    preemptions: int | None,
    symmetry: bool,
    start: StorageState | None,
    max_states: int | None,
    on_level: Callable[[int, int, int], None] | None,
    lockstep: bool,
) -> StorageBoundedResult:
    began = time.perf_counter()
    root = start if start is not None else initial_storage_state(config)
    reduce = symmetry and rank_symmetric(config) and not lockstep

    def key_of(state: StorageState, actor: Actor) -> Key:
        return canonical_key(state, actor) if reduce else (state, actor)

    def moves_of(state: StorageState) -> list[Move]:
        return lockstep_moves(state) if lockstep else [(op,) for op in successor_ops(state)]

    def concrete(path: tuple[StorageOp, ...]) -> tuple[StorageOp, ...]:
        return path if lockstep else _concrete_trace(root, path, key_of, bounded)

    root_key: Key = key_of(root, TREE)
    parents: dict[Key, tuple[Key, Move] | None] = {root_key: None}
    spent: dict[Key, int] = {root_key: 0}
    bounded = preemptions is not None
    found = tuple(check_storage_invariants(root))
    if found:
        return _result(config, preemptions, parents, 0, 0, began, True, found, ())
    frontier: list[Key] = [root_key]
    transitions = 0
    depth = 0
    while frontier and depth < max_depth:
        following: list[Key] = []
        for key in frontier:
            state, last = key
            used = spent[key]
            last_runs = bounded and _can_run(state, last)
            for move in moves_of(state):
                actor = _actor_of_move(move, lockstep)
                cost = used + (1 if last_runs and actor != last else 0)
                if bounded and cost > preemptions:  # type: ignore[operator]
                    continue
                successor, taken = state, 0
                while taken < len(move) and not successor.faults:
                    successor, _ = storage_step(successor, move[taken])
                    taken += 1
                transitions += 1
                if successor.faults:  # a violation: report it on the concrete path
                    found = tuple(check_storage_invariants(successor))
                    trace = concrete((*_trace(parents, key), *move[:taken]))
                    return _result(
                        config, preemptions, parents, transitions, depth + 1, began, False,
                        found, trace,
                    )  # fmt: skip
                child: Key = key_of(successor, actor if bounded else TREE)
                if child in spent and spent[child] <= cost:
                    continue
                fresh = child not in spent
                spent[child] = cost
                if fresh:
                    parents[child] = (key, move)
                    violations = tuple(check_storage_invariants(successor))
                    if violations:
                        path = _trace(parents, child)
                        trace = concrete(path)
                        violations = tuple(check_storage_invariants(run_storage_ops(root, trace)))
                        return _result(
                            config, preemptions, parents, transitions, depth + 1, began, False,
                            violations, trace,
                        )  # fmt: skip
                following.append(child)
                if max_states is not None and len(parents) >= max_states:
                    return _result(
                        config, preemptions, parents, transitions, depth + 1, began, False, (), ()
                    )
        frontier = following
        depth += 1
        if on_level is not None:
            on_level(depth, len(frontier), len(parents))
    return _result(config, preemptions, parents, transitions, depth, began, not frontier, (), ())


def _concrete_trace(
    root: StorageState,
    path: tuple[StorageOp, ...],
    key_of: Callable[[StorageState, Actor], Key],
    bounded: bool,
) -> tuple[StorageOp, ...]:
    """Re-walk a path of ops recorded on representatives from the concrete ``root``: at each
    step the op whose successor is in the same class as the recorded one (ranks renamed)."""

    def class_of(state: StorageState, actor: Actor) -> tuple[Key, tuple[str, ...]]:
        # fault messages name ranks: a class compares the ids of its faults only
        ids = tuple(sorted(v.inv_id for v in state.faults))
        return key_of(evolve(state, faults=()), actor if bounded else TREE), ids

    state, actor = root, TREE
    concrete: list[StorageOp] = []
    for recorded in path:
        goal_state, _ = storage_step(key_of(state, actor)[0], recorded)
        goal = class_of(goal_state, actor_of(recorded))
        for op in successor_ops(state):
            successor, _ = storage_step(state, op)
            if class_of(successor, actor_of(op)) == goal:
                concrete.append(op)
                state, actor = successor, actor_of(op)
                break
        else:
            raise AssertionError(f"no concrete op follows {concrete} to the recorded class")
    return tuple(concrete)


def _trace(parents: dict[Key, tuple[Key, Move] | None], key: Key) -> tuple[StorageOp, ...]:
    moves: list[Move] = []
    link = parents[key]
    while link is not None:
        key, move = link
        moves.append(move)
        link = parents[key]
    return tuple(op for move in reversed(moves) for op in move)


def _result(
    config: StorageConfig,
    preemptions: int | None,
    parents: dict[Key, tuple[Key, Move] | None],
    transitions: int,
    depth: int,
    began: float,
    complete: bool,
    violations: tuple[Violation, ...],
    trace: tuple[StorageOp, ...],
) -> StorageBoundedResult:
    return StorageBoundedResult(
        config=config,
        states=len(parents),
        transitions=transitions,
        depth=depth,
        preemptions=preemptions,
        elapsed_s=time.perf_counter() - began,
        complete=complete,
        violations=violations,
        trace=trace,
    )


def build_storage_config(args: argparse.Namespace) -> StorageConfig:
    """The ``StorageConfig`` the CLI flags describe."""
    if args.op:
        specs = tuple(_parse_op(text, args.pages) for text in args.op)
    else:
        cycle = (OpSpec("prefetch", args.pages), OpSpec("backup", args.pages))
        specs = tuple(cycle[i % 2] for i in range(args.ops))
    preloaded = tuple(args.preloaded) if args.preloaded else (args.pages,) * args.ranks
    return StorageConfig(
        ranks=args.ranks,
        pages=args.pages,
        batch_pages=args.batch,
        ops=specs,
        preloaded=preloaded,
        max_faults=args.faults,
        max_resets=args.resets,
        terminations=not args.no_terminate,
        detach=args.detach,
        clear=args.clear,
        variant=make_storage_variant(*args.variant),
    )


def _parse_op(text: str, pages: int) -> OpSpec:
    kind, _, count = text.partition(":")
    if kind not in ("prefetch", "backup") or (count and not count.isdigit()):
        raise SystemExit(f"error: --op {text!r}: use prefetch[:PAGES] or backup[:PAGES]")
    return OpSpec(kind, int(count) if count else pages)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: explore, print the summary; exit 1 on a violation, 2 on bad input."""
    from hicache_ref.errors import HiCacheInputError

    parser = argparse.ArgumentParser(prog="python -m hicache_ref.formal.bounded_storage")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--ops", type=int, default=1, help="ops: prefetch, backup, prefetch...")
    parser.add_argument("--op", action="append", default=[], help="KIND[:PAGES] (repeatable)")
    parser.add_argument("--pages", type=int, default=2, help="pages in the chain")
    parser.add_argument("--batch", type=int, default=1, help="pages per backend call")
    parser.add_argument("--preloaded", type=int, nargs="*", help="pages in L3 per rank")
    parser.add_argument("--faults", type=int, default=1, help="non-ok outcomes and lost pages")
    parser.add_argument("--resets", type=int, default=1)
    parser.add_argument("--no-terminate", action="store_true")
    parser.add_argument("--detach", action="store_true")
    parser.add_argument("--clear", action="store_true")
    parser.add_argument("--max-depth", type=int, default=20)
    parser.add_argument("--preemptions", type=int, default=None, help="CHESS bound (none: all)")
    parser.add_argument("--max-states", type=int, default=None)
    parser.add_argument("--no-symmetry", action="store_true", help="keep rank-renamed states")
    parser.add_argument(
        "--lockstep", action="store_true", help="move as the harness grants (traces translate)"
    )
    parser.add_argument("--variant", action="append", default=[], help="planted bug flag")
    parser.add_argument("--progress", action="store_true", help="one line per level on stderr")
    args = parser.parse_args(argv)
    try:
        config = build_storage_config(args)
    except HiCacheInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def report(depth: int, frontier: int, states: int) -> None:
        print(f"depth {depth}: frontier {frontier}, states {states}", file=sys.stderr, flush=True)

    result = explore_storage(
        config,
        args.max_depth,
        preemptions=args.preemptions,
        symmetry=not args.no_symmetry,
        max_states=args.max_states,
        on_level=report if args.progress else None,
        lockstep=args.lockstep,
    )
    print(result.summary())
    if not result.ok:  # the search is deterministic: the same command finds the same trace
        replay = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        print(f"replay: python -m hicache_ref.formal.bounded_storage {replay}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
