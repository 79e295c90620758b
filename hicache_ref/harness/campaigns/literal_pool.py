"""Hypothesis' pool of local literals, pinned while a campaign searches.

Hypothesis (6.13x on) mixes literals into its draws: about one draw in twenty may take a
value from a pool of constants instead of its random choice, and that pool holds, beside
Hypothesis' own, every literal it mined from the source of each *local* module in
``sys.modules`` (``providers._get_local_constants``, refreshed at every case; test files
excepted, everything they import included). Whether a literal is in the pool changes which
random numbers the draws consume, so the programs a seed draws depended on which modules the
process had imported: a 0.5.23 planted gate at seed 0 took 116 cases from the command line and
159 after a pytest collection, and a replay printed by one process was not the same program in
another (``benchmarks/RESULTS.md``, 2026-12-07 and 2026-12-08). No setting or environment
variable of Hypothesis turns the pool off or fixes it, so ``pinned_literal_pool`` swaps the
function that returns it for one returning ``CAMPAIGN_POOL``, and restores it afterwards.

``CAMPAIGN_POOL`` is the empty pool: a seed's programs then depend on the seed and on the
harness's strategies alone, never on a literal edited anywhere in the package, nor on the
sglang tree (whose re-executed modules are local too) or the mutant a catalogue imported.
Measured against the pool mined from every module of this package (a fixed set, the other
choice): both catch the catalogue and the planted bugs, the empty pool at as few cases or
fewer (``benchmarks/RESULTS.md``, 2026-12-08).

- ``CAMPAIGN_POOL``: the pool every campaign searches with;
- ``compute_package_pool``: the literals of every module of the package (the measured
  alternative, for the benchmark);
- ``pinned_literal_pool``: the context a campaign's search runs in (re-entrant, restored at
  its end).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants, _constants_from_source

CAMPAIGN_POOL = Constants()
"""Empty: no literal of any module takes part in a campaign's draws (Hypothesis' own global
constants, the same in every process, still do)."""

_lock = threading.Lock()
_depth = [0]
_live: list[Callable[[], Any]] = []


def compute_package_pool() -> Constants:
    """The literals Hypothesis would mine from every module of ``hicache_ref``, in a fixed
    order (the same whatever is imported)."""
    package = Path(__file__).resolve().parents[2]
    pool = Constants()
    for path in sorted(package.rglob("*.py")):
        pool |= _constants_from_source(path.read_bytes(), limit=True)
    return pool


@contextmanager
def pinned_literal_pool(pool: Constants | None = None) -> Iterator[None]:
    """Search with ``pool`` (default ``CAMPAIGN_POOL``) as Hypothesis' local literals, whatever
    this process imported.

    Hypothesis caches which of the pool's values each kind of draw permits
    (``CONSTANTS_CACHE``): it is emptied when the pool is swapped in and again when the live
    pool returns, so neither sees the other's values. Nested campaigns (a gate's PP share
    inside a process already pinned) keep the outer pin."""
    with _lock:
        _depth[0] += 1
        if _depth[0] == 1:
            _live.append(providers._get_local_constants)
            pinned = CAMPAIGN_POOL if pool is None else pool
            providers._get_local_constants = lambda: pinned
            providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        with _lock:
            _depth[0] -= 1
            if _depth[0] == 0:
                providers._get_local_constants = _live.pop()
                providers.CONSTANTS_CACHE.cache.clear()
