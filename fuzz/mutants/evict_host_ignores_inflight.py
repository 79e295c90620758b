"""Uncaught mutant: host eviction does not refuse slots an in-flight copy still uses.

Re-creates sglang#27444 / #31427 / #26728 (host pages reused while an H2D still read them) and
bug class 4: ``evict_host`` and ``evict_cp_host`` free host and draft host slots without asking
the in-flight tracker (INV-07).

Why the harness does not catch it: the tree driver, like SGLang's radix cache, offers
``evict_host`` only for a node whose backup ack was drained and that is not loading, so it never
asks to free a slot in flight, and the removed guard is never needed. Fix in the harness: a rule
that asks ``evict_host``/``evict_cp_host`` for a node whose write or load ack is undrained and
expects the refusal (``InvariantViolation("INV-07")``) with nothing freed (INV-17); the
controller test suite covers the refusal, the state machine does not.
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.controller.inflight import InflightTracker
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "evict_host_ignores_inflight"
INVARIANT = "INV-07"
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
