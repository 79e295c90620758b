"""The L3 storage interface: a key -> flat-page store with SGLang's ``HiCacheStorage`` API.

A backend stores whole pages under their chained content keys (``hashing.py``). The key a backend
really uses is ``compute_storage_key(key, config, format_tag)``: the content key followed by the
backend's *namespace* (``compute_storage_namespace``): the model, the rank shard and a *format
tag*. The tag names the flat page format (dtype, element count and page size of
``get_dummy_flat_data_page()``), never the host layout: the flat format is layout-independent, so
pages written under one layout read back under another, while a pool with a different page
geometry gets different keys instead of garbage (bug class 21). Ranks therefore never share a
stored key, and ``clear`` removes only its own namespace (INV-28).

Calls, in the order data flows: ``register_mem_pool_host`` -> ``batch_set`` (backup) ->
``batch_exists`` (prefetch hit query: length of the leading run of hits) -> ``batch_get``
(prefetch transfer) -> ``clear`` / ``close``. Sidecar pools (``pool_transfers.py``) add
``register_mem_host_pool_v2`` and the v2 calls, which store a sidecar page under its component
key through the same v1 calls.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.pages import get_page_head
from hicache_ref.storage.pool_transfers import (
    ALL_PAGES,
    TRAILING_PAGES,
    PoolTransferResult,
    component_key,
    pool_name,
    restorable_prefixes,
)
from hicache_ref.storage.protocols import StorageHostPool

FLAT_PAGE_FORMAT_VERSION = "kvflat1"
"""Version of the flat page byte format that ``get_data_page`` produces."""

_T = TypeVar("_T")
_UNSAFE_KEY_CHARS = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class HiCacheStorageConfig:
    """Who is storing: rank split, model and backend options (SGLang's ``HiCacheStorageConfig``)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = False
    model_name: str | None = None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    extra_config: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class HiCacheStorageExtraInfo:
    """Per-call hints for a backend.

    ``prefix_keys`` defaults to ``None``: SGLang 0.5.10 defaulted it to ``(None,)``, a truthy
    tuple that made every default-constructed hint look like it carried a prefix (bug class 20).
    It is a tuple so no backend or caller can extend the controller's list in place.
    """

    prefix_keys: tuple[str, ...] | None = None
    extra_info: Mapping[str, object] | None = None


STORAGE_KEYS_REMEMBERED = 4096
"""Bound on the storage keys a backend remembers (then it forgets them all and starts over)."""


def compute_format_tag(mem_pool_host: StorageHostPool | None) -> str:
    """The layout-independent tag of a pool's flat page format (bug class 21)."""
    if mem_pool_host is None:
        return FLAT_PAGE_FORMAT_VERSION
    page = mem_pool_host.get_dummy_flat_data_page()
    dtype_name = str(page.dtype).removeprefix("torch.")
    return f"{FLAT_PAGE_FORMAT_VERSION}-{dtype_name}x{page.numel()}p{mem_pool_host.page_size}"


def compute_storage_namespace(config: HiCacheStorageConfig, format_tag: str) -> str:
    """What a stored key carries besides the content: model, rank shard, page format (INV-28).

    MLA ranks hold identical KV, so their namespace omits the TP split; the pipeline split
    appears only when pipeline parallelism is on (as in SGLang's file backend).
    """
    parts = [config.model_name or "model"]
    if not config.is_mla_model:
        parts.append(f"tp{config.tp_rank}of{config.tp_size}")
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}of{config.pp_size}")
    parts.append(format_tag)
    return _UNSAFE_KEY_CHARS.sub("-", "_".join(parts))


def compute_storage_key(key: str, config: HiCacheStorageConfig, format_tag: str) -> str:
    """The key a backend stores a page under: ``<content key>_<namespace>`` (INV-28)."""
    return f"{_UNSAFE_KEY_CHARS.sub('-', key)}_{compute_storage_namespace(config, format_tag)}"


