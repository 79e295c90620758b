"""What the machine remembers within one step answers as asking afresh would.

``Session.is_offered`` keeps each machine rule's precondition until the next step is applied
(Hypothesis asks it several times while it picks one rule); a machine that compares every
remembered answer with a fresh one after every rule shows the cache never goes stale.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import invariant, run_state_machine_as_test

from hicache_ref.harness.adapters import ReferenceImplementation
from hicache_ref.harness.campaigns.machine import FailureFolder, machine_for
from hicache_ref.harness.steps.programs import PROGRAMS
from hicache_ref.harness.steps.rules import RULES
from hicache_ref.harness.steps.session import Session


def machine_preconditions() -> dict[str, Callable[[Session], bool]]:
    """Every machine rule's ``offered``, by rule name (compound programs and atomic records)."""
    offered = {p.name: p.offered for p in PROGRAMS.values() if p.in_machine}
    for record in RULES.values():
        if record.draw is not None and record.draw.in_machine:
            offered[record.name] = record.draw.offered
    return offered


def test_a_remembered_precondition_equals_asking_the_session_afresh() -> None:
    preconditions = machine_preconditions()
    compared = {"answers": 0, "offered": 0}
    base = machine_for(ReferenceImplementation(), "reference", FailureFolder())

    class Comparing(base):  # type: ignore[valid-type,misc]
        @invariant()
        def remembered_equals_fresh(self) -> None:
            if self.session is None:
                return
            for name, offered in preconditions.items():
                remembered = self.session.is_offered(name, offered)
                assert remembered == offered(self.session), f"{name}: a stale precondition"
                compared["answers"] += 1
                compared["offered"] += remembered

    run_state_machine_as_test(
        hypothesis_seed(3)(Comparing),
        settings=settings(
            max_examples=12,
            stateful_step_count=25,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        ),
    )
    # the comparison ran over many states, with rules both offered and not
    assert compared["answers"] > 500
    assert 0 < compared["offered"] < compared["answers"]
