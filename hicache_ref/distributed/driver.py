"""One rank's side of a CP case: draw (rank 0) -> broadcast -> plan -> agree -> apply -> compare.

Per step, three collectives: rank 0 broadcasts the step it drew from its session (or read from
a trace); every rank gathers every rank's ``StepPlan`` and takes the same ``Agreement``; every
rank applies the step (or, when the ranks disagreed on whether it is possible, none does), then
gathers every rank's ``RankDigest`` or ``RankError`` and takes the same ``Verdict``. A case
ends with every stream synchronized and one agreed drain (``quiesce_steps``), then
``Session.finish`` on every rank and one last round that compares the quiescent states. On a
verdict rank 0 writes the trace (its header records the process count; the note names the
backend) at a path every rank computes alike, so every rank reports the same replay line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hicache_ref.distributed.agreement import StepPlan, agree, plan_step
from hicache_ref.distributed.compare import RankDigest, digest_rank
from hicache_ref.distributed.group import RankGroup
from hicache_ref.distributed.rank_session import RankSession, open_rank_session
from hicache_ref.distributed.schedule import StepProgram, quiesce_steps
from hicache_ref.distributed.verdict import RankError, Verdict, decide
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.step_types import done
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.world import HarnessDevice

BACKEND_NOTE = "backend="


class StepSource(Protocol):
    """Where rank 0's steps come from: a seeded program, or a recorded trace."""

    def next_step(self, session: Session) -> Step | None: ...


class ProgramSource:
    """A seeded program, then the quiescing steps every case ends with."""

    def __init__(self, seed: int, steps_max: int, *, probes: bool = True) -> None:
        self.program = StepProgram(seed, steps_max, probes=probes)
        self.tail = iter(quiesce_steps())

    def next_step(self, session: Session) -> Step | None:
        step = self.program.next_step(session)
        return step if step is not None else next(self.tail, None)


class TraceSource:
    """A recorded trace's steps, in order (its quiescing steps are among them)."""

    def __init__(self, steps: tuple[Step, ...]) -> None:
        self.steps: Iterator[Step] = iter(steps)

    def next_step(self, session: Session) -> Step | None:
        return next(self.steps, None)


@dataclass(frozen=True)
class CaseSpec:
    """One case, as rank 0 broadcasts it: the world, the program's seed, where a trace goes."""

    index: int
    config: HarnessConfig
    program_seed: int
    steps_max: int
    trace_path: str


@dataclass
class CaseResult:
    steps: int = 0
    skipped: int = 0
    left_out: int = 0  # steps only some ranks enabled: applied by none
    rules: Counter[str] = field(default_factory=Counter)
    checks_by_id: Counter[str] = field(default_factory=Counter)
    verdict: Verdict | None = None
    trace: str = ""


@dataclass
class _Case:
    group: RankGroup
    spec: CaseSpec
    backend_note: str
    rank_session: RankSession | None = None
    result: CaseResult = field(default_factory=CaseResult)


def drive_case(
    group: RankGroup,
    spec: CaseSpec,
    implementation: Implementation,
    impl_name: str,
    source: StepSource | None,
    *,
    device: HarnessDevice | None = None,
) -> CaseResult:
    """Run one case on this rank (``source`` is read on rank 0 only) and return what it did;
    the rank's session is closed however the case ends."""
    assert (source is not None) == (group.rank == 0), "rank 0, and only rank 0, draws steps"
    case = _Case(group, spec, f"cp_processes={group.world_size} {BACKEND_NOTE}{group.backend}")
    try:
        return _drive(case, group, spec, implementation, impl_name, source, device)
    finally:
        if case.rank_session is not None:
            case.rank_session.session.close()


def _drive(
    case: _Case,
    group: RankGroup,
    spec: CaseSpec,
    implementation: Implementation,
    impl_name: str,
    source: StepSource | None,
    device: HarnessDevice | None,
) -> CaseResult:
    error: RankError | None = None
    try:
        case.rank_session = open_rank_session(
            spec.config, implementation, impl_name, group.rank, device=device
        )
    except Exception as exc:
        error = RankError.of(group.rank, exc)
    built = case.rank_session
    digest = None if error or built is None else digest_rank(built, done("built"))
    if _judge(case, "world setup", error, digest, record=False):  # the seed rebuilds it
        return case.result
    while True:
        drawn: Step | RankError | None = group.broadcast(_draw(case, source))
        if isinstance(drawn, RankError):  # rank 0 could not draw: every rank fails with it
            where = "drawing the next step"
            errors = [drawn, *[None] * (group.world_size - 1)]
            _judge(case, where, drawn, None, decide(where, errors, []), record=False)
            break
        if drawn is None or not _run_step(case, drawn):
            break
    if case.result.verdict is None:
        _run_finish(case)
    _count(case)
    return case.result


