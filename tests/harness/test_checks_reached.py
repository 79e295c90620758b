"""Every registered checker is reached by a campaign, not only by its own unit test: a short
default campaign on the reference hands evidence to each one (a checker nothing calls would
reward dead code)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from hicache_ref.campaign.run import run_campaign
from hicache_ref.invariants import registry
from hicache_ref.invariants.evidence import Evidence

CAMPAIGN_SECONDS = 12


def test_a_short_campaign_reaches_every_registered_checker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # wrap each registered checker -> run the default campaign -> every wrapper was called
    calls: Counter[str] = Counter()

    def counting(inv_id: str) -> registry.Checker:
        checker = registry.REGISTERED[inv_id]

        def run(evidence: Evidence) -> None:
            calls[inv_id] += 1
            checker(evidence)

        return run

    wrapped = {inv_id: counting(inv_id) for inv_id in registry.REGISTERED}
    monkeypatch.setattr(registry, "REGISTERED", wrapped)
    report = run_campaign(
        "reference",
        seconds=CAMPAIGN_SECONDS,
        profile="ci",
        seed=3,
        out_dir=tmp_path,
        progress=False,
    )
    assert not report.failures
    unreached = sorted(set(wrapped) - set(calls))
    assert not unreached, f"registered checkers no campaign step reached: {unreached}"
