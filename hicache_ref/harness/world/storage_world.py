"""The storage world of a case: its ranks, their rank group, and one shared L3 behind them.

Rank 0 is the tree's controller (``World.ranks[0]``, built with the group's view 0); ranks
1..n-1 are *storage peers*: controllers of the same implementation over pools of the same
geometry, which the tree never drives except through storage (a TP group whose other ranks
serve the same requests). Every rank's backend is a client of one shared L3 (a ``MemoryStore``,
one directory of ``FileStorage`` files, or upstream's own ``HiCacheFile`` over one directory:
the gated tree's when upstream's code is under test, else 0.5.23's),
behind a seeded ``FaultInjectingStorage`` and, outermost, a ``RecordingStorage`` the harness
reads. The builders are registered with ``StorageBackendFactory`` under names private to this
world, so ``attach_storage_backend(name)`` goes through the seed's own attach path.

The L3 directory of the file backends lives on the machine's memory-backed filesystem
(``l3_parent``: ``/dev/shm`` where it is a writable tmpfs with room, else the default temp
dir): the files, names and calls are the same, and writing one costs ~40 us there instead of
~800 us on a disk's filesystem, which was most of a file-backed storage step.

A world is closed by its case (``close``, through ``Session.close``): its storage threads and
lockstep threads keep it alive, so the collector never ends a forgotten one;
``close_open_worlds`` finds and closes those (the test suite runs it after each test).
"""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache_ref.controller.storage.collectives import RankGroup
from hicache_ref.controller.storage.lockstep import LockstepThreads
from hicache_ref.device.sim import SimDevice
from hicache_ref.harness.adapters.base import BuildRequest, ControllerLike, Implementation
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.content import HARNESS_DTYPE
from hicache_ref.harness.world.recording_storage import RecordingStorage
from hicache_ref.harness.world.side_pools import build_side_allocator, make_state_pool
from hicache_ref.harness.world.world import World, make_device_pool, physical_size_tokens
from hicache_ref.pools.host_pool import HostKVCache
from hicache_ref.pools.host_pool_kinds import make_host_pool
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.fault_injection import FaultInjectingStorage
from hicache_ref.storage.file_backend import FileStorage
from hicache_ref.storage.memory_backend import MemoryStorage, MemoryStore
from hicache_ref.storage.protocols import StorageHostPool

BACKGROUND_FAULTS: Mapping[str, float] = {
    "fail_rate": 0.05,
    "miss_rate": 0.05,
    "short_read_rate": 0.05,
    "drop_rate": 0.03,
    "raise_rate": 0.02,
}
MODEL_NAME = "harness"
UPSTREAM_FILE_VERSION = "0.5.23"
MEMORY_FS = Path("/dev/shm")
MEMORY_FS_FREE_MIN_BYTES = 64 << 20
"""A world's L3 holds a few hundred pages of a few KiB at most; keep well clear of a full tmpfs."""
_names = itertools.count()


def l3_parent(memory_fs: Path = MEMORY_FS) -> Path | None:
    """Where a world's L3 directory goes: ``memory_fs`` when it is a writable directory with
    room, else None (``tempfile``'s default)."""
    try:
        usable = memory_fs.is_dir() and os.access(memory_fs, os.W_OK | os.X_OK)
        return (
            memory_fs
            if usable and shutil.disk_usage(memory_fs).free >= MEMORY_FS_FREE_MIN_BYTES
            else None
        )
    except OSError:
        return None


@dataclass
class StorageRank:
    """One rank of the storage world: its controller, host pool and backend layers."""

    rank: int
    controller: Any  # the implementation's controller (rank 0: the tree's)
    host_pool: HostKVCache
    backend_name: str
    recording: RecordingStorage | None = None
    faults: FaultInjectingStorage | None = None
    draft_host_pool: HostKVCache | None = None  # a sidecar world's draft pool (KV's slots)
    side_host_pool: HostKVCache | None = None  # an SWA world's side pool (slots of its own)


