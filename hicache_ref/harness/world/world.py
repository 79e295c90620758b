"""Build the simulated world of one case: a SimDevice, and per CP rank the pools and controller.

Every rank gets identical allocators (same policy, same seed), so the logical pages they hand out
agree; each rank's device pool is physical (it holds only the pages that rank owns). The world
also fixes the implementation's capabilities once: what its adapter declares, checked against
what its controller class has (``adapters/base.check_declared_capabilities``), and the typed
views the tree driver calls (``Rank.cp``, ``Rank.per_layer``).

The device kind is chosen around the world, not inside it: ``open_device("cuda", perturbation)``
prepares the device and gives the world builder a campaign or a replay hands its sessions
(``DeviceWorlds``: a world per case on a fresh device), and ``on_device`` narrows an implementation to what a real GPU can
run (``copy_path="runs"``; no misuse probes, which would race the GPU's own progress).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeGuard, cast

from hicache_ref.device.perturb import DEFAULT_PERTURBATION, Perturbation
from hicache_ref.device.protocol import DeviceModule, StreamT
from hicache_ref.device.sim import SimDevice
from hicache_ref.errors import HiCacheSetupError, UnknownOptionError
from hicache_ref.harness.adapters.base import (
    BuildRequest,
    ControllerLike,
    CpControllerLike,
    Implementation,
    PerLayerWriteLike,
    RankLike,
    SidePoolsLike,
    UndrainedGateLike,
    check_declared_capabilities,
)
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.content import HARNESS_DTYPE
from hicache_ref.harness.world.side_pools import build_side_allocator, make_state_pool
from hicache_ref.invariants.snapshot import RankSnapshot
from hicache_ref.pools.triton_copy import is_triton_available

if TYPE_CHECKING:
    from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator
    from hicache_ref.pools.cp_layout import CpSharedKVLayout
    from hicache_ref.pools.device_pool import KVCache
    from hicache_ref.pools.host_pool import HostKVCache

MHA_HEADS, MHA_HEAD_DIM = 2, 2
MLA_LORA, MLA_ROPE, NSA_INDEX_DIM = 3, 1, 2


@dataclass
class Rank:
    """One simulated rank: its pools and the controller under test."""

    rank: int
    device_pool: KVCache
    allocator: PagedTokenToKVPoolAllocator
    host_pool: HostKVCache
    draft_device_pool: KVCache | None
    draft_host_pool: HostKVCache | None
    cp_layout: CpSharedKVLayout | None
    controller: ControllerLike
    cp: CpControllerLike | None = None  # the controller, when the world uses CP
    per_layer: PerLayerWriteLike | None = None  # the controller, with per_layer_write
    gate: UndrainedGateLike | None = None  # the controller, if it has the undrained-ack gate
    side_allocator: PagedTokenToKVPoolAllocator | None = None
    """An independent side pool's own device allocator (``config.has_side_pools``)."""
    sides: SidePoolsLike | None = None
    """The controller's side-pool calls (its ``side_pools``; ``config.has_side_pools``)."""


class HarnessDevice(DeviceModule, Protocol):
    """What the harness needs beyond ``DeviceModule``: the forward stream, and a way to let the
    queued work run. ``SimDevice`` has it natively; a real GPU's campaign device maps
    ``advance`` to a timing perturbation and ``run_until_idle`` to a synchronize."""

    @property
    def default_stream(self) -> StreamT: ...

    def advance(self, stream: StreamT, n: int = 1) -> int: ...

    def advance_to_record(self, stream: StreamT) -> int: ...

    def is_idle(self) -> bool: ...

    def run_until_idle(self) -> None: ...


