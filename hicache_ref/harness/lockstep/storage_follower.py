"""What the storage lockstep's step translations and comparisons read of their follower.

``StorageFollower`` is the face ``storage.StorageLockstep`` shows ``storage_steps`` (a whole loop
body), ``storage_point_steps`` (one schedule point) and ``storage_compare``: the driver it
follows, the oracle state it steps (``apply_op``), what it learned of the case (keys, ops,
collectives, the backend calls not yet translated, the results of loop bodies that ended) and how
it reports a difference (``divergence``). So those modules import this Protocol, never the
follower, and the follower imports them: one direction.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

from hicache_ref.controller.storage.records import StepResult
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.world.recording_storage import BackendCall
from hicache_ref.invariants.storage_snapshot import Prefix
from hicache_ref.oracle.storage import StorageOp, StorageState

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_driver import StorageDriver
    from hicache_ref.harness.steps.session import Session


class StorageFollower(Protocol):
    """The storage lockstep as its translations and comparisons see it."""

    session: Session
    driver: StorageDriver
    state: StorageState
    steps: int  # storage steps compared
    prefixes: list[Prefix]  # oracle key id -> its token prefix
    prefetch_ops: dict[str, int]  # request id -> oracle op, this epoch
    backup_ops: list[dict[int, int]]  # per rank: the driver's backup op id -> oracle op
    key_names: list[dict[str, int]]  # per rank: backend key name -> oracle key id
    collectives: dict[str, int]  # collectives the oracle ran per group
    calls: list[list[BackendCall]]  # per rank: backend calls not yet translated
    results: dict[int, StepResult]  # per rank: the loop body that ended in this step
    lock: threading.Lock  # guards ``results`` (a tier's observer runs on its thread)

    def apply_op(self, op: StorageOp, what: str) -> None:
        """Step the oracle by ``op`` (a divergence if it refuses it)."""

    def divergence(self, inv_id: str, what: str, detail: str) -> InvariantViolation:
        """A difference between what the oracle and the implementation predict."""
