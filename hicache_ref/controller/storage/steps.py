"""``StepRunner``: a tier's four step components, and running one step of any of them.

The same ``run`` serves both executors: a storage thread calls ``run_of_epoch`` (refused once
its epoch is over, INV-24), a manual caller ``run_manual``; either way the tier's
``step_observer`` (the harness) sees every step that did something. ``thread_errors`` keeps what
the storage threads raised, for ``check_storage_threads``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from hicache_ref.controller.storage.executor import STORAGE_ERRORS_MAX
from hicache_ref.controller.storage.records import STEP_KINDS, StepResult, StorageStepKind
from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.storage.queues import BoundedQueue

if TYPE_CHECKING:
    from hicache_ref.controller.storage.ports import RunnerTier, StepComponent


class StepRunner:
    """Dispatch from a step kind to its component, for one tier."""

    def __init__(self, tier: RunnerTier) -> None:
        self.tier = tier
        self.thread_errors: list[BaseException] = []
        self._errors_lock = threading.Lock()

    def component(self, kind: StorageStepKind) -> StepComponent:
        tier = self.tier
        if kind is StorageStepKind.HIT_QUERY:
            return tier.hit_query
        if kind is StorageStepKind.IO:
            return tier.prefetch_io
        if kind is StorageStepKind.SYNC:
            return tier.prefetch_sync
        return tier.backup

    def source(self, kind: StorageStepKind) -> BoundedQueue[Any]:
        """The queue a ``kind`` thread waits on."""
        queues = self.tier.queues
        if kind is StorageStepKind.HIT_QUERY:
            return queues.prefetch_queue
        if kind is StorageStepKind.IO:
            return queues.prefetch_buffer
        if kind is StorageStepKind.SYNC:
            return queues.prefetch_sync_queue
        return queues.backup_queue

    def has_work(self, kind: StorageStepKind) -> bool:
        """Whether a ``kind`` step can run; an executor that parks its threads mid-step (the
        harness's gated executor) answers for them."""
        gated = getattr(self.tier.executor, "has_work", None)
        return bool(gated(kind)) if gated is not None else self.component(kind).has_work()

    def has_any_work(self) -> bool:
        return any(self.has_work(kind) for kind in STEP_KINDS)

    def runnable(self) -> list[StorageStepKind]:
        return [kind for kind in STEP_KINDS if self.has_work(kind)]

    def wait_for_work(self, kind: StorageStepKind, timeout_s: float) -> None:
        self.source(kind).wait_nonempty(timeout_s)

    def run_manual(self, kind: StorageStepKind) -> StepResult:
        tier = self.tier
        tier.require_backend(f"a {kind.value} step")
        advance = getattr(tier.executor, "advance", None)
        if advance is not None:  # the harness's gated executor: its thread runs to its next point
            result: StepResult = advance(kind)
            return result
        if tier.executor.name != "manual":
            raise HiCacheInputError(
                "storage steps need storage_executor='manual' (in thread mode the storage "
                "threads run them)"
            )
        return self.run(kind)

    def run_of_epoch(self, kind: StorageStepKind, epoch: int) -> StepResult:
        tier = self.tier
        # Verify an old-epoch thread never acts (sglang#36882)
        if epoch != tier.epoch:
            raise InvariantViolation(
                "INV-24",
                f"rank {tier.rank}: a {kind.value} thread of epoch {epoch} acted in epoch "
                f"{tier.epoch} (join every storage thread before starting the next epoch)",
            )
        return self.run(kind)

    def run(self, kind: StorageStepKind) -> StepResult:
        result = self.component(kind).step()
        observer = self.tier.step_observer
        if observer is not None and result.ran:
            observer(result)
        return result

    def run_until_idle(self) -> int:
        tier = self.tier
        if tier.collectives.world_size > 1:
            raise HiCacheInputError(
                "run_until_idle runs one rank; a rank group steps every rank at once "
                "(lockstep.run_until_idle)"
            )
        steps = 0
        # Each prefetch takes a query, two steps per batch and a final sync; a backup one step
        bound = 16 + sum(tier.queues.sizes().values()) * (2 * self._max_batches() + 4)
        while True:
            runnable = self.runnable()
            if not runnable:
                return steps
            if steps > bound:
                raise InvariantViolation(
                    "INV-25",
                    f"storage work did not quiesce within {bound} steps (a step re-queued "
                    "work instead of bringing its operation to its one final ack)",
                )
            for kind in runnable:
                self.run_manual(kind)
                steps += 1

    def _max_batches(self) -> int:
        tier = self.tier
        pages = tier.mem_pool_host.size // tier.page_size
        return -(-pages // tier.storage_batch_size)

    # -- thread errors -----------------------------------------------------------------------------
    def record_thread_error(self, exc: BaseException) -> None:
        with self._errors_lock:
            if len(self.thread_errors) < STORAGE_ERRORS_MAX:
                self.thread_errors.append(exc)

    def check_thread_errors(self) -> None:
        with self._errors_lock:
            first = self.thread_errors[0] if self.thread_errors else None
        if first is not None:
            raise first
