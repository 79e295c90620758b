"""Invariants of the HiCache controller: validated records and one checker per invariant id.

In the order data flows through the protocol:

- write: ``HiCacheWriteReservation`` (host slots reserved, INV-13/INV-01) carrying a
  ``CpHiCacheNodeMetadata`` (INV-13), or a ``HiCacheWriteFailure`` value (INV-17);
  per-layer progress in ``HiCacheLayerWriteState`` (INV-04 before the ack, INV-12, INV-15);
- ack: one undrained write ack per node (INV-02), FIFO drain (INV-09), identical rows on
  every rank (INV-14), acked once (INV-16);
- evict: nothing freed while a copy uses it (INV-07 host, INV-08 device), slots conserved
  (INV-05);
- load: owner pattern replayed (INV-03), producer slots (INV-10), layer gate (INV-11),
  finish after every layer (INV-04), bytes as written (INV-06);
- storage prefetch accounting (INV-19); reset leaves nothing behind (INV-18).

``rules`` holds the pure rules shared by the models' validators and the checkers;
``checks`` gathers the checkers and maps each id to them (``CHECKERS_BY_INVARIANT``).
``snapshot`` is the plain data the harness reads of each rank and of its own model, and
``registry`` is the one home of the harness's checks over it, by id (``STEP_CHECKS``,
``REFUSAL_CHECKS``, ``RESET_CHECKS``, ``QUIESCENCE_CHECKS``), each calling the checkers above.
"""

from hicache_ref.invariants.checks import CHECKERS_BY_INVARIANT
from hicache_ref.invariants.models import (
    CpHiCacheNodeMetadata,
    HiCacheLayerWriteState,
    HiCacheWriteFailure,
    HiCacheWriteReservation,
    HiCacheWriteResult,
    WriteFailureReason,
)
from hicache_ref.invariants.rules import Problem, compute_padded_len, find_page_misalignment

__all__ = [
    "CHECKERS_BY_INVARIANT",
    "CpHiCacheNodeMetadata",
    "HiCacheLayerWriteState",
    "HiCacheWriteFailure",
    "HiCacheWriteReservation",
    "HiCacheWriteResult",
    "Problem",
    "WriteFailureReason",
    "compute_padded_len",
    "find_page_misalignment",
]
