"""What every test shares: a release the cache lacks, offline, is a skip that names the fix.

A test that reads an sglang release (``fetch_wheel_tree``) fetches it into the cache once. On a
machine without the package index (an air-gapped GPU runner) that fetch raises
``ReleaseUnavailable``; the test is then skipped with the command that fills the cache from a
file (``hicache-fuzz setup --from``), never failed. CI is online and sets
``HICACHE_REQUIRE_RELEASES=1`` (``.ci/run``), so there a release that cannot be fetched fails.

A test that needs an implementation of its own under a plain name takes ``name_implementation``:
the registry's table is read-only, so the test swaps in a copy with its row for its own run.

Every Hypothesis search of the suite (the machines pytest runs as ``TestCase``, ``@given`` tests,
campaigns run in this process) draws with the campaign's pinned literal pool
(``harness/campaigns/literal_pool.py``): a derandomized test then draws the same cases whatever
the other test files its worker imported before it, so a CI failure replays with the file alone.

A test that builds a session and never closes it leaves its storage world's threads running
(a running storage thread keeps its world alive, so no collector ends them): after every test
the worlds still open are closed, so one test's threads never slow the ones after it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Any

import pytest

from hicache_ref.harness.adapters import registry
from hicache_ref.harness.adapters.sglang_tree import ReleaseUnavailable
from hicache_ref.harness.campaigns.literal_pool import pinned_literal_pool
from hicache_ref.harness.world.storage_world import close_open_worlds

REQUIRE_RELEASES_ENV = "HICACHE_REQUIRE_RELEASES"
NameImplementation = Callable[[str, Callable[[], object]], None]


@pytest.fixture(autouse=True, scope="session")
def pinned_literals() -> Iterator[None]:
    """The whole session searches with the campaign's literal pool (see the module docstring)."""
    with pinned_literal_pool():
        yield


@pytest.fixture(autouse=True)
def no_world_outlives_its_test() -> Iterator[None]:
    """The storage worlds a test left open are closed when it ends (see the module docstring);
    looked for only when the test left threads behind (the search walks the collector's objects)."""
    threads = threading.active_count()
    yield
    if threading.active_count() > threads:
        close_open_worlds()


@pytest.fixture
def name_implementation(monkeypatch: pytest.MonkeyPatch) -> Iterator[NameImplementation]:
    """``name_implementation(name, factory)``: ``get_implementation(name)`` builds ``factory()``
    until the test ends (``registry.BUILT_IN`` swapped for a copy with that row, and the
    contract-check memo forgotten on both ends)."""

    def add(name: str, factory: Callable[[], object]) -> None:
        table = MappingProxyType({**registry.BUILT_IN, name: factory})
        monkeypatch.setattr(registry, "BUILT_IN", table)
        registry.checked_implementation.cache_clear()

    yield add
    registry.checked_implementation.cache_clear()


def get_release_skip(excinfo: Any) -> str | None:
    """The skip reason for a test that stopped at a release the cache lacks, offline."""
    if excinfo is None or os.environ.get(REQUIRE_RELEASES_ENV):
        return None
    error = excinfo.value
    if not isinstance(error, ReleaseUnavailable):
        return None
    return f"sglang {error.version} is not in the cache and cannot be fetched; run: {error.fill}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    reason = get_release_skip(call.excinfo) if call.when in ("setup", "call") else None
    if reason is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")
