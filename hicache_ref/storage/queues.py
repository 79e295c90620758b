"""``BoundedQueue``: the storage tier's thread-safe FIFO with a bound it checks (TigerStyle).

A put beyond the bound raises ``StorageQueueOverflow`` instead of blocking: a full storage queue
means its consumer (a storage thread, or the scheduler draining acks and releases) has stopped,
and blocking the scheduler on it would turn that bug into a hang. Reads never block forever:
``poll`` waits at most ``timeout_s`` and also returns early after ``wake_all``, which is how
storage threads notice a stop request promptly.

The reading surface matches what SGLang's scheduler calls on a ``queue.Queue``
(``qsize``, ``empty``, ``get``, ``get_nowait``, ``put``).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Generic, TypeVar

from hicache_ref.errors import HiCacheInputError

T = TypeVar("T")


class StorageQueueOverflow(HiCacheInputError):
    """A storage queue reached its bound: its consumer is not draining it."""


class BoundedQueue(Generic[T]):
    """A FIFO of at most ``capacity`` items, safe to share between threads."""

    def __init__(self, name: str, capacity: int, drain_hint: str) -> None:
        if capacity < 1:
            raise HiCacheInputError(f"queue {name!r} needs capacity >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.drain_hint = drain_hint
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._wakeups = 0

    def put(self, item: T) -> None:
        """Append ``item``; raise ``StorageQueueOverflow`` if the queue is at its bound. From a
        gated storage thread of a harness world with schedule points, the put is a point the
        thread parks at first (``harness/schedule/points.py``: its ``park_at_point``), and the
        item, once visible, is told to that thread's ``note_put``."""
        park = getattr(threading.current_thread(), "park_at_point", None)
        if park is not None:
            park("put", self.name)
        with self._cond:
            # Verify the bound: beyond it the consumer has stopped draining
            if len(self._items) >= self.capacity:
                raise StorageQueueOverflow(
                    f"{self.name} holds {self.capacity} items, its bound ({self.drain_hint})"
                )
            self._items.append(item)
            self._cond.notify()
        note = getattr(threading.current_thread(), "note_put", None)
        if note is not None:  # the harness's gated thread: it tells its gate what is visible
            note(item)

    put_nowait = put

    def get_nowait(self) -> T:
        """Pop the oldest item; ``queue.Empty`` if there is none."""
        with self._cond:
            if not self._items:
                raise queue.Empty
            return self._items.popleft()

    def get(self, block: bool = True, timeout: float | None = None) -> T:
        """Pop the oldest item, waiting up to ``timeout`` seconds; ``queue.Empty`` if none."""
        if not block:
            return self.get_nowait()
        item = self.poll(timeout if timeout is not None else 1.0)
        if item is None:
            raise queue.Empty
        return item

    def poll(self, timeout_s: float) -> T | None:
        """The oldest item, or None after ``timeout_s`` seconds or a ``wake_all``."""
        with self._cond:
            wakeups = self._wakeups
            if not self._items:
                self._cond.wait_for(
                    lambda: bool(self._items) or self._wakeups != wakeups, timeout=timeout_s
                )
            return self._items.popleft() if self._items else None

    def wait_nonempty(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an item (or a ``wake_all``); whether one is queued."""
        with self._cond:
            wakeups = self._wakeups
            if not self._items:
                self._cond.wait_for(
                    lambda: bool(self._items) or self._wakeups != wakeups, timeout=timeout_s
                )
            return bool(self._items)

    def wake_all(self) -> None:
        """Return every waiting ``poll`` now (used to stop storage threads promptly)."""
        with self._cond:
            self._wakeups += 1
            self._cond.notify_all()

    def clear(self) -> list[T]:
        """Remove and return every queued item, oldest first."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def snapshot(self) -> list[T]:
        """The queued items, oldest first, left in place (for checkers and tests)."""
        with self._cond:
            return list(self._items)

    def qsize(self) -> int:
        # no lock: a deque's length is one atomic read, and every step and check asks
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def __len__(self) -> int:
        return self.qsize()
