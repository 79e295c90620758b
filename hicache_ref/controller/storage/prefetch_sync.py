"""The prefetch sync step (T3, SGLang 0.5.23's ``prefetch_sync_thread_func``): one ack per step.

A step takes the oldest ack of ``prefetch_sync_queue``; a progress ack's ``completed_tokens`` is
replaced by the MIN over ranks (``_reduce_prefetch_ack``), so what the tree applies is progress
every rank has made: no rank inserts or frees a bounce page by its own progress (INV-21,
sglang#27010). The ack then goes to ``ack_prefetch_queue``. A final ack
(``completed_req=True``) carries no number and issues no collective, on every rank alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache_ref.controller.storage.collectives import PREFETCH_COMPLETION, ReduceOp
from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.controller.storage.side_window import reduce_pool_hits
from hicache_ref.errors import InvariantViolation
from hicache_ref.storage.operations import PrefetchAck

if TYPE_CHECKING:
    from hicache_ref.controller.storage.ports import StepTier


class PrefetchSync:
    """T3's loop body."""

    kind = StorageStepKind.SYNC

    def __init__(self, tier: StepTier) -> None:
        self.tier = tier

    def has_work(self) -> bool:
        return not self.tier.queues.prefetch_sync_queue.empty()

    def step(self) -> StepResult:
        tier = self.tier
        ack = tier.queues.prefetch_sync_queue.poll(0.0)
        if ack is None:
            return tier.idle_result(self.kind)
        tier.check_current_epoch(ack.operation, "a prefetch sync")
        self.reduce_prefetch_ack(ack)
        reduce_pool_hits(tier, ack)  # a window's hits: MIN over ranks (side_window.py)
        tier.queues.ack_prefetch_queue.put(ack)
        return tier.result(
            self.kind,
            ack.operation,
            tokens=ack.completed_tokens or 0,
            acked=True,
            final=bool(ack.completed_req),
        )

    def reduce_prefetch_ack(self, ack: PrefetchAck) -> None:
        """Agree on the ack across ranks: the MIN of the ranks' completed tokens."""
        if ack.completed_tokens is None:
            return
        local = ack.completed_tokens
        completed = torch.tensor(local, dtype=torch.int64)
        self.tier.collectives.all_reduce(completed, op=ReduceOp.MIN, group=PREFETCH_COMPLETION)
        reduced = int(completed.item())
        # Verify the agreed progress is whole pages this rank has made too (INV-21)
        if reduced > local or reduced % self.tier.page_size:
            raise InvariantViolation(
                "INV-21",
                f"prefetch {ack.rid!r}: progress reduced {local} -> {reduced} (the MIN over "
                "ranks is whole pages and never more than a rank's own progress)",
            )
        ack.completed_tokens = reduced
