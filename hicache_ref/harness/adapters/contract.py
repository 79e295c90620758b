"""The implementation contract, declared once: what an adapter must and may define.

An implementation under test is an object with three **required** hooks:

- ``name: str`` — how traces, reports and replay lines name it;
- ``capabilities: frozenset[str]`` — a subset of ``base.CAPABILITIES`` (upstream adapters may
  add ``base.GROUP_CAPABILITIES``; an adapter that hands an independent side pool to its
  controller, as the reference's does, adds ``base.SIDE_POOL_CAPABILITY``); the machines draw only
  configurations and rules these allow, and those detectable from the controller class
  (``base.CAPABILITY_METHODS``) are checked against it;
- ``build_controller(request: BuildRequest) -> ControllerLike`` — one controller per rank, over
  the pools, allocator, CP layout and device the harness built.

and three **optional** ones, with the defaults ``ImplementationBase`` gives them:

- ``snapshot(rank, gate_ids) -> RankSnapshot`` — one rank as plain data (default
  ``base.snapshot_rank``: SGLang's attribute names); only for queues kept elsewhere;
- ``refine_config(config) -> HarnessConfig`` — how it runs a drawn configuration: a value it
  fixes (sglang's producer-slot count) or a campaign's focus (a mutant's); default: unchanged;
- ``source_tree: str`` — where its code came from, recorded in traces (default ``""``).

``ImplementationBase`` is the documented base class; ``adopt`` turns any object with the
required hooks (an outside package need not import the base) into one, reading its optional
hooks once. ``check_contract`` is the preflight every command runs before the first case:
it builds one small world and checks that the controller has every method and attribute the
tree driver calls (``CONTROLLER_METHODS``, ``CONTROLLER_ATTRIBUTES``) and every method of the
capabilities it declares. A break is a ``ContractError``: one line, exit status 2, never a
failure reported as a finding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.base import (
    CAPABILITIES,
    GROUP_CAPABILITIES,
    HOST_PRESSURE_CAPABILITY,
    STORAGE_BUFFER_CAPABILITY,
    STORAGE_MAMBA_CAPABILITY,
    STORAGE_PP_CAPABILITY,
    STORAGE_SIDECAR_CAPABILITY,
    STORAGE_SWA_CAPABILITY,
    BuildRequest,
    ControllerLike,
    RankLike,
    check_declared_capabilities,
    snapshot_rank,
    supports,
)
from hicache_ref.harness.world.config import HarnessConfig, IoBackend, Layout, PoolKind
from hicache_ref.invariants.snapshot import RankSnapshot

REQUIRED_HOOKS = ("name", "capabilities", "build_controller")
OPTIONAL_HOOKS = ("snapshot", "refine_config", "source_tree")
CONTROLLER_METHODS = (
    "write",
    "start_writing",
    "load",
    "start_loading",
    "evict_device",
    "evict_host",
    "reset",
)
"""``ControllerLike``'s methods: the tree driver calls every one of them."""
CONTROLLER_ATTRIBUTES = (
    "ack_write_queue",
    "ack_load_queue",
    "layer_done_counter",
    "write_stream",
    "load_stream",
)
"""``ControllerLike``'s attributes (read on the built controller: they are set per instance)."""

_PROBE_POOLS: tuple[PoolKind, ...] = ("mha", "mla", "nsa")
_PROBE_LAYOUTS: tuple[tuple[IoBackend, Layout], ...] = (
    ("direct", "layer_first"),
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("direct", "page_first_direct"),
    ("direct", "layer_page_first"),
    ("kernel", "page_head"),
)
PROBE_CONFIGS: tuple[HarnessConfig, ...] = tuple(
    HarnessConfig(pool_kind=pool, layout=layout, io_backend=io, host_pages=4, device_pages=6)
    for pool in _PROBE_POOLS
    for io, layout in _PROBE_LAYOUTS
    if not (layout == "page_head" and pool != "mha")
)
"""Small worlds the preflight tries, in order, until one is within the capabilities."""


class ContractError(HiCacheInputError):
    """An implementation that breaks the adapter contract: one line naming the hook and the fix."""


class ImplementationBase(ABC):
    """The base class of an implementation under test (see the module docstring).

    Subclass it, set ``name`` and ``capabilities``, write ``build_controller``; override an
    optional hook only when the default does not fit.
    """

    name: str
    capabilities: frozenset[str]
    source_tree: str = ""

    @abstractmethod
    def build_controller(self, request: BuildRequest) -> ControllerLike:
        """The controller of one rank (``request.rank``) over the harness's pools."""

    def snapshot(self, rank: RankLike, gate_ids: Iterable[int]) -> RankSnapshot:
        """One rank as plain data; the default reads SGLang's attribute names."""
        return snapshot_rank(rank, gate_ids)

    def refine_config(self, config: HarnessConfig) -> HarnessConfig:
        """How this implementation runs ``config`` (default: as drawn)."""
        return config


