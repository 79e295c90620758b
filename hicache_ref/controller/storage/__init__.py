"""The L3 storage tier a ``HiCacheController`` owns: prefetch from and backup to a backend.

Its map, in the order a prefetch and a backup flow through it (SGLang 0.5.23's protocol):

- ``tier.StorageTier``: attach (backend, fresh queues, a new epoch, the executor) ->
  ``prefetch`` -> ... -> ``terminate_prefetch`` / ``append_host_mem_release``;
  ``write_storage`` -> ...; ``reset`` (join, drop, next epoch) and ``detach``;
- ``queues.StorageQueues``: the eight queues, who fills and who drains each;
- ``hit_query.HitQuery`` (T1): one prefetch's leading hit run, MIN over ranks ->
  ``prefetch_hit_queue``; the tree then revokes it or gives it a bounce buffer
  (``alloc_prefetch_host_buffers``) and puts it on ``prefetch_buffer``;
- ``prefetch_io.PrefetchIO`` (T2): one batch per step into the bounce buffer, one cumulative
  ``PrefetchAck`` per batch, the final ``completed_req`` ack after the last;
- ``prefetch_sync.PrefetchSync`` (T3): one ack per step, progress MIN over ranks ->
  ``ack_prefetch_queue``;
- ``backup.Backup`` (T4): one ``write_storage`` per step, stored prefix, one ack;
- ``buffer_mode``: the tier in ``buffer_only`` host memory (loads alone rate limited, the KV
  pool's verdict agreed beside the hit); ``existence_beliefs``: the tree's beliefs of what L3
  holds, which the controller keeps for it in that mode (INV-41);
- ``side_window``: an independent side pool's window (SWA pages, a Mamba state) stored with
  its node, agreed per prefix, re-aligned to the served hit and read all-or-nothing (INV-39);
- ``releases``: host pages back to the pool, never one an IO may still write;
- ``lifecycle``: what a detach waits for (every op at its final ack) and the backend's close;
- ``collectives``: ``SingleRank`` and the in-process ``RankGroup`` (logs every collective,
  fails on any asymmetry or deadlock);
- ``steps``: ``StepRunner``, the tier's four step components and one step of any of them;
- ``executor``: ``ThreadExecutor`` (four threads per epoch) and ``ManualExecutor``;
  ``lockstep``: one step on every rank of a group at once, and a reset or detach of all ranks;
- ``records``: ``StorageStepKind`` and ``StepResult``; ``config``: what the backend is told;
- ``ports``: the narrow views of the tier each step, the runner, the executors and a detach
  take (so none of them imports ``tier.py``).
"""

from hicache_ref.controller.storage.collectives import (
    PREFETCH_COMPLETION,
    PREFETCH_HITS,
    Collectives,
    RankCollectives,
    RankGroup,
    ReduceOp,
    SingleRank,
    StorageInterrupted,
    SyncGroup,
)
from hicache_ref.controller.storage.executor import STORAGE_EXECUTORS
from hicache_ref.controller.storage.lockstep import (
    detach_ranks,
    reset_ranks,
    run_lockstep,
    run_until_idle,
    runnable_steps,
)
from hicache_ref.controller.storage.queues import QUEUE_NAMES, StorageQueues
from hicache_ref.controller.storage.records import (
    STEP_KINDS,
    StepResult,
    StorageStepKind,
    parse_step_kind,
)
from hicache_ref.controller.storage.releases import drain_host_mem_release
from hicache_ref.controller.storage.tier import StorageTier
from hicache_ref.invariants.storage_snapshot import CollectiveRecord

__all__ = [
    "PREFETCH_COMPLETION",
    "PREFETCH_HITS",
    "QUEUE_NAMES",
    "STEP_KINDS",
    "STORAGE_EXECUTORS",
    "CollectiveRecord",
    "Collectives",
    "RankCollectives",
    "RankGroup",
    "ReduceOp",
    "SingleRank",
    "StepResult",
    "StorageInterrupted",
    "StorageQueues",
    "StorageStepKind",
    "StorageTier",
    "SyncGroup",
    "detach_ranks",
    "drain_host_mem_release",
    "parse_step_kind",
    "reset_ranks",
    "run_lockstep",
    "run_until_idle",
    "runnable_steps",
]
