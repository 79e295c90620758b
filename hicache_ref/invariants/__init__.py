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

Modules, in the order a check flows through them: ``models`` (the records above) and ``rules``
(the pure rules their validators and the checkers share); ``snapshot`` and
``storage_snapshot``, the plain data the harness reads of each rank, each tier and its own
models; ``evidence``, what it hands a checker; the pure checks over plain values, by concept:
``checks_layout`` (where bytes go), ``checks_transfer`` (what a transfer must respect),
``checks_acks`` (the ack protocol), ``checks_ownership`` (who holds a slot),
``checks_prefetch`` (prefetch accounting), and the storage tier's ``checks_storage_prefetch``, ``checks_storage_l3`` and
``checks_storage_windows``, ``checks_storage_pp``, ``checks_storage_side`` and
``checks_storage_buffer`` (gathered by
``checks_storage``), with ``_convert``'s plain ints
for all of them; ``checker``, the registration
decorator and the phase tables derived from it; and ``registry``, the one home of every
invariant the harness checks: one ``check_inv_NN_*`` per id (``REGISTERED``), run
by the session per phase (``STEP_IDS``, ``REFUSAL_IDS``, ``RESET_IDS``, ``QUIESCENCE_IDS``) and by
the tree and the byte checks on what they observe (``CheckRunner``).
"""

from hicache_ref.invariants.models import (
    CpHiCacheNodeMetadata,
    HiCacheLayerWriteState,
    HiCacheWriteFailure,
    HiCacheWriteReservation,
    HiCacheWriteResult,
    WriteFailureReason,
)
from hicache_ref.invariants.registry import REGISTERED
from hicache_ref.invariants.rules import Problem, compute_padded_len, find_page_misalignment

__all__ = [
    "REGISTERED",
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
