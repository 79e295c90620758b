"""``RecordingStorage``: the outermost backend layer of a storage world, which writes down calls.

The tier under test talks to a rank's backend only through this wrapper, so the harness learns
from its own object, not from the tier, which keys were queried and what ``batch_exists``
answered, which pages were stored (and the digest of their bytes), and what every read returned.
The storage driver takes the calls after each step (``take``) and turns them into its L3 model
(``invariants/storage_snapshot.L3Model``). Calls are recorded in the order they were made. In a
world with schedule points, each ``batch_*`` call is also a point where the calling storage
thread parks and learns the call's drawn outcome (``harness/schedule/outcomes.py``). A sidecar
pool's page calls (the v2 calls, ``storage/pool_transfers.py``) are recorded as
``sidecar_exists`` / ``sidecar_get`` / ``sidecar_set`` with the pool's name, so what counts KV
pages never counts them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from hicache_ref.harness.schedule.outcomes import after_backend_call, at_backend_call
from hicache_ref.harness.schedule.points import BATCH_EXISTS, BATCH_GET, BATCH_SET
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageExtraInfo
from hicache_ref.storage.fault_injection import FaultInjectingStorage
from hicache_ref.storage.pool_transfers import DRAFT_POOL, component_key
from hicache_ref.storage.protocols import StorageHostPool

_T = TypeVar("_T")
CALLS_MAX = 1_000_000
"""Bound on calls held between two ``take``s (TigerStyle)."""


def page_digest(page: torch.Tensor) -> str:
    """A short digest of a flat page's bytes (what the L3 model compares)."""
    data = page.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:24]


@dataclass(frozen=True)
class BackendCall:
    """One backend call: ``exists`` (answer = the leading run), ``set`` (ok, digest) or
    ``get`` (digest of what came back, None when nothing did)."""

    kind: str
    keys: tuple[str, ...]
    answer: int = 0
    ok: bool = False
    digests: tuple[str | None, ...] = ()
    stored_keys: tuple[str, ...] = ()
    raised: bool = False  # the backend raised instead of answering
    thread: str = ""  # the storage thread function that called (its loop body's, under points)
    pool: str = ""  # a sidecar pool's call (kind ``sidecar_<kind>``, component keys), else ""


LEGACY_DRAFT_PREFIX = "d:"
"""0.5.11 - 0.5.12 store a draft page under ``d:<key>`` (0.5.13 - 0.5.18: ``<key>.draft``)."""


