"""Record one vector: drive the reference through a session, step by step, and write down what
it produced.

``Recorder.offer(step)`` -> settle the streams a completion-reading step depends on
(``settle.py``: a ``synchronize`` step is recorded before it) -> refuse a step that is not
enabled or not determinate -> note the capabilities the step needs beyond the configuration's
(``requires``) -> apply it (every session check runs; the oracle follows in lockstep) ->
``observe.observe``; ``Recorder.vector()`` runs quiescence and seals the vector with its digest.

The reference passing every check of the harness is what makes its observations the expected
ones: any failure while recording is a bug of the generator or of the reference, and raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hicache_ref.harness.adapters.contract import ImplementationBase
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.lockstep.oracle import attach_lockstep
from hicache_ref.harness.rules import RULES
from hicache_ref.harness.rules.streams import SYNCHRONIZE
from hicache_ref.harness.step_types import StepArg
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.world import make_device_pool
from hicache_ref.vectors.models import (
    SUITE_VERSION,
    Schedule,
    Vector,
    VectorStep,
    compute_digest,
)
from hicache_ref.vectors.observe import capture, expected_bytes, observe, observe_final
from hicache_ref.vectors.settle import CompletionTracker

PROBED_CAPABILITIES = ("guards", "multi_consumer", "reset_drains", "per_layer_write", "storage")
"""Capabilities a rule may ask for that no configuration field implies; ``requires`` lists
those whose absence would disable a recorded step."""


class GenerationError(RuntimeError):
    """The reference failed while a vector was recorded (a generator or reference bug)."""


def components_of(config: HarnessConfig) -> dict[str, list[int]]:
    from hicache_ref.device.sim import SimDevice

    pool = make_device_pool(config, 1, config.page_size, SimDevice())
    return {name: list(shape) for name, shape in pool.component_row_shapes().items()}


class Recorder:
    """One vector being recorded on the reference."""

    def __init__(
        self,
        config: HarnessConfig,
        *,
        vector_id: str,
        title: str,
        kind: str,
        implementation: ImplementationBase | None = None,
        settle: bool = True,
    ) -> None:
        self.config = config
        self.vector_id, self.title, self.kind = vector_id, title, kind
        self.implementation = implementation or ReferenceImplementation()
        self.session = Session(config, self.implementation, self.implementation.name)
        attach_lockstep(self.session)
        self.tracker = CompletionTracker(self.session)
        self.steps: list[VectorStep] = []
        self.requires: set[str] = set()
        self.story_ids: set[str] = set()
        self.schedule: Schedule = "any"
        self.settle = settle  # False: keep the reference's own schedule (``ops`` vectors)

    # -- steps --------------------------------------------------------------------------------
    def prepared(self, rule: str, args: Mapping[str, StepArg] | None = None) -> Step:
        """The step, with the handle a prefill will take named in it."""
        args = dict(args or {})
        pins = RULES[rule].pins
        if pins is not None:
            args = dict(pins(self.session, args))
        return Step(rule=rule, args=args)  # type: ignore[arg-type]

    def offer(self, step: Step, *, inv: str | None = None, note: str = "") -> bool:
        """Apply ``step`` if it is enabled and determinate; False (nothing recorded) if not."""
        if self.session.why_disabled(step) is not None:
            return False
        if not self.settle:
            if self.tracker.unsettled_streams(step) or not self.tracker.in_flight_determinate(step):
                self.schedule = "ops"
        else:
            for stream in self.tracker.unsettled_streams(step):
                self._apply(Step(rule=SYNCHRONIZE.name, args={"stream": stream}), note="settle")
            if not self.tracker.in_flight_determinate(step):
                return False
        if self.session.why_disabled(step) is not None:
            return False
        if self.tracker.relies_on_in_flight(step) and self.schedule == "any":
            self.schedule = "sim"
        self.requires |= self._needed_capabilities(step)
        self._apply(step, inv=inv, note=note)
        return True

    def apply(
        self,
        rule: str,
        args: Mapping[str, StepArg] | None = None,
        *,
        inv: str | None = None,
        note: str = "",
    ) -> None:
        """A story's step: it must be enabled and determinate (else the story is wrong)."""
        step = self.prepared(rule, args)
        if not self.offer(step, inv=inv, note=note):
            why = self.session.why_disabled(step) or "its answer would depend on the schedule"
            raise GenerationError(f"{self.vector_id}: {step.render()} cannot be recorded: {why}")

    def _apply(self, step: Step, *, inv: str | None = None, note: str = "") -> None:
        before = capture(self.session)
        self.tracker.before_step()
        try:
            outcome = self.session.apply(step)
        except Exception as exc:
            raise GenerationError(
                f"{self.vector_id}: the reference failed {step.render()} at step "
                f"{len(self.steps)}: {type(exc).__name__}: {exc}"
            ) from exc
        self.tracker.after_step(step)
        expect = observe(self.session, before, step, outcome)
        if inv is not None:
            self.story_ids.add(inv)
        self.steps.append(
            VectorStep(op=step.rule, args=dict(step.args), expect=expect, inv=inv, note=note)
        )

    def _needed_capabilities(self, step: Step) -> set[str]:
        """Capabilities whose absence would disable ``step`` now (probed on the session)."""
        session, world = self.session, self.session.world
        needed = set(RULES[step.rule].requires(session, step.args))  # the record says
        held_session, held_world = session.capabilities, world.capabilities
        try:
            for capability in PROBED_CAPABILITIES:
                if capability not in held_session:
                    continue
                session.capabilities = held_session - {capability}
                world.capabilities = held_world - {capability}
                if session.why_disabled(step) is not None:
                    needed.add(capability)
        finally:
            session.capabilities, world.capabilities = held_session, held_world
        return needed

    # -- the vector ---------------------------------------------------------------------------
    def applied_rules(self) -> list[str]:
        return sorted({s.op for s in self.steps})

    def vector(self, extra_ids: Iterable[str] = ()) -> Vector:
        """Quiescence, then the sealed vector; the recording world is closed either way."""
        try:
            return self._sealed(extra_ids)
        finally:
            self.session.close()

    def _sealed(self, extra_ids: Iterable[str]) -> Vector:
        before = capture(self.session)
        try:
            self.session.finish()
        except Exception as exc:
            raise GenerationError(
                f"{self.vector_id}: the reference failed quiescence: {type(exc).__name__}: {exc}"
            ) from exc
        final = observe_final(self.session, before)
        self._check_bytes_against_oracle(final)
        checked = {inv for inv, n in self.session.stats.checks_by_id.items() if n}
        data = {
            "suite": SUITE_VERSION,
            "id": self.vector_id,
            "title": self.title,
            "kind": self.kind,
            "invariants": sorted(checked | self.story_ids | set(extra_ids)),
            "rules": self.applied_rules(),
            "requires": sorted(self.requires),
            "schedule": self.schedule,
            "config": self.config,
            "components": components_of(self.config),
            "steps": self.steps,
            "final": final,
            "digest": "0" * 16,
        }
        draft = Vector.model_validate(data)
        return draft.model_copy(update={"digest": compute_digest(draft)})

    def _check_bytes_against_oracle(self, final: object) -> None:
        """Every digest recorded is the content oracle's (the bytes the reference holds)."""
        nodes = {n.handle: n for n in self.session.tree.nodes.values()}
        for copy in getattr(final, "bytes", ()):
            node = nodes[copy.node]
            want = expected_bytes(self.session, node, copy.copy_kind)
            if want.pages != copy.pages:
                raise GenerationError(
                    f"{self.vector_id}: node {copy.node} {copy.copy_kind} digests differ from "
                    "the content oracle's"
                )
