"""Seeded mutants: every one must be caught, shrunk to a short program, and pinned to the bug.

A mutant is our reference with one deliberate bug (fuzz/mutants/<name>.py). The harness must
find it within a bounded campaign; the minimized trace must fail on the mutant with one of the
invariants the mutant declares (``INVARIANTS``: the checks that catch it, not merely some
``INV-`` id) and pass on the reference (so the failure is the mutant's bug, not a harness
artefact). A mutant with ``NEEDS_GUARDS = True`` is seen only by a misuse probe;
tests/harness/test_catalogue.py runs the others with the ``guards`` capability off.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.cli import run_campaign
from hicache_ref.harness.adapters.mutant import unguarded_name
from hicache_ref.harness.adapters.registry import list_mutants, load_mutant_module
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace

MUTANTS = list_mutants()
GUARD_MUTANTS = [name for name in MUTANTS if load_mutant_module(name).NEEDS_GUARDS]
CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus" / "mutants"
SHORT_PROGRAM_STEPS_MAX = 48
"""Under schedule points a storage loop body is 3-5 steps (each backend call, put and wait is a
grant), so a minimal trace through a storage world with points is that much longer: a load of
a chain prefetched under a stored parent is two round trips of about 20 steps each
(``load_ack_before_last_layer`` is first found that way at seed 0, 44 steps)."""


MUTANT_CASES = 600
"""A mutant's campaign ends at its first failure; seed 0 catches the slowest
(``cancel_without_write_sync``) at case 247 with the literal pool pinned (benchmarks/RESULTS.md),
whatever the host's load, so a case budget, not a wall clock, bounds the search."""
MUTANT_WALL_CAP = 900
"""Seconds: a safety net only, far past the case budget's time on a loaded host."""


def test_the_catalogue_is_not_empty() -> None:
    assert len(MUTANTS) >= 4


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught_and_shrunk(name: str, tmp_path: Path) -> None:
    module = load_mutant_module(name)
    # campaign against the mutant -> a failure with a minimized trace
    report = run_campaign(
        f"mutant:{name}",
        seconds=MUTANT_WALL_CAP,
        cases_max=MUTANT_CASES,
        profile="ci",
        seed=0,
        out_dir=tmp_path,
        progress=False,
        shrink=False,
    )
    assert report.failures, f"mutant {name} survived {report.cases} cases"
    trace = Trace.read(Path(report.failures[0]["trace"]))
    assert len(trace.steps) <= SHORT_PROGRAM_STEPS_MAX, trace.to_jsonl()
    # the minimized trace fails on the mutant with an invariant it declares ...
    on_mutant = replay(trace)
    assert on_mutant.failed, trace.to_jsonl()
    assert on_mutant.signature() in module.INVARIANTS, (
        f"mutant {name} was caught by {on_mutant.signature()}, not by its declared "
        f"{module.INVARIANTS}: {on_mutant.error} (fix the mutant, or declare the check that "
        "catches it and say why in its docstring)"
    )
    # ... and passes on the reference: the bug is the mutant's
    assert not replay(trace, implementation="reference").failed


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_declares_its_invariants_and_bug(name: str) -> None:
    module = load_mutant_module(name)
    # Verify the declared ids are invariant ids, the first of them the primary
    assert module.INVARIANTS and all(inv.startswith("INV-") for inv in module.INVARIANTS)
    assert module.INVARIANT == module.INVARIANTS[0]
    # Verify the guard label, the bug and a docstring that does not call a caught mutant uncaught
    assert isinstance(module.NEEDS_GUARDS, bool)
    assert module.BUG and module.__doc__
    assert "Uncaught" not in module.__doc__, f"{name} is caught: its docstring must say by what"


@pytest.mark.parametrize("name", GUARD_MUTANTS)
def test_guard_mutant_is_caught_only_through_a_probe(name: str) -> None:
    # corpus trace with a probe -> replay with guards off (probes skipped) -> it passes
    trace = Trace.read(CORPUS / f"{name}.jsonl")
    assert any(step.rule.startswith("probe_") for step in trace.steps), trace.to_jsonl()
    result = replay(trace, implementation=unguarded_name(name))
    assert not result.failed, f"{name} fails without a probe: set NEEDS_GUARDS = False"
