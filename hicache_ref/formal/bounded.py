"""Bounded model checking of the oracle: breadth-first over every enabled op, every invariant.

From the initial state (or a given one), ``explore`` applies every enabled op of the finite
universe (``oracle.step.all_ops``), keeps one canonical representative per symmetry class
(``canonical``), and runs ``check_invariants`` on every new state. Breadth-first order makes the
first violation a shortest one; ``explore`` returns it with a *concrete* trace (an op list that
replays from the start state with ``oracle.run_ops``, so the lead can feed it to a controller).

CLI::

    python -m hicache_ref.formal.bounded --nodes 2 --layers 2 --pages 2 --cp 2 --draft 1 \\
        --max-depth 12 [--variant no_fence_before_d2h] [--no-symmetry]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hicache_ref.formal.canonical import canonicalize, node_groups
from hicache_ref.oracle.config import OracleConfig, make_variant
from hicache_ref.oracle.invariants import check_invariants
from hicache_ref.oracle.ops import Op
from hicache_ref.oracle.state import OracleState, Violation, evolve, initial_state
from hicache_ref.oracle.step import all_ops, enabled_ops, step


@dataclass(frozen=True)
class BoundedResult:
    """What one exploration found; ``trace`` replays ``violations`` from ``start``."""

    config: OracleConfig
    states: int
    transitions: int
    depth: int
    elapsed_s: float
    complete: bool
    violations: tuple[Violation, ...] = ()
    trace: tuple[Op, ...] = ()

    @property
    def states_per_s(self) -> float:
        return self.states / self.elapsed_s if self.elapsed_s > 0 else float(self.states)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        """The report the CLI prints: counts, rate, and the shortest failing trace if any."""
        status = "exhausted" if self.complete else "bounded"
        lines = [
            f"config: {self.config.describe()}",
            f"states explored: {self.states}  transitions: {self.transitions}  "
            f"depth reached: {self.depth} ({status})",
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


def explore(
    config: OracleConfig,
    max_depth: int,
    *,
    start: OracleState | None = None,
    symmetry: bool = True,
    include_reset: bool = True,
    max_states: int | None = None,
    on_level: Callable[[int, int, int], None] | None = None,
) -> BoundedResult:
    """Breadth-first search to ``max_depth`` ops; stops at the first violating state.

    ``on_level(depth, frontier, states)`` is called after each completed level (progress).
    """
    began = time.perf_counter()
    universe = all_ops(config, include_reset=include_reset)
    groups = node_groups(config)

    def canon(state: OracleState) -> OracleState:
        return canonicalize(state, groups) if symmetry else state

    root = start if start is not None else initial_state(config)
    root_canon = canon(root)
    parents: dict[OracleState, tuple[OracleState, Op] | None] = {root_canon: None}
    initial_violations = tuple(check_invariants(root))
    if initial_violations:
        return _result(config, parents, 0, 0, began, True, initial_violations, ())
    frontier = [root_canon]
    transitions = 0
    depth = 0
    while frontier and depth < max_depth:
        following: list[OracleState] = []
        for state in frontier:
            for op in enabled_ops(state, universe):
                successor, _ = step(state, op)
                transitions += 1
                if successor == state:
                    continue
                canonical = canon(successor)
                if canonical in parents:
                    continue
                parents[canonical] = (state, op)
                violations = check_invariants(canonical)
                if violations:
                    trace, final = _concrete_trace(root, canonical, parents, canon, universe)
                    found = tuple(check_invariants(final))
                    return _result(
                        config, parents, transitions, depth + 1, began, False, found, trace
                    )
                following.append(canonical)
                if max_states is not None and len(parents) >= max_states:
                    return _result(config, parents, transitions, depth + 1, began, False, (), ())
        frontier = following
        depth += 1
        if on_level is not None:
            on_level(depth, len(frontier), len(parents))
    return _result(config, parents, transitions, depth, began, not frontier, (), ())


def _result(
    config: OracleConfig,
    parents: dict[OracleState, tuple[OracleState, Op] | None],
    transitions: int,
    depth: int,
    began: float,
    complete: bool,
    violations: tuple[Violation, ...],
    trace: tuple[Op, ...],
) -> BoundedResult:
    return BoundedResult(
        config=config,
        states=len(parents),
        transitions=transitions,
        depth=depth,
        elapsed_s=time.perf_counter() - began,
        complete=complete,
        violations=violations,
        trace=trace,
    )


def _concrete_trace(
    root: OracleState,
    target: OracleState,
    parents: dict[OracleState, tuple[OracleState, Op] | None],
    canon: Callable[[OracleState], OracleState],
    universe: tuple[Op, ...],
) -> tuple[tuple[Op, ...], OracleState]:
    """Re-walk the canonical path from ``root`` with concrete ops (node ids as ``root`` has them).

    Returns the trace and the concrete state it ends in (whose faults name concrete ids).
    """
    path: list[OracleState] = [target]
    link = parents[target]
    while link is not None:
        path.append(link[0])
        link = parents[link[0]]
    path.reverse()
    state = root
    trace: list[Op] = []
    for goal in path[1:]:
        for op in enabled_ops(state, universe):
            successor, _ = step(state, op)
            if _same_class(canon(successor), goal):
                trace.append(op)
                state = successor
                break
        else:
            raise AssertionError(f"no concrete op reaches the canonical state after {trace}")
    return tuple(trace), state


def _same_class(left: OracleState, right: OracleState) -> bool:
    """Equal canonical states, comparing faults by invariant id only (messages name labels)."""
    if not left.faults and not right.faults:
        return left == right
    ids = sorted(v.inv_id for v in left.faults) == sorted(v.inv_id for v in right.faults)
    return ids and evolve(left, faults=()) == evolve(right, faults=())


def build_config(args: argparse.Namespace) -> OracleConfig:
    """The ``OracleConfig`` the CLI flags describe."""
    tokens = tuple(args.tokens) if args.tokens else (args.page_size,) * args.nodes
    return OracleConfig(
        page_size=args.page_size,
        layer_num=args.layers,
        draft_layer_num=args.draft,
        device_pages=args.pages,
        host_pages=args.host_pages or args.pages,
        draft_host_pages=args.host_pages or args.pages,
        cp_size=args.cp,
        num_counters=args.counters,
        node_tokens=tokens,
        variant=make_variant(*args.variant),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: explore, print the summary, exit 1 on a violation."""
    parser = argparse.ArgumentParser(prog="python -m hicache_ref.formal.bounded")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--draft", type=int, default=0, help="draft layers (0 = no draft pool)")
    parser.add_argument("--pages", type=int, default=2, help="device pages")
    parser.add_argument(
        "--host-pages", type=int, default=0, help="host pages per rank (default: --pages)"
    )
    parser.add_argument("--page-size", type=int, default=2)
    parser.add_argument(
        "--tokens", type=int, nargs="*", help="tokens per node (default: one page each)"
    )
    parser.add_argument("--cp", type=int, default=0, help="CP ranks (0 = plain controller)")
    parser.add_argument("--counters", type=int, default=5, help="producer slots (num_counters)")
    parser.add_argument("--max-depth", type=int, default=10)
    parser.add_argument("--max-states", type=int, default=None)
    parser.add_argument(
        "--variant", action="append", default=[], help="planted bug flag (repeatable)"
    )
    parser.add_argument("--no-symmetry", action="store_true")
    parser.add_argument("--no-reset", action="store_true")
    parser.add_argument("--progress", action="store_true", help="one line per level on stderr")
    parser.add_argument(
        "--trace-out",
        default="fuzz/out/bounded-counterexample.jsonl",
        help="where a violation's shortest trace is written as a harness trace",
    )
    parser.add_argument(
        "--impl", default="reference", help="implementation the written trace replays on"
    )
    args = parser.parse_args(argv)

    def report(depth: int, frontier: int, states: int) -> None:
        print(f"depth {depth}: frontier {frontier}, states {states}", file=sys.stderr, flush=True)

    result = explore(
        build_config(args),
        args.max_depth,
        symmetry=not args.no_symmetry,
        include_reset=not args.no_reset,
        max_states=args.max_states,
        on_level=report if args.progress else None,
    )
    print(result.summary())
    if not result.ok:
        from pathlib import Path

        from hicache_ref.harness.lockstep.from_oracle import trace_for_ops

        note = "; ".join(f"{v.inv_id}: {v.message}" for v in result.violations)[:500]
        trace = trace_for_ops(result.trace, result.config, implementation=args.impl, note=note)
        path = trace.write(Path(args.trace_out))
        print(f"replay on a controller: hicache-fuzz replay {path} [--impl mutant:<name>]")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
