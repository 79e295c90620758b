"""The storage world as upstream's controller sees it: its process group, its attach, its backend.

In the order a rank meets them:

- ``harness_torch``: the controller module's ``torch``, whose ``distributed`` serves upstream's
  ``get_world_size`` / ``all_reduce`` / ``destroy_process_group`` on ``tp_group`` handles
  (``TpHandle``) backed by the storage world's ``RankGroup``, which records every collective per
  rank and fails on any asymmetry (INV-20);
- ``attaching(module, handle, tree)``: while one rank attaches, ``create_custom_parallel_group``
  (upstream's gloo sync groups, ``SyncGroups``) and the TP coordinates upstream reads for its
  storage config answer for that rank, passed in, never through a module-level variable;
- ``PpBroadcast`` / ``pp_broadcast_pyobj``: in a PP world (``HarnessConfig.storage_pp``),
  0.5.23's ``broadcast_pyobj`` on the PP command group: a copy of PP rank 0's objects (upstream
  pickles them; the controller module here is per device, so a deep copy stands in) reaches
  every other rank's inbox in order; a follower's command thread waits at its
  inbox like a served ``get`` (the harness grants it once the source broadcast), and every rank's
  received tickets are logged (INV-38);
- ``UpstreamFacingFactory`` / ``install_storage_factory``: the backend factory upstream's attach
  imports, which builds this project's backend (the world's recording layer) from upstream's
  storage config.
"""

from __future__ import annotations

import copy
import queue
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hicache_ref.controller.storage.collectives import (
    PREFETCH_COMPLETION,
    PREFETCH_HITS,
    RankCollectives,
    SingleRank,
    SyncGroup,
)
from hicache_ref.errors import HiCacheSetupError
from hicache_ref.harness.adapters.sglang_stubs import install_stubs, sync_groups_for

SYNC_GROUP_NAMES = (PREFETCH_HITS, PREFETCH_COMPLETION)
"""0.5.23's attach creates the hit-query groups, then the completion groups, in that order."""
PP_COMMAND = SyncGroup("pp_prefetch_command")
PP_SYNC_GROUP_NAMES = (PP_COMMAND, PREFETCH_HITS, PREFETCH_COMPLETION)
"""In a PP world 0.5.23's hybrid attach creates the PP command group first (``enable_pp_ticket``),
then the base attach its hit-query and completion groups (TP 1: one of each, on the PP ranks)."""


class TpHandle:
    """What upstream holds as ``tp_group`` (and as each gloo sync group): one rank's view of the
    storage world's ``RankGroup``, under one group name."""

    def __init__(
        self, collectives: RankCollectives | SingleRank, name: SyncGroup, *, pp: bool = False
    ) -> None:
        self.collectives = collectives
        self.name = name
        self.pp = pp  # the group's ranks are PP ranks (TP 1): a PP world's handles

    def sync_group(self, name: SyncGroup) -> TpHandle:
        return TpHandle(self.collectives, name, pp=self.pp)


