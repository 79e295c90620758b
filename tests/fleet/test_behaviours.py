"""Behaviours: rule/outcome pairs and checks by id, counted with when each was first and last
seen; the latest first sighting (of those or of a covered line or branch) is the campaign's
last new behaviour."""

from __future__ import annotations

from dataclasses import dataclass

from hicache_ref.campaign.behaviours import Behaviours, get_last_new, get_outcome_kind


@dataclass(frozen=True)
class _Step:
    rule: str


def test_outcomes_are_done_refused_or_skipped() -> None:
    assert get_outcome_kind("wrote 4 pages") == "done"
    assert get_outcome_kind("refused: host_capacity") == "refused"
    assert get_outcome_kind("drained 1; refused: device full") == "refused"
    assert get_outcome_kind("skipped") == "skipped"


def test_a_case_counts_its_rules_by_outcome_and_its_checks() -> None:
    behaviours = Behaviours()
    # write -> write refused -> load skipped, INV-02 checked twice
    steps = [_Step("write"), _Step("write"), _Step("load")]
    outcomes = ["wrote 1 page", "refused: host_capacity", "skipped"]
    behaviours.absorb(steps, outcomes, {"INV-02": 2}, at_s=1.234)
    behaviours.absorb([_Step("write")], ["wrote 2 pages"], {"INV-02": 1}, at_s=3.0)
    assert behaviours.get_rule("write") == {
        "done": 2, "refused": 1, "skipped": 0, "first_s": 1.23, "last_s": 3.0,
    }  # fmt: skip
    assert behaviours.get_rule("load")["skipped"] == 1
    assert behaviours.counts["check/INV-02"] == 3
    assert behaviours.get_rules() == ["load", "write"]


def test_workers_merge_to_the_earliest_first_and_the_latest_last_sighting() -> None:
    one, other = Behaviours(), Behaviours()
    one.absorb([_Step("write")], ["ok"], {}, at_s=2.0)
    other.absorb([_Step("write")], ["ok"], {}, at_s=1.0)
    other.absorb([_Step("write")], ["ok"], {}, at_s=1.5)
    one.merge(other)
    assert (one.counts["write/done"], one.first_s["write/done"], one.last_s["write/done"]) == (
        3, 1.0, 2.0,
    )  # fmt: skip
    assert Behaviours.from_json(one.as_json()) == one


def test_the_last_new_behaviour_is_the_latest_first_sighting() -> None:
    behaviours = Behaviours()
    behaviours.absorb([_Step("write")], ["ok"], {"INV-02": 1}, at_s=0.5)
    behaviours.absorb([_Step("evict_host")], ["refused: busy"], {}, at_s=4.0)
    last = get_last_new(behaviours, {})
    assert last is not None and (last.at_s, last.what) == (4.0, "evict_host refused")
    # a branch covered later is newer still
    coverage = {"files": {"a.py": {"lines": {"3": 0.0}, "arcs": {"3>5": 7.5}}}}
    last = get_last_new(behaviours, coverage)
    assert last is not None and (last.at_s, last.what) == (7.5, "branch a.py:3 -> 5")
    assert get_last_new(Behaviours(), {}) is None
