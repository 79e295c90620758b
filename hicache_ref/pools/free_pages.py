"""Free-page bookkeeping shared by the device allocator and the host pools.

A ``PageFreeList`` owns a fixed range of page ids and says, for each, whether it is free. Which free
page is handed out next is the *allocation policy*:

- ``fifo``: the page freed longest ago first (a freed page is reused as late as possible);
- ``lifo``: the page freed most recently first (a freed page is reused at once, the upstream
  allocator's habit of prepending freed pages, and the policy that exposes use-after-free);
- ``random``: uniformly among the free pages, drawn from ``random.Random(seed)``.

Pages are split into owner classes ``page % num_owner_classes`` (CP ranks own pages round robin) so
``take_with_owners`` can hand out a page of a given owner without a scan. Membership, counts and
removal of a given page are O(1); the set of taken pages is kept by every take and push
(``taken_pages``: snapshots read it every step, so it is never rebuilt from the free lists); the fifo/lifo order lives in a deque whose stale entries are
dropped lazily (and compacted when they outnumber the live ones).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Literal

from hicache_ref.errors import HiCacheInputError, InvariantViolation, UnknownOptionError

AllocPolicy = Literal["fifo", "lifo", "random"]
ALLOC_POLICIES: tuple[AllocPolicy, ...] = ("fifo", "lifo", "random")


def check_alloc_policy(alloc_policy: str) -> AllocPolicy:
    """Return ``alloc_policy`` typed, or raise ``UnknownOptionError`` naming the legal ones."""
    if alloc_policy not in ALLOC_POLICIES:
        raise UnknownOptionError(
            f"unknown alloc_policy {alloc_policy!r}; legal values: {', '.join(ALLOC_POLICIES)}"
        )
    return alloc_policy


class _OwnerClass:
    """The free pages of one owner class: a live set with positions, plus a stamped order."""

    def __init__(self) -> None:
        self.live: list[int] = []
        self.position: dict[int, int] = {}
        self.order: deque[tuple[int, int]] = deque()

    def add(self, page: int, stamp: int) -> None:
        self.position[page] = len(self.live)
        self.live.append(page)
        self.order.append((stamp, page))

    def remove(self, page: int) -> None:
        index = self.position.pop(page)
        last = self.live.pop()
        if last != page:
            self.live[index] = last
            self.position[last] = index


class PageFreeList:
    """The free pages among ``page_ids``, handed out by ``alloc_policy``."""

    def __init__(
        self,
        page_ids: range,
        *,
        alloc_policy: str = "fifo",
        seed: int = 0,
        num_owner_classes: int = 1,
    ) -> None:
        if num_owner_classes < 1:
            raise HiCacheInputError(f"num_owner_classes must be >= 1, got {num_owner_classes}")
        self.page_ids = page_ids
        self.alloc_policy: AllocPolicy = check_alloc_policy(alloc_policy)
        self.seed = seed
        self.num_owner_classes = num_owner_classes
        self._rng = random.Random(seed)
        self._stamp: dict[int, int] = {}
        self._next_stamp = 0
        self._classes = [_OwnerClass() for _ in range(num_owner_classes)]
        self._taken: set[int] = set()
        self._taken_frozen: frozenset[int] | None = None
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Make every page free again, handed out in ascending order (random: reseeded)."""
        self._rng = random.Random(self.seed)
        self._stamp.clear()
        self._next_stamp = 0
        self._classes = [_OwnerClass() for _ in range(self.num_owner_classes)]
        self._taken = set()
        self._taken_frozen = None
        self.push(list(self.page_ids))

    def push(self, pages: Sequence[int]) -> None:
        """Mark ``pages`` free; among them the earlier ones are handed out earlier.

        The caller has checked that each page is managed here and not free already.
        """
        ordered: Iterable[int] = reversed(pages) if self.alloc_policy == "lifo" else pages
        self._taken_frozen = None
        for page in ordered:
            self._taken.discard(page)
            self._stamp[page] = self._next_stamp
            self._classes[page % self.num_owner_classes].add(page, self._next_stamp)
            self._next_stamp += 1
        for owner_class in self._classes:
            self._compact(owner_class)

    # ------------------------------------------------------------------ reads
    def is_managed(self, page: int) -> bool:
        """Whether ``page`` belongs to this free list's range at all."""
        return page in self.page_ids

    def is_free(self, page: int) -> bool:
        """Whether ``page`` is free now."""
        return page in self._classes[page % self.num_owner_classes].position

    def count(self) -> int:
        """Number of free pages."""
        return sum(len(owner_class.live) for owner_class in self._classes)

    def count_owned_by(self, owner: int) -> int:
        """Number of free pages of owner class ``owner``."""
        return len(self._classes[owner].live)

    def sorted_pages(self) -> list[int]:
        """The free pages, ascending."""
        return sorted(page for owner_class in self._classes for page in owner_class.live)

    def taken_pages(self) -> frozenset[int]:
        """The managed pages that are not free: kept by every take and push, not recomputed
        (the same frozenset until the next change)."""
        if self._taken_frozen is None:
            self._taken_frozen = frozenset(self._taken)
        return self._taken_frozen

    # ------------------------------------------------------------------ takes
    def take(self, num_pages: int) -> list[int] | None:
        """Hand out ``num_pages`` pages by policy, or ``None`` (nothing changed) when short."""
        if num_pages > self.count():
            return None
        return [self._take_one(self._pick_class()) for _ in range(num_pages)]

    def take_with_owners(self, owners: Sequence[int]) -> list[int] | None:
        """One page of owner class ``owners[i]`` per entry, or ``None`` (nothing changed) when
        some class has too few free pages."""
        needed = [0] * self.num_owner_classes
        for owner in owners:
            needed[owner] += 1
        if any(needed[c] > len(self._classes[c].live) for c in range(self.num_owner_classes)):
            return None
        return [self._take_one(self._classes[owner]) for owner in owners]

    def take_specific(self, pages: Sequence[int]) -> None:
        """Take exactly ``pages`` (the caller checked that each one is free)."""
        self._taken_frozen = None
        for page in pages:
            self._classes[page % self.num_owner_classes].remove(page)
            self._taken.add(page)

    def find_free_run(self, num_pages: int) -> list[int] | None:
        """The lowest run of ``num_pages`` consecutive free pages, or ``None`` if there is none."""
        run_start = None
        run_length = 0
        for page in self.page_ids:
            if self.is_free(page):
                if run_length == 0:
                    run_start = page
                run_length += 1
                if run_length == num_pages and run_start is not None:
                    return list(range(run_start, run_start + num_pages))
            else:
                run_length = 0
        return None

    # ------------------------------------------------------------------ internals
    def _is_live_entry(self, entry: tuple[int, int]) -> bool:
        stamp, page = entry
        return self.is_free(page) and self._stamp.get(page) == stamp

    def _peek(self, owner_class: _OwnerClass) -> tuple[int, int] | None:
        """Drop stale entries at the policy's end of the order; return the live one there."""
        order = owner_class.order
        if self.alloc_policy == "lifo":
            while order and not self._is_live_entry(order[-1]):
                order.pop()
            return order[-1] if order else None
        while order and not self._is_live_entry(order[0]):
            order.popleft()
        return order[0] if order else None

    def _pick_class(self) -> _OwnerClass:
        """The class holding the page the policy hands out next (some page is free)."""
        if self.alloc_policy == "random":
            draw = self._rng.randrange(self.count())
            for owner_class in self._classes:
                if draw < len(owner_class.live):
                    return owner_class
                draw -= len(owner_class.live)
        best: _OwnerClass | None = None
        best_stamp = 0
        for owner_class in self._classes:
            head = self._peek(owner_class)
            if head is None:
                continue
            if best is None or self._is_handed_out_before(head[0], best_stamp):
                best, best_stamp = owner_class, head[0]
        if best is None:
            raise InvariantViolation(
                "INV-05", f"free list counts {self.count()} free pages but none is live"
            )
        return best

    def _is_handed_out_before(self, stamp: int, other_stamp: int) -> bool:
        """fifo hands out the older stamp first, lifo the newer."""
        return stamp > other_stamp if self.alloc_policy == "lifo" else stamp < other_stamp

    def _take_one(self, owner_class: _OwnerClass) -> int:
        if self.alloc_policy == "random":
            page = owner_class.live[self._rng.randrange(len(owner_class.live))]
        else:
            head = self._peek(owner_class)
            if head is None:
                raise InvariantViolation(
                    "INV-05", "an owner class with live pages has no live entry"
                )
            page = head[1]
        owner_class.remove(page)
        self._taken.add(page)
        self._taken_frozen = None
        return page

    def _compact(self, owner_class: _OwnerClass) -> None:
        """Drop stale order entries once they outnumber live pages (bounds the deque)."""
        if len(owner_class.order) <= 2 * len(owner_class.live) + 16:
            return
        owner_class.order = deque(e for e in owner_class.order if self._is_live_entry(e))
