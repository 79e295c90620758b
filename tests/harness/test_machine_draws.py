"""How the machine draws its rules: a swarm per case, then one offered rule per step.

The machine has a single Hypothesis rule, ``step``; ``RuleChoices`` draws the protocol rule
among those the case's swarm keeps and its session offers, and Hypothesis prints each step as
the rule call it is.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis.stateful import rule
from hypothesis.vendor.pretty import pretty

from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.campaigns.machine import (
    ALWAYS_OFFERED,
    MACHINE_RULES,
    RULE_CHOICES,
    SWARM,
    Choice,
    MachineRule,
    machine_for,
)
from hicache_ref.harness.campaigns.profiles import make_settings
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import HarnessConfig

BY_NAME = {r.name: r for r in MACHINE_RULES}


def test_a_drawn_step_prints_as_the_rule_call_it_is() -> None:
    # Hypothesis' falsifying program then reads state.step(choice=offload(pick=3))
    choice = Choice(BY_NAME["offload"], {"pick": 3})
    assert pretty(choice) == repr(choice) == "offload(pick=3)"
    assert pretty((BY_NAME["write"], BY_NAME["reset"])) == "(write, reset)"


def test_the_rules_are_ordered_fewest_params_first_as_hypothesis_orders_its_own() -> None:
    keys = [(len(r.params), r.name) for r in MACHINE_RULES]
    assert keys == sorted(keys)
    assert len(BY_NAME) == len(MACHINE_RULES)  # one rule per name


@given(SWARM)
def test_a_swarm_keeps_rules_in_order_and_always_one_that_is_always_offered(
    swarm: tuple[MachineRule, ...],
) -> None:
    in_order = [r for r in MACHINE_RULES if r in swarm]
    if list(swarm) != in_order:  # the draw left every always-offered rule out: one came back
        *drawn, back = swarm
        assert back.name in ALWAYS_OFFERED
        assert drawn == [r for r in in_order if r is not back]
        assert not any(r.name in ALWAYS_OFFERED for r in drawn)
    assert any(r.name in ALWAYS_OFFERED for r in swarm)


class _CheckedDraws(machine_for(ReferenceImplementation(), "reference")):  # type: ignore[misc]
    """The reference machine, asserting what every drawn step is before applying it."""

    drawn: ClassVar[list[str]] = []

    @rule(choice=RULE_CHOICES)
    def step(self, choice: Choice) -> None:
        # Verify the drawn rule is one the swarm keeps and the session offers right now
        assert choice.rule in self.swarm
        assert choice.rule.offered(self.s), f"{choice!r} drawn while not offered"
        assert [key for key, _ in choice.rule.params] == list(choice.drawn)
        self.drawn.append(choice.rule.name)
        super().step(choice)


def test_every_drawn_step_is_kept_by_the_swarm_and_offered_when_drawn() -> None:
    _CheckedDraws.drawn.clear()
    _CheckedDraws.TestCase.settings = make_settings("ci", max_examples=25)
    _CheckedDraws.TestCase("runTest").runTest()
    assert len(set(_CheckedDraws.drawn)) >= 20  # most rules were drawn somewhere


def test_a_step_keeps_the_candidates_of_its_draw_only_when_the_caller_says_nothing_ran_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = Session(HarnessConfig(), ReferenceImplementation(), "reference")
    session.apply(Step(rule="prefill", args={"tokens": 1, "early_reserve": False, "batch": True}))
    while session.tree.batch:  # the forward computes the node: now it may be written
        session.apply(Step(rule="forward_layer", args={}))
    # a list cached before the world moved (here: planted) is asked again by the next step
    session._candidates["write"] = [7]
    assert session.apply(Step(rule="write", args={"node": 7})).skipped
    assert "node 7 is not" in session.skip_reasons[len(session.steps) - 1]
    # the machine's draw asked, then vouches that nothing ran since: the step reuses its list
    computed: list[str] = []
    compute = Session._compute_candidates
    monkeypatch.setattr(
        Session, "_compute_candidates", lambda s, rule: computed.append(rule) or compute(s, rule)
    )
    node = session.candidates("write")[0]
    session.candidates_current = True
    assert not session.apply(Step(rule="write", args={"node": node})).skipped
    assert computed.count("write") == 1 and not session.candidates_current
