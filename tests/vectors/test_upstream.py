"""Upstream SGLang (0.5.10 and 0.5.23) and the seed fork replay the shipped suite: every vector
within their capabilities passes, or fails exactly as a written-up finding
(``specs/upstream_findings.md``, matched by ``known_findings``) says it does, and each finding
the suite reaches is seen.

The trees are read at test time: the sglang wheels fetched with pip (cached), the seed from
``../shared/seeds`` (skipped, saying why, where that folder is absent)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from hicache_ref.harness.adapters.sglang import SeedImplementation, SglangImplementation
from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree, fork_tree, tree_release
from hicache_ref.harness.campaigns.known_findings import KNOWN_FINDINGS, match_known_finding
from hicache_ref.vectors.replay import SuiteReport, replay_vectors
from tests.vectors.conftest import shipped

REPO = Path(__file__).resolve().parents[2]
SEED_FILE = Path(
    os.environ.get("HICACHE_SEED_FILE")
    or Path(os.environ.get("HICACHE_SHARED_DIR", REPO.parent / "shared"))
    / "seeds"
    / "cache_controller_seed_reindented.py.txt"
)


STORAGE_FINDINGS = ("F22", "F23", "F24", "F25", "F26")
"""0.5.10's storage findings, the seed fork's too (its storage threads are 0.5.10's)."""


def _replay(implementation: object, name: str) -> SuiteReport:
    _, vectors = shipped()
    return replay_vectors(vectors, implementation, name)  # type: ignore[arg-type]


def _findings(report: SuiteReport, name: str, release: str) -> Counter[str]:
    """The known finding behind each failure (of a tree of ``release``: findings are scoped
    by release); an unexplained failure fails the test."""
    seen: Counter[str] = Counter()
    for result in report.results:
        if result.status != "fail":
            continue
        assert result.what == "check", f"a divergence no finding describes: {result.render()}"
        finding = match_known_finding(
            tuple(KNOWN_FINDINGS.values()), name, result.invariant or "", result.reason, release
        )
        assert finding is not None, f"no written-up finding explains {result.render()}"
        seen[finding.id] += 1
    return seen


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
def test_upstream_fails_only_where_its_findings_say(version: str) -> None:
    tree = fetch_wheel_tree(version)
    report = _replay(SglangImplementation(tree), "sglang")
    seen = _findings(report, "sglang", tree_release(tree))
    # F8: reset() keeps the layer counter (INV-18), on every vector that resets after a load
    assert set(seen) == {"F8"}, seen
    assert report.count("pass") >= 100  # the vectors within upstream's capabilities
    assert "needs guards" in " ".join(report.skip_reasons)


def test_the_seed_fails_only_where_its_findings_say() -> None:
    if not SEED_FILE.is_file():
        pytest.skip(f"the seed's controller is not at {SEED_FILE} (../shared is absent here)")
    implementation = SeedImplementation(fork_tree(SEED_FILE, base=fetch_wheel_tree()))
    report = _replay(implementation, "seed")
    seen = _findings(report, "seed", tree_release(implementation.tree))
    # F1: a constructor-given draft pool is never backed up; F4: a zero-owned CP rank acks
    # before the draft layers
    assert {"F1", "F4"} <= set(seen), seen
    # and, since the fork's storage tier is driven, 0.5.10's storage findings (F22 - F26)
    assert set(seen) <= {"F1", "F2", "F3", "F4", "F7", "F8", "F20", *STORAGE_FINDINGS}, seen
    assert report.count("pass") >= 30
