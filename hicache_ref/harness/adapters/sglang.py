"""SGLang's own ``HiCacheController``, read from an unpacked tree and driven by the machines.

Two implementations share this loader:

- ``sglang``: upstream's controller (default: the 0.5.10 wheel; ``--sglang-version X`` any
  release, ``HICACHE_SGLANG_SRC`` or ``--sglang-src`` any other tree, e.g. a developer's modified
  copy). It has no CP and no guards against unsafe calls, and three producer slots; what else it
  has depends on the release's shape (``sglang_shapes.py``: draft pools 0.5.11 - 0.5.18, the
  fence streams of 0.5.23, ``HybridCacheController`` over a ``HostPoolGroup`` from 0.5.19 in
  ``sglang_group.py``), and its capabilities follow the shape.
- ``seed``: the context-parallel / draft fork this project was made from: the 0.5.10 tree with
  the fork's ``cache_controller.py`` (``sglang_tree.resolve_seed_tree``). Its fork-only imports
  are served by this project's equivalents (``CpSharedKVLayout``, the page-index validators,
  ``CpHiCacheNodeMetadata``, the fork's environment flags).

How a controller file is run without the rest of sglang, in the order it happens:

1. ``install_stubs(tree)`` (``sglang_stubs.py``): the tree as the ``sglang`` package, its
   controller's other imports stubbed, this project's pools as upstream's pool modules.
2. ``ControllerSource.module_for(device)``: the controller file is compiled once and executed
   once per simulated world, with ``get_device_module()`` answering that world's ``SimDevice``
   (the file binds ``device_module`` at import, as upstream binds ``torch.cuda``).
3. ``build_controller``: the module's ``HiCacheController`` (or, for ``pool_group`` worlds, the
   hybrid module's ``HybridCacheController``, ``hybrid_module_for``) over the harness's allocator
   and host pool behind the shape's shims, with ``tp_group=None`` (TP 1); in a storage world,
   ``sglang_storage.py``'s subclass of it instead, whose storage threads are upstream's own,
   served one loop iteration per ``storage_step``, over the storage world's rank group (every
   release 0.5.10+; a storage world's pool group, 0.5.19+, carries the ``DRAFT`` sidecar or an
   independent ``SWA`` pool's window, ``storage:sidecar`` / ``storage:swa``).

Not drawn, and why: decode context parallel (``attn_dcp_size > 1``). In 0.5.23 its logic lives
in upstream's MLA host pool (each rank's token selection), in the transfer engine's index
translation for virtual-page device pools, and in the storage tier; the gate runs this
project's pools and no virtual-page pool, and its storage worlds no DCP, so a DCP world would run
none of it.

Nothing here reads the implementation's view of itself: the harness checks it from its own model
(``adapters/base.py``'s snapshot reads the ack queues and the harness's own pools).
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache_ref.errors import HiCacheSetupError
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
)
from hicache_ref.harness.adapters.contract import ImplementationBase
from hicache_ref.harness.adapters.sglang_buffer import has_buffer_beliefs
from hicache_ref.harness.adapters.sglang_group import build_group_controller
from hicache_ref.harness.adapters.sglang_hashes import tree_hash_functions
from hicache_ref.harness.adapters.sglang_shapes import (
    L2AllocatorShim,
    detect_shape,
    host_pool_shim,
    shape_capabilities,
    wire_draft_pools,
)
from hicache_ref.harness.adapters.sglang_storage import (
    PP_TICKET_FUNC,
    PROTOCOL_POLL,
    SHORTENED_PREFETCH,
    build_storage_controller,
    prefetch_protocol,
    storage_controller_class,
    supports_storage,
)
from hicache_ref.harness.adapters.sglang_stubs import (
    device_module_for,
    install_group_stubs,
    install_stubs,
)
from hicache_ref.harness.adapters.sglang_tree import (
    CONTROLLER_RELPATH,
    resolve_seed_tree,
    resolve_tree,
)
from hicache_ref.harness.world.config import HarnessConfig

UPSTREAM_CAPABILITIES = frozenset(
    {
        "io:direct",
        "io:kernel",
        "layout:layer_first",
        "layout:page_first",
        "layout:page_first_direct",
        "layout:page_head",
        "pool:mha",
        "pool:mla",
        "pool:nsa",
        "pool:hybrid",
    }
)
"""Every release: write/load/start_*/evict_*/reset; no CP, no guards (a release adds ``draft``,
``fence_streams`` or the ``pool_group`` family by its shape, and ``storage`` where its controller
has upstream's storage threads: 0.5.10+, ``sglang_storage.supports_storage``).
Neither 0.5.10's nor 0.5.23's ``LayerDoneCounter.set_consumer(index: int)`` takes a list (its
``wait_until`` compares the index with 0: no ``multi_consumer``), and neither ``reset()``
synchronizes a stream before clearing the queues (no ``reset_drains``)."""

SEED_CAPABILITIES = CAPABILITIES - {
    "guards",
    "storage:batch_steps",
    "storage:lock_points",
    "reset_drains",
    "fence_streams",
}
# the fork's move_indices also drives layer_page_first (direct) and unwraps hybrid pools
"""The fork adds CP shared KV (reserve/submit/load_cp/evict_cp_host), per-layer write-back and
draft pools; like upstream it does not refuse unsafe calls. Its ``LayerDoneCounter`` takes a
list of consumer slots and waits on each (``multi_consumer``); its ``reset()`` clears the queues
without synchronizing the write or load stream (no ``reset_drains``)."""

PER_WORLD_MODULES = (
    ("sglang.srt.mem_cache.l2_transfer", Path("sglang/srt/mem_cache/l2_transfer.py")),
    ("sglang.srt.managers.cache_controller", CONTROLLER_RELPATH),
)
HYBRID_CONTROLLER_RELPATH = Path("sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py")
"""Modules that bind ``device_module = get_device_module()`` at import: executed per world."""


class ControllerSource:
    """One controller file (and, on 0.5.23, its transfer engine), compiled once, executed once
    per simulated world (device)."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree
        self.path = tree / CONTROLLER_RELPATH
        install_stubs(tree)
        self.codes: list[tuple[str, Path, types.CodeType]] = []
        for name, relpath in PER_WORLD_MODULES:
            path = tree / relpath
            if not path.is_file():
                continue
            try:
                code = compile(path.read_text(), str(path), "exec")
            except SyntaxError as exc:
                raise HiCacheSetupError(
                    f"{path}:{exc.lineno}: the file does not compile ({exc.msg})"
                ) from None
            self.codes.append((name, path, code))
        self._last: tuple[Any, dict[str, types.ModuleType]] | None = None
        self._hybrid_code: types.CodeType | None = None

    def module_for(self, device: Any) -> types.ModuleType:
        """The controller module bound to ``device`` (the last one is reused)."""
        return self._world_modules(device)[CONTROLLER_MODULE]

    def _world_modules(self, device: Any) -> dict[str, types.ModuleType]:
        if self._last is not None and self._last[0] is device:
            return self._last[1]
        install_stubs(self.tree)
        modules: dict[str, types.ModuleType] = {}
        with device_module_for(device):
            for name, path, code in self.codes:
                modules[name] = _exec_module(name, path, code)
        check_controller_module(modules[CONTROLLER_MODULE], self.path)
        self._last = (device, modules)
        return modules

    def hybrid_module_for(self, device: Any) -> types.ModuleType:
        """0.5.19+'s ``hybrid_cache_controller`` over the controller module bound to
        ``device`` (its ``HostPoolGroup`` and the stubs it imports installed first)."""
        modules = self._world_modules(device)
        if "hybrid" in modules:
            return modules["hybrid"]
        path = self.tree / HYBRID_CONTROLLER_RELPATH
        if "sglang.srt.mem_cache.pool_host.group" not in sys.modules:  # once per installed tree
            install_group_stubs(self.tree)
        if self._hybrid_code is None:
            self._hybrid_code = compile(path.read_text(), str(path), "exec")
        for name, module in modules.items():
            sys.modules[name] = module  # its imports see this world's controller and engine
        modules["hybrid"] = _exec_module(HYBRID_MODULE, path, self._hybrid_code)
        return modules["hybrid"]


def _exec_module(name: str, path: Path, code: types.CodeType) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except ImportError as exc:
        imported = _tree_file(path, exc.name or "")
        if imported is not None:  # the tree has the module, but not what the file needs of it
            raise HiCacheSetupError(
                f"{path} imports from {imported}, which lacks it ({exc}); the tree is not "
                "whole: pass an unpacked sglang release (or a fork of one) with that file intact"
            ) from None
        raise HiCacheSetupError(
            f"{path} imports {exc.name or exc}, which the gate does not stub; add a "
            "stub in hicache_ref/harness/adapters/sglang_stubs.py (install_stubs)"
        ) from None
    return module


def _tree_file(path: Path, module: str) -> Path | None:
    """The file of the tree holding ``path`` that module ``sglang.x.y`` is, if it has one."""
    if not module.startswith("sglang."):
        return None
    parts = module.split(".")
    for root in path.parents:
        if (root / "sglang").is_dir() and root / "sglang" in path.parents:
            found = root.joinpath(*parts).with_suffix(".py")
            return found if found.is_file() else None
    return None


CONTROLLER_MODULE = "sglang.srt.managers.cache_controller"
CONTROLLER_NAMES = ("HiCacheController", "LayerDoneCounter")
"""What the gate drives in every release's controller file."""


def check_controller_module(module: types.ModuleType, path: Path) -> None:
    """A controller file that defines what the gate drives; else one ``HiCacheSetupError`` naming
    the file and what it lacks (a truncated copy, an empty file, a wrong file in its place)."""
    missing = [
        name for name in CONTROLLER_NAMES if not isinstance(getattr(module, name, None), type)
    ]
    if missing:
        raise HiCacheSetupError(
            f"{path} defines no {' and no '.join(missing)}, which the gate drives; it is not "
            "a whole cache_controller.py: pass a tree whose controller file is an sglang "
            "release's (or a fork of one)"
        )


HYBRID_MODULE = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"


@functools.cache
def controller_source(tree: Path) -> ControllerSource:
    """One tree's controller source, loaded once per process (never evicted: its classes must
    stay the same objects for as long as the process gates that tree)."""
    return ControllerSource(tree)


def _allocator_free(allocator: Any) -> Callable[[Any], int]:
    def evict_device(device_indices: Any) -> int:
        allocator.free(device_indices)
        return len(device_indices)

    return evict_device


def _producer_slots(module: types.ModuleType) -> int:
    counter = module.LayerDoneCounter(1)
    return int(counter.num_counters)


class SglangImplementation(ImplementationBase):
    """Upstream SGLang's controller from a tree (``--impl sglang``)."""

    name = "sglang"
    capabilities = UPSTREAM_CAPABILITIES

    def __init__(self, tree: Path | None = None) -> None:
        self.tree = tree if tree is not None else resolve_tree()
        self.loader = controller_source(self.tree)
        self.source_tree = str(self.tree)  # recorded in trace headers (replay rebuilds it)
        self._producer_slots: int | None = None
        self.shape = detect_shape(self.tree)  # which release shape, read from its files
        self.group_refused = ""  # why the tree's HybridCacheController is not drawn, if not
        if self.name != "sglang":
            return  # the fork declares its own surface (SEED_CAPABILITIES)
        self.capabilities = UPSTREAM_CAPABILITIES | shape_capabilities(self.shape)
        if self._storage_driven():
            self.capabilities = self.capabilities | {"storage"}
            if self._allocates_at_the_hit() or self._shortens_up_front():
                # 0.5.16+: a hit may be cut to the host room; 0.5.13 - 0.5.15: the prefetch
                self.capabilities = self.capabilities | {HOST_PRESSURE_CAPABILITY}
        if "storage" in self.capabilities and "draft" in self.shape.features:
            # 0.5.11 - 0.5.18: set_draft_kv_pool's draft pages go to L3 beside the KV's
            self.capabilities = self.capabilities | {STORAGE_SIDECAR_CAPABILITY}
        if "hybrid" in self.shape.features:
            self.group_refused = self._try_hybrid()
            if not self.group_refused:
                self.capabilities = self.capabilities | GROUP_CAPABILITIES
                if "storage" in self.capabilities:  # v2 calls for its DRAFT sidecar
                    self.capabilities = self.capabilities | {STORAGE_SIDECAR_CAPABILITY}
                    if self._has_pp_tickets():  # 0.5.21+: PP prefetch tickets
                        self.capabilities = self.capabilities | {STORAGE_PP_CAPABILITY}
                    if self._has_buffer_beliefs():  # 0.5.19+: buffer mode's beliefs
                        self.capabilities = self.capabilities | {STORAGE_BUFFER_CAPABILITY}
                    if self._reads_side_windows():  # 0.5.19+: an SWA window in L3
                        self.capabilities = self.capabilities | {STORAGE_SWA_CAPABILITY}
                        if self._stores_mamba_states():  # and a node's Mamba state
                            self.capabilities = self.capabilities | {STORAGE_MAMBA_CAPABILITY}

    def _storage_driven(self) -> bool:
        """Upstream's storage threads are in the tree (``sglang_storage.supports_storage``) and
        the gate computes its page keys with the tree's own hash (``sglang_hashes``): every
        release 0.5.10+ (0.5.10 - 0.5.15 under the polling protocol, 0.5.16 - 0.5.18 under the
        polling protocol with the bounce buffer allocated at the hit, 0.5.19+ with PrefetchAck;
        ``sglang_storage.prefetch_protocol``)."""
        from hicache_ref.device.sim import SimDevice

        module = self.loader.module_for(SimDevice())
        if not supports_storage(module):
            return False
        try:
            tree_hash_functions(self.tree)  # 0.5.11+: utils.py's get_hash_str (and 0.5.20+'s)
        except HiCacheSetupError:
            hashes = sys.modules.get("sglang.srt.mem_cache.hicache_storage")
            return callable(getattr(hashes, "get_hash_str", None))  # 0.5.10's own place
        return True

    def _allocates_at_the_hit(self) -> bool:
        """The tree gives the bounce buffer when it drains the hit (0.5.16+), so it can cut
        the hit to its host room; 0.5.10 - 0.5.15 allocate the whole prefetch up front."""
        from hicache_ref.device.sim import SimDevice

        module = self.loader.module_for(SimDevice())
        return prefetch_protocol(module.HiCacheController) != PROTOCOL_POLL

    def _shortens_up_front(self) -> bool:
        """0.5.13 - 0.5.15's radix cache cuts a prefetch it allocates up front to the free
        whole pages when the whole one does not fit (read in the tree's ``hiradix_cache.py``)."""
        radix = self.tree / "sglang" / "srt" / "mem_cache" / "hiradix_cache.py"
        return radix.is_file() and SHORTENED_PREFETCH in radix.read_text(errors="replace")

    def _has_pp_tickets(self) -> bool:
        """The hybrid controller's PP prefetch protocol of 0.5.21+: its ticket thread (0.5.21 -
        0.5.22's tickets carry PP rank 0's hit, 0.5.23+'s none: ``pp_tree.carries_rank_0_hit``)."""
        from hicache_ref.device.sim import SimDevice

        hybrid = self.loader.hybrid_module_for(SimDevice())
        cls = getattr(hybrid, "HybridCacheController", None)
        return callable(getattr(cls, PP_TICKET_FUNC, None))

    def _has_buffer_beliefs(self) -> bool:
        """Buffer mode's tree half as the harness models it (0.5.19+): the tree's
        ``StorageExistenceCache`` (0.5.22+ per pool, with the hybrid controller's rank-agreed
        per-pool query verdicts; 0.5.19 - 0.5.21 flat), read in the tree's files
        (``sglang_buffer``)."""
        from hicache_ref.device.sim import SimDevice

        return has_buffer_beliefs(self.tree, self.loader.hybrid_module_for(SimDevice()))

    def _reads_side_windows(self) -> bool:
        """The hybrid controller reads an independent side pool's L3 pages after the KV's
        (``_page_transfer_sidecar`` with ``_sync_trailing_keys``: 0.5.19+)."""
        from hicache_ref.device.sim import SimDevice

        hybrid = self.loader.hybrid_module_for(SimDevice())
        cls = getattr(hybrid, "HybridCacheController", None)
        return all(
            callable(getattr(cls, name, None))
            for name in ("_page_transfer_sidecar", "_sync_trailing_keys")
        )

    def _stores_mamba_states(self) -> bool:
        """The tree's Mamba component names a node's state for L3 (its ``BACKUP_STORAGE``
        transfer, one ``TRAILING_PAGES`` page per node: 0.5.19+), read in the tree's files."""
        components = self.tree / "sglang" / "srt" / "mem_cache" / "unified_cache" / "components"
        texts = [p.read_text(errors="replace") for p in sorted(components.glob("mamba*.py"))]
        return any("BACKUP_STORAGE" in t and "TRAILING_PAGES" in t for t in texts)

    def _try_hybrid(self) -> str:
        from hicache_ref.device.sim import SimDevice

        try:
            self.loader.hybrid_module_for(SimDevice())
        except HiCacheSetupError as exc:
            return str(exc)
        return ""

    def refine_config(self, config: HarnessConfig) -> HarnessConfig:
        """The implementation's producer-slot count is a constant of its LayerDoneCounter."""
        from hicache_ref.device.sim import SimDevice

        if self._producer_slots is None:
            self._producer_slots = _producer_slots(self.loader.module_for(SimDevice()))
        update: dict[str, object] = {"num_counters": self._producer_slots}
        stores_draft = STORAGE_SIDECAR_CAPABILITY in self.capabilities
        stored_group = (
            (config.pool_group == "sidecar" and stores_draft)
            or (config.storage_pp and STORAGE_PP_CAPABILITY in self.capabilities)
            or (config.storage_buffer_only and STORAGE_BUFFER_CAPABILITY in self.capabilities)
            or (
                config.storage_swa_window > 0
                and (STORAGE_MAMBA_CAPABILITY if config.has_state_pool else STORAGE_SWA_CAPABILITY)
                in self.capabilities
            )
        )
        stored_pair = (
            config.pool_group == "none" and stores_draft and "draft" in self.shape.features
        )
        if (
            config.uses_storage
            and not stored_group
            and not stored_pair
            and (config.pool_group != "none" or config.has_draft)
        ):
            update["storage_ranks"] = 0  # the plain controller, or a DRAFT sidecar group
            update["storage_swa_window"] = 0
        return config.model_copy(update=update)

    def build_controller(self, request: BuildRequest) -> Any:
        module = self.loader.module_for(request.device_module)
        shape = self.shape
        l2_engine = shape.engine != "streams"
        allocator: Any = request.allocator
        if l2_engine:
            allocator = L2AllocatorShim(request.allocator, request.device_module)
        host_pool = host_pool_shim(shape, request.host_pool)
        if request.config.pool_group != "none":  # 0.5.19+: HybridCacheController over a group
            hybrid = self.loader.hybrid_module_for(request.device_module)
            storage_class = None
            if request.config.uses_storage:  # its DRAFT sidecar stored beside the KV pages
                storage_class = storage_controller_class(module, self.tree, hybrid)
            controller = build_group_controller(
                hybrid, request, allocator, request.config.io_backend, storage_class
            )
        elif request.config.uses_storage:  # upstream's storage threads, served step by step
            controller = build_storage_controller(
                module,
                self.tree,
                allocator,
                host_pool,
                request.config.page_size,
                None,  # tp_group: the subclass hands upstream its harness group
                threading.Event(),
                write_policy="write_through",
                io_backend=request.config.io_backend,
                collectives=request.storage_collectives,
                schedule_points=request.config.storage_points,
                page_points=request.config.storage_page_points,
            )
        else:
            controller = module.HiCacheController(
                allocator,
                host_pool,
                request.config.page_size,
                None,  # tp_group: TP 1, no storage
                threading.Event(),
                write_policy="write_through",
                io_backend=request.config.io_backend,
            )
        engine = getattr(controller, "l2_transfer_engine", None)
        if engine is not None and not hasattr(controller, "write_stream"):
            # 0.5.18+ keeps its two streams on the transfer engine; the harness advances them
            controller.write_stream = engine.device_to_host_stream
            controller.load_stream = engine.host_to_device_stream
        if not hasattr(controller, "evict_device"):
            # 0.5.21 dropped evict_device: its radix cache frees device pages itself, with the
            # allocator's free, which is what this does
            controller.evict_device = _allocator_free(allocator)
        if request.draft_device_pool is not None and request.config.pool_group == "none":
            wire_draft_pools(controller, request, shape)
        return controller


class SeedImplementation(SglangImplementation):
    """The fork (CP shared KV, per-layer write-back, drafts) from its tree (``--impl seed``)."""

    name = "seed"
    capabilities = SEED_CAPABILITIES

    def __init__(self, tree: Path | None = None) -> None:
        super().__init__(tree if tree is not None else resolve_seed_tree())

    def build_controller(self, request: BuildRequest) -> Any:
        module = self.loader.module_for(request.device_module)
        kwargs: dict[str, Any] = {}
        if request.cp_layout is not None:
            kwargs["cp_shared_kv_layout"] = request.cp_layout
        if request.draft_device_pool is not None:
            kwargs["draft_mem_pool_host"] = request.draft_host_pool
            kwargs["draft_mem_pool_device"] = request.draft_device_pool
        if request.config.uses_storage:  # its 0.5.10-shaped storage threads, step by step
            return build_storage_controller(
                module,
                self.tree,
                request.allocator,
                request.host_pool,
                request.config.page_size,
                None,  # tp_group: the subclass hands the fork its harness group
                threading.Event(),
                write_policy="write_through",
                io_backend=request.config.io_backend,
                collectives=request.storage_collectives,
                schedule_points=request.config.storage_points,
                page_points=request.config.storage_page_points,
                **kwargs,
            )
        controller = module.HiCacheController(
            request.allocator,
            request.host_pool,
            request.config.page_size,
            None,
            threading.Event(),
            write_policy="write_through",
            io_backend=request.config.io_backend,
            **kwargs,
        )
        return controller


FACTORIES: dict[str, Callable[[], Any]] = {
    "sglang": SglangImplementation,
    "seed": SeedImplementation,
}
