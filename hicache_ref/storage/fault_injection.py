"""``FaultInjectingStorage``: a backend wrapper that fails, drops, delays or lies, seeded.

It mirrors SGLang 0.5.23's ``HiCacheStorageFailureInjector`` in the BUGGIFY style: every
decision is a pure function of ``(seed, rank, kind, key, attempt)``, so the same seed injects the
same faults however threads interleave, ranks of one world diverge the same way on every run,
and ``replay_line()`` prints the one line that rebuilds the wrapper.

What can be injected, per page, in the order a page meets them:

- ``exists_miss``: ``batch_exists`` says a stored page is absent, so the hit run ends early;
- ``get_fail``: the page exists (``exists`` stays True) but reading it returns ``None``: a hole
  inside a hit run, a page evicted between query and read (sglang#8901, #31315);
- ``short_read``: the read fills part of the target, then reports the page unreadable;
- ``set_fail``: ``batch_set`` stops at the page and reports False; earlier pages of the batch
  are stored (a partial write);
- ``set_drop``: ``set`` reports success but nothing is stored (a lossy or evicting store);
- ``raise``: the call raises ``InjectedBackendError`` (a dead connection, sglang#38427);
- ``delay``: the call sleeps up to ``delay_s_max`` first (only real threads notice).

Pages are chosen by key (``str``) or by ordinal (``int``: the n-th page get, or n-th page set,
this wrapper has seen, counting from 0), at random with the ``*_rate`` arguments, or one-shot:
``arm(kind, pages)`` makes the next ``pages`` page operations that kind can hit fail with it (a
state machine's ``inject_fault`` step); ``arm_key(kind, key)`` makes the next operation on one
key fail with it, and ``evict(key)`` makes the page absent from now on for every read and query
through this wrapper (a schedule point's drawn outcome, ``harness/schedule/outcomes.py``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageExtraInfo
from hicache_ref.storage.protocols import StorageHostPool

FaultKind = Literal[
    "exists_miss", "get_fail", "short_read", "set_fail", "set_drop", "raise", "delay"
]
FAULT_KINDS: tuple[FaultKind, ...] = (
    "exists_miss",
    "get_fail",
    "short_read",
    "set_fail",
    "set_drop",
    "raise",
    "delay",
)

FAULT_LOG_MAX = 100_000
"""Bound on the fault log (TigerStyle); older entries are dropped first, counts stay exact."""


class InjectedBackendError(ConnectionError):
    """An exception the fault wrapper raised on purpose (the backend 'went away')."""


@dataclass(frozen=True)
class InjectedFault:
    """One injected fault: what, on which key, at which page ordinal of its operation."""

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
        miss_rate: float = 0.0,
        short_read_rate: float = 0.0,
        raise_rate: float = 0.0,
        delay_rate: float = 0.0,
        delay_s_max: float = 0.0,
        rank: int = 0,
    ) -> None:
        super().__init__(inner.config)
        rates = {
            "fail_rate": fail_rate,
            "drop_rate": drop_rate,
            "miss_rate": miss_rate,
            "short_read_rate": short_read_rate,
            "raise_rate": raise_rate,
            "delay_rate": delay_rate,
        }
        for name, rate in rates.items():
            _check_rate(name, rate)
        if delay_s_max < 0:
            raise HiCacheInputError(f"delay_s_max must be >= 0, got {delay_s_max}")
        self.inner = inner
        self.seed, self.rank = seed, rank
        self.rates = rates
        self.delay_s_max = delay_s_max
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
        self.fault_counts: dict[FaultKind, int] = dict.fromkeys(FAULT_KINDS, 0)
        self.dropped_keys: set[str] = set()
        self._armed: dict[FaultKind, int] = {}
        self._armed_keys: set[tuple[FaultKind, str]] = set()
        self.evicted: set[str] = set()

    def replay_line(self) -> str:
        """One line that rebuilds this wrapper's fault plan around the same inner backend."""
        rates = ", ".join(f"{name}={rate}" for name, rate in self.rates.items() if rate)
        return (
            f"FaultInjectingStorage(inner, seed={self.seed}, rank={self.rank}, "
            f"get_fail_pages={sorted(self._get_fail_keys) + sorted(self._get_fail_ordinals)}, "
            f"set_fail_pages={sorted(self._set_fail_keys) + sorted(self._set_fail_ordinals)}"
            f"{', ' + rates if rates else ''}, delay_s_max={self.delay_s_max})"
        )

    def arm(self, kind: FaultKind, pages: int = 1) -> None:
        """The next ``pages`` page operations ``kind`` applies to fail with it (one-shot)."""
        if kind not in FAULT_KINDS or kind == "delay":
            legal = ", ".join(k for k in FAULT_KINDS if k != "delay")
            raise HiCacheInputError(f"cannot arm fault {kind!r}; legal values: {legal}")
        if pages < 1:
            raise HiCacheInputError(f"arm({kind!r}) needs pages >= 1, got {pages}")
        with self._lock:
            self._armed[kind] = self._armed.get(kind, 0) + pages

    def arm_key(self, kind: FaultKind, key: str) -> None:
        """The next page operation on ``key`` that ``kind`` applies to fails with it."""
        with self._lock:
            self._armed_keys.add((kind, key))

    def evict(self, key: str) -> None:
        """``key``'s page is gone from now on: queries miss it, reads return nothing."""
        with self._lock:
            self.evicted.add(key)

    def _take_key(self, kind: FaultKind, key: str) -> bool:
        with self._lock:
            if (kind, key) in self._armed_keys:
                self._armed_keys.discard((kind, key))
                return True
            return False

    def _take_armed(self, kind: FaultKind) -> bool:
        with self._lock:
            left = self._armed.get(kind, 0)
            if left:
                self._armed[kind] = left - 1
            return bool(left)

    # -- decisions ---------------------------------------------------------------------------------
    def _draw(self, kind: str, key: str, attempt: int) -> float:
        """A uniform number in [0, 1) fixed by (seed, rank, kind, key, attempt)."""
        text = f"{self.seed}|{self.rank}|{kind}|{key}|{attempt}"
        digest = hashlib.sha256(text.encode()).digest()
        return int.from_bytes(digest[:8], "little") / 2**64

    def _next(self, op: str, key: str) -> tuple[int, int]:
        """This call's page ordinal of ``op`` and its attempt number for ``key``."""
        with self._lock:
            ordinal = self._ordinals.get(op, 0)
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

    def _hits(self, kind: FaultKind, rate_name: str, key: str, attempt: int) -> bool:
        return self._draw(kind, key, attempt) < self.rates[rate_name]

    def _before_call(self, op: str, key: str, ordinal: int, attempt: int) -> None:
        """The call-wide faults: a delay, then perhaps an exception."""
        if self.delay_s_max and self._hits("delay", "delay_rate", f"{op}:{key}", attempt):
            self._record("delay", key, ordinal)
            time.sleep(self.delay_s_max * self._draw("delay-length", key, attempt))
        if (
            self._take_key("raise", key)
            or self._take_armed("raise")
            or self._hits("raise", "raise_rate", f"{op}:{key}", attempt)
        ):
            self._record("raise", key, ordinal)
            raise InjectedBackendError(f"injected: the storage backend failed on {op}({key!r})")

    def _decide_get(self, key: str) -> FaultKind | None:
        ordinal, attempt = self._next("get", key)
        self._before_call("get", key, ordinal, attempt)
        kind: FaultKind | None = None
        if (
            key in self._get_fail_keys
            or ordinal in self._get_fail_ordinals
            or key in self.evicted
            or self._take_key("get_fail", key)
            or self._take_armed("get_fail")
            or self._hits("get_fail", "fail_rate", key, attempt)
        ):
            kind = "get_fail"
        elif (
            self._take_key("short_read", key)
            or self._take_armed("short_read")
            or self._hits("short_read", "short_read_rate", key, attempt)
        ):
            kind = "short_read"
        if kind is not None:
            self._record(kind, key, ordinal)
        return kind

    def _decide_set(self, key: str) -> FaultKind | None:
        ordinal, attempt = self._next("set", key)
        self._before_call("set", key, ordinal, attempt)
        kind: FaultKind | None = None
        if (
            key in self._set_fail_keys
            or ordinal in self._set_fail_ordinals
            or self._take_key("set_fail", key)
            or self._take_armed("set_fail")
            or self._hits("set_fail", "fail_rate", key, attempt)
        ):
            kind = "set_fail"
        elif self._take_armed("set_drop") or self._hits("set_drop", "drop_rate", key, attempt):
            kind = "set_drop"
        if kind is not None:
            self._record(kind, key, ordinal)
        return kind

    # -- HiCacheStorage ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: StorageHostPool) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.inner.register_mem_pool_host(mem_pool_host)

    @property
    def namespace(self) -> str:
        return self.inner.namespace

    def _read(self, key: str, target: torch.Tensor | None) -> torch.Tensor | None:
        fault = self._decide_get(key)
        if fault == "get_fail":
            return None
        page = self.inner.batch_get([key], None if target is None else [target])[0]
        if fault == "short_read" and page is not None:
            flat = page.view(torch.uint8).reshape(-1)
            flat[flat.numel() // 2 :] = 0  # half a page landed, then the read broke off
            return None
        return page

    def get(
        self,
        key: str,
        target_location: torch.Tensor | None = None,
        target_sizes: int | None = None,
    ) -> torch.Tensor | None:
        return self._read(key, target_location)

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
        return [
            self._read(key, None if target_locations is None else target_locations[i])
            for i, key in enumerate(keys)
        ]

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
            with self._lock:
                self.dropped_keys.add(key)
            return True
        stored = self.inner.set(key, value, target_location, target_sizes)
        if stored:
            with self._lock:
                self.evicted.discard(key)  # written again: present from now on
        return stored

    def exists(self, key: str) -> bool:
        return key not in self.evicted and self.inner.exists(key)

    def batch_exists(
        self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        for i, key in enumerate(keys):
            ordinal, attempt = self._next("exists", key)
            self._before_call("exists", key, ordinal, attempt)
            if (
                self._take_key("exists_miss", key)
                or self._take_armed("exists_miss")
                or self._hits("exists_miss", "miss_rate", key, attempt)
            ):
                self._record("exists_miss", key, ordinal)
                return i
            if key in self.evicted or not self.inner.exists(key):
                return i
        return len(keys)

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        self.inner.close()

    def get_stats(self) -> Mapping[str, int] | None:
        with self._lock:
            return {str(kind): count for kind, count in self.fault_counts.items()}
