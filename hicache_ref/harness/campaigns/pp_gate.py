"""The PP gate: Hypothesis draws programs of the PP tree half's steps on fresh PP worlds.

A PP world (``HarnessConfig.storage_pp``, capability ``storage:pp``: 0.5.21+'s hybrid controller)
is driven by ``driver/pp_tree.PpTree``, not by the state machine's rules: its tree half is the
unified radix cache's PP path (PP rank 0 submits, the others follow the tickets), which the
machine's storage rules do not model. A case draws the world's faults and a program of steps;
``run_program`` applies it and ends the case by releasing every request and running every thread
to idle, so every ticket is retired and judged (INV-38 after every step). ``run_pp_gate`` runs
cases until its budget is spent or one fails; Hypothesis then shrinks the failing program.

- ``PpProgram``: the drawn world (faults, backend, schedule points: three in four worlds park
  the command threads at every point of their loop bodies, so a submit, a release or another
  thread's step lands between a ticket's query, allocation and state lookups; three in four of
  those park the IO, sync and backup threads too, at the points any storage world with points
  parks them at, and three in four of those the IO before each host page it writes, so a
  release or a progress check lands between two batches of a ticket's IO or inside its sync
  thread's publication; about a quarter of the worlds have a draft pool riding on the KV's
  slots, so every ticket carries its pool spec and every IO reads its sidecar pages, about a
  quarter an independent SWA side pool with a window of 1 - 3 pages, so every ticket's spec names
  a window each rank allocates from its own side pool and its IO re-aligns to the served hit, and
  about a quarter a Mamba state pool, so every ticket's spec names the one state page, a slot
  each rank allocates and its IO keys by the served hit's last page,
  ``pp_side``: INV-38 on its slots, INV-39 on its bytes) and steps (``PpOp``: a verb
  and a number the verb reads as its pick; the runs of steps and the search rounds below);
- ``pp_worlds``: the worlds (``WORLDS``) an implementation's capabilities admit: a side pool's
  world needs its window in L3 (``storage:swa``, ``storage:mamba``);
- ``apply_op``, ``judge_verdicts``, ``finish_verdicts``: a step on the tree; a ``progress``
  step also polls the world's cache-mode prefetch (``driver/pp_verdict``: every rank's timeout
  verdict, PP rank 0's handed along PP, judged by INV-38), which the case's end polls until its
  verdict ends it;
- ``run_program``: one case; raises what the world raised (an ``InvariantViolation`` names its
  id; anything else upstream's code raised on the scheduler side is a failure too);
- ``run_pp_gate``: the budgeted search, its ``PpGateReport`` (cases, checks, the failure).
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky, NoSuchExample

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import (
    STORAGE_MAMBA_CAPABILITY,
    STORAGE_SWA_CAPABILITY,
    Implementation,
)
from hicache_ref.harness.campaigns.known_findings import KnownFinding, match_known_finding
from hicache_ref.harness.campaigns.literal_pool import pinned_literal_pool
from hicache_ref.harness.driver.pp_tree import PpTree
from hicache_ref.harness.driver.pp_verdict import PpVerdicts
from hicache_ref.harness.driver.pp_world import pp_config
from hicache_ref.harness.schedule.points import ALL_REDUCE, BATCH_GET, LOCK, PAGE_WRITE, PUT, WAIT

VERBS = (
    "back_up",
    "submit",
    "fetch",
    "relay",
    "command",
    "point",
    "io",
    "sync",
    "progress",
    "release",
    "reset",
)
"""The steps of a program, in the order a request meets them."""
DRAWN_VERBS = (*VERBS, "fetch", "io", "io", "sync", "release")
"""The verbs a program draws from: a request's own steps twice as often (the IO thrice), so a
program of a dozen steps often takes a request through its ticket's IO body with a release or
a progress check landing inside it (``fetch``: a submit and the command threads' rounds that
stage every queued ticket, this one last: the usual order, one step)."""
RUN_STEPS_MAX = 4
RUNS_MAX = 6
STEPS_MAX = RUN_STEPS_MAX * RUNS_MAX
"""A program's steps come in runs of 1 - 4 (about 15 steps on average, where one flat list
drew about 6), and shrink to a single step."""
CHAIN_PAGES_MAX = 4
CASES_MAX = 10_000
ROUND_CASES = 100
"""Cases of one search round: each round starts Hypothesis afresh (its own random), since
one search draws its programs as variations of a few (a window needs several verbs in order)."""
ASSUMED_PICKS = 4
"""A ``submit`` or ``fetch`` whose pick is at least this hands the tree's belief of the span's
stored end (``storage_hit_end``): the span is cut there and submitted with ``assume_stored``."""
FETCH_ROUNDS_MAX = STEPS_MAX + 1
"""A ``fetch`` runs the command threads' rounds until no ticket is queued (at most one per
submit a program can hold)."""
STOPS: dict[StorageStepKind, tuple[str, ...]] = {
    StorageStepKind.IO: (LOCK, BATCH_GET, PAGE_WRITE, PUT, WAIT),
    StorageStepKind.SYNC: (ALL_REDUCE, LOCK, PUT, WAIT),
}
"""With storage points, an ``io`` or ``sync`` step runs every rank's thread of its kind point
by point until one parks at the kind of point its pick names (``wait``: its body ended), so
one step reaches any window of a body (a page write is its IO's fourth point)."""


@dataclass(frozen=True)
class PpOp:
    verb: str
    pick: int

    def describe(self) -> str:
        return f"{self.verb}({self.pick})"


@dataclass(frozen=True)
class PpProgram:
    faults: bool
    backend: str
    points: bool  # the command threads park at every schedule point of their loop bodies
    ops: tuple[PpOp, ...]
    storage_points: bool = False  # (with points) so do the IO, sync and backup threads
    page_points: bool = False  # (with storage points) the IO before each host page it writes
    sidecar: bool = False  # a draft pool rides on the KV's slots: every ticket carries its spec
    swa_window: int = 0  # an independent SWA side pool: every ticket names a window of this many
    # pages, allocated by each rank from the side pool's own slots (0: none)
    mamba: bool = False  # a Mamba state pool: every ticket names its one state page (one slot)

    def describe(self) -> str:
        steps = " ".join(op.describe() for op in self.ops)
        threads = f" storage_points={self.storage_points}" if self.storage_points else ""
        pages = f" page_points={self.page_points}" if self.page_points else ""
        sidecar = " sidecar=True" if self.sidecar else ""
        sidecar += f" swa_window={self.swa_window}" if self.swa_window else ""
        sidecar += " mamba=True" if self.mamba else ""
        world = f"faults={self.faults} backend={self.backend} points={self.points}"
        return f"{world}{threads}{pages}{sidecar}: {steps}"


WORLDS = ("anchor", "sidecar", "swa", "mamba")
"""A PP world's pool group (``world_of``)."""
WORLD_NEEDS = {"swa": STORAGE_SWA_CAPABILITY, "mamba": STORAGE_MAMBA_CAPABILITY}
"""The capability a PP world of an independent side pool needs of its tree besides
``storage:pp`` (its window in L3: every tree with PP tickets, 0.5.21+, has both)."""


def pp_worlds(capabilities: Collection[str]) -> tuple[str, ...]:
    """The ``WORLDS`` a PP gate of an implementation with ``capabilities`` draws."""
    return tuple(w for w in WORLDS if w not in WORLD_NEEDS or WORLD_NEEDS[w] in capabilities)


def world_picks(first: int = 0, worlds: tuple[str, ...] = WORLDS) -> st.SearchStrategy[str]:
    """The world's pool group, ``WORLDS`` rotated to start at ``first``. Hypothesis' generation
    favours a strategy's first item (measured with three worlds: 50 / 25 / 25), so the gate rotates
    the order each search round (``programs_of_round``) and over rounds every world is drawn
    about as often; a failing program shrinks towards its round's first world."""
    first %= len(worlds)
    return st.sampled_from(worlds[first:] + worlds[:first])


def world_of(program: PpProgram) -> str:
    """Which of ``WORLDS`` a program's world is."""
    if program.mamba:
        return "mamba"
    return "swa" if program.swa_window else "sidecar" if program.sidecar else "anchor"


def _in_world(program: PpProgram, world: str, window: int) -> PpProgram:
    """``program`` in a world of pool group ``world`` (an SWA one with a ``window``-page window),
    each kind of point nested in the last."""
    program = _nested(program)
    window = window if world == "swa" else 0
    return replace(program, sidecar=world == "sidecar", swa_window=window, mamba=world == "mamba")


def _nested(program: PpProgram) -> PpProgram:
    """Each kind of point only inside the last: page points need storage points, which need
    points (what ``PpTree`` accepts)."""
    storage_points = program.points and program.storage_points
    return replace(
        program,
        storage_points=storage_points,
        page_points=storage_points and program.page_points,
    )


FIRST = PpOp("back_up", 1)
OPS = st.builds(PpOp, verb=st.sampled_from(DRAWN_VERBS), pick=st.integers(0, 7))


MOSTLY = st.sampled_from([True, True, True, False])
"""Three worlds in four: the command threads' points, then the storage threads' too, then the
page points (each inside the last; every kind of world is still drawn)."""


def programs(
    *, storage_points: bool = True, first_world: int = 0, worlds: tuple[str, ...] = WORLDS
) -> st.SearchStrategy[PpProgram]:
    """Programs as the gate draws them; ``storage_points=False`` the same draw with the storage
    threads always running whole loop bodies (a baseline: what points inside them add);
    ``first_world``: the world of ``worlds`` the draw favours (``world_picks``)."""
    return st.builds(
        PpProgram,
        faults=st.booleans(),
        backend=st.sampled_from(["memory", "file"]),
        points=MOSTLY,
        ops=st.lists(
            st.lists(OPS, min_size=1, max_size=RUN_STEPS_MAX), min_size=1, max_size=RUNS_MAX
        ).map(lambda runs: (FIRST, *(op for run in runs for op in run))),
        storage_points=MOSTLY if storage_points else st.just(False),
        page_points=MOSTLY,
    ).flatmap(
        lambda program: st.builds(
            _in_world, st.just(program), world_picks(first_world, worlds), st.integers(1, 3)
        )
    )


PROGRAMS = programs()
"""A program starts with a chain in L3, so its first submit has something to fetch."""


@functools.cache
def _round_programs(first: int, worlds: tuple[str, ...]) -> st.SearchStrategy[PpProgram]:
    return programs(first_world=first, worlds=worlds)


def programs_of_round(
    round_index: int, worlds: tuple[str, ...] = WORLDS
) -> st.SearchStrategy[PpProgram]:
    """What the gate's search round ``round_index`` draws: programs of ``worlds`` favouring
    world ``round_index`` mod their number, so the gate's rounds share the worlds about evenly."""
    return _round_programs(round_index % len(worlds), worlds)


def _pick(items: list[str], pick: int) -> str | None:
    return items[pick % len(items)] if items else None


def apply_op(tree: PpTree, op: PpOp, verdicts: PpVerdicts | None = None) -> None:
    """One step of a program on ``tree`` (a step with nothing to act on does nothing); a
    ``progress`` step also polls the world's cache-mode prefetch (``verdicts``)."""
    if op.verb == "progress" and verdicts is not None and verdicts.drives:
        verdicts.poll(op.pick)
        judge_verdicts(tree, verdicts)
    live = sorted(tree.live)
    if op.verb == "back_up":
        pages = 1 + op.pick % CHAIN_PAGES_MAX
        if tree.has_room(pages):  # staged tickets may hold every host slot
            tree.back_up(pages)
    elif op.verb in ("submit", "fetch") and tree.chains:
        chain = tree.chains[op.pick % len(tree.chains)]
        skip = (op.pick // len(tree.chains)) % (len(chain.tokens) // tree.page)
        tree.submit(chain, skip, assume=op.pick >= ASSUMED_PICKS)
        for _ in range(FETCH_ROUNDS_MAX if op.verb == "fetch" else 0):
            if not tree.command_step():  # every queued ticket staged, this one last
                break
    elif op.verb == "command":
        tree.command_step()
    elif op.verb == "point":
        tree.command_point(op.pick % 2)
    elif op.verb in ("io", "sync"):
        kind = StorageStepKind(op.verb)
        if not tree.storage_points:
            tree.storage_step(kind)
        else:  # on to the next point of the kind the pick names (a body's end: its wait)
            stops = STOPS[kind]
            tree.storage_to(kind, stops[op.pick % len(stops)])
    elif op.verb == "reset":
        tree.reset()
    else:
        rid = _pick(live, op.pick)
        if rid is None:
            return
        if op.verb == "relay":
            tree.relay(rid)
        elif op.verb == "progress":
            tree.check_progress(rid)
        elif op.verb == "release":
            tree.release(rid)


VERDICT_POLLS_MAX = 16
FINAL_POLL_PICK = 1
"""At a case's end the open cache-mode prefetch is polled until its verdict ends it (a pick
that lands nothing and moves the follower's clock faster than PP rank 0's)."""


def judge_verdicts(tree: PpTree, verdicts: PpVerdicts) -> None:
    """INV-38 on the verdicts polled since the last look (PP rank 0's, handed along PP)."""
    records = verdicts.take_records()
    if records:
        tree.checks.run("INV-38", replace(tree.snapshot(), pp_verdicts=records))


def finish_verdicts(tree: PpTree, verdicts: PpVerdicts) -> None:
    """Poll the open cache-mode prefetch until the ranks' verdict ends it."""
    for _ in range(VERDICT_POLLS_MAX):
        if not verdicts.operations:
            break
        verdicts.poll(FINAL_POLL_PICK)
        judge_verdicts(tree, verdicts)


def run_program(implementation: Implementation, program: PpProgram, seed: int = 0) -> PpTree:
    """One case: a fresh PP world, the program, then every request released and run to idle."""
    config = pp_config(
        sidecar=program.sidecar,
        swa_window=program.swa_window,
        mamba=program.mamba,
        storage_faults=program.faults,
        storage_backend=program.backend,
        seed=seed,
    )
    tree = PpTree(
        implementation,
        config,
        points=program.points,
        storage_points=program.storage_points,
        page_points=program.page_points,
    )
    source = Path(implementation.source_tree) if implementation.source_tree else Path("-")
    verdicts = PpVerdicts(source, tree.hybrid, tree.page, len(tree.cc))
    try:
        for op in program.ops:
            apply_op(tree, op, verdicts)
        finish_verdicts(tree, verdicts)
        tree.finish()
    finally:
        tree.storage.close()
    return tree


@dataclass
class PpGateReport:
    """What one PP gate run did and found."""

    cases: int = 0
    cases_at_failure: int = 0  # the case that first failed (the rest of ``cases``: shrinking)
    checks: dict[str, int] = field(default_factory=dict)
    failure: str = ""  # the violation's id (or the exception's type) and message
    failure_id: str = ""  # the invariant id, when a check fired
    program: str = ""  # the shrunk failing program
    found: PpProgram | None = None  # that program itself (what a program file replays)
    flaky: bool = False  # the failure did not repeat on a replay (thread timing): the first one
    known_hits: dict[str, int] = field(default_factory=dict)  # cases a known finding explained
    worlds: dict[str, int] = field(default_factory=dict)  # cases per pool group (WORLDS)

    @property
    def failed(self) -> bool:
        return bool(self.failure)


def run_pp_gate(
    implementation: Implementation,
    *,
    seconds: float,
    seed: int = 0,
    known: Sequence[KnownFinding] = (),
    impl: str = "sglang",
    release: str | None = None,
    drawn: st.SearchStrategy[PpProgram] | None = None,
    cases_max: int | None = None,
) -> PpGateReport:
    """Draw programs (``drawn``, by default each round's ``programs_of_round`` of the worlds
    the implementation's capabilities admit, ``pp_worlds``) until
    ``seconds`` are spent, ``cases_max`` programs ran (the case budget: the same programs on a
    busy host as on an idle one) or one fails (then shrink it). A case whose
    failure one of ``known`` explains (for ``impl`` at ``release``) is counted, not failed: a
    PP world on 0.5.21 meets F26 (the IO thread dies of a backend exception) under faults."""
    report = PpGateReport()
    worlds = pp_worlds(implementation.capabilities)
    deadline = time.monotonic() + seconds
    shrink_deadline = deadline + seconds  # shrinking a failure gets as long again

    first: list[tuple[str, str, PpProgram]] = []  # the first failure: (failure, id, program)

    def failed(program: PpProgram, failure: str, failure_id: str) -> None:
        report.failure, report.failure_id = failure, failure_id
        if not first:
            first.append((failure, failure_id, program))
            report.cases_at_failure = report.cases

    def keep_first() -> None:  # the shrunk failure did not repeat: the first one stands
        report.failure, report.failure_id, report.found = first[0]
        report.program = report.found.describe()
        report.flaky = True

    def fails(program: PpProgram) -> bool:
        now = time.monotonic()
        cases_spent = cases_max is not None and report.cases >= cases_max
        if (now >= deadline or cases_spent) and not report.failed:
            raise _BudgetSpent
        if now >= shrink_deadline:
            return False  # shrinking stops: every further candidate is rejected
        report.cases += 1
        world = world_of(program)
        report.worlds[world] = report.worlds.get(world, 0) + 1
        try:
            tree = run_program(implementation, program, seed)
        except InvariantViolation as exc:
            finding = match_known_finding(known, impl, exc.inv_id, str(exc), release)
            if finding is not None:
                report.known_hits[finding.id] = report.known_hits.get(finding.id, 0) + 1
                return False
            failed(program, f"{exc.inv_id}: {exc}", exc.inv_id)
            return True
        except Exception as exc:  # upstream's scheduler-side code raised: a finding too
            failed(program, f"{type(exc).__name__}: {exc}", "")
            return True
        for inv_id, count in tree.checks.counts.items():
            report.checks[inv_id] = report.checks.get(inv_id, 0) + count
        return False

    search = settings(
        max_examples=ROUND_CASES,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    found: Any = None
    for round_index in range(CASES_MAX // ROUND_CASES):
        try:  # a fresh search each round: Hypothesis draws one round's programs near each other
            with pinned_literal_pool():  # the seed's programs, whatever this process imported
                found = find(
                    drawn if drawn is not None else programs_of_round(round_index, worlds),
                    fails,
                    settings=search,
                    random=random.Random(f"{seed}/{round_index}"),
                )
        except NoSuchExample:
            continue
        except _BudgetSpent:
            break
        except Flaky:  # the failure hangs on how the rank threads interleaved: the first stands
            keep_first()
            return report
        break
    if found is None:
        report.failure = report.failure_id = ""
        return report
    report.found, report.program = found, found.describe()
    shrink_deadline = float("inf")
    if not fails(found):  # the shrunk program's own failure is the one reported, if it repeats
        keep_first()
    return report


class _BudgetSpent(Exception):
    """The gate's budget ran out with no failure: the search ends."""
