"""The campaign profile's PCT-style bias: the highest-priority thread runs until a change point.

A case's priorities and change points come from its seed alone, so the same case picks the same
threads again; the default profiles keep the uniform draw.
"""

from __future__ import annotations

import pytest

from hicache_ref.harness.schedule.pct import PCT_DEPTH, PctBias, campaign_bias

KINDS = ("hit_query", "io", "sync", "backup")


def test_the_highest_priority_thread_runs_until_a_change_point_drops_it() -> None:
    bias = PctBias(seed=7, kinds=KINDS)
    first = max(KINDS, key=lambda kind: bias.priority[kind])
    change = min(bias.changes)
    picks = [bias.pick(KINDS) for _ in range(change)]
    assert picks == [first] * change  # the same thread, step after step
    assert bias.pick(KINDS) != first  # its priority fell below every other at the change point
    assert bias.changed == 1 and len(bias.changes) == PCT_DEPTH - 1


def test_a_case_picks_the_same_threads_again_from_its_seed() -> None:
    runs = [[PctBias(seed=3, kinds=KINDS).pick(KINDS[i % 3 :]) for i in range(50)] for _ in "ab"]
    assert runs[0] == runs[1]


def test_only_the_campaign_profile_biases_the_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_PROFILE", "ci")
    assert campaign_bias(0, KINDS) is None
    monkeypatch.setenv("HICACHE_PROFILE", "campaign")
    assert isinstance(campaign_bias(0, KINDS), PctBias)
