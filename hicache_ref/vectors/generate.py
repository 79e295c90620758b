"""Generate a suite, deterministically from one seed.

stories (``stories.py``) -> programs over the rule table and over the oracle (``walks.py``)
-> ``ops`` programs (the reference's own schedule) -> ``Coverage`` (``coverage.py``): which
rules each vector applied and which invariant ids it checked. A rule no vector applied gets
programs biased towards it until one does (or the report names it uncovered).

Nothing here uses Hypothesis' engine: the walks draw from ``random.Random(seed)``, so a suite
is the same on every machine and every Hypothesis version; ``tests/vectors`` regenerates the
shipped suite and compares digests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hicache_ref import __version__
from hicache_ref.vectors.coverage import Coverage
from hicache_ref.vectors.models import SUITE_VERSION, SuiteHeader, Vector, compute_suite_digest
from hicache_ref.vectors.stories import STORIES, record_story
from hicache_ref.vectors.walks import oracle_vector, program_vector

DEFAULT_SEED = 1
GENERATED = 400  # programs over the rule table
ORACLE = 100  # programs over the oracle's ops
OPS = 40  # programs that keep the reference's own schedule (``ops`` vectors)
TARGETED_TRIES = 40  # extra programs per rule no vector applied


@dataclass
class Generated:
    header: SuiteHeader
    vectors: list[Vector]
    coverage: Coverage


def generate_suite(
    seed: int = DEFAULT_SEED,
    *,
    generated: int = GENERATED,
    oracle: int = ORACLE,
    ops: int = OPS,
    progress: Callable[[int], None] | None = None,
) -> Generated:
    """Every vector of a suite, in order: stories, programs, oracle programs, targeted ones."""
    vectors: list[Vector] = []
    coverage = Coverage()

    def keep(vector: Vector) -> None:
        vectors.append(vector)
        coverage.add(vector)
        if progress is not None:
            progress(len(vectors))

    for story in STORIES:
        keep(record_story(story).vector())
    for index in range(generated):
        keep(program_vector(seed, index))
    for index in range(oracle):
        keep(oracle_vector(seed, index))
    for index in range(ops):
        keep(program_vector(seed, index, settle=False))
    for rule in coverage.missing_rules():
        for attempt in range(TARGETED_TRIES):
            vector = program_vector(seed, generated + attempt, favour=rule)
            if rule in vector.rules:
                keep(vector)
                break
    header = SuiteHeader(
        suite=SUITE_VERSION,
        seed=seed,
        vectors=len(vectors),
        digest=compute_suite_digest([v.digest for v in vectors]),
        generator=f"hicache_ref {__version__}",
    )
    return Generated(header, vectors, coverage)