class _HarnessDistributed:
    """``torch.distributed`` as upstream's controller calls it, on ``TpHandle`` groups."""

    ReduceOp = torch.distributed.ReduceOp
    ProcessGroup = object

    @staticmethod
    def _handle(group: object, what: str) -> TpHandle:
        if not isinstance(group, TpHandle):
            raise HiCacheSetupError(
                f"upstream called torch.distributed.{what} on {group!r}, not a harness group"
            )
        return group

    def get_world_size(self, group: object = None) -> int:
        return int(self._handle(group, "get_world_size").collectives.world_size)

    def get_rank(self, group: object = None) -> int:
        if group is None:  # the global rank: the PP command thread asks it of its controller
            return _calling_rank()
        return int(self._handle(group, "get_rank").collectives.rank)

    def get_process_group_ranks(self, group: object) -> list[int]:
        return list(range(self.get_world_size(group)))

    def all_reduce(self, tensor: torch.Tensor, op: object = None, group: object = None) -> None:
        handle = self._handle(group, "all_reduce")
        handle.collectives.all_reduce(tensor, op if op is not None else "sum", handle.name)

    def destroy_process_group(self, group: object = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


def _calling_rank() -> int:
    """The global rank of the calling storage thread: its controller's rank in the world."""
    import threading

    owner = getattr(getattr(threading.current_thread(), "_target", None), "__self__", None)
    collectives = getattr(owner, "_harness_collectives", None)
    if collectives is None:
        raise HiCacheSetupError(
            "upstream called torch.distributed.get_rank() off a storage thread of a harness "
            "controller; only a controller's own threads have a global rank here"
        )
    return int(collectives.rank)


class _HarnessTorch:
    """The controller module's ``torch``: the real one, but ``distributed`` is the harness's."""

    distributed = _HarnessDistributed()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


harness_torch = _HarnessTorch()


class SyncGroups:
    """``create_custom_parallel_group`` for one attaching rank: 0.5.23's attach creates the
    hit-query groups, then the completion groups, so the k-th group it asks for gets the k-th
    name of ``SYNC_GROUP_NAMES`` (cycling), each a view of the rank's ``TpHandle``."""

    def __init__(self, handle: TpHandle) -> None:
        self.handle = handle
        self.created = 0

    def __call__(self, group_ranks: Sequence[int], backend: str = "gloo") -> TpHandle:
        names = PP_SYNC_GROUP_NAMES if self.handle.pp else SYNC_GROUP_NAMES
        name = names[self.created % len(names)]
        self.created += 1
        return self.handle.sync_group(name)


def _rank_parallel(handle: TpHandle) -> types.SimpleNamespace:
    rank, size = int(handle.collectives.rank), int(handle.collectives.world_size)
    tp_rank, tp_size, pp_rank, pp_size = (0, 1, rank, size) if handle.pp else (rank, size, 0, 1)
    return types.SimpleNamespace(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_tp_rank=tp_rank,
        attn_tp_size=tp_size,
        attn_dp_rank=0,
        attn_dp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        attn_dcp_rank=0,
        attn_dcp_size=1,
    )


@contextmanager
def attaching(module: types.ModuleType, handle: TpHandle, tree: Path) -> Iterator[None]:
    """While ``handle``'s rank attaches: its sync groups and TP coordinates answer for it, and
    ``import sglang...`` resolves against its own tree again (a storage world running
    upstream's file backend from another release installs that release's modules)."""
    install_stubs(tree)
    coordinates = _rank_parallel(handle)
    answers: dict[str, Callable[[], Any]] = {
        "get_parallel": lambda: coordinates,
        "get_tensor_model_parallel_rank": lambda: coordinates.tp_rank,
        "get_tensor_model_parallel_world_size": lambda: coordinates.tp_size,
        "get_attention_tp_rank": lambda: coordinates.attn_tp_rank,
        "get_attention_tp_size": lambda: coordinates.attn_tp_size,
    }
    saved = {name: module.__dict__[name] for name in answers if name in module.__dict__}
    install_storage_factory()  # again: loading upstream's file backend remakes the package
    module.__dict__.update({name: answers[name] for name in saved})
    with sync_groups_for(SyncGroups(handle)):  # upstream imports it lazily, inside attach
        try:
            yield
        finally:
            module.__dict__.update(saved)


# -- the PP command group's broadcast --------------------------------------------------------------
@dataclass(frozen=True)
class ReceivedObjects:
    """One ``broadcast_pyobj`` as one rank returned from it: the objects, in the rank's copy."""

    rank: int
    seq: int
    objects: tuple[Any, ...]


class PpBroadcast:
    """One PP world's command group: rank 0 broadcasts, every other rank takes from its inbox
    (a ``ServedQueue``: its command thread waits there until the harness grants it)."""

    def __init__(self, world_size: int) -> None:
        from hicache_ref.harness.adapters.sglang_gate import ServedQueue

        self.inboxes: list[ServedQueue] = [ServedQueue() for _ in range(world_size)]
        self.received: list[list[ReceivedObjects]] = [[] for _ in range(world_size)]
        self._lock = threading.Lock()

    def broadcast(self, data: list[Any], rank: int) -> list[Any]:
        if rank == 0:
            for inbox in self.inboxes[1:]:  # each rank its own copy, as the pickled bytes give
                inbox.put(copy.deepcopy(list(data)))
            self._log(rank, data)
            return data
        inbox = self.inboxes[rank]
        try:
            objects: list[Any] = inbox.get()
        except queue.Empty:  # the world went with nothing broadcast: an empty broadcast
            objects = []
        self._log(rank, objects)
        return objects

    def _log(self, rank: int, objects: list[Any]) -> None:
        with self._lock:
            log = self.received[rank]
            log.append(ReceivedObjects(rank, len(log), tuple(objects)))

    def pending(self, rank: int) -> int:
        """Broadcasts waiting in ``rank``'s inbox (none for the source)."""
        return self.inboxes[rank].qsize() if rank else 0


def pp_broadcast_for(collectives: Any) -> PpBroadcast:
    """The command-group broadcast of the PP world ``collectives`` (a rank's view) belongs to,
    kept with its rank group (one per world)."""
    attachments: dict[str, object] = collectives.group.attachments
    found = attachments.setdefault("pp_broadcast", PpBroadcast(int(collectives.world_size)))
    assert isinstance(found, PpBroadcast)
    return found


def pp_broadcast_pyobj(
    data: list[Any],
    rank: int,
    dist_group: object = None,
    src: int = 0,
    force_cpu_device: bool = True,
) -> list[Any]:
    """0.5.23's ``sglang.srt.utils.broadcast_pyobj`` on a harness PP command group."""
    handle = _HarnessDistributed._handle(dist_group, "broadcast_pyobj")
    if handle.name != PP_COMMAND or src != 0:
        raise HiCacheSetupError(
            f"upstream broadcast on group {handle.name.name!r} from rank {src}; the harness "
            "serves broadcast_pyobj on the PP command group from PP rank 0 only"
        )
    return pp_broadcast_for(handle.collectives).broadcast(data, int(handle.collectives.rank))


# -- the backend factory upstream's attach imports -----------------------------------------------
class _UpstreamFacingBackend:
    """This project's backend (the world's recording layer) as upstream's attach calls it:
    0.5.23 also calls ``on_host_pools_registered()``, which our interface does not have."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def on_host_pools_registered(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class UpstreamFacingFactory:
    """``sglang.srt.mem_cache.storage.StorageBackendFactory``: this project's factory, handed
    upstream's ``HiCacheStorageConfig`` as ours (the fields both have)."""

    @staticmethod
    def create_backend(name: str, config: Any, mem_pool_host: Any = None) -> Any:
        import dataclasses

        from hicache_ref.storage.backend import HiCacheStorageConfig
        from hicache_ref.storage.factory import StorageBackendFactory

        ours = {f.name for f in dataclasses.fields(HiCacheStorageConfig)}
        values = {k: v for k, v in vars(config).items() if k in ours}
        values["extra_config"] = dict(values.get("extra_config") or {})
        backend = StorageBackendFactory.create_backend(
            name, HiCacheStorageConfig(**values), mem_pool_host
        )
        return _UpstreamFacingBackend(backend)


def install_storage_factory() -> None:
    """What upstream's attach imports: the backend factory, and the pool class its storage
    config tests the device pool against."""
    import sys

    name = "sglang.srt.mem_cache.storage"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module
    module.__dict__["StorageBackendFactory"] = UpstreamFacingFactory
    pools = "sglang.srt.mem_cache.deepseek_v4_memory_pool"  # imported by the storage config
    if pools not in sys.modules:  # its kernels are not loaded; the gate's pools are none of it
        stub = types.ModuleType(pools)
        stub.__dict__["DeepSeekV4TokenToKVPool"] = type("DeepSeekV4TokenToKVPool", (), {})
        sys.modules[pools] = stub
