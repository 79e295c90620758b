"""Replay vectors on an implementation and name the first divergence like a harness failure.

``skip_reason`` (a capability, a configuration value the implementation fixes, a schedule the
device cannot promise) -> ``replay_vector``: every step through ``Session.apply`` (so every
check of the harness runs, and the oracle follows in lockstep), then the step's observation
(``observe.py``) against the vector's ``Expect``; quiescence against ``Final`` ->
``VectorResult``: pass, fail (the invariant id, the step, expected and got) or skip (why).

A failure of a harness check is reported under its own id (the one a campaign would report);
a differing observation under the id its field guards (``FIELD_INVARIANTS``), or the id the
step declares (a story's ``inv``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hicache_ref.harness.adapters.base import unsupported_reasons
from hicache_ref.harness.adapters.contract import ImplementationBase
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.lockstep.oracle import attach_lockstep
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.world import check_device_kind, gpu_config, on_device, open_device
from hicache_ref.vectors.models import Expect, Final, Vector
from hicache_ref.vectors.observe import capture, observe, observe_final

FIELD_INVARIANTS: dict[str, str] = {
    "status": "INV-17",
    "refusal": "INV-17",
    "returned.count": "INV-05",
    "returned.aligned": "INV-01",
    "owners": "INV-03",
    "drained.write": "INV-09",
    "drained.load": "INV-09",
    "queued.write": "INV-02",
    "queued.load": "INV-16",
    "held": "INV-05",
    "bytes": "INV-09",
    "final.acked": "INV-16",
    "final.held": "INV-05",
    "final.bytes": "INV-06",
}
"""The invariant each observed field guards, for naming a divergence."""


@dataclass(frozen=True)
class VectorResult:
    """How one vector went on one implementation."""

    vector: str
    status: str  # pass | fail | skip
    invariant: str | None = None
    step: int | None = None  # None: at quiescence (or never started)
    op: str = ""
    what: str = ""  # the field that differed, or the harness check that fired
    expected: str = ""
    got: str = ""
    reason: str = ""  # a skip's reason, or a failure's full message

    def render(self) -> str:
        if self.status == "pass":
            return f"PASS {self.vector}"
        if self.status == "skip":
            return f"SKIP {self.vector}: {self.reason}"
        where = "at quiescence" if self.step is None else f"at step {self.step} ({self.op})"
        inv = self.invariant or "no invariant"
        if self.what == "check":
            return f"FAIL {self.vector}: {inv} {where}: {self.reason}"
        return (
            f"FAIL {self.vector}: {inv} {where}: {self.what} expected {self.expected}, "
            f"got {self.got}"
        )

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class SuiteReport:
    implementation: str
    device: str
    results: list[VectorResult] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def skip_reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            if r.status == "skip":
                out[r.reason] = out.get(r.reason, 0) + 1
        return dict(sorted(out.items()))

    def closing_line(self) -> str:
        n = len(self.results)
        line = f"{n} vectors, {self.count('pass')} passed, {self.count('fail')} failed"
        skipped = self.count("skip")
        return f"{line}, {skipped} skipped" if skipped else line

    def as_json(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "device": self.device,
            "vectors": len(self.results),
            "passed": self.count("pass"),
            "failed": self.count("fail"),
            "skipped": self.count("skip"),
            "skip_reasons": self.skip_reasons,
            "results": [r.as_json() for r in self.results],
        }


def issues_reference_ops(implementation: ImplementationBase) -> bool:
    """Whether the implementation is the reference's controller (or a mutant of it), whose
    device ops an ``ops`` vector's completion expectations pin."""
    return isinstance(implementation, ReferenceImplementation)


def _config_for(vector: Vector, device: str) -> Any:
    return vector.config if device == "sim" else gpu_config(vector.config)


def skip_reason(vector: Vector, implementation: ImplementationBase, device: str) -> str | None:
    """Why ``implementation`` cannot replay ``vector`` as written (None: it can)."""
    as_run = on_device(implementation, device)  # a GPU runs no misuse probes
    capabilities = as_run.capabilities
    missing = unsupported_reasons(capabilities, vector.config)
    missing += sorted(set(vector.requires) - capabilities)
    if missing:
        return f"needs {', '.join(sorted(set(missing)))}"
    if device != "sim" and vector.schedule != "any":
        return f"schedule {vector.schedule}: completion is controlled on a simulated device only"
    if vector.schedule == "ops" and not issues_reference_ops(implementation):
        return "schedule ops: pins the reference's own device ops (its regression vectors)"
    config = _config_for(vector, device)
    refined = as_run.refine_config(config)
    if refined != config:
        ours, theirs = config.model_dump(), refined.model_dump()
        changed = sorted(k for k in ours if ours[k] != theirs.get(k))
        runs = ", ".join(f"{k}={theirs[k]!r}" for k in changed)
        return f"runs the configuration with {runs}"
    return None


