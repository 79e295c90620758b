"""Seeded mutants: our reference with one deliberate bug, loaded from ``fuzz/mutants/<name>.py``.

A mutant file defines ``Controller`` (a subclass of ``HiCacheController`` overriding one small
method), ``INVARIANTS`` (every invariant id whose check catches it, which a minimized trace
must fail with; ``INVARIANT``, the first of them, is the usual one), ``NEEDS_GUARDS`` (True
when only a misuse probe sees it, so it is out of reach once the ``guards`` capability is off),
``BUG`` (the upstream bug or bug class it re-creates) and ``implementation()`` returning
``MutantImplementation(Controller, NAME)``.

``without_guards`` gives the same mutant with ``guards`` off (``unguarded`` any implementation),
as an implementation without SGLang-style refusals (upstream has none) is run; the name
``unguarded_name(entry)`` resolves to it in any process (``registry.get_implementation``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.base import BuildRequest, ControllerLike, RankLike
from hicache_ref.harness.adapters.contract import ImplementationBase
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.invariants.snapshot import RankSnapshot

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
        self.focus = refine_config

    def refine_config(self, config: HarnessConfig) -> HarnessConfig:
        if self.focus is None:
            return config
        focused = self.focus(config)
        if focused.storage_buffer_only and not focused.may_run_buffer_only:
            # a focus that gave a drawn buffer world a draft or side pool: cache mode there
            return focused.model_copy(update={"storage_buffer_only": False})
        return focused


def without_guards(implementation: MutantImplementation) -> MutantImplementation:
    """The same mutant with the ``guards`` capability off: the machine's misuse probes stop."""
    base = implementation.name.split(":", 1)[-1]
    unguarded = MutantImplementation(
        implementation.controller_class,
        base,
        capabilities=implementation.capabilities - {GUARDS},
        refine_config=implementation.focus,
    )
    unguarded.name = f"{UNGUARDED_PREFIX}{base}"
    return unguarded


class _Unguarded(ImplementationBase):
    """Any implementation with the ``guards`` capability off (an outside mutant's)."""

    def __init__(self, inner: ImplementationBase) -> None:
        self.inner = inner
        self.name = f"{UNGUARDED_PREFIX}{inner.name}"
        self.capabilities = inner.capabilities - {GUARDS}
        self.source_tree = inner.source_tree

    def build_controller(self, request: BuildRequest) -> ControllerLike:
        return self.inner.build_controller(request)

    def snapshot(self, rank: RankLike, gate_ids: Iterable[int]) -> RankSnapshot:
        return self.inner.snapshot(rank, gate_ids)

    def refine_config(self, config: HarnessConfig) -> HarnessConfig:
        return self.inner.refine_config(config)


def unguarded(implementation: ImplementationBase) -> ImplementationBase:
    """Any implementation (an outside mutant's) with the ``guards`` capability off."""
    return _Unguarded(implementation)


def unguarded_name(entry: str) -> str:
    """The implementation name of catalogue entry ``entry`` (a mutant's name, or an outside
    ``pkg.module:factory``) with ``guards`` off; ``registry.get_implementation`` builds it from
    the name alone, so a replay in another process rebuilds it too."""
    return f"{UNGUARDED_PREFIX}{entry}"