def _draw(case: _Case, source: StepSource | None) -> Step | RankError | None:
    """Rank 0's next step (None: the case is over; a ``RankError``: drawing it raised)."""
    if source is None or case.rank_session is None:
        return None
    try:
        return source.next_step(case.rank_session.session)
    except Exception as exc:
        return RankError.of(case.group.rank, exc)


def _run_step(case: _Case, step: Step) -> bool:
    """Agree on, apply and compare one step; False once the case has a verdict."""
    rank_session = case.rank_session
    assert rank_session is not None
    rank = case.group.rank
    plan: StepPlan | None = None
    error: RankError | None = None
    try:
        plan = plan_step(rank_session, step)
    except Exception as exc:
        error = RankError.of(rank, exc)
    plans = case.group.gather((plan, error))
    where = f"step {len(rank_session.session.steps) + 1} {step.render()}"
    if any(e is not None for _, e in plans):
        # a plan that raised is a harness bug, and the step is not in the trace: no trace
        verdict = decide(where, [e for _, e in plans], [None] * len(plans))
        return not _judge(case, where, error, None, verdict, record=False)
    agreement = agree([p for p, _ in plans if p is not None])
    if not agreement.apply:
        case.result.left_out += 1
        return True
    digest: RankDigest | None = None
    rank_session.drains.agree(agreement.ready)
    try:
        outcome = rank_session.session.apply(step)
        digest = digest_rank(rank_session, outcome)
    except Exception as exc:
        error = RankError.of(rank, exc)
    finally:
        rank_session.drains.release()
    return not _judge(case, where, error, digest)


def _run_finish(case: _Case) -> None:
    rank_session = case.rank_session
    assert rank_session is not None
    error: RankError | None = None
    digest: RankDigest | None = None
    try:
        rank_session.session.finish()
        digest = digest_rank(rank_session, done("finished"), quiescent=True)
    except Exception as exc:
        error = RankError.of(case.group.rank, exc)
    _judge(case, "quiescence (Session.finish)", error, digest)


def _judge(
    case: _Case,
    where: str,
    error: RankError | None,
    digest: RankDigest | None,
    verdict: Verdict | None = None,
    *,
    record: bool = True,
) -> bool:
    """The agreement round after ``where`` (skipped when ``verdict`` is already agreed): True
    when the case failed, and then, with ``record``, rank 0 writes the trace."""
    if verdict is None:
        gathered = case.group.gather((error, digest))
        verdict = decide(where, [e for e, _ in gathered], [d for _, d in gathered])
    if verdict is None:
        return False
    case.result.verdict = verdict
    if record and case.spec.trace_path:
        case.result.trace = case.spec.trace_path
        if case.group.rank == 0:
            _write_trace(case, verdict)
    return True


def _write_trace(case: _Case, verdict: Verdict) -> None:
    assert case.rank_session is not None
    trace = case.rank_session.session.trace(note=f"{case.backend_note}; {verdict.line}"[:500])
    header = trace.header.model_copy(update={"cp_processes": case.group.world_size})
    Trace(header=header, steps=trace.steps).write(Path(case.spec.trace_path))


def _count(case: _Case) -> None:
    if case.rank_session is None:
        return
    stats = case.rank_session.session.stats
    case.result.steps = stats.steps
    case.result.skipped = stats.skipped
    case.result.rules = Counter(stats.rules)
    case.result.checks_by_id = Counter(stats.checks_by_id)


def backend_of(trace: Trace) -> str:
    """The backend a trace was recorded with (its note says; ``gloo`` when it does not)."""
    for word in trace.header.note.replace(";", " ").split():
        if word.startswith(BACKEND_NOTE):
            return word.removeprefix(BACKEND_NOTE)
    return "gloo"
