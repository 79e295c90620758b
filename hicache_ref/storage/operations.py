"""Storage operations: a backup (``StorageOperation``), a prefetch (``PrefetchOperation``) and
the progress messages of a prefetch (``PrefetchAck``), shaped as SGLang 0.5.23 has them.

A prefetch is created without host slots: the hit query decides how many leading pages storage
holds (the MIN over ranks), and only then does the tree give it a *bounce buffer* of exactly
that many tokens. Once its transfer ends, the buffer ``[0, n)`` splits into ranges that are each
released exactly once (INV-19 prefetch-ranges):

    [0 : matched)        freed by the tree (those tokens were cached meanwhile)
    [matched : completed) inserted into the tree (now owned by radix nodes)
    [completed : n)      released after the request's final ack (the IO thread owns them
                         until then, INV-23)

``completed_tokens`` is the *published* progress: the tree sets it from the rank-reduced acks
(INV-21). It is a page multiple that never shrinks and never changes once the operation is
terminated, so the tree and the release of the tail agree on where the buffer splits.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.storage.hashing import Token
from hicache_ref.storage.pool_transfers import PoolTransfer

_op_ids = itertools.count()
_op_ids_lock = threading.Lock()


def _next_op_id() -> int:
    with _op_ids_lock:
        return next(_op_ids)


class StorageOperation:
    """A backup of host pages to storage, or the base of a prefetch.

    ``prefix_keys`` is kept as a tuple: SGLang 0.5.10 extended the operation's own list in
    place, so a retried or reused operation sent ever longer prefix chains (bug class 20).
    ``epoch`` is the storage tier's epoch when the operation was created (INV-24).
    """

    def __init__(
        self,
        host_indices: torch.Tensor | None,
        token_ids: Sequence[Token],
        last_hash: str | None = None,
        hash_value: Sequence[str] | None = None,
        prefix_keys: Sequence[str] | None = None,
        *,
        epoch: int = 0,
        pool_transfers: Sequence[PoolTransfer] | None = None,
    ) -> None:
        self.host_indices = host_indices
        self.token_ids = token_ids
        self.last_hash = last_hash
        self.completed_tokens = 0
        self.hash_value: list[str] = list(hash_value) if hash_value is not None else []
        self.prefix_keys: tuple[str, ...] | None = (
            tuple(prefix_keys) if prefix_keys is not None else None
        )
        self.epoch = epoch
        self.pool_transfers: list[PoolTransfer] | None = (
            list(pool_transfers) if pool_transfers is not None else None
        )
        """The tree's ``extra_pools``: an independent side pool's window (SGLang's name)."""
        self.id = _next_op_id()

    def __lt__(self, other: StorageOperation) -> bool:
        return self.id < other.id


@dataclass(frozen=True)
class ReleasedRange:
    """Bounce-buffer tokens ``[start, end)`` handed back by ``releaser``."""

    start: int
    end: int
    releaser: str


def _lock_point(name: str) -> None:
    """A storage thread of a harness world with schedule points parks before it takes the
    operation's lock (its ``park_at_point``; the harness decides whether a ``lock`` is a point
    there); the tree's thread, and any thread outside such a world, passes at once."""
    park = getattr(threading.current_thread(), "park_at_point", None)
    if park is not None:
        park("lock", name)


class PrefetchOperation(StorageOperation):
    """A prefetch from storage (SGLang 0.5.23's ``PrefetchOperation``).

    ``mark_terminate`` freezes ``completed_tokens`` under the operation's lock: from then on the
    published progress cannot move (INV-19), whatever acks are still on their way.
    """

    _LOCK_NAME = "PrefetchOperation._lock"

    def __init__(
        self,
        request_id: str,
        token_ids: Sequence[Token],
        last_hash: str | None = None,
        prefix_keys: Sequence[str] | None = None,
        *,
        page_size: int = 1,
        epoch: int = 0,
        pool_transfers: Sequence[PoolTransfer] | None = None,
    ) -> None:
        self.request_id = request_id
        self.page_size = page_size
        self._lock = threading.Lock()
        self._terminated_flag = False
        self._frozen_completed_tokens: int | None = None
        self._completed = 0
        self._released: list[ReleasedRange] = []
        self.storage_hit_count = 0
        self.hit_known = False
        """Set by the hit query once the rank-reduced hit count is in ``storage_hit_count``."""
        self.all_hash_values: list[str] | None = None
        self.query_pool_hit_pages: dict[str, int] = {}
        """Buffer mode: each pool's rank-agreed verdict, the leading pages every rank's backend
        answered (none where a rank had no answer); the tree heals its beliefs from it."""
        self.restorable_prefix_pages: list[int] | None = None
        """With a window: the prefix lengths (pages) this rank's L3 can restore, window too."""
        self.start_time = time.monotonic()
        super().__init__(
            None,
            token_ids,
            last_hash,
            prefix_keys=prefix_keys,
            epoch=epoch,
            pool_transfers=pool_transfers,
        )

    # -- published progress ------------------------------------------------------------------------
    @property
    def completed_tokens(self) -> int:
        """Tokens of the bounce buffer every rank has filled, as the tree last applied them."""
        return self._completed

    @completed_tokens.setter
    def completed_tokens(self, value: int) -> None:
        with self._lock:
            self._check_progress(value)
            self._completed = value

    def _check_progress(self, value: int) -> None:
        # Verify published progress is whole pages and never shrinks (INV-19)
        if value % self.page_size or value < self._completed:
            raise InvariantViolation(
                "INV-19",
                f"prefetch {self.request_id!r} op {self.id}: completed_tokens "
                f"{self._completed} -> {value} (it only grows, in whole pages of {self.page_size})",
            )
        # Verify progress is frozen once terminate_prefetch returned (INV-19)
        frozen = self._frozen_completed_tokens
        if frozen is not None and value != frozen:
            raise InvariantViolation(
                "INV-19",
                f"prefetch {self.request_id!r} op {self.id}: completed_tokens {frozen} -> "
                f"{value} after termination (the tree already split the bounce buffer at "
                f"{frozen}; apply no ack to a terminated prefetch)",
            )

    def mark_terminate(self) -> None:
        """Stop the prefetch: from now on ``completed_tokens`` cannot change."""
        with self._lock:
            self._terminated_flag = True
            if self._frozen_completed_tokens is None:
                self._frozen_completed_tokens = self._completed

    def is_terminated(self) -> bool:
        _lock_point(self._LOCK_NAME)  # a storage thread's look at termination
        with self._lock:
            return self._terminated_flag

    @property
    def frozen_completed_tokens(self) -> int | None:
        """``completed_tokens`` at the first ``mark_terminate``; None while running."""
        return self._frozen_completed_tokens

    @property
    def bounce_buffer_tokens(self) -> int:
        """Tokens of the bounce buffer the tree gave this prefetch (0 before it has one)."""
        return 0 if self.host_indices is None else int(self.host_indices.numel())

    # -- the release ledger ------------------------------------------------------------------------
    def record_release(self, start: int, end: int, releaser: str) -> None:
        """Note that bounce-buffer tokens ``[start, end)`` went back; each token at most once."""
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


@dataclass
class PrefetchAck:
    """One progress message of a prefetch (SGLang 0.5.23's ``PrefetchAck``).

    The IO step emits one per batch with the cumulative ``completed_tokens`` of this rank, even
    after a failure or a termination (every rank emits the same number), and a last one with
    ``completed_req=True``. The sync step replaces ``completed_tokens`` by the MIN over ranks
    before the ack reaches ``ack_prefetch_queue`` (INV-21).
    """

    rid: str
    operation: PrefetchOperation
    completed_tokens: int | None = None
    pool_hits: Mapping[str, int] | None = None
    completed_req: bool | None = None


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
    """The ranges; together they cover ``[0, total_tokens)`` exactly once.

    With 0.5.23's rank-reduced progress ``min_completed_tokens == completed_tokens``, so the
    range released by the tree is empty; 0.5.10 published rank-local progress and needed it.

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