class AdoptedImplementation(ImplementationBase):
    """An object that has the required hooks but does not subclass ``ImplementationBase``;
    its optional hooks are read once, here, and nowhere else."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.name = str(getattr(inner, "name"))  # noqa: B009 (checked by adopt)
        self.capabilities = frozenset(getattr(inner, "capabilities"))  # noqa: B009
        self.source_tree = str(getattr(inner, "source_tree", "") or "")
        self._build: Callable[[BuildRequest], ControllerLike] = getattr(inner, "build_controller")  # noqa: B009
        self._snapshot: Callable[..., RankSnapshot] | None = _callable(inner, "snapshot")
        self._refine: Callable[[HarnessConfig], HarnessConfig] | None = _callable(
            inner, "refine_config"
        )

    def build_controller(self, request: BuildRequest) -> ControllerLike:
        return self._build(request)

    def snapshot(self, rank: RankLike, gate_ids: Iterable[int]) -> RankSnapshot:
        if self._snapshot is None:
            return snapshot_rank(rank, gate_ids)
        return self._snapshot(rank, gate_ids)

    def refine_config(self, config: HarnessConfig) -> HarnessConfig:
        return config if self._refine is None else self._refine(config)


def _callable(obj: object, hook: str) -> Callable[..., Any] | None:
    found = getattr(obj, hook, None)
    return found if callable(found) else None


def adopt(obj: object, origin: str) -> ImplementationBase:
    """``obj`` as an ``ImplementationBase``, after checking its required hooks (``origin`` is
    how the user named it, for the message)."""
    if isinstance(obj, ImplementationBase):
        check_hooks(obj, origin)
        return obj
    check_hooks(obj, origin)
    return AdoptedImplementation(obj)


def check_hooks(obj: object, origin: str) -> None:
    """The required hooks are there and well-typed; the capabilities are known ones."""
    for hook in REQUIRED_HOOKS:
        # Verify the adapter defines every required hook of the contract
        if not hasattr(obj, hook):
            raise ContractError(
                f"implementation {origin!r} ({type(obj).__name__}) has no {hook!r}: an "
                f"implementation needs {', '.join(REQUIRED_HOOKS)} (subclass "
                "hicache_ref.harness.adapters.contract.ImplementationBase)"
            )
    name = getattr(obj, "name")  # noqa: B009
    if not isinstance(name, str) or not name:
        raise ContractError(f"implementation {origin!r}: 'name' must be a non-empty str")
    if not callable(getattr(obj, "build_controller")):  # noqa: B009
        raise ContractError(f"implementation {origin!r}: 'build_controller' is not callable")
    capabilities = getattr(obj, "capabilities")  # noqa: B009
    if isinstance(capabilities, str) or not isinstance(capabilities, (set, frozenset)):
        raise ContractError(
            f"implementation {origin!r}: 'capabilities' must be a frozenset of names, got "
            f"{type(capabilities).__name__}"
        )
    legal = (
        CAPABILITIES
        | GROUP_CAPABILITIES
        | {
            STORAGE_SIDECAR_CAPABILITY,
            HOST_PRESSURE_CAPABILITY,
            STORAGE_PP_CAPABILITY,
            STORAGE_SWA_CAPABILITY,
            STORAGE_MAMBA_CAPABILITY,
            STORAGE_BUFFER_CAPABILITY,
        }
    )
    unknown = sorted(str(c) for c in capabilities if c not in legal)
    # Verify every declared capability is one the harness knows
    if unknown:
        raise ContractError(
            f"implementation {origin!r} declares unknown capabilities {unknown}; legal: "
            f"{', '.join(sorted(legal))}"
        )


def probe_config(implementation: ImplementationBase) -> HarnessConfig:
    """The first small world the implementation supports (as it refines it)."""
    for config in PROBE_CONFIGS:
        if supports(implementation.capabilities, config):
            refined = implementation.refine_config(config)
            if supports(implementation.capabilities, refined):
                return refined
    raise ContractError(
        f"implementation {implementation.name!r} supports no configuration: its capabilities "
        "name no pool kind, layout and io backend that go together (e.g. pool:mha, "
        "layout:layer_first, io:direct)"
    )


def check_controller(controller: object, impl_name: str) -> None:
    """The built controller has every method and attribute the tree driver calls."""
    cls = type(controller).__name__
    for method in CONTROLLER_METHODS:
        # Verify the controller has every method of ControllerLike
        if not callable(getattr(controller, method, None)):
            raise ContractError(
                f"implementation {impl_name!r}: its controller {cls} has no method {method}() "
                f"(the contract's ControllerLike needs {', '.join(CONTROLLER_METHODS)})"
            )
    for attribute in CONTROLLER_ATTRIBUTES:
        # Verify the controller has every attribute the tree driver reads
        if not hasattr(controller, attribute):
            raise ContractError(
                f"implementation {impl_name!r}: its controller {cls} has no attribute "
                f"{attribute} (the contract's ControllerLike reads "
                f"{', '.join(CONTROLLER_ATTRIBUTES)})"
            )
    counter = getattr(controller, "layer_done_counter")  # noqa: B009
    if not callable(getattr(counter, "set_consumer", None)):
        raise ContractError(
            f"implementation {impl_name!r}: {cls}.layer_done_counter has no set_consumer() "
            "(the forward sets its consumer slot before reading a layer)"
        )


def check_contract(implementation: ImplementationBase) -> None:
    """The preflight: build one small world and check the controller against the contract.

    A ``HiCacheInputError`` raised while building (a bad option, a missing tree) keeps its own
    message; any other error is reported as the contract's: the adapter could not build.
    """
    from hicache_ref.harness.world.world import build_world

    config = probe_config(implementation)
    try:
        world = build_world(config, implementation)
    except HiCacheInputError as exc:
        raise ContractError(f"{' '.join(str(exc).split())}") from None
    except Exception as exc:
        raise ContractError(
            f"implementation {implementation.name!r}: build_controller failed on "
            f"{config.describe()} ({type(exc).__name__}: {exc}); it must build a controller "
            "from the BuildRequest the harness hands it"
        ) from None
    for rank in world.ranks:
        check_controller(rank.controller, implementation.name)
        check_declared_capabilities(
            implementation.capabilities, type(rank.controller), implementation.name
        )