def copy_page_bytes(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Copy ``source``'s bytes into ``target`` (same byte size) and return ``target``; a page
    of another size is refused, never read as valid (INV-30)."""
    source_bytes = source.contiguous().view(torch.uint8).reshape(-1)
    target_bytes = target.view(torch.uint8).reshape(-1)
    if source_bytes.numel() != target_bytes.numel():
        raise OSError(
            f"stored page has {source_bytes.numel()} bytes but the target holds "
            f"{target_bytes.numel()} (page format mismatch)"
        )
    target_bytes.copy_(source_bytes)
    return target


class HiCacheStorage(ABC):
    """A page store keyed by content hash (SGLang's ``HiCacheStorage``).

    ``batch_get`` returns one entry per key, ``None`` where the page is missing or unreadable;
    ``batch_set`` reports all-or-nothing success (pages before the first failure may be stored);
    ``batch_exists`` returns the length of the leading run of keys that exist.
    """

    def __init__(self, config: HiCacheStorageConfig | None = None) -> None:
        self.config = config if config is not None else HiCacheStorageConfig()
        self.mem_pool_host: StorageHostPool | None = None
        self.format_tag = compute_format_tag(None)
        self._keys: tuple[str, dict[str, str]] = (self.format_tag, {})
        self.registered_pools: dict[str, StorageHostPool] = {}

    def register_mem_pool_host(self, mem_pool_host: StorageHostPool) -> None:
        """Remember the host pool: its flat page format becomes part of every key."""
        self.mem_pool_host = mem_pool_host
        self.format_tag = compute_format_tag(mem_pool_host)

    def _storage_key(self, key: str) -> str:
        # a pure function of the key, the (frozen) config and the format tag: remembered per
        # key while the tag stays (the harness asks every stored key's presence every step)
        tag, keys = self._keys
        if tag != self.format_tag:
            tag, keys = self._keys = (self.format_tag, {})
        stored = keys.get(key)
        if stored is None:
            if len(keys) >= STORAGE_KEYS_REMEMBERED:
                keys.clear()
            stored = keys[key] = compute_storage_key(key, self.config, self.format_tag)
        return stored

    @property
    def namespace(self) -> str:
        """The suffix every key this backend stores carries; ``clear`` stays inside it."""
        return compute_storage_namespace(self.config, self.format_tag)

    def _require_target(self, key: str, target_location: torch.Tensor | None) -> torch.Tensor:
        """The tensor to read a page into: the caller's, else a fresh flat page of the pool."""
        if target_location is not None:
            return target_location
        if self.mem_pool_host is None:
            raise HiCacheInputError(
                f"get({key!r}) needs a target_location to learn the page format "
                "(pass one, or call register_mem_pool_host first)"
            )
        return self.mem_pool_host.get_dummy_flat_data_page()

    @abstractmethod
    def get(
        self,
        key: str,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> torch.Tensor | None:
        """The page stored under ``key`` (written into ``target_location`` if given), or None."""

    def batch_get(
        self,
        keys: Sequence[str],
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> list[torch.Tensor | None]:
        """``get`` for each key, in order."""
        if target_locations is not None and len(target_locations) != len(keys):
            raise HiCacheInputError(
                f"batch_get got {len(keys)} keys but {len(target_locations)} target_locations "
                "(pass one target per key, or None)"
            )
        return [
            self.get(key, None if target_locations is None else target_locations[i])
            for i, key in enumerate(keys)
        ]

    @abstractmethod
    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> bool:
        """Store ``value`` under ``key``; an existing key is kept (first writer wins)."""

    def batch_set(
        self,
        keys: Sequence[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> bool:
        """``set`` each key in order, stopping at the first failure; True iff all succeeded."""
        if values is None or len(values) != len(keys):
            raise HiCacheInputError(
                f"batch_set got {len(keys)} keys but "
                f"{'no' if values is None else len(values)} values (pass one flat page per key)"
            )
        return all(self.set(key, value) for key, value in zip(keys, values, strict=True))

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a page is stored under ``key``."""

    def batch_exists(
        self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Length of the leading run of ``keys`` that exist (a chain stops at its first miss)."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    # -- sidecar pools (SGLang's v2 calls; ``pool_transfers.py``) ---------------------------------
    def register_mem_host_pool_v2(self, host_pool: StorageHostPool, host_pool_name: object) -> None:
        """Remember a pool of a group by name; a v2 call moves that pool's pages."""
        self.registered_pools[pool_name(host_pool_name)] = host_pool

    def on_host_pools_registered(self) -> None:  # noqa: B027 - optional hook
        """Every pool of the group is registered (the default needs nothing more)."""

    def _registered_pool(self, name: str) -> StorageHostPool:
        pool = self.registered_pools.get(name)
        if pool is None:
            raise HiCacheInputError(
                f"a v2 call names pool {name!r}, which was never registered (call "
                "register_mem_host_pool_v2 for every pool of the group at attach)"
            )
        return pool

    def batch_exists_v2(
        self,
        keys: Sequence[str],
        pool_transfers: Sequence[object] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix of ``keys``: the KV pages' leading run, cut where a sidecar's
        page is missing (``all_pages``: a sidecar must hold every page of the KV hit, INV-37),
        and kept only at prefix lengths whose trailing window a ``trailing_pages`` pool holds
        (SWA: its pages are asked one by one, so a hole shows; INV-39). As ``HiCacheFile``:
        the restorable prefix lengths, and each pool's longest."""
        kv_pages = max(0, min(int(self.batch_exists(keys, extra_info)), len(keys)))
        hits: dict[str, int] = {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or ():
            name = pool_name(getattr(transfer, "name", ""))
            policy = pool_name(getattr(transfer, "hit_policy", ALL_PAGES))
            if policy not in (ALL_PAGES, TRAILING_PAGES):
                raise HiCacheInputError(
                    f"pool {name!r} asks hit policy {policy!r}; this backend stores side pools "
                    f"under {ALL_PAGES!r} or {TRAILING_PAGES!r}"
                )
            if policy == ALL_PAGES:
                run = 0
                if kv_pages:
                    sidecar_keys = [component_key(k, name) for k in keys[:kv_pages]]
                    answer = self._sidecar_call(name, self.batch_exists, sidecar_keys, extra_info)
                    run = max(0, min(int(answer), kv_pages))
                pool_restorable = list(range(1, run + 1))
            else:
                present = [
                    int(self._sidecar_call(name, self.batch_exists, [component_key(k, name)])) == 1
                    for k in keys[:kv_pages]
                ]
                trailing = max(1, len(getattr(transfer, "keys", None) or ()))
                pool_restorable = restorable_prefixes(present, trailing)
            hits[name] = max(pool_restorable, default=0)
            restorable = [p for p in restorable if p in pool_restorable]
        usable = restorable[-1] if restorable else 0
        return PoolTransferResult(usable, hits, restorable)

    def batch_get_v2(
        self, transfers: Sequence[object], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages into its pool's host slots; per page, whether its bytes
        were set (nothing after the first page that did not come back)."""
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name, pool, keys, host = self._transfer_parts(transfer)
            targets = [pool.get_dummy_flat_data_page() for _ in keys]
            pages = self._sidecar_call(
                name, self.batch_get, [component_key(k, name) for k in keys], targets
            )
            flags = [False] * len(keys)
            for i in range(len(keys)):
                data = pages[i] if i < len(pages) else None
                if data is None:
                    break
                pool.set_from_flat_data_page(get_page_head(host, i, pool.page_size), data)
                flags[i] = True
            results[name] = flags
        return results

    def batch_set_v2(
        self, transfers: Sequence[object], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Write each transfer's pages from its pool's host slots; ``batch_set`` is
        all-or-nothing, so every page of a transfer reports its outcome."""
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name, pool, keys, host = self._transfer_parts(transfer)
            pages = [
                pool.get_data_page(get_page_head(host, i, pool.page_size), True)
                for i in range(len(keys))
            ]
            sidecar_keys = [component_key(k, name) for k in keys]
            ok = (
                bool(self._sidecar_call(name, self.batch_set, sidecar_keys, pages))
                if keys
                else True
            )
            results[name] = [ok] * len(keys)
        return results

    def _sidecar_call(self, pool: str, call: Callable[..., _T], *args: object) -> _T:
        """One v1 batch call on a sidecar's component keys (a layer that records calls tags
        it with the pool)."""
        return call(*args)

    def _transfer_parts(
        self, transfer: object
    ) -> tuple[str, StorageHostPool, list[str], torch.Tensor]:
        name = pool_name(getattr(transfer, "name", ""))
        pool = self._registered_pool(name)
        keys = [str(k) for k in (getattr(transfer, "keys", None) or [])]
        host = getattr(transfer, "host_indices", None)
        if not isinstance(host, torch.Tensor) or host.numel() != len(keys) * pool.page_size:
            got = "none" if not isinstance(host, torch.Tensor) else f"{host.numel()} slots"
            raise HiCacheInputError(
                f"pool {name!r}: {len(keys)} key(s) need {len(keys) * pool.page_size} host "
                f"slots, got {got} (give one page of slots per key)"
            )
        return name, pool, keys, host

    @abstractmethod
    def clear(self) -> None:
        """Drop every page of this backend's namespace, and nothing of anyone else's."""

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing to close
        """Release backend resources; the default holds none."""

    def get_stats(self) -> Mapping[str, int] | None:
        """Backend counters, if the backend keeps any."""
        return None