def _peer_rank(
    config: HarnessConfig, implementation: Implementation, rank: int, group: RankGroup
) -> tuple[ControllerLike, HostKVCache, HostKVCache | None]:
    """A storage peer: pools of the world's geometry (a draft pair too in a sidecar world) and a
    controller of the implementation."""
    from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator

    device = SimDevice(seed=config.seed + rank)
    device_pool = make_device_pool(config, config.layer_num, physical_size_tokens(config), device)
    page = config.page_size
    allocator = PagedTokenToKVPoolAllocator(
        config.device_pages * page, page, HARNESS_DTYPE, device.device, device_pool
    )
    host_pool = make_host_pool(
        device_pool, layout=config.layout, size_tokens=config.host_pages * page
    )
    draft_device_pool = draft_host_pool = side_allocator = None
    if config.has_side_pools:  # an SWA world: the side pool's own rows, slots and allocator
        if config.has_state_pool:  # a Mamba world: one state slot per node, pages of one slot
            draft_device_pool = make_state_pool(config, device)
        else:
            draft_device_pool = make_device_pool(
                config, config.draft_layer_num, config.side_device_pages * page, device
            )
        side_allocator = build_side_allocator(config, draft_device_pool, device)
        draft_host_pool = make_host_pool(
            draft_device_pool,
            layout=config.layout,
            size_tokens=config.draft_host_pages * config.side_page_size,
        )
    elif config.has_draft:  # a sidecar world: the peer's draft pages go to L3 beside its KV
        draft_device_pool = make_device_pool(
            config, config.draft_layer_num, physical_size_tokens(config), device
        )
        draft_host_pool = make_host_pool(
            draft_device_pool, layout=config.layout, size_tokens=config.host_pages * page
        )
    request = BuildRequest(
        config=config,
        rank=rank,
        device_module=device,
        allocator=allocator,
        host_pool=host_pool,
        cp_layout=None,
        draft_device_pool=draft_device_pool,
        draft_host_pool=draft_host_pool,
        storage_collectives=group.view(rank),
        side_allocator=side_allocator,
    )
    return implementation.build_controller(request), host_pool, draft_host_pool


class StorageWorld:
    """Every storage rank of a case and the L3 they share."""

    def __init__(self, world: World, implementation: Implementation) -> None:
        config = world.config
        group = world.storage_group
        assert isinstance(group, RankGroup), "build_world makes the group of a storage config"
        self.config = config
        self.group = group
        self.store = MemoryStore()
        self._tmp = Path(tempfile.mkdtemp(prefix="hicache-l3-", dir=l3_parent()))
        self.root = self._tmp / "l3"
        tag = next(_names)
        self.ranks: list[StorageRank] = []
        for rank in range(config.storage_ranks):
            if rank == 0:
                first = world.ranks[0]
                controller, host_pool, draft = first.controller, first.host_pool, None
                if config.has_draft:
                    draft = first.draft_host_pool
            else:
                controller, host_pool, draft = _peer_rank(config, implementation, rank, group)
            name = f"harness-l3-{tag}-r{rank}"
            side = draft if config.has_side_pools else None  # its own slots, not the KV's
            self.ranks.append(
                StorageRank(
                    rank,
                    controller,
                    host_pool,
                    name,
                    draft_host_pool=None if side is not None else draft,
                    side_host_pool=side,
                )
            )
        weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)
        self.threads = LockstepThreads()  # the lockstep steps' rank threads, ended with the world
        self._closer = weakref.finalize(
            self, _close_tiers, [r.controller for r in self.ranks], self.threads
        )
        self.attached = False
        self.file_tree = _file_backend_tree(implementation)

    def build_backend(self, rank: int, cfg: HiCacheStorageConfig) -> HiCacheStorage:
        """Rank ``rank``'s backend: recording, then faults, then a client of the shared L3."""
        faults = FaultInjectingStorage(self._client(cfg), seed=self.config.seed, rank=rank)
        if self.config.storage_faults:
            faults.rates.update(BACKGROUND_FAULTS)
        recording = RecordingStorage(faults, rank)
        self.ranks[rank].faults, self.ranks[rank].recording = faults, recording
        if self.config.storage_pp:  # a PP rank's query may name another rank's shard
            shards = [r.recording for r in self.ranks if r.recording is not None]
            if len(shards) == len(self.ranks):
                for shard in shards:
                    shard.pp_shards = shards
        return recording

    def _client(self, cfg: HiCacheStorageConfig) -> HiCacheStorage:
        backend = self.config.storage_backend
        if backend == "memory":
            return MemoryStorage(cfg, self.store)
        if backend == "file":
            return FileStorage(self.root, cfg)
        from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree
        from hicache_ref.harness.adapters.upstream_storage import UpstreamFileStorage

        tree = self.file_tree or fetch_wheel_tree(UPSTREAM_FILE_VERSION)
        return UpstreamFileStorage(tree, self.root, cfg)

    @property
    def controllers(self) -> list[Any]:
        return [r.controller for r in self.ranks]

    @property
    def tiers(self) -> list[Any]:
        """Every rank's storage tier (the reference's ``controller.storage``)."""
        return [r.controller.storage for r in self.ranks]

    def attach(self, backend_name: str = "") -> None:
        """Every rank attaches through the seed's own path: its builder is registered with
        ``StorageBackendFactory`` only for the call, so no world leaves a name behind.
        ``backend_name`` replaces the private names where the seed keys a protocol on the
        backend's name (0.5.21 - 0.5.22 enable PP tickets only for "mooncake")."""
        for rank in self.ranks:
            name = backend_name or rank.backend_name
            StorageBackendFactory.register_backend(name, _builder(weakref.ref(self), rank.rank))
            try:
                rank.controller.attach_storage_backend(
                    name,
                    prefetch_threshold=self.config.page_size,
                    model_name=MODEL_NAME,
                )
            finally:
                StorageBackendFactory.unregister_backend(name)
            rank.controller.storage_batch_size = self.config.storage_batch_pages
        self.attached = True

    def close(self) -> None:
        """Stop every rank's own storage threads and the lockstep threads (idempotent; also run
        when the world goes)."""
        self._closer()

    @property
    def is_open(self) -> bool:
        """Not closed yet (its threads, if any, still run)."""
        return self._closer.alive

    def reset_peers(self) -> None:
        """The storage peers' half of a tree reset (rank 0 resets with the world)."""
        for rank in self.ranks[1:]:
            rank.controller.reset()
            rank.host_pool.clear()
            if rank.side_host_pool is not None:
                rank.side_host_pool.clear()


