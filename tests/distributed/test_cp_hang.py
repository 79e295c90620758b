"""No hang: a rank stuck inside a step fails the world instead of blocking it.

A test-only mutant sleeps in ``start_loading`` on rank 1. Rank 0 waits for it in the step's
agreement round, its collective times out (``init_process_group``'s timeout), it reports the
timeout and ends; the parent then kills rank 1 (it outlived every collective timeout), and the
report names both ranks. The whole run takes a few collective timeouts, not the deadline.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hicache_ref.distributed.campaign import run_cp_campaign

HANGING_MUTANT = '''
"""Test-only: rank 1 never returns from start_loading."""
import time

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation


class Controller(HiCacheController):
    def start_loading(self):
        layout = self.cp_shared_kv_layout
        if layout is not None and layout.cp_rank == 1:
            time.sleep(600)
        return super().start_loading()


def implementation():
    return MutantImplementation(Controller, "hangs_on_rank_1")
'''


def test_a_rank_that_hangs_is_timed_out_and_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mutants = tmp_path / "mutants"
    mutants.mkdir()
    (mutants / "hangs_on_rank_1.py").write_text(HANGING_MUTANT)
    monkeypatch.setenv("HICACHE_MUTANTS_DIR", str(mutants))  # the spawned ranks inherit it
    start = time.monotonic()
    report = run_cp_campaign(
        "mutant:hangs_on_rank_1",
        processes=2,
        seconds=60,
        cases_max=6,
        steps_per_case=60,
        seed=0,
        out_dir=tmp_path / "out",
        progress=False,
        collective_timeout_s=3.0,
        deadline_s=150.0,
    )
    assert time.monotonic() - start < 100.0  # well before the deadline
    assert report.failed
    rank0, rank1 = report.ranks
    assert "timed out" in rank0.error.lower() or "timeout" in rank0.error.lower(), rank0.error
    assert rank1.error == "rank 1 sent no report within 150s (killed or crashed)"
    assert any(p.startswith("rank 1: rank 1 sent no report") for p in report.rank_errors)
