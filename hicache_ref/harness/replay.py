"""Replay a trace without Hypothesis, and shrink it further by delta debugging over steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.session import Session
from hicache_ref.harness.trace import Step, Trace


@dataclass(frozen=True)
class ReplayResult:
    """How a replay ended: ``error`` is None when every step and the quiescence checks passed."""

    steps_applied: int
    outcomes: tuple[str, ...]
    error: BaseException | None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def signature(self) -> str:
        """What kind of failure this is: the invariant id (or exception type), not the text."""
        if self.error is None:
            return "pass"
        inv = getattr(self.error, "inv_id", None)
        return inv if isinstance(inv, str) else type(self.error).__name__


def replay(trace: Trace, *, implementation: str | None = None, finish: bool = True) -> ReplayResult:
    """Apply every step of ``trace`` to a fresh world, then (optionally) the quiescence checks."""
    name = implementation or trace.header.implementation
    source = trace.header.source if name == trace.header.implementation else ""
    session = Session(trace.header.config, get_implementation(name, source), name)
    try:
        for step in trace.steps:
            session.apply(step)
        if finish:
            session.finish()
    except Exception as exc:  # the failure is the result; callers decide what to do with it
        return ReplayResult(len(session.outcomes), tuple(session.outcomes), exc)
    return ReplayResult(len(session.outcomes), tuple(session.outcomes), None)


def minimize(
    trace: Trace,
    *,
    implementation: str | None = None,
    still_fails: Callable[[ReplayResult], bool] | None = None,
    max_replays: int = 2000,
) -> Trace:
    """Delta debugging (ddmin) over steps: the smallest trace that still fails the same way."""
    original = replay(trace, implementation=implementation)
    if not original.failed:
        return trace
    target = original.signature()
    keep = still_fails or (lambda r: r.failed and r.signature() == target)
    steps: list[Step] = list(trace.steps)
    replays = 0
    chunk = max(1, len(steps) // 2)
    while chunk >= 1 and replays < max_replays:
        removed_any = False
        start = 0
        while start < len(steps) and replays < max_replays:
            candidate = steps[:start] + steps[start + chunk :]
            replays += 1
            if keep(replay(trace.with_steps(tuple(candidate)), implementation=implementation)):
                steps = candidate
                removed_any = True
            else:
                start += chunk
        if not removed_any:
            chunk //= 2
    # Drop steps that were skipped anyway (their precondition never held)
    final = replay(trace.with_steps(tuple(steps)), implementation=implementation)
    applied = [s for s, o in zip(steps, final.outcomes, strict=False) if o != "skipped"]
    candidate_trace = trace.with_steps(tuple(applied))
    if keep(replay(candidate_trace, implementation=implementation)):
        return candidate_trace
    return trace.with_steps(tuple(steps))
