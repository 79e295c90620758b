"""Replay a trace without Hypothesis, and shrink it further by delta debugging over steps.

A replay runs on the device its header names (``device``: a ``cuda`` trace rebuilds the same
spin schedule from its config seed and ``perturbation``), unless the caller picks another.
Both go through ``Session.apply``, so a step means what its record in ``harness/rules/`` says; a
skipped step keeps its record's reason (``ReplayResult.skipped``, ``render_skips``), which is
also how the minimizer knows which steps it may drop at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hicache_ref.harness.adapters.registry import get_implementation
from hicache_ref.harness.adapters.sglang_tree import recorded_tree
from hicache_ref.harness.lockstep.oracle import attach_lockstep
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace
from hicache_ref.harness.world.world import check_device_kind, gpu_config, on_device, open_device


@dataclass(frozen=True)
class ReplayResult:
    """How a replay ended: ``error`` is None when every step and the quiescence checks passed."""

    steps_applied: int
    outcomes: tuple[str, ...]
    error: BaseException | None
    skipped: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    """Step index -> why its rule was not enabled (``rules.RuleRecord.why_not``)."""

    @property
    def failed(self) -> bool:
        return self.error is not None

    def signature(self) -> str:
        """What kind of failure this is: the invariant id (or exception type), not the text."""
        if self.error is None:
            return "pass"
        inv = getattr(self.error, "inv_id", None)
        return inv if isinstance(inv, str) else type(self.error).__name__

    def render_skips(self, steps: tuple[Step, ...]) -> list[str]:
        """One line per skipped step: its index, the step, and why it did not run."""
        return [
            f"step {i}: {steps[i].render()} skipped: {why}"
            for i, why in sorted(self.skipped.items())
            if i < len(steps)
        ]


def replay(
    trace: Trace,
    *,
    implementation: str | None = None,
    finish: bool = True,
    device: str | None = None,
    source: str = "",
) -> ReplayResult:
    """Apply every step of ``trace`` to a fresh world, then (optionally) the quiescence checks.

    ``source``: the sglang tree to read instead of the one the trace recorded (``--sglang-src``).

    The world runs on ``device``, by default the one the trace's header names. On a GPU it runs
    as a GPU campaign would have drawn it (``on_device``, ``gpu_config``): a simulator trace's
    CPU-only copy path becomes a GPU one, and the capabilities a GPU cannot check are left out
    (their steps are skipped, with the reason).
    """
    name = implementation or trace.header.implementation
    if not source:
        source = recorded_tree(trace.header.source if name == trace.header.implementation else "")
    kind = check_device_kind(device or trace.header.device)
    config = trace.header.config if kind == "sim" else gpu_config(trace.header.config)
    with open_device(kind, trace.header.perturbation) as build:
        implementation_ = on_device(get_implementation(name, source), kind)
        session = Session(config, implementation_, name, build=build)
        attach_lockstep(session)  # the pure oracle follows every step
        try:
            for step in trace.steps:
                session.apply(step)
            if finish:
                session.finish()
        except Exception as exc:  # the failure is the result; callers decide what to do with it
            return _result(session, exc)
        finally:
            session.close()
    return _result(session, None)


def _result(session: Session, error: BaseException | None) -> ReplayResult:
    """The replay's result, with the reason each skipped step's rule gave (its record's ``why_not``)."""
    skipped = MappingProxyType(dict(session.skip_reasons))
    return ReplayResult(len(session.outcomes), tuple(session.outcomes), error, skipped)


def minimize(
    trace: Trace,
    *,
    implementation: str | None = None,
    still_fails: Callable[[ReplayResult], bool] | None = None,
    max_replays: int = 2000,
    device: str | None = None,
    source: str = "",
) -> Trace:
    """Delta debugging (ddmin) over steps: the smallest trace that still fails the same way."""

    def run(candidate: Trace) -> ReplayResult:
        return replay(candidate, implementation=implementation, device=device, source=source)

    original = run(trace)
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
            if keep(run(trace.with_steps(tuple(candidate)))):
                steps = candidate
                removed_any = True
            else:
                start += chunk
        if not removed_any:
            chunk //= 2
    # Drop steps that were skipped anyway (their rule was never enabled: ``final.skipped``)
    final = run(trace.with_steps(tuple(steps)))
    applied = [s for i, s in enumerate(steps[: len(final.outcomes)]) if i not in final.skipped]
    candidate_trace = trace.with_steps(tuple(applied))
    if keep(run(candidate_trace)):
        return candidate_trace
    return trace.with_steps(tuple(steps))
