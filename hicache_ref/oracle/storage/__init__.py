"""The storage oracle: a pure model of the L3 tier's protocol (SGLang 0.5.23's four threads per
rank, the tree's half, the backend's contents per rank namespace), one schedule point at a time.

No torch. A state is a frozen, hashable value (``StorageState``); every transition is
``storage_step(state, op) -> (new_state, observations)``; ``why_storage_disabled(state, op)``
says which rule refuses an op. Unlike the device oracle, whose ops are whole API calls, a
storage thread here runs from one *schedule point* to the next (``Advance(rank, thread,
outcome)``): a queue ``get`` or ``put``, one backend call per batch with its drawn outcome (a
hole, a raise, a deferred completion, a refused write), the IO's termination check; a
collective is one joint point of every rank (``Collective(group)``). So every window inside a
loop body (an ack before its write, a termination between batches, a hole inside a run, an
exception, an old thread after reset) is a reachable interleaving.

Primitives, in the order a prefetch and a backup flow through them:

1. start    ``Prefetch(op)`` / ``WriteStorage(op)`` (``tree``): every rank queues the op;
2. query    T1 (``hit_query``): ``prefetch_queue.get`` -> ``batch_exists`` per batch ->
            ``Collective("hits")`` (MIN over ranks, ``keys.compute_hit_endpoint``) ->
            ``prefetch_hit_queue.put``;
3. buffer   ``DrainHits()``: revoke on every rank, or a bounce buffer of exactly the hit;
4. IO       T2 (``prefetch_io``): ``prefetch_buffer.get`` -> per batch termination check,
            ``batch_get`` (pages land, then count), ``prefetch_sync_queue.put`` of the progress
            -> the final ack;
5. sync     T3: ``get`` -> ``Collective("completion")`` (MIN) -> ``ack_prefetch_queue.put``;
6. settle   ``DrainAcks()`` (progress; the final ack inserts ``[0:published]`` and queues the
            rest for release), ``Terminate(op)`` (insert ``[0:published]`` now),
            ``DrainReleases()``;
7. backup   T4 (``backup``): ``backup_queue.get`` -> ``batch_set`` per batch (stop at the
            first failure) -> ``ack_backup_queue.put``; ``DrainBackupAcks()`` releases the
            source's host lock;
8. epochs   ``Reset()``, ``Detach()`` / ``Attach()``, ``Clear(rank)``, and the backend's own
            fault ``LosePage(rank, page)`` (``epochs``).

``check_storage_invariants(state)`` returns every ``Violation`` (INV-19..31 where expressible,
and the window properties of ``config.WINDOWS``); ``StorageVariant`` flags plant one bug each
(``PLANTED_STORAGE_BUGS``); ``keys`` holds the pure helpers CrossHair checks.
``formal/bounded_storage.py`` explores every interleaving of small worlds.

Modules, in the same order: ``config`` (the world and ``WINDOWS``), ``universe`` (the keys and
operations a harness adds as a case goes on), ``keys``, ``state`` and ``ops``; the threads'
halves ``tree`` (1, 3, 6), ``hit_query`` (2), ``prefetch_io`` (4, 5), ``backup`` (7) and
``epochs`` (8); ``step`` (``why_storage_disabled`` and ``storage_step``, the one entry point);
``invariants`` (``check_storage_invariants``).
"""

from hicache_ref.oracle.storage.config import (
    PLANTED_STORAGE_BUGS,
    WINDOWS,
    OpSpec,
    StorageConfig,
    StorageVariant,
    make_storage_variant,
)
from hicache_ref.oracle.storage.invariants import check_storage_invariants, storage_quiescent
from hicache_ref.oracle.storage.ops import (
    Advance,
    Attach,
    Clear,
    Collective,
    Detach,
    DrainAcks,
    DrainBackupAcks,
    DrainHits,
    DrainReleases,
    LosePage,
    Prefetch,
    Reset,
    StorageOp,
    Terminate,
    WriteStorage,
)
from hicache_ref.oracle.storage.state import (
    BACKUP,
    HIT_QUERY,
    IO,
    SYNC,
    THREADS,
    StorageState,
    initial_storage_state,
)
from hicache_ref.oracle.storage.step import (
    all_storage_ops,
    enabled_storage_ops,
    run_storage_ops,
    storage_step,
    why_storage_disabled,
)

__all__ = [
    "BACKUP",
    "HIT_QUERY",
    "IO",
    "PLANTED_STORAGE_BUGS",
    "SYNC",
    "THREADS",
    "WINDOWS",
    "Advance",
    "Attach",
    "Clear",
    "Collective",
    "Detach",
    "DrainAcks",
    "DrainBackupAcks",
    "DrainHits",
    "DrainReleases",
    "LosePage",
    "OpSpec",
    "Prefetch",
    "Reset",
    "StorageConfig",
    "StorageOp",
    "StorageState",
    "StorageVariant",
    "Terminate",
    "WriteStorage",
    "all_storage_ops",
    "check_storage_invariants",
    "enabled_storage_ops",
    "initial_storage_state",
    "make_storage_variant",
    "run_storage_ops",
    "storage_quiescent",
    "storage_step",
    "why_storage_disabled",
]
