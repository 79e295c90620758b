"""``FaultInjectingStorage``: a backend wrapper that fails or drops chosen page operations.

It mirrors SGLang 0.5.23's ``HiCacheStorageFailureInjector`` without the sleeps, in the
BUGGIFY style: every decision is a pure function of ``(seed, operation kind, key, attempt)``,
so the same seed injects the same faults however threads interleave, and ``replay_line()``
prints the one line that rebuilds the wrapper.

What can be injected, per page:

- a *failed get*: the page exists (``exists`` stays True) but reading it returns ``None``, which
  is how a prefetch meets a torn or evicted page mid-transfer (sglang#8901);
- a *failed set*: ``batch_set`` stops at the page and reports False; earlier pages are stored;
- a *dropped set*: ``set`` reports success but nothing is stored (a lossy or evicting store).

Pages are chosen by key (``str``) or by ordinal (``int``: the n-th page get, or n-th page set,
this wrapper has seen, counting from 0), or at random with ``fail_rate`` / ``drop_rate``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageExtraInfo
from hicache_ref.storage.protocols import StorageHostPool

FaultKind = Literal["get_fail", "set_fail", "set_drop"]

FAULT_LOG_MAX = 100_000
"""Bound on the fault log (TigerStyle); older entries are dropped first, counts stay exact."""


@dataclass(frozen=True)
class InjectedFault:
    """One injected fault: what, on which key, at which page ordinal of its kind."""

    kind: FaultKind
    key: str
    ordinal: int


def _check_rate(name: str, rate: float) -> None:
    if not 0.0 <= rate <= 1.0:
        raise HiCacheInputError(f"{name} must lie in [0, 1], got {rate}")


def _split_choices(
    choices: Iterable[str | int], name: str
) -> tuple[frozenset[str], frozenset[int]]:
    keys: set[str] = set()
    ordinals: set[int] = set()
    for choice in choices:
        if isinstance(choice, str):
            keys.add(choice)
        elif isinstance(choice, int) and choice >= 0:
            ordinals.add(choice)
        else:
            raise HiCacheInputError(
                f"{name} entries are page keys (str) or page ordinals (int >= 0), got {choice!r}"
            )
    return frozenset(keys), frozenset(ordinals)


class FaultInjectingStorage(HiCacheStorage):
    """Wraps ``inner`` and injects seeded, replayable page faults."""

    def __init__(
        self,
        inner: HiCacheStorage,
        *,
        seed: int,
        fail_rate: float = 0.0,
        get_fail_pages: Iterable[str | int] = (),
        set_fail_pages: Iterable[str | int] = (),
        drop_rate: float = 0.0,
    ) -> None:
        super().__init__(inner.config)
        _check_rate("fail_rate", fail_rate)
        _check_rate("drop_rate", drop_rate)
        self.inner = inner
        self.seed = seed
        self.fail_rate = fail_rate
        self.drop_rate = drop_rate
        self._get_fail_keys, self._get_fail_ordinals = _split_choices(
            get_fail_pages, "get_fail_pages"
        )
        self._set_fail_keys, self._set_fail_ordinals = _split_choices(
            set_fail_pages, "set_fail_pages"
        )
        self._lock = threading.Lock()
        self._ordinals = {"get": 0, "set": 0}
        self._attempts: dict[tuple[str, str], int] = {}
        self.faults: list[InjectedFault] = []
        self.fault_counts: dict[FaultKind, int] = {"get_fail": 0, "set_fail": 0, "set_drop": 0}

    def replay_line(self) -> str:
        """One line that rebuilds this wrapper's fault plan around the same inner backend."""
        return (
            f"FaultInjectingStorage(inner, seed={self.seed}, fail_rate={self.fail_rate}, "
            f"get_fail_pages={sorted(self._get_fail_keys) + sorted(self._get_fail_ordinals)}, "
            f"set_fail_pages={sorted(self._set_fail_keys) + sorted(self._set_fail_ordinals)}, "
            f"drop_rate={self.drop_rate})"
        )

    # -- decisions ---------------------------------------------------------------------------------
    def _draw(self, kind: str, key: str, attempt: int) -> float:
        """A uniform number in [0, 1) fixed by (seed, kind, key, attempt): order-independent."""
        digest = hashlib.sha256(f"{self.seed}|{kind}|{key}|{attempt}".encode()).digest()
        return int.from_bytes(digest[:8], "little") / 2**64

    def _next_ordinal_and_attempt(self, op: str, key: str) -> tuple[int, int]:
        with self._lock:
            ordinal = self._ordinals[op]
            self._ordinals[op] = ordinal + 1
            attempt = self._attempts.get((op, key), 0)
            self._attempts[(op, key)] = attempt + 1
        return ordinal, attempt

    def _record(self, kind: FaultKind, key: str, ordinal: int) -> None:
        with self._lock:
            self.fault_counts[kind] += 1
            if len(self.faults) >= FAULT_LOG_MAX:
                del self.faults[0]
            self.faults.append(InjectedFault(kind, key, ordinal))

    def _decide_get(self, key: str) -> bool:
        """Whether this page get fails (and record it if so)."""
        ordinal, attempt = self._next_ordinal_and_attempt("get", key)
        fails = (
            key in self._get_fail_keys
            or ordinal in self._get_fail_ordinals
            or self._draw("get", key, attempt) < self.fail_rate
        )
        if fails:
            self._record("get_fail", key, ordinal)
        return fails

    def _decide_set(self, key: str) -> FaultKind | None:
        """``set_fail``, ``set_drop`` or None for this page set (recorded if a fault)."""
        ordinal, attempt = self._next_ordinal_and_attempt("set", key)
        kind: FaultKind | None = None
        if (
            key in self._set_fail_keys
            or ordinal in self._set_fail_ordinals
            or self._draw("set", key, attempt) < self.fail_rate
        ):
            kind = "set_fail"
        elif self._draw("drop", key, attempt) < self.drop_rate:
            kind = "set_drop"
        if kind is not None:
            self._record(kind, key, ordinal)
        return kind

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
        if self._decide_get(key):
            return None
        return self.inner.get(key, target_location, target_sizes)

    def batch_get(
        self,
        keys: Sequence[str],
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> list[torch.Tensor | None]:
        if target_locations is not None and len(target_locations) != len(keys):
            raise HiCacheInputError(
                f"batch_get got {len(keys)} keys but {len(target_locations)} target_locations"
            )
        pages: list[torch.Tensor | None] = []
        for i, key in enumerate(keys):
            if self._decide_get(key):
                pages.append(None)
                continue
            targets = None if target_locations is None else [target_locations[i]]
            pages.append(self.inner.batch_get([key], targets)[0])
        return pages

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> bool:
        fault = self._decide_set(key)
        if fault == "set_fail":
            return False
        if fault == "set_drop":
            return True
        return self.inner.set(key, value, target_location, target_sizes)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def batch_exists(
        self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        return self.inner.batch_exists(keys, extra_info)

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        self.inner.close()

    def get_stats(self) -> Mapping[str, int] | None:
        with self._lock:
            return {str(kind): count for kind, count in self.fault_counts.items()}