def legacy_draft_call(keys: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """A v1 call the draft releases (0.5.11 - 0.5.18) make for their draft pool's pages, which
    they store beside the KV's through plain ``batch_set`` / ``batch_get`` (``d:<key>``, then
    ``<key>.draft``): the pool (``draft``) and the keys in component form, else ``("", keys)``.
    Page keys are hex digests, so neither spelling can be a KV key (INV-37 judges them, F27)."""
    suffix = f".{DRAFT_POOL}"
    if not keys:
        return "", tuple(keys)
    if all(k.startswith(LEGACY_DRAFT_PREFIX) for k in keys):
        return DRAFT_POOL, tuple(
            component_key(k[len(LEGACY_DRAFT_PREFIX) :], DRAFT_POOL) for k in keys
        )
    if all(k.endswith(suffix) for k in keys):
        return DRAFT_POOL, tuple(keys)
    return "", tuple(keys)


class RecordingStorage(HiCacheStorage):
    """Forwards every call to ``inner`` and records it."""

    def __init__(self, inner: HiCacheStorage, rank: int) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.rank = rank
        self._lock = threading.Lock()
        self._calls: list[BackendCall] = []
        self._faults = inner if isinstance(inner, FaultInjectingStorage) else None
        self._sidecar = threading.local()  # the pool of the v2 call in progress on this thread
        self.pp_shards: Sequence[RecordingStorage] = ()  # every PP rank's backend (a PP world)

    def _record(self, call: BackendCall) -> None:
        function = getattr(threading.current_thread(), "function", "")
        if function:
            call = dataclasses.replace(call, thread=str(function))
        pool = getattr(self._sidecar, "pool", "")
        keys = call.keys
        if not pool:
            pool, keys = legacy_draft_call(call.keys)
        if pool:  # a sidecar's page call: its own kind, so KV observers never count it
            call = dataclasses.replace(call, kind=f"sidecar_{call.kind}", pool=pool, keys=keys)
        with self._lock:
            if len(self._calls) >= CALLS_MAX:
                del self._calls[0]
            self._calls.append(call)

    def take(self) -> list[BackendCall]:
        """Every call since the last ``take``, oldest first."""
        with self._lock:
            calls, self._calls = self._calls, []
        return calls

    def stored_key(self, key: str) -> str:
        """The key the store really holds ``key`` under (content key + namespace)."""
        return f"{key}_{self.inner.namespace}"

    @property
    def namespace(self) -> str:
        return self.inner.namespace

    def _sidecar_call(self, pool: str, call: Callable[..., _T], *args: object) -> _T:
        self._sidecar.pool = pool
        try:
            return call(*args)
        finally:
            self._sidecar.pool = ""

    # -- HiCacheStorage ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: StorageHostPool) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.inner.register_mem_pool_host(mem_pool_host)

    def get(
        self,
        key: str,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self,
        keys: Sequence[str],
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> list[torch.Tensor | None]:
        grant = at_backend_call(self._faults, BATCH_GET, keys)
        pages = self.inner.batch_get(keys, target_locations, target_sizes)
        digests = tuple(None if p is None else page_digest(p) for p in pages)
        self._record(BackendCall("get", tuple(keys), digests=digests))
        after_backend_call(grant, BATCH_GET)
        return pages

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def batch_set(
        self,
        keys: Sequence[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> bool:
        ok = False
        grant = at_backend_call(self._faults, BATCH_SET, keys)
        try:
            ok = bool(self.inner.batch_set(keys, values, target_locations, target_sizes))
        finally:  # recorded when it ran (a deferred call's return point comes after)
            digests = tuple(page_digest(v) for v in values or ())
            self._record(
                BackendCall(
                    "set",
                    tuple(keys),
                    ok=ok,
                    digests=digests,
                    stored_keys=tuple(self.stored_key(k) for k in keys),
                )
            )
        after_backend_call(grant, BATCH_SET)
        return ok

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        shard = self._pp_shard_of(extra_info)
        if shard is not None:
            return shard.batch_exists(keys)
        answer, raised = 0, True
        grant = at_backend_call(self._faults, BATCH_EXISTS, keys)
        try:
            answer = int(self.inner.batch_exists(keys, extra_info))
            raised = False
        finally:  # recorded when it ran (a deferred call's return point comes after)
            self._record(BackendCall("exists", tuple(keys), answer=answer, raised=raised))
        after_backend_call(grant, BATCH_EXISTS)
        return answer

    def _pp_shard_of(self, extra_info: HiCacheStorageExtraInfo | None) -> RecordingStorage | None:
        """The backend of the PP rank a query names (``extra_info={"pp_rank": r}``), when not
        this one: 0.5.21 - 0.5.22's PP rank 0 asks every PP rank's shard for a ticket's hit, as
        Mooncake answers it by rewriting the keys' PP suffix. That rank's client answers and
        records the call (its shard's faults apply)."""
        hints = getattr(extra_info, "extra_info", None) or {}
        pp_rank = hints.get("pp_rank") if isinstance(hints, Mapping) else None
        if pp_rank is None or not self.pp_shards or int(pp_rank) == self.rank:
            return None
        return self.pp_shards[int(pp_rank)]

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        self.inner.close()

    def get_stats(self) -> Mapping[str, int] | None:
        return self.inner.get_stats()
