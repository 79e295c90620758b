"""The three failure channels of hicache_ref, kept apart on purpose.

1. A capacity shortfall is a *value* (``None`` or ``HiCacheWriteFailure``), never an exception.
2. Misuse (bad input) raises a ``HiCacheInputError`` subclass of ``ValueError`` whose message
   names the rule that was broken and the legal values.
3. A broken invariant raises ``InvariantViolation`` naming the invariant id from
   ``specs/invariants.md``, the page/node/op involved and what would have been right.
"""

from __future__ import annotations


class HiCacheInputError(ValueError):
    """Bad input to a public API: the message names the rule and the fix."""


class PageAlignmentError(HiCacheInputError):
    """Indices that are not whole, aligned pages (INV-01)."""

    inv_id = "INV-01"


class LayerRangeError(HiCacheInputError):
    """A layer id outside ``[0, layer_num)``."""


class UnknownOptionError(HiCacheInputError):
    """An unknown layout, io backend, write policy, pool kind or allocation policy."""


class DraftPoolPairError(HiCacheInputError):
    """A draft device pool given without its host pool, or the reverse."""


class DoubleFreeError(HiCacheInputError):
    """Freeing a slot or page that is free already (INV-05)."""

    inv_id = "INV-05"


class ForeignSlotError(HiCacheInputError):
    """Freeing a slot or page that this pool never handed out (INV-05)."""

    inv_id = "INV-05"


class MissingCpMetadataError(HiCacheInputError):
    """A CP load or evict for a node without ``cp_hicache`` metadata."""


class HiCacheSetupError(HiCacheInputError):
    """The world an implementation needs is missing: a source tree that cannot be fetched or
    unpacked, a file that is not where it must be. The message names what and how to fix it.

    A subclass of ``HiCacheInputError`` on purpose: a wrong environment is bad input to the
    harness, not a bug in it, so it travels the misuse channel; ``hicache-fuzz`` answers both with
    one line on stderr and exit status 2, and a campaign never counts it as a finding."""


class InvariantViolation(AssertionError):
    """A broken invariant: ``INV-xx violated: <what> (<what would be right>)``.

    It subclasses ``AssertionError`` so test frameworks report it as a failed check,
    but it is raised explicitly and survives ``python -O``.
    """

    def __init__(self, inv_id: str, message: str) -> None:
        if not inv_id.startswith("INV-"):
            raise HiCacheInputError(f"invariant ids look like 'INV-07', got {inv_id!r}")
        self.inv_id = inv_id
        self.detail = message
        super().__init__(f"{inv_id} violated: {message}")


def is_violation_of(exc: BaseException, inv_id: str) -> bool:
    """Whether ``exc`` is an ``InvariantViolation`` of ``inv_id``."""
    return isinstance(exc, InvariantViolation) and exc.inv_id == inv_id