@dataclass
class World:
    config: HarnessConfig
    device: HarnessDevice
    ranks: list[Rank]
    capabilities: frozenset[str] = frozenset()
    storage_group: Any = None  # the storage world's RankGroup (``storage_world.py``), if any
    forward: StreamT | None = None
    """The forward's own stream (``config.forward_stream``); None: the default stream."""

    @property
    def forward_stream(self) -> StreamT:
        """Where the forward's stores, reads and layer hooks run (the tree enters it)."""
        return self.forward if self.forward is not None else self.device.default_stream

    @property
    def per_layer_write(self) -> bool:
        """Whether CP backups may be driven layer by layer (early reservations, layer hooks)."""
        return "per_layer_write" in self.capabilities


def make_device_pool(
    config: HarnessConfig, layer_num: int, size_tokens: int, device: DeviceModule
) -> KVCache:
    from hicache_ref.pools.device_pool import MHATokenToKVPool, MLATokenToKVPool, NSATokenToKVPool

    if config.pool_kind == "mha":
        return MHATokenToKVPool(
            size_tokens, config.page_size, HARNESS_DTYPE, MHA_HEADS, MHA_HEAD_DIM, layer_num, device
        )
    if config.pool_kind == "mla":
        return MLATokenToKVPool(
            size_tokens, config.page_size, HARNESS_DTYPE, MLA_LORA, MLA_ROPE, layer_num, device
        )
    return NSATokenToKVPool(
        size_tokens,
        config.page_size,
        HARNESS_DTYPE,
        MLA_LORA,
        MLA_ROPE,
        layer_num,
        device,
        index_head_dim=NSA_INDEX_DIM,
    )


