"""The storage oracle's fixed world: ranks, the operations a case may issue, and planted bugs.

Everything here is frozen and hashable, because it rides inside every ``StorageState``. The
world has one chain of ``pages`` page keys (key ``i`` commits to the prefix ``[0, i]``,
``keys.compute_chain_keys``); an operation is a backup or a prefetch of the chain's first
``OpSpec.pages`` pages. Each rank has its own key namespace (INV-28), so L3 is one tuple of page
tags per rank, seeded by ``preloaded``.

A ``StorageVariant`` with one flag set is a *planted bug*: it changes one thread's code or one
tree rule, and ``PLANTED_STORAGE_BUGS`` names the invariant whose check must report it. The
first five are the windows of the interleavings issue (a backup ack before its write, an IO loop
that ignores termination, progress counted past a hole, an exception that skips the final ack,
an old-epoch thread after reset); ``WINDOWS`` maps each window property to the id that checks it
here until the window ids of that issue are in ``specs/invariants.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from hicache_ref.errors import HiCacheInputError, UnknownOptionError

OpKind = Literal["prefetch", "backup"]

KEYS_MAX = 1 << 16
"""Bound on the key universe of a world given by ``key_parents`` (a harness's, grown per op)."""

OUTCOMES = ("ok", "hole", "raise", "defer", "fail")
"""Per-call outcomes a backend point may draw (``Advance.outcome``); see ``ops.Advance``."""


@dataclass(frozen=True)
class OpSpec:
    """One operation a case may issue once per epoch: a prefetch or a backup of ``pages`` pages,
    the keys ``keys`` (key ids of the world; ``()``: the chain's first ``pages`` keys)."""

    kind: OpKind
    pages: int
    keys: tuple[int, ...] = ()


@dataclass(frozen=True)
class StorageVariant:
    """Planted bugs, one flag each; the comment names the invariant that must catch it."""

    backup_ack_before_write: bool = False
    """The backup thread puts its ack (all pages) before its ``batch_set`` calls (INV-26)."""
    io_ignores_termination: bool = False
    """The IO loop does not act on termination between batches: it reads on (INV-19)."""
    io_counts_past_hole: bool = False
    """A page missing from a batch is skipped (``continue``) and later pages still count
    (INV-19)."""
    io_raise_skips_final_ack: bool = False
    """An exception in ``batch_get`` escapes the IO loop: the thread dies without the final ack
    (INV-25, sglang#27501)."""
    reset_keeps_old_thread: bool = False
    """``reset`` does not join the storage threads: a parked old-epoch thread runs on (INV-24,
    sglang#36882)."""
    progress_not_reduced: bool = False
    """The sync thread publishes its rank's own progress, not the MIN over ranks (INV-21,
    sglang#27010)."""
    hit_sync_per_batch: bool = False
    """The hit query reduces once per batch: the collective count follows rank-local hits
    (INV-20, sglang#30760)."""
    terminate_releases_tail: bool = False
    """``terminate`` releases the unpublished rest of the bounce buffer at once, while the IO
    may still write it (INV-23, sglang#27550 / #31668)."""
    backup_skips_failed_batch: bool = False
    """A backup goes on past a failed batch: L3 holds a page after a hole (INV-31)."""
    reset_keeps_release_queue: bool = False
    """``reset`` keeps ``host_mem_release_queue`` (INV-24, sglang#26009)."""
    clear_wipes_every_namespace: bool = False
    """A rank's ``clear`` removes every rank's pages (INV-28, sglang#32693)."""
    detach_with_work_in_flight: bool = False
    """``detach`` stops the threads while operations are queued or mid-way (INV-24,
    sglang#20746)."""

    def enabled_flags(self) -> tuple[str, ...]:
        """The names of the flags that are set, in declaration order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


PLANTED_STORAGE_BUGS: dict[str, str] = {
    "backup_ack_before_write": "INV-26",
    "io_ignores_termination": "INV-19",
    "io_counts_past_hole": "INV-19",
    "io_raise_skips_final_ack": "INV-25",
    "reset_keeps_old_thread": "INV-24",
    "progress_not_reduced": "INV-21",
    "hit_sync_per_batch": "INV-20",
    "terminate_releases_tail": "INV-23",
    "backup_skips_failed_batch": "INV-31",
    "reset_keeps_release_queue": "INV-24",
    "clear_wipes_every_namespace": "INV-28",
    "detach_with_work_in_flight": "INV-24",
}
"""Each planted bug and the invariant id whose check must report it."""

WINDOWS: dict[str, str] = {
    "acked backup readable": "INV-26",
    "no read after an observed termination": "INV-19",
    "progress never past a hole": "INV-19",
    "exactly one final ack": "INV-25",
    "no old-epoch thread after reset": "INV-24",
}
"""The window properties of the interleavings issue and the id each is reported under."""


def make_storage_variant(*flags: str) -> StorageVariant:
    """A variant with the named flags set; an unknown name raises ``UnknownOptionError``."""
    known = {f.name for f in fields(StorageVariant)}
    for flag in flags:
        # Verify the flag exists, so a typo does not silently check the correct protocol
        if flag not in known:
            raise UnknownOptionError(f"unknown storage variant {flag!r}; legal: {sorted(known)}")
    return StorageVariant(**{flag: True for flag in flags})


@dataclass(frozen=True)
class StorageConfig:
    """One small world of the storage tier.

    ``ranks`` TP ranks (each with its own namespace and four threads), a chain of ``pages``
    pages (or, in a world that ``grows``, ``pages`` keys where key ``k`` follows key
    ``key_parents[k]`` in its chain, -1 at a chain's head: a harness's many chains, added with
    its ops by ``universe``), ``batch_pages`` pages per backend call (``STORAGE_BATCH_SIZE``), the operations
    ``ops`` (each issued at most once per epoch), ``preloaded[r]`` leading pages already in rank
    ``r``'s L3, at most ``max_faults`` non-ok call outcomes and lost pages in all, at most
    ``max_resets`` new epochs (resets and re-attaches); ``terminations``, ``detach`` and ``clear`` admit those tree ops.
    ``page_points``: the IO lands each page a read returned at a point of its own (``land``, the
    harness's ``page_write``), checking termination before each, instead of the whole batch at
    its ``get``. ``lock_points``: each termination check under the operation's lock is a point
    of its own (the harness's ``lock``): the hit query's ``check`` before its query, and the IO's
    per-batch ``check`` and per-page ``recheck``, so a termination lands right before a look.
    """

    ranks: int = 1
    pages: int = 2
    key_parents: tuple[int, ...] = ()
    grows: bool = False
    batch_pages: int = 1
    ops: tuple[OpSpec, ...] = (OpSpec("prefetch", 2),)
    preloaded: tuple[int, ...] = ()
    max_faults: int = 1
    max_resets: int = 1
    terminations: bool = True
    detach: bool = False
    clear: bool = False
    page_points: bool = False
    lock_points: bool = False
    variant: StorageVariant = field(default_factory=StorageVariant)

    def __post_init__(self) -> None:
        # Verify the world is one the model can hold (positive sizes, ops within the chain)
        limit, least = (KEYS_MAX, 0) if self.grows else (8, 1)
        if not 1 <= self.ranks <= 4 or not least <= self.pages <= limit or self.batch_pages < 1:
            raise HiCacheInputError(
                f"ranks={self.ranks} must be in [1, 4], pages={self.pages} in [1, {limit}], "
                f"batch_pages={self.batch_pages} >= 1"
            )
        if self.grows and len(self.key_parents) != self.pages:
            raise HiCacheInputError(
                f"key_parents has {len(self.key_parents)} entries; need one per key ({self.pages})"
            )
        if (not self.ops and not self.grows) or any(
            not 1 <= op.pages <= self.pages for op in self.ops
        ):
            raise HiCacheInputError(
                f"ops {self.ops} must be at least one, each of 1..pages={self.pages} pages"
            )
        if any(
            op.keys and (len(op.keys) != op.pages or max(op.keys) >= self.pages) for op in self.ops
        ):
            raise HiCacheInputError(f"ops {self.ops}: each op's keys are its pages' key ids")
        if any(op.kind not in ("prefetch", "backup") for op in self.ops):
            raise HiCacheInputError(f"op kinds must be 'prefetch' or 'backup': {self.ops}")
        if self.preloaded and (
            len(self.preloaded) != self.ranks
            or any(not 0 <= n <= self.pages for n in self.preloaded)
        ):
            raise HiCacheInputError(
                f"preloaded={self.preloaded} needs one count in [0, {self.pages}] per rank"
            )
        if self.max_faults < 0 or self.max_resets < 0:
            raise HiCacheInputError("max_faults and max_resets must be >= 0")

    def preloaded_pages(self, rank: int) -> int:
        return self.preloaded[rank] if self.preloaded else 0

    def op_keys(self, op: int) -> tuple[int, ...]:
        """The key id of every page of op ``op``, in page order."""
        spec = self.ops[op]
        return spec.keys or tuple(range(spec.pages))

    def parent_key(self, key: int) -> int:
        """The key before ``key`` in its chain (-1: the chain's head)."""
        return self.key_parents[key] if self.grows else key - 1

    def describe(self) -> str:
        """One line naming the world, for CLI output and failure messages."""
        bugs = ",".join(self.variant.enabled_flags()) or "none"
        ops = ",".join(f"{op.kind}:{op.pages}" for op in self.ops)
        return (
            f"ranks={self.ranks} pages={self.pages} batch={self.batch_pages} ops=[{ops}] "
            f"preloaded={self.preloaded or (0,) * self.ranks} faults<={self.max_faults} "
            f"resets<={self.max_resets} terminate={self.terminations} detach={self.detach} "
            f"clear={self.clear} planted={bugs}"
        )
