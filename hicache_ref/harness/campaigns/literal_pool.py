"""Hypothesis' pool of local literals, pinned while a campaign searches.

Hypothesis (6.170 here) mixes literals into its draws: about one draw in twenty may take a
value from a pool of constants instead of its random choice, and that pool holds, beside
Hypothesis' own, every literal it mined from the source of each *local* module in
``sys.modules`` (``providers._get_local_constants``, refreshed at every case; test files
excepted, everything they import included). Whether a literal is in the pool changes which
random numbers the draws consume, so the programs a seed draws depended on which modules the
process had imported: at seed 0 a mutant's campaign fell at case 5 as a process's first work
and at case 27 after every test module was imported (a planted gate: 116 cases from the command
line, 159 after a pytest collection), and a replay printed by one process was not the same
program in another (``benchmarks/RESULTS.md``, 2026-12-07: the steps/s section and the pin's).
No setting or environment variable of Hypothesis turns the pool off or fixes it, so
``pinned_literal_pool`` swaps the function that returns it for one returning
``CAMPAIGN_POOL``, and restores it afterwards.

``CAMPAIGN_POOL`` is the empty pool: a seed's programs then depend on the seed and on the
harness's strategies alone, never on a literal edited anywhere in the package, nor on the
sglang tree (whose re-executed modules are local too) or the mutants a catalogue imported, and
nothing is mined. The other fixed choice, every literal of the package's modules, finds bugs
no faster: 54 of the 58 mutants fall at the same case under either pool, the four others
split (each pool is faster on some), and the slowest mutant takes 247 cases under both
(``benchmarks/RESULTS.md``, the pin's section).

- ``CAMPAIGN_POOL``: the pool every campaign searches with;
- ``compute_package_pool``: the literals of every module of the package (the measured
  alternative, for the benchmark);
- ``pinned_literal_pool``: the context a campaign's search runs in (re-entrant, restored at
  its end).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants, _constants_from_source

CAMPAIGN_POOL = Constants()
"""Empty: no literal of any module takes part in a campaign's draws (Hypothesis' own global
constants, the same in every process, still do)."""

PINNED = "hicache_pinned_pool"
"""The attribute that marks the function a pin swapped in (a nested pin sees it and keeps it);
it holds the function the pin replaced (Hypothesis' own), for a test of the pin itself."""


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
    pool returns, so neither sees the other's values. A nested pin (a search inside a search
    already pinned) keeps the outer pool. One search at a time per process: campaigns run in
    processes of their own (the catalogue's jobs, a fleet's workers), never in threads."""
    live: Callable[[], Constants] = providers._get_local_constants
    if getattr(live, PINNED, False):
        yield
        return
    pinned = CAMPAIGN_POOL if pool is None else pool

    def get_pinned_constants() -> Constants:
        return pinned

    setattr(get_pinned_constants, PINNED, live)
    providers._get_local_constants = get_pinned_constants
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = live
        providers.CONSTANTS_CACHE.cache.clear()
