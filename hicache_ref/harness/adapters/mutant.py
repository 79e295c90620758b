"""Seeded mutants: our reference with one deliberate bug, loaded from ``fuzz/mutants/<name>.py``.

A mutant file defines ``Controller`` (a subclass of ``HiCacheController`` overriding one small
method), ``INVARIANTS`` (every invariant id whose check catches it, which a minimized trace
must fail with; ``INVARIANT``, the first of them, is the usual one), ``NEEDS_GUARDS`` (True
when only a misuse probe sees it, so it is out of reach once the ``guards`` capability is off),
``BUG`` (the upstream bug or bug class it re-creates) and ``implementation()`` returning
``MutantImplementation(Controller, NAME)``.

``without_guards`` and ``register_unguarded_mutant`` give the same mutant with ``guards`` off,
as an implementation without SGLang-style refusals (upstream has none) is run.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.config import HarnessConfig

GUARDS = "guards"
UNGUARDED_PREFIX = "unguarded:"


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


def without_guards(implementation: MutantImplementation) -> MutantImplementation:
    """The same mutant with the ``guards`` capability off: the machine's misuse probes stop."""
    base = implementation.name.split(":", 1)[-1]
    unguarded = MutantImplementation(
        implementation.controller_class,
        base,
        capabilities=implementation.capabilities - {GUARDS},
        refine_config=implementation.refine_config,
    )
    unguarded.name = f"{UNGUARDED_PREFIX}{base}"
    return unguarded


def register_unguarded_mutant(name: str) -> str:
    """Register ``unguarded:<name>`` (mutant ``name`` without guards) and return that name.

    A trace names its implementation, so a replay or a ddmin in this process rebuilds the
    unguarded mutant; another process must register it again before replaying such a trace.
    """
    from hicache_ref.harness.adapters.registry import load_mutant_module, register_implementation

    def build() -> MutantImplementation:
        implementation: MutantImplementation = load_mutant_module(name).implementation()
        return without_guards(implementation)

    register_implementation(f"{UNGUARDED_PREFIX}{name}", build)
    return f"{UNGUARDED_PREFIX}{name}"
