"""Real threads: reset and detach under load lose no page and leave no thread (INV-24).

These run the thread executor (production) with faults on: injected misses, holes, short reads,
failed, partial and dropped writes, exceptions and delays. Each is bounded in time.
"""

from __future__ import annotations

import logging

import pytest

from hicache_ref.harness.campaigns.storage_soak import SoakConfig, run_soak


@pytest.fixture(autouse=True)
def quiet_storage_logs() -> None:
    logging.getLogger("hicache_ref").setLevel(logging.CRITICAL)


@pytest.mark.parametrize(("ranks", "backend"), [(2, "memory"), (3, "file")])
def test_resets_and_a_detach_under_load_lose_nothing(ranks: int, backend: str) -> None:
    # work in flight on every rank -> reset twice -> detach -> every page is free, no thread
    report = run_soak(
        SoakConfig(seconds=2.5, ranks=ranks, backend=backend, reset_every_s=0.6, seed=ranks)
    )
    assert report.resets >= 2 and report.faults_injected > 0
    assert report.pages_read_back > 0 and report.pages_mismatched == 0
    assert report.leaked_pages == 0 and report.double_frees == 0
    assert report.threads_alive_after_detach == 0
    assert report.violations == [] and report.thread_errors == []


def test_a_single_rank_soak_without_faults_reads_back_every_page() -> None:
    report = run_soak(SoakConfig(seconds=1.0, ranks=1, faults=False, reset_every_s=0.3))
    assert report.clean and report.faults_injected == 0 and report.pages_read_back > 0