def physical_size_tokens(config: HarnessConfig) -> int:
    """Tokens a rank's device pool must hold for ``device_pages`` logical pages."""
    if not config.uses_cp:
        return config.device_pages * config.page_size
    # logical page p lives on physical page p // cp_size of its owner rank (page 0 reserved)
    return (config.device_pages // config.cp_size + 1) * config.page_size


CONFORMS_CACHE_MAX = 256


@dataclass(frozen=True)
class _Shape:
    """What a runtime protocol check reads of an object: its class and its instance attribute
    names (the object rides along to be asked, but is not part of the key)."""

    kind: type
    protocol: type
    attributes: frozenset[str]
    controller: weakref.ref[object] = field(compare=False, hash=False)
    """Asked only while the caller holds it; weak, so the cache keeps no world alive."""


@functools.lru_cache(maxsize=CONFORMS_CACHE_MAX)
def _conforms(shape: _Shape) -> bool:
    return isinstance(shape.controller(), shape.protocol)


def conforms(controller: object, protocol: type) -> bool:
    """``isinstance(controller, protocol)`` for a runtime-checkable protocol, remembered per
    class and instance attribute names (the check only asks which attributes exist, and a
    protocol ``isinstance`` costs tens of microseconds); asked afresh for a class with a
    ``__getattr__``, whose attributes may come and go."""
    kind = type(controller)
    if hasattr(kind, "__getattr__"):
        return isinstance(controller, protocol)
    attributes = frozenset(getattr(controller, "__dict__", ()))
    try:
        held = weakref.ref(controller)
    except TypeError:  # a class with __slots__ and no __weakref__: asked every time
        return isinstance(controller, protocol)
    return _conforms(_Shape(kind, protocol, attributes, held))


def is_cp_controller(controller: object) -> TypeGuard[CpControllerLike]:
    return conforms(controller, CpControllerLike)


def is_per_layer_writer(controller: object) -> TypeGuard[PerLayerWriteLike]:
    return conforms(controller, PerLayerWriteLike)


def has_undrained_gate(controller: object) -> TypeGuard[UndrainedGateLike]:
    return conforms(controller, UndrainedGateLike)


def _views(
    controller: ControllerLike, capabilities: frozenset[str], config: HarnessConfig
) -> tuple[CpControllerLike | None, PerLayerWriteLike | None]:
    """The controller as the CP and per-layer contracts, where the world uses them."""
    cp = per_layer = None
    if config.uses_cp:
        assert is_cp_controller(controller), "cp was checked against the class"
        cp = controller
        if "per_layer_write" in capabilities:
            assert is_per_layer_writer(controller)
            per_layer = controller
    return cp, per_layer


COPY_RANK_TAG, COPY_POOL_TAG = "copy_rank", "copy_pool"
"""Meta keys a simulated world's host pools put on every copy they launch: the rank and the
pool (``target`` or ``draft``) the copy belongs to (what the lockstep oracle and the store
watch read of an executed copy)."""


def copy_launcher(device: HarnessDevice, rank: int, pool: str) -> DeviceModule | None:
    """The device view a host pool launches its copies through: on the simulator one that tags
    each copy with its rank and pool; elsewhere None (the device pool's device itself)."""
    if not isinstance(device, SimDevice):
        return None
    return cast("DeviceModule", device.tagged(**{COPY_RANK_TAG: rank, COPY_POOL_TAG: pool}))


def build_world(
    config: HarnessConfig,
    implementation: Implementation,
    *,
    device: HarnessDevice | None = None,
    only_ranks: Sequence[int] | None = None,
) -> World:
    """The world of one case: by default a SimDevice and every CP rank in this process.

    ``device`` replaces the simulator (a GPU campaign's device; without it, the factory
    ``open_device``'s builder hands in); ``only_ranks`` builds just those ranks (a multi-process CP
    world builds one rank per process, each with the full config).
    """
    from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator
    from hicache_ref.pools.cp_layout import CpSharedKVLayout
    from hicache_ref.pools.host_pool_kinds import make_host_pool

    if device is None:
        device = SimDevice(seed=config.seed, settle_records=config.settle_records)
    ranks: list[Rank] = []
    capabilities = implementation.capabilities
    forward = device.Stream() if config.forward_stream else None
    page = config.page_size
    storage_group = None
    if config.uses_storage:  # rank 0 of the storage world; the peers are storage_world.py's
        from hicache_ref.controller.storage.collectives import RankGroup

        storage_group = RankGroup(config.storage_ranks)
    wanted = range(config.num_ranks) if only_ranks is None else only_ranks
    for rank in wanted:
        if not 0 <= rank < config.num_ranks:
            raise ValueError(f"rank {rank} is outside the config's ranks [0, {config.num_ranks})")
        device_pool = make_device_pool(
            config, config.layer_num, physical_size_tokens(config), device
        )
        cp_layout = CpSharedKVLayout(config.cp_size, rank, page) if config.uses_cp else None
        kv_cache = device_pool
        if config.hybrid:  # the allocator hands out a hybrid pool; the controller unwraps it
            from hicache_ref.pools.hybrid_pool import HybridLinearKVPool, interleaved_layer_ids

            kv_cache = HybridLinearKVPool(device_pool, *interleaved_layer_ids(config.layer_num))
        allocator = PagedTokenToKVPoolAllocator(
            config.device_pages * page,
            page,
            HARNESS_DTYPE,
            device.device,
            kv_cache,
            alloc_policy=config.alloc_policy,
            seed=config.seed,
            cp_layout=cp_layout,
        )
        host_pool = make_host_pool(
            device_pool,
            layout=config.layout,
            size_tokens=config.host_pages * page,
            alloc_policy=config.alloc_policy,
            seed=config.seed + 1,
            copy_path=config.copy_path,
            device_module=copy_launcher(device, rank, "target"),
        )
        draft_device_pool = draft_host_pool = side_allocator = None
        if config.has_draft:
            draft_tokens = physical_size_tokens(config)
            if config.has_side_pools:  # rows of its own, from its own allocator
                draft_tokens = config.side_device_pages * page
            if config.has_state_pool:  # one state slot per node, pages of one slot
                draft_device_pool = make_state_pool(config, device)
            else:
                draft_device_pool = make_device_pool(
                    config, config.draft_layer_num, draft_tokens, device
                )
            if config.has_side_pools:
                side_allocator = build_side_allocator(config, draft_device_pool, device)
            draft_pages = config.draft_host_pages if config.uses_cp or config.has_side_pools else 0
            draft_host_pool = make_host_pool(
                draft_device_pool,
                layout=config.layout,
                # a state pool's host pages are single slots (the anchor's page elsewhere)
                size_tokens=(draft_pages or config.host_pages) * config.side_page_size,
                alloc_policy=config.draft_alloc_policy,
                seed=config.seed + 2,
                copy_path=config.copy_path,
                device_module=copy_launcher(device, rank, "draft"),
            )
        request = BuildRequest(
            config=config,
            rank=rank,
            device_module=device,
            allocator=allocator,
            host_pool=host_pool,
            cp_layout=cp_layout,
            draft_device_pool=draft_device_pool,
            draft_host_pool=draft_host_pool,
            storage_collectives=None if storage_group is None else storage_group.view(rank),
            side_allocator=side_allocator,
        )
        controller = implementation.build_controller(request)
        sides = _side_pools(controller, config, implementation.name)
        capabilities = check_declared_capabilities(
            implementation.capabilities, type(controller), implementation.name
        )
        if forward is not None:  # what a scheduler under overlap does (sglang#36738, #38463)
            controller.write_fence_stream = forward  # type: ignore[attr-defined]
            controller.load_fence_stream = forward  # type: ignore[attr-defined]
        cp, per_layer = _views(controller, capabilities, config)
        ranks.append(
            Rank(
                rank,
                device_pool,
                allocator,
                host_pool,
                draft_device_pool,
                draft_host_pool,
                cp_layout,
                controller,
                cp,
                per_layer,
                controller if has_undrained_gate(controller) else None,
                side_allocator,
                sides,
            )
        )
    return World(config, device, ranks, capabilities, storage_group, forward)


def _side_pools(controller: object, config: HarnessConfig, name: str) -> SidePoolsLike | None:
    """The controller's side-pool calls in a world with an independent side pool."""
    if not config.has_side_pools:
        return None
    sides = getattr(controller, "side_pools", None)
    if not isinstance(sides, SidePoolsLike):
        raise HiCacheSetupError(
            f"{name}: pool_group={config.pool_group!r} needs the controller's side_pools "
            "(write, load and evict_host naming the side pool; adapters/base.SidePoolsLike); "
            "declare capability pool_group:swa only where it has them"
        )
    return sides


# -- the device kind of the worlds built in a context ------------------------------------------
DeviceKind = Literal["sim", "cuda"]
DEVICE_KINDS: tuple[DeviceKind, ...] = ("sim", "cuda")
DeviceFactory = Callable[[HarnessConfig], HarnessDevice]
DeviceBinding = Callable[[Perturbation], AbstractContextManager[DeviceFactory | None]]
"""Given the perturbation, a context that prepares the device kind and yields its factory."""

WorldBuilder = Callable[[HarnessConfig, Implementation], World]
"""How a session builds its world from the case's configuration and the implementation."""


@dataclass(frozen=True)
class DeviceWorlds:
    """A session's world builder: each world on a device from ``device_factory`` (None: a fresh
    ``SimDevice``), holding ``only_ranks`` (None: every rank)."""

    device_factory: DeviceFactory | None = None
    only_ranks: tuple[int, ...] | None = None

    def __call__(self, config: HarnessConfig, implementation: Implementation) -> World:
        device = None if self.device_factory is None else self.device_factory(config)
        return build_world(config, implementation, device=device, only_ranks=self.only_ranks)


SIM_WORLDS = DeviceWorlds()
"""Worlds on a fresh ``SimDevice`` each, every rank (what a session builds by default)."""


def gpu_config(config: HarnessConfig, *, triton: bool | None = None) -> HarnessConfig:
    """What a GPU world's configuration must say: a GPU copy path, and records that complete
    with the work ahead of them (as they do on a GPU).

    ``gather`` is CPU-only: it becomes the run-merged ``runs``, or, for odd config seeds where
    Triton is installed (``triton``, default: looked up), the zero-copy ``triton`` kernel, so a
    GPU campaign fuzzes the kernel on real streams too; ``runs`` and the copy engine's ``batch``
    stay as drawn. The choice follows the config alone, so a replay makes it again."""
    copy_path = config.copy_path
    if copy_path in ("gather", "auto"):
        use_triton = is_triton_available() if triton is None else triton
        copy_path = "triton" if use_triton and config.seed % 2 else "runs"
    return config.model_copy(update={"copy_path": copy_path, "settle_records": True})


GPU_UNSUPPORTED = frozenset({"guards"})
"""Capabilities a GPU campaign leaves out: a misuse probe reads "copy in flight" and then asks
the controller, and a real copy may land in between, so an acceptance would prove nothing."""


@contextmanager
def _sim_binding(perturbation: Perturbation) -> Iterator[DeviceFactory | None]:
    yield None  # build_world's own SimDevice


@contextmanager
def _cuda_binding(perturbation: Perturbation) -> Iterator[DeviceFactory | None]:
    from hicache_ref.device.cuda import cuda_campaign_device, keep_current_stream, require_cuda

    require_cuda()
    with keep_current_stream():
        yield lambda config: cuda_campaign_device(config.seed, perturbation)


DEVICE_BINDINGS: dict[str, DeviceBinding] = {"sim": _sim_binding, "cuda": _cuda_binding}
"""How each device kind is set up around its worlds (tests may bind a fake under ``cuda``)."""


def check_device_kind(kind: str) -> DeviceKind:
    """``kind`` typed, or an ``UnknownOptionError`` naming the legal kinds."""
    for legal in DEVICE_KINDS:
        if kind == legal:
            return legal
    raise UnknownOptionError(f"unknown device {kind!r}; legal: {', '.join(DEVICE_KINDS)}")


@contextmanager
def open_device(kind: str, perturbation: Perturbation | None = None) -> Iterator[DeviceWorlds]:
    """The world builder of a ``kind`` device, prepared for as long as the context lasts.

    On ``cuda`` each world gets a fresh ``PerturbedDevice`` whose spin schedule is seeded with
    the world's config seed and ``perturbation`` (so a trace replays the same schedule); a
    machine without a GPU gets one ``HiCacheSetupError`` line. The builder is handed to the
    sessions (``Session(..., build=...)``, ``machine_for(..., build=...)``): nothing else
    carries the device.
    """
    binding = DEVICE_BINDINGS[check_device_kind(kind)]
    with binding(perturbation or DEFAULT_PERTURBATION) as factory:
        yield DeviceWorlds(factory)


class _OnGpu:
    """An implementation as a GPU campaign runs it (``on_device``); everything else is its own."""

    def __init__(self, inner: Implementation) -> None:
        self._inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities - GPU_UNSUPPORTED
        self.source_tree = inner.source_tree

    def build_controller(self, request: BuildRequest) -> ControllerLike:
        return self._inner.build_controller(request)

    def snapshot(self, rank: RankLike, gate_ids: Iterable[int]) -> RankSnapshot:
        return self._inner.snapshot(rank, gate_ids)

    def refine_config(self, config: HarnessConfig) -> HarnessConfig:
        return gpu_config(self._inner.refine_config(config))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # controller_class, focus, ... (not contract hooks)


def get_auto_copy_path(world: World) -> str:
    """What ``copy_path="auto"`` would take in this world's transfers on its device (rank 0's
    host pool; every rank is built alike): ``gather`` on the simulator; on a GPU the path
    ``pools/copy_choice.py`` picks for these pools (a campaign report counts it)."""
    return world.ranks[0].host_pool.describe_auto_copy_path() if world.ranks else "none"


def on_device(implementation: Implementation, kind: str) -> Implementation:
    """``implementation`` as a ``kind`` campaign draws its worlds (unchanged on ``sim``)."""
    if check_device_kind(kind) == "sim":
        return implementation
    return _OnGpu(implementation)
