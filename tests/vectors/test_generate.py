"""Generation: the shipped suite is what its seed regenerates, covers every rule and every
reachable invariant id, and has a story for each id."""

from __future__ import annotations

import pytest

from hicache_ref.harness.rules import RULES
from hicache_ref.vectors.coverage import INVARIANT_IDS, Coverage
from hicache_ref.vectors.generate import generate_suite
from hicache_ref.vectors.stories import STORIES
from hicache_ref.vectors.walks import UnsampledRule
from tests.vectors.conftest import shipped


def test_regenerating_the_shipped_suite_from_its_seed_gives_the_same_digest() -> None:
    # if this fails after a change to the harness or the reference, regenerate the suite:
    #   hicache-fuzz vectors generate --out hicache_ref/vectors/suites
    header, vectors = shipped()
    again = generate_suite(header.seed)
    assert [v.id for v in again.vectors] == [v.id for v in vectors]
    assert again.header.digest == header.digest
    coverage = again.coverage
    assert coverage.missing_rules() == []
    assert coverage.missing_ids(list(INVARIANT_IDS)) == []


def test_every_rule_and_reachable_id_is_in_some_shipped_vector() -> None:
    _, vectors = shipped()
    coverage = Coverage()
    for vector in vectors:
        coverage.add(vector)
    assert [rule for rule in RULES if not coverage.by_rule[rule]] == []
    uncovered = [i for i in INVARIANT_IDS if not coverage.by_id[i]]
    assert all(Coverage.exempt(i) for i in uncovered), uncovered
    table = coverage.render(list(INVARIANT_IDS))
    assert table.splitlines()[-1] == "coverage: every rule and every reachable invariant id"


def test_a_story_guards_every_reachable_invariant_id() -> None:
    guarded = {s.inv for s in STORIES}
    assert [i for i in INVARIANT_IDS if i not in guarded and not Coverage.exempt(i)] == []


def test_a_rule_with_no_way_to_draw_its_arguments_is_named() -> None:
    import dataclasses
    import random

    from hicache_ref.harness.adapters.reference import ReferenceImplementation
    from hicache_ref.harness.world.config import HarnessConfig
    from hicache_ref.vectors import walks
    from hicache_ref.vectors.record import Recorder

    recorder = Recorder(HarnessConfig(), vector_id="t", title="t", kind="generated")
    assert ReferenceImplementation.name == recorder.implementation.name
    # a prefill record without its sample -> the walk names the rule and the fix
    unsampled = dataclasses.replace(RULES["prefill"], sample=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(walks, "RULES", {**RULES, "prefill": unsampled})
        with pytest.raises(UnsampledRule, match="rule 'prefill' has no draw and no sample"):
            walks.rule_step(recorder, "prefill", random.Random(0))