def close_open_worlds() -> int:
    """Close every storage world of this process not closed yet (a case that forgot
    ``Session.close``); how many. A world's finalizer alone cannot end its threads: a running
    storage thread holds its tier, and the tier's harness hooks (the lockstep's observer, the
    gate) reach back to the world, so a forgotten world is never collected. It is found through
    the collector's objects (no registry: one a thread keeps alive is always there)."""
    worlds = [o for o in gc.get_objects() if type(o) is StorageWorld and o.is_open]
    for world in worlds:
        world.close()
    return len(worlds)


def _file_backend_tree(implementation: Implementation) -> Path | None:
    """The tree under test, when it has upstream's ``HiCacheFile`` (the gate of a release or a
    fork then runs that tree's file backend, not 0.5.23's); None for this project's own code."""
    from hicache_ref.harness.adapters.upstream_storage import STORAGE_RELPATH

    source = getattr(implementation, "source_tree", "")
    path = Path(source) / STORAGE_RELPATH if source else None
    if path is None or not path.is_file() or "class HiCacheFile(" not in path.read_text():
        return None
    return Path(source)


def _close_tiers(controllers: list[Any], threads: LockstepThreads) -> None:
    """When the world goes: an implementation whose tier runs threads of its own (upstream's,
    ``adapters/sglang_storage.py``) stops them (the reference's manual tier has none), and the
    lockstep threads end."""
    for controller in controllers:
        storage = getattr(controller, "storage", None)
        close = getattr(storage, "close", None) or getattr(
            getattr(storage, "executor", None), "close", None
        )  # upstream's tier, or the reference's gated executor (schedule points)
        if callable(close):
            close()
    threads.close()


def _builder(world: weakref.ref[StorageWorld], rank: int) -> Any:
    """A factory builder that holds its world weakly (the world unregisters it when it goes)."""

    def build(
        cfg: HiCacheStorageConfig, pool: StorageHostPool | None, extra: Mapping[str, object]
    ) -> HiCacheStorage:
        owner = world()
        assert owner is not None, "a storage world's backend built after the world was gone"
        return owner.build_backend(rank, cfg)

    return build
