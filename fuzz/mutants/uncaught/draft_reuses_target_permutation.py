"""Uncaught mutant: the CP per-layer draft D2H reuses the target's device permutation.

Re-creates bug class 17 as the seed has it (specs/upstream_findings.md): ``move_indices`` sorts
the target and the draft host indices separately (direct backend, ``layer_first``), and the seed
reused the target-permuted device indices for the draft copy. When the draft host pool handed
out its pages in a different order from the target's, draft rows land in the host slots of other
tokens. Must be caught by INV-06 (byte equality of the draft host copy); the harness sees the
swapped rows when the ack drains (INV-09).

Why the harness does not catch it: both host pools allocate through
``alloc_contiguous_preferred``, which returns the lowest run of consecutive free pages whenever
one exists, so both host index lists come out sorted, both permutations are the identity and
the mutant's reuse changes nothing. They differ only when the draft host pool is fragmented
enough that no run fits and the policy hands out pages out of order. The focus below draws CP +
a draft + ``direct``/``layer_first`` with different handout orders; 60 s of the ``ci`` profile
(about 400 cases) did not reach it, nor did focuses with a small draft host pool (3-12 pages),
``page_size`` 1 or 2 and a ``lifo`` or ``random`` draft policy (2026-12-01). Fix in the
harness: a rule that pins scattered host pages (fragments the pools) before a backup, so
``alloc_contiguous_preferred`` falls back to the policy; the write ack drain's byte check
(``TreeDriver.writing_check``, INV-09) then sees the swapped draft rows.
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation
from hicache_ref.harness.world.config import HarnessConfig

NAME = "draft_reuses_target_permutation"
INVARIANTS = ("INV-09", "INV-06")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug class 17 (seed _get_or_create_layer_write_state reused the target permutation)"


class Controller(HiCacheController):
    def _get_or_create_layer_write_state(self, reservation: Any) -> Any:
        state = super()._get_or_create_layer_write_state(reservation)
        if state.draft_host_indices is not None:
            # MUTATION: the draft copy reads device locs in the target host indices' order
            state.draft_physical_device_indices = state.physical_device_indices
        return state


def _focus(config: HarnessConfig) -> HarnessConfig:
    # CP per-layer write with a draft, direct/layer_first (the path that sorts host indices),
    # and target/draft host pools handing out pages in different orders
    return config.model_copy(
        update={
            "cp_size": max(1, config.cp_size),
            "pool_kind": "nsa",
            "draft_layer_num": max(1, config.draft_layer_num),
            "io_backend": "direct",
            "layout": "layer_first",
            "alloc_policy": "random",
            "draft_alloc_policy": "lifo",
            "draft_host_pages": max(4, config.draft_host_pages),
        }
    )


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME, refine_config=_focus)
