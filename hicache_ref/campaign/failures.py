"""What a campaign does with a failing round: name it, keep its trace, count or record it.

``CampaignSink`` is what the campaign hands its machine (``machine_for(..., sink)``): every
finished case goes into the report, and every failing case's trace into a scratch folder of
this campaign alone (Hypothesis rewrites it on each re-run). When the round ends in a failure,
``get_campaign_failure`` says what was found, ``absorb_failure`` counts it against the known
findings or records it: the trace is kept under a name no other campaign can take
(``failure-<impl>-seed<N>-<digest>.jsonl``, the digest of the trace's own text: its
implementation, source tree, configuration and steps), then minimized next to it
(``...-min.jsonl``), and the record carries the line that replays it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypothesis.errors import Flaky

from hicache_ref.device.perturb import Perturbation
from hicache_ref.harness.campaigns.known_findings import KnownFinding, match_known_finding
from hicache_ref.harness.steps.replay import minimize
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Trace
from hicache_ref.replay_lines import get_replay_line, get_rerun_line

if TYPE_CHECKING:
    from hicache_ref.campaign.report import CampaignReport

TRACE_DIGEST_CHARS = 10


def get_failure_invariant(exc: BaseException) -> str:
    """The invariant a failure broke (``INV-xx``), or its exception type when it is no violation."""
    inv = getattr(exc, "inv_id", None)
    return inv if isinstance(inv, str) else type(exc).__name__


def get_root_failure(exc: BaseException) -> BaseException:
    """The failure inside an exception group (Hypothesis' ``FlakyFailure`` wraps the first run's
    error when a re-run passed, which a GPU's timing can make happen), else ``exc`` itself."""
    inner = getattr(exc, "exceptions", None)
    if not inner:
        return exc
    leaves = [get_root_failure(e) for e in inner if isinstance(e, BaseException)]
    violations = [e for e in leaves if isinstance(getattr(e, "inv_id", None), str)]
    return (violations or leaves or [exc])[0]


class RecordedFailure(Exception):
    """A failure known from its trace's note only: Hypothesis saw it, then its re-run drew a
    different program (a real device's timing changes which rules are enabled) and it raised a
    ``Flaky`` error of its own. ``inv_id`` is the recorded failure's invariant or type."""

    def __init__(self, note: str) -> None:
        super().__init__(note)
        kind, _, rest = note.partition(": ")
        found = re.match(r"(INV-\d\d)\b", rest)
        self.inv_id = found.group(1) if found else kind


def get_campaign_failure(exc: BaseException, last_failure: Path | None) -> BaseException:
    """What a round's exception says was found: the root failure, or for a Hypothesis ``Flaky``
    error with nothing inside, the failure its last trace recorded (``RecordedFailure``)."""
    failure = get_root_failure(exc)
    if isinstance(failure, Flaky) and last_failure is not None:
        note = Trace.read(last_failure).header.note
        if note:
            return RecordedFailure(note)
    return failure


@dataclass
class CampaignSink:
    """The machine's sink for one campaign: cases into ``report``, traces into ``scratch``."""

    report: CampaignReport
    scratch: Path
    clock: Callable[[], float]
    """Seconds since the campaign started (when a configuration or a check was first seen)."""
    last_failure: Path | None = field(default=None)
    last_schedule: dict[str, Any] | None = field(default=None)
    """The PCT bias of the case ``last_failure`` holds (``campaign`` profile, points worlds)."""
    known: Sequence[KnownFinding] = ()
    """The written-up findings a case may hit: counted, and the round goes on (``on_known``)."""

    def on_case(self, session: Session) -> None:
        self.report.absorb(session, at_s=self.clock())

    def on_known(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a written-up finding of this implementation; if so it is counted
        here, and the machine ends the case as invalid instead of failing the round: a round
        that ended at each known hit started again from Hypothesis' simplest case (upstream's
        gates hit F8 and F22 in one case in five) and shrank a failure nobody reads."""
        invariant = get_failure_invariant(exc)
        report = self.report
        finding = match_known_finding(
            self.known, report.implementation, invariant, str(exc), report.release
        )
        if finding is None:
            return False
        report.known_hits[finding.id] += 1
        return True

    def on_failure(self, trace: Trace, schedule: dict[str, Any] | None = None) -> Path:
        name = trace.header.implementation.replace(":", "-")
        self.last_failure = trace.write(self.scratch / f"failure-{name}.jsonl")
        self.last_schedule = schedule
        return self.last_failure


def get_trace_stem(trace: Trace, round_seed: int | None = None) -> str:
    """``failure-<impl>-seed<N>-<digest>``: the digest of the trace's text, so two campaigns
    (two trees gated under one name, two workers, two runners) never write one file name for
    different traces, and the same trace always gets the same name."""
    digest = hashlib.sha256(trace.to_jsonl().encode()).hexdigest()[:TRACE_DIGEST_CHARS]
    seed = "" if round_seed is None else f"-seed{round_seed}"
    return f"failure-{trace.header.implementation.replace(':', '-')}{seed}-{digest}"


def stamp_device(trace: Trace, device: str, perturbation: Perturbation | None) -> Trace:
    """``trace`` with its header naming ``device`` and the perturbation it ran under."""
    if device == "sim" and perturbation is None:
        return trace
    header = trace.header.model_copy(update={"device": device, "perturbation": perturbation})
    return Trace(header=header, steps=trace.steps)


@dataclass(frozen=True)
class FailureContext:
    """Where and when a round failed, for its record."""

    out_dir: Path
    round_seed: int
    round_index: int
    at_s: float
    last_failure: Path | None
    minimize_replays: int
    save_trace: Callable[[Trace], None] | None = None
    """Also keep the kept trace in a shared store (``fleet.database``)."""
    schedule: dict[str, Any] | None = None
    """The failing case's PCT bias (``schedule/pct.py``: depth, priority changes), if any."""


def absorb_failure(
    report: CampaignReport,
    exc: BaseException,
    context: FailureContext,
    known: Sequence[KnownFinding],
) -> bool:
    """Count a known failure or record a new one; True when it is new."""
    invariant = get_failure_invariant(exc)
    finding = match_known_finding(known, report.implementation, invariant, str(exc), report.release)
    if finding is not None:
        report.known_hits[finding.id] += 1
        return False
    if any(f["invariant"] == invariant for f in report.failures):
        report.repeats[invariant] += 1
        return True
    record = failure_record(exc, report, context, invariant)
    report.failures.append(record)  # before ddmin: an interrupted ddmin keeps the whole trace
    _keep_trace(record, report, context)
    return True


def failure_record(
    exc: BaseException, report: CampaignReport, context: FailureContext, invariant: str
) -> dict[str, Any]:
    """The report's record of a new failure, before its trace is kept."""
    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return {
        "error": error,
        "invariant": invariant,
        "seed": str(context.round_seed),
        "round": context.round_index,
        "case": report.cases + 1,
        "found_at_s": round(context.at_s, 2),
        "trace": "",
        "replay": get_rerun_line(
            report.implementation, report.profile, context.round_seed, report.device, report.source
        ),
        **({"pct": context.schedule} if context.schedule is not None else {}),
    }


def _keep_trace(record: dict[str, Any], report: CampaignReport, context: FailureContext) -> None:
    """Copy the round's trace under its own name, store it, then ddmin it beside the copy."""
    if context.last_failure is None:
        return  # it failed outside a step: the rerun line reproduces it
    trace = stamp_device(Trace.read(context.last_failure), report.device, report.perturbation)
    stem = get_trace_stem(trace, context.round_seed)
    kept = trace.write(context.out_dir / f"{stem}.jsonl").absolute()
    line = get_replay_line(kept, report.implementation)
    record.update(trace=str(kept), replay=line, steps=str(len(trace.steps)))
    record.update(config=trace.header.config.describe(), program=[s.render() for s in trace.steps])
    if context.save_trace is not None:
        context.save_trace(trace)
    if context.minimize_replays > 0:
        small = minimize(trace, max_replays=context.minimize_replays)
        small_path = small.write(context.out_dir / f"{stem}-min.jsonl").absolute()
        if context.save_trace is not None:
            context.save_trace(small)
        record.update(
            trace=str(small_path),
            replay=get_replay_line(small_path, report.implementation),
            steps=str(len(small.steps)),
        )
        record.update(program=[step.render() for step in small.steps])  # the report shows it
