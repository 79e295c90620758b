"""A seed draws the same programs in any process: Hypothesis' pool of local literals is pinned
while a campaign searches, whatever modules the process imported, and restored afterwards."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn, cast

import pytest
from hypothesis import strategies as st
from hypothesis.internal.conjecture import providers

from hicache_ref.campaign.run import run_campaign
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.campaigns import literal_pool
from hicache_ref.harness.campaigns.literal_pool import (
    CAMPAIGN_POOL,
    compute_package_pool,
    pinned_literal_pool,
)
from hicache_ref.harness.campaigns.pp_gate import run_pp_gate

LITERALS = (
    [n * 37 + 100 for n in range(300)]
    + [round(0.001 + n / 401, 6) for n in range(400)]
    + [f"lit{n:03d}" for n in range(200)]
)
"""Literals a local module may hold: integers past the ones Hypothesis already favours, floats
in (0, 1), short strings (under Hypothesis' 1,024 per module, past which it mines none)."""

STALE: Any = ("integer", ("stale",))
"""A key of Hypothesis' cache of permitted constants, as a swap must empty it."""


@pytest.fixture
def literal_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A local module full of literals, importable (imported by the test that wants it)."""
    name = f"hicache_literals_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(f"LITERALS = {LITERALS!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def live_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """These stories start from Hypothesis' own pool: the suite's session pin
    (``tests/conftest.py``) is lifted for each of them and back after it."""
    current = providers._get_local_constants
    monkeypatch.setattr(
        providers, "_get_local_constants", getattr(current, literal_pool.PINNED, current)
    )
    assert not getattr(providers._get_local_constants, literal_pool.PINNED, False)


def _fingerprint(out: Path) -> tuple[int, int, dict[str, Any]]:
    """What a short reference campaign at seed 0 ran: its cases, steps and rule counts."""
    report = run_campaign(
        "reference", seconds=60.0, profile="ci", seed=0, out_dir=out, progress=False,
        rounds_max=1, examples_per_round=6,
    )  # fmt: skip
    return report.cases, report.steps, dict(report.as_json()["rules"])


def test_a_seed_draws_the_same_programs_after_new_local_modules(
    tmp_path: Path, literal_module: str
) -> None:
    # a campaign at seed 0 -> import a local module full of literals -> the same campaign
    # runs the same programs (before the pin the pool took the new literals, and the seed's
    # draws changed: a planted gate took 116 cases from the command line, 159 under pytest)
    before = _fingerprint(tmp_path / "before")
    importlib.import_module(literal_module)
    assert _fingerprint(tmp_path / "after") == before


def test_the_pool_is_pinned_inside_and_live_again_after(literal_module: str) -> None:
    # inside: the campaign's pool, new modules or not; the permitted-values cache emptied
    # at both ends; after: Hypothesis' own function again, which mines the new module
    live = providers._get_local_constants
    providers.CONSTANTS_CACHE[STALE] = ((), ())
    with pinned_literal_pool():
        assert STALE not in providers.CONSTANTS_CACHE
        importlib.import_module(literal_module)
        assert providers._get_local_constants() is CAMPAIGN_POOL
        with pinned_literal_pool(compute_package_pool()):  # nested: the outer pin holds
            assert providers._get_local_constants() is CAMPAIGN_POOL
        assert providers._get_local_constants() is CAMPAIGN_POOL
        providers.CONSTANTS_CACHE[STALE] = ((), ())
    assert providers._get_local_constants is live
    assert STALE not in providers.CONSTANTS_CACHE
    assert LITERALS[0] in providers._get_local_constants().integers


def test_a_search_that_raises_restores_the_live_pool() -> None:
    live = providers._get_local_constants
    with pytest.raises(RuntimeError), pinned_literal_pool():
        raise RuntimeError("a found bug")
    assert providers._get_local_constants is live


def test_the_campaign_pool_is_empty_and_the_package_pool_fixed() -> None:
    # the campaigns search with no local literal at all; the measured alternative (the whole
    # package's literals) is mined from the files, the same whatever is imported
    assert len(CAMPAIGN_POOL) == 0 and literal_pool.CAMPAIGN_POOL is CAMPAIGN_POOL
    package = compute_package_pool()
    assert len(package) > 0 and compute_package_pool() == package


class _Drawn(Exception):
    """The PP gate's first draw happened (the test stops its search there)."""


def test_the_pp_gate_draws_its_programs_from_the_pinned_pool() -> None:
    # the PP gate's search (Hypothesis' find) draws its first program -> the pool it sees
    # there is the campaign's, and Hypothesis' own function is back once the search ends
    seen: list[object] = []

    def record(_: None) -> NoReturn:
        seen.append(providers._get_local_constants())
        raise _Drawn

    live = providers._get_local_constants
    with pytest.raises(_Drawn):
        run_pp_gate(cast(Implementation, None), seconds=60.0, drawn=st.none().map(record))
    assert seen and all(pool is CAMPAIGN_POOL for pool in seen)
    assert providers._get_local_constants is live
