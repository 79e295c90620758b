"""The failure channels of hicache_ref, kept apart on purpose.

1. A capacity shortfall is a *value* (``None`` or ``HiCacheWriteFailure``), never an exception.
2. Misuse (bad input) raises a ``HiCacheInputError`` subclass of ``ValueError`` whose message
   names the rule that was broken and the legal values.
3. A broken invariant raises ``InvariantViolation`` naming the invariant id from
   ``specs/invariants.md``, the page/node/op involved and what would have been right.
4. A fault of the world under a correct call (a copy or kernel that fails to launch) raises a
   ``HiCacheFault`` subclass of ``RuntimeError``, e.g. ``TransferLaunchError``. It is neither of
   the two above: the caller did nothing wrong, and no rule of the protocol was broken. The call
   that raises it is rolled back (queues, acks, producer slot, in-flight state and whatever it
   allocated are as before it), so the caller may retry it once the device recovers.
"""

from __future__ import annotations


class HiCacheInputError(ValueError):
    """Bad input to a public API: the message names the rule and the fix."""


class PageAlignmentError(HiCacheInputError):
    """Indices that are not whole, aligned pages (INV-01)."""

    inv_id = "INV-01"


class LayerRangeError(HiCacheInputError):
    """A layer id outside ``[0, layer_num)``."""


class LayerOutsidePoolError(LayerRangeError):
    """A transfer addressing a layer its device pool does not have: its bytes land nowhere the
    oracle predicts (INV-06). Under the harness it is the controller under test that chose the
    layer id (a side pool's transfer mapped with another pool's layers), so a gate reports it
    under the invariant, not as bad input to the harness."""

    inv_id = "INV-06"


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


class IndexOutsidePoolError(HiCacheInputError):
    """A transfer addressing a row or slot past its pool's end: one this pool never handed out
    (INV-05). Under the harness it is the controller under test that built the indices, so a
    gate reports it under the invariant, not as bad input to the harness."""

    inv_id = "INV-05"


class MissingCpMetadataError(HiCacheInputError):
    """A CP load or evict for a node without ``cp_hicache`` metadata."""


class HiCacheSetupError(HiCacheInputError):
    """The world an implementation needs is missing: a source tree that cannot be fetched or
    unpacked, a file that is not where it must be. The message names what and how to fix it.

    A subclass of ``HiCacheInputError`` on purpose: a wrong environment is bad input to the
    harness, not a bug in it, so it travels the misuse channel; ``hicache-fuzz`` answers both with
    one line on stderr and exit status 2, and a campaign never counts it as a finding."""


class HiCacheFault(RuntimeError):
    """The device or a pool failed under a correct call; the call was rolled back (channel 4)."""


class TransferLaunchError(HiCacheFault):
    """A host<->device copy failed to launch inside ``start_writing``, ``start_loading`` or a
    per-layer CP submit. Queues, ack queues, the producer slot, the in-flight tracker and the
    pending per-layer writes are as before the call, and the call's own allocations are freed;
    copies already issued by the failed call have landed (the stream was synchronized), so no
    stale copy writes into a slot the caller frees next. ``__cause__`` is the launch's error."""

    def __init__(self, action: str, node_ids: list[int], cause: BaseException) -> None:
        self.action = action
        self.node_ids = list(node_ids)
        super().__init__(
            f"{action} for node(s) {self.node_ids[:8]}: a copy failed to launch "
            f"({type(cause).__name__}: {cause}); the call was rolled back, nothing was queued "
            "or acked (retry once the device recovers)"
        )


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