def _check_failure(vector: str, step: int | None, op: str, exc: BaseException) -> VectorResult:
    inv = getattr(exc, "inv_id", None)
    name = inv if isinstance(inv, str) else type(exc).__name__
    message = " ".join(f"{type(exc).__name__}: {exc}".split())
    return VectorResult(vector, "fail", name, step, op, "check", reason=message)


def _first_difference(expected: Expect | Final, got: Expect | Final) -> tuple[str, str, str] | None:
    want, have = expected.model_dump(mode="json"), got.model_dump(mode="json")
    for key in want:
        if want[key] == have.get(key):
            continue
        if isinstance(want[key], dict) and isinstance(have.get(key), dict):
            for sub in want[key]:
                if want[key][sub] != have[key].get(sub):
                    return f"{key}.{sub}", _short(want[key][sub]), _short(have[key].get(sub))
        return key, _short(want[key]), _short(have.get(key))
    return None


def _short(value: object, limit: int = 160) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_invariant(path: str, final: bool) -> str | None:
    key = f"final.{path.split('.')[0]}" if final else path
    return FIELD_INVARIANTS.get(key, FIELD_INVARIANTS.get(path.split(".")[0]))


def replay_vector(
    vector: Vector, implementation: ImplementationBase, name: str, device: str = "sim"
) -> VectorResult:
    """Replay one vector (see the module docstring); never raises for what it finds."""
    kind = check_device_kind(device)
    why = skip_reason(vector, implementation, kind)
    if why is not None:
        return VectorResult(vector.id, "skip", reason=why)
    with open_device(kind) as build:
        impl = on_device(implementation, kind)
        session = Session(_config_for(vector, kind), impl, name, build=build)
        try:  # the world's threads end with the vector, failed or not (nothing outlives it)
            return _replay_steps(vector, session)
        finally:
            session.close()


def _replay_steps(vector: Vector, session: Session) -> VectorResult:
    """Apply ``vector``'s steps to ``session``, comparing each observation, then finish."""
    attach_lockstep(session)
    for index, vstep in enumerate(vector.steps):
        step = Step(rule=vstep.op, args=dict(vstep.args))
        before = capture(session)
        try:
            outcome = session.apply(step)
        except Exception as exc:
            return _check_failure(vector.id, index, step.render(), exc)
        if index in session.skip_reasons:
            return VectorResult(
                vector.id,
                "fail",
                vstep.inv,
                index,
                step.render(),
                "status",
                "applied",
                f"not enabled ({session.skip_reasons[index]})",
            )
        got = observe(session, before, step, outcome)
        diff = _first_difference(vstep.expect, got)
        if diff is not None:
            path, want, have = diff
            inv = vstep.inv or _field_invariant(path, final=False)
            return VectorResult(vector.id, "fail", inv, index, step.render(), path, want, have)
    before = capture(session)
    try:
        session.finish()
    except Exception as exc:
        return _check_failure(vector.id, None, "finish", exc)
    final = observe_final(session, before)
    diff = _first_difference(vector.final, final)
    if diff is not None:
        path, want, have = diff
        return VectorResult(
            vector.id,
            "fail",
            _field_invariant(path, final=True),
            None,
            "finish",
            f"final.{path}",
            want,
            have,
        )
    return VectorResult(vector.id, "pass")


def replay_vectors(
    vectors: Iterable[Vector],
    implementation: ImplementationBase,
    name: str,
    device: str = "sim",
    *,
    on_result: Any = None,
) -> SuiteReport:
    """Replay every vector; ``on_result`` (if given) sees each result as it comes."""
    report = SuiteReport(name, device)
    for vector in vectors:
        result = replay_vector(vector, implementation, name, device)
        report.results.append(result)
        if on_result is not None:
            on_result(result)
    return report
