"""Storage operations: a backup (``StorageOperation``) and a prefetch (``PrefetchOperation``).

A prefetch owns a *bounce buffer* of host slots that the tree allocated for ``n`` tokens. When
the prefetch ends, the buffer splits into four ranges, and each slot must be released exactly
once (INV-19 prefetch-ranges):

    [0 : matched)                freed by the tree (those tokens were cached meanwhile)
    [matched : min_completed)    inserted into the tree (now owned by radix nodes)
    [min_completed : completed)  released by the tree (another TP rank fetched fewer pages)
    [completed : n)              released by the controller: the non-hit tail at hit-query
                                 time, the untransferred rest after the transfer, or all of it
                                 when the prefetch is revoked

``completed`` (``completed_tokens``) is a page multiple, counts only pages whose bytes have
landed (sglang#8901), and never changes once the operation is terminated, so the tree's and the
controller's views of the split agree (bug class 13, sglang#13483).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.storage.hashing import Token

_op_ids = itertools.count()
_op_ids_lock = threading.Lock()


def _next_op_id() -> int:
    with _op_ids_lock:
        return next(_op_ids)


class StorageOperation:
    """A backup of host pages to storage, or the base of a prefetch.

    ``prefix_keys`` is kept as a tuple: SGLang extended the operation's own list in place, so a
    retried or reused operation sent ever longer prefix chains (bug class 20).
    """

    def __init__(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[Token],
        last_hash: str | None = None,
        hash_value: Sequence[str] | None = None,
        prefix_keys: Sequence[str] | None = None,
    ) -> None:
        self.host_indices = host_indices
        self.token_ids = token_ids
        self.last_hash = last_hash
        self.completed_tokens = 0
        self.hash_value: list[str] = list(hash_value) if hash_value is not None else []
        self.prefix_keys: tuple[str, ...] | None = (
            tuple(prefix_keys) if prefix_keys is not None else None
        )
        self.id = _next_op_id()

    def __lt__(self, other: StorageOperation) -> bool:
        return self.id < other.id


@dataclass(frozen=True)
class ReleasedRange:
    """Bounce-buffer tokens ``[start, end)`` handed back by ``releaser``."""

    start: int
    end: int
    releaser: str


class PrefetchOperation(StorageOperation):
    """A prefetch from storage into a pre-allocated bounce buffer (SGLang's ``PrefetchOperation``).

    ``increment`` and ``mark_terminate`` share one lock, so once ``mark_terminate`` returned no
    increment can land: ``completed_tokens`` is frozen from then on (INV-19).
    """

    def __init__(
        self,
        request_id: str,
        host_indices: torch.Tensor,
        token_ids: Sequence[Token],
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
        *,
        page_size: int = 1,
    ) -> None:
        super().__init__(host_indices, token_ids, last_hash, prefix_keys=prefix_keys)
        self.request_id = request_id
        self.page_size = page_size
        self.bounce_buffer_tokens = int(host_indices.numel())
        self.start_time = time.monotonic()
        self._lock = threading.Lock()
        self._terminated_flag = False
        self._frozen_completed_tokens: int | None = None
        self._released: list[ReleasedRange] = []

    def increment(self, num_tokens: int) -> bool:
        """Count ``num_tokens`` more landed tokens; False (and no change) once terminated."""
        with self._lock:
            if self._terminated_flag:
                return False
            # Verify progress moves in whole pages inside the buffer (INV-19)
            if num_tokens < 0 or num_tokens % self.page_size != 0:
                raise InvariantViolation(
                    "INV-19",
                    f"prefetch {self.request_id!r} op {self.id}: increment({num_tokens}) is not "
                    f"a whole number of pages of {self.page_size} (count a page after its bytes land)",
                )
            if self.completed_tokens + num_tokens > self.host_indices.numel():
                raise InvariantViolation(
                    "INV-19",
                    f"prefetch {self.request_id!r} op {self.id}: completed_tokens would reach "
                    f"{self.completed_tokens + num_tokens} past the {self.host_indices.numel()} "
                    "slots being filled",
                )
            self.completed_tokens += num_tokens
            return True

    def mark_terminate(self) -> None:
        """Stop the prefetch: from now on ``completed_tokens`` cannot change."""
        with self._lock:
            self._terminated_flag = True
            if self._frozen_completed_tokens is None:
                self._frozen_completed_tokens = self.completed_tokens

    def is_terminated(self) -> bool:
        return self._terminated_flag

    @property
    def frozen_completed_tokens(self) -> int | None:
        """``completed_tokens`` at the first ``mark_terminate``; None while running."""
        return self._frozen_completed_tokens

    def check_completed_frozen(self) -> None:
        """Raise unless ``completed_tokens`` still equals its value at termination (INV-19)."""
        frozen = self._frozen_completed_tokens
        if frozen is not None and self.completed_tokens != frozen:
            raise InvariantViolation(
                "INV-19",
                f"prefetch {self.request_id!r} op {self.id}: completed_tokens changed from "
                f"{frozen} to {self.completed_tokens} after termination (the tree already split "
                "the bounce buffer at the old value)",
            )

    # -- the release ledger ------------------------------------------------------------------------
    def record_release(self, start: int, end: int, releaser: str) -> None:
        """Note that bounce-buffer tokens ``[start, end)`` were released; each at most once."""
        if start == end:
            return
        # Verify a whole-page range inside the buffer, disjoint from every earlier release
        if not (0 <= start < end <= self.bounce_buffer_tokens) or (
            start % self.page_size or end % self.page_size
        ):
            raise InvariantViolation(
                "INV-19",
                f"prefetch {self.request_id!r} op {self.id}: release [{start}:{end}) by "
                f"{releaser} is not whole pages inside the {self.bounce_buffer_tokens}-token buffer",
            )
        with self._lock:
            for earlier in self._released:
                if start < earlier.end and earlier.start < end:
                    raise InvariantViolation(
                        "INV-19",
                        f"prefetch {self.request_id!r} op {self.id}: [{start}:{end}) released by "
                        f"{releaser} overlaps [{earlier.start}:{earlier.end}) released by "
                        f"{earlier.releaser} (a slot released twice, sglang#13483)",
                    )
            self._released.append(ReleasedRange(start, end, releaser))

    def released_ranges(self, releaser: str | None = None) -> list[ReleasedRange]:
        """Releases so far, sorted by start, optionally only ``releaser``'s."""
        with self._lock:
            chosen = [r for r in self._released if releaser is None or r.releaser == releaser]
        return sorted(chosen, key=lambda r: r.start)

    def check_controller_released_tail(self) -> None:
        """Raise unless the controller released exactly ``[completed_tokens, n)`` (INV-19)."""
        ranges = self.released_ranges("controller")
        covered = sum(r.end - r.start for r in ranges)
        expected = self.bounce_buffer_tokens - self.completed_tokens
        contiguous = all(a.end == b.start for a, b in itertools.pairwise(ranges))
        starts_at_completed = not ranges or ranges[0].start == self.completed_tokens
        ends_at_buffer_end = not ranges or ranges[-1].end == self.bounce_buffer_tokens
        if covered != expected or not (contiguous and starts_at_completed and ends_at_buffer_end):
            raise InvariantViolation(
                "INV-19",
                f"prefetch {self.request_id!r} op {self.id}: the controller released "
                f"{[(r.start, r.end) for r in ranges]} but must release exactly "
                f"[{self.completed_tokens}:{self.bounce_buffer_tokens})",
            )


@dataclass(frozen=True)
class PrefetchSplit:
    """The four token ranges a finished prefetch's bounce buffer splits into (INV-19)."""

    freed_by_tree: tuple[int, int]
    inserted: tuple[int, int]
    released_by_tree: tuple[int, int]
    released_by_controller: tuple[int, int]


def is_valid_prefetch_split(
    total_tokens: int,
    matched_tokens: int,
    min_completed_tokens: int,
    completed_tokens: int,
    page_size: int,
) -> bool:
    """Whether the cut points are ordered inside the buffer and whole pages.

    pre: page_size >= 1
    pre: total_tokens >= 0
    post: (not __return__) or 0 <= matched_tokens <= min_completed_tokens <= completed_tokens
    """
    assert page_size >= 1
    assert total_tokens >= 0
    ordered = 0 <= matched_tokens <= min_completed_tokens <= completed_tokens <= total_tokens
    cuts = (matched_tokens, min_completed_tokens, completed_tokens)
    return ordered and all(cut % page_size == 0 for cut in cuts)


def compute_prefetch_split(
    total_tokens: int, matched_tokens: int, min_completed_tokens: int, completed_tokens: int
) -> PrefetchSplit:
    """The four ranges; together they cover ``[0, total_tokens)`` exactly once.

    pre: 0 <= matched_tokens <= min_completed_tokens <= completed_tokens <= total_tokens
    post: __return__.released_by_controller[1] == total_tokens
    """
    assert 0 <= matched_tokens <= min_completed_tokens <= completed_tokens <= total_tokens
    return PrefetchSplit(
        freed_by_tree=(0, matched_tokens),
        inserted=(matched_tokens, min_completed_tokens),
        released_by_tree=(min_completed_tokens, completed_tokens),
        released_by_controller=(completed_tokens, total_tokens),
    )
