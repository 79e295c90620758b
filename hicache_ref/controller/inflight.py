"""Which host slots and device pages an issued transfer still uses, until its finish event fires.

The controller registers every issued transfer with the pages it reads or writes and the event
that marks its end. ``evict_host`` / ``evict_device`` ask ``check_not_in_flight`` first: freeing a
page that a pending copy still uses is the classic corruption (sglang#27444, bug classes 4, 10).
Completion is read with ``Event.query()``, which never blocks or synchronizes a stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hicache_ref.device.protocol import EventT
from hicache_ref.errors import InvariantViolation
from hicache_ref.pools.page_index import get_small_cpu_values

PoolKey = str
"""Names a pool in the tracker: ``"host"``, ``"draft_host"``, ``"device"``, ``"draft_device"``."""

INFLIGHT_BOUND = 100_000
"""Upper bound on tracked transfers; more means acks are never drained (TigerStyle bound)."""


@dataclass
class InflightTransfer:
    label: str
    node_ids: tuple[int, ...]
    finish_event: EventT
    pages: dict[PoolKey, frozenset[int]]


def pages_of(indices: torch.Tensor | None, page_size: int) -> frozenset[int]:
    """The page ids that ``indices`` touch (CPU tensors only; CUDA tensors are not inspected).

    Small tensors are read as Python ints (``get_small_cpu_values``): the same pages, without a
    ``torch.unique`` per call."""
    if indices is None or indices.numel() == 0 or indices.is_cuda:
        return frozenset()
    values = get_small_cpu_values(indices)
    if values is not None:
        return frozenset(value // page_size for value in values)
    return frozenset(int(p) for p in torch.unique(indices // page_size).tolist())


class InflightTracker:
    """Pages in use by issued transfers, pruned lazily as their finish events complete."""

    def __init__(self) -> None:
        self._transfers: list[InflightTransfer] = []

    def add(
        self,
        label: str,
        node_ids: Iterable[int],
        finish_event: EventT,
        pages: dict[PoolKey, frozenset[int]],
    ) -> None:
        if len(self._transfers) >= INFLIGHT_BOUND:
            self.prune()
        if len(self._transfers) >= INFLIGHT_BOUND:
            raise InvariantViolation(
                "INV-16",
                f"{INFLIGHT_BOUND} transfers in flight: acks are not being drained "
                "(call writing_check/loading_check)",
            )
        self._transfers.append(
            InflightTransfer(
                label, tuple(node_ids), finish_event, {k: v for k, v in pages.items() if v}
            )
        )

    def prune(self) -> None:
        self._transfers = [t for t in self._transfers if not t.finish_event.query()]

    def clear(self) -> None:
        self._transfers.clear()

    def snapshot(self) -> list[InflightTransfer]:
        """The tracked transfers, for rolling a failed launch back (``restore``)."""
        return list(self._transfers)

    def restore(self, saved: list[InflightTransfer]) -> None:
        """Track exactly ``saved`` again (entries pruned since were finished: keeping is a no-op)."""
        self._transfers[:] = saved

    def users_of(self, pool: PoolKey, pages: frozenset[int]) -> list[InflightTransfer]:
        self.prune()
        return [t for t in self._transfers if t.pages.get(pool, frozenset()) & pages]

    def check_not_in_flight(
        self, pool: PoolKey, pages: frozenset[int], inv_id: str, action: str
    ) -> None:
        """Raise ``InvariantViolation(inv_id)`` if a pending transfer still uses ``pages``."""
        # Verify no unacked transfer still reads or writes these pages (sglang#27444)
        users = self.users_of(pool, pages)
        if users:
            first = users[0]
            overlap = sorted(first.pages[pool] & pages)
            raise InvariantViolation(
                inv_id,
                f"{action} frees {pool} page(s) {overlap[:8]} while {first.label} for node(s) "
                f"{list(first.node_ids)} still uses them (wait for its ack before freeing)",
            )

    def __len__(self) -> int:
        return len(self._transfers)
