"""Mutant: ``reset()`` resets the gate's max node id but keeps ``ack_write_queue``.

Re-creates bug classes 2 and 15 together: a reset that clears one of the ack queue and the
undrained-ack gate's max id but not the other, and stale queues surviving ``reset()``. Node ids
restart at 0 after a tree reset, so a stale ack names a node id that a new node reuses: the
gate answers False while the queue holds its id, and draining the stale ack completes a backup
that was never written (or one the tree no longer tracks).

Caught by the session's check right after the ``reset`` step that every queue is empty
(INV-18: reset leaves nothing behind). Without that check the next drain catches it:
``TreeDriver.writing_check`` pops a write ack for a node with no backup in flight (INV-02), the
step check finds the gate disagreeing with the queue (INV-02), or acks are left at quiescence
(INV-16).
"""

from __future__ import annotations

from hicache_ref.controller.cache_controller import HiCacheController
from hicache_ref.harness.adapters.mutant import MutantImplementation

NAME = "reset_keeps_write_acks"
INVARIANTS = ("INV-18", "INV-02", "INV-16")
INVARIANT = INVARIANTS[0]
NEEDS_GUARDS = False
BUG = "bug classes 2 and 15 (seed/0.5.10 reset leaves queues behind)"


class Controller(HiCacheController):
    def reset(self) -> None:
        stale = list(self.ack_write_queue)
        super().reset()
        self.ack_write_queue.extend(stale)  # MUTATION: the write acks survive the reset


def implementation() -> MutantImplementation:
    return MutantImplementation(Controller, NAME)
