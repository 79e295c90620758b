"""Every seeded mutant of the catalogue fails at least one shipped vector (the table of the
first failing vector is ``benchmarks/vector_mutants.py``'s, in ``benchmarks/RESULTS.md``)."""

from __future__ import annotations

import pytest

from hicache_ref.harness.adapters.registry import get_implementation, list_mutants
from hicache_ref.vectors.replay import VectorResult, replay_vector
from tests.vectors.conftest import shipped


def first_failure(name: str) -> VectorResult | None:
    implementation = get_implementation(f"mutant:{name}")
    for vector in shipped()[1]:
        result = replay_vector(vector, implementation, f"mutant:{name}")
        if result.status == "fail":
            return result
    return None


@pytest.mark.parametrize("name", list_mutants())
def test_every_mutant_fails_a_vector(name: str) -> None:
    result = first_failure(name)
    assert result is not None, f"mutant {name} passes every vector of the shipped suite"
    assert result.invariant is not None and result.invariant.startswith("INV-")
