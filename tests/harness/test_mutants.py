"""Seeded mutants: every one must be caught, shrunk to a short program, and pinned to the bug.

A mutant is our reference with one deliberate bug (fuzz/mutants/<name>.py). The harness must
find it within a bounded campaign; the minimized trace must fail on the mutant and pass on the
reference (so the failure is the mutant's bug, not a harness artefact).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ref.cli import run_campaign
from hicache_ref.harness.adapters.registry import list_mutants, load_mutant_module
from hicache_ref.harness.replay import replay
from hicache_ref.harness.trace import Trace

MUTANTS = list_mutants()
SHORT_PROGRAM_STEPS_MAX = 25


def test_the_catalogue_is_not_empty() -> None:
    assert len(MUTANTS) >= 4


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught_and_shrunk(name: str, tmp_path: Path) -> None:
    # campaign against the mutant -> a failure with a minimized trace
    report = run_campaign(
        f"mutant:{name}",
        seconds=90,
        profile="ci",
        seed=0,
        out_dir=tmp_path,
        progress=False,
        shrink=False,
    )
    assert report.failures, f"mutant {name} survived {report.cases} cases"
    trace = Trace.read(Path(report.failures[0]["trace"]))
    assert len(trace.steps) <= SHORT_PROGRAM_STEPS_MAX, trace.to_jsonl()
    # the minimized trace fails on the mutant, with an invariant violation ...
    on_mutant = replay(trace)
    assert on_mutant.failed and on_mutant.signature().startswith("INV-")
    # ... and passes on the reference: the bug is the mutant's
    assert not replay(trace, implementation="reference").failed


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_declares_its_invariant_and_bug(name: str) -> None:
    module = load_mutant_module(name)
    assert module.INVARIANT.startswith("INV-") and module.BUG and module.__doc__
