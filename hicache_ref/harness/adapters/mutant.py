"""Seeded mutants: our reference with one deliberate bug, loaded from ``fuzz/mutants/<name>.py``.

A mutant file defines ``Controller`` (a subclass of ``HiCacheController`` overriding one small
method), ``INVARIANT`` (the id that must catch it), ``BUG`` (the upstream bug or bug class it
re-creates) and ``implementation()`` returning ``MutantImplementation(Controller, NAME)``.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.config import HarnessConfig


class MutantImplementation(ReferenceImplementation):
    """The reference implementation with its controller class swapped for a mutant."""

    def __init__(
        self,
        controller_class: type[HiCacheController],
        name: str,
        capabilities: frozenset[str] | None = None,
        refine_config: Callable[[HarnessConfig], HarnessConfig] | None = None,
    ) -> None:
        self.controller_class = controller_class
        self.name = f"mutant:{name}"
        if capabilities is not None:
            self.capabilities = capabilities
        # focus: the machine draws a config, then this narrows it to where the bug lives
        self.refine_config = refine_config
