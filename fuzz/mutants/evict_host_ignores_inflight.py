"""Mutant: host eviction does not refuse slots an in-flight copy still uses.

Re-creates sglang#27444 / #31427 / #26728 (host pages reused while an H2D still read them) and
bug class 4: ``evict_host`` and ``evict_cp_host`` free host and draft host slots without asking
the in-flight tracker (INV-07).

Needs guards: the tree driver, like SGLang's radix cache, offers ``evict_host`` only for a node
whose backup ack was drained and that is not loading, so only the
``probe_misuse(kind="evict_host")`` rule (``TreeDriver.probe``) asks to free a slot in flight;
the mutant accepts and the probe raises INV-07. With the ``guards`` capability off the probes
are disabled and nothing sees it.
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.inflight import InflightTracker
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "evict_host_ignores_inflight"
INVARIANTS = ("INV-07",)
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = True
BUG = "sglang#27444, #31427, #26728; bug class 4"


class _HostBlindTracker(InflightTracker):
    def check_not_in_flight(
        self, pool: str, pages: frozenset[int], inv_id: str, action: str
    ) -> None:
        if pool in ("host", "draft_host"):
            return  # MUTATION: host slots are never checked
        super().check_not_in_flight(pool, pages, inv_id, action)


class Controller(HiCacheController):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inflight.__class__ = _HostBlindTracker


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
