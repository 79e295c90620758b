"""What one storage step is and what it did: ``StorageStepKind`` and ``StepResult``.

Each of SGLang 0.5.23's four storage threads is a loop whose body is one *step*:

- ``hit_query`` (T1, ``prefetch_thread_func``): query one prefetch's hit run, MIN over ranks;
- ``io`` (T2, ``prefetch_io_aux_func``): transfer one batch of one prefetch, ack its progress;
- ``sync`` (T3, ``prefetch_sync_thread_func``): reduce one progress ack over ranks, publish it;
- ``backup`` (T4, ``backup_thread_func``): back up one operation, ack it.

The thread executor runs the steps on real threads; the manual executor lets a test (or the
harness) run any runnable one, so interleavings are drawn like stream completions.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StorageStepKind(str, Enum):
    HIT_QUERY = "hit_query"
    IO = "io"
    SYNC = "sync"
    BACKUP = "backup"


STEP_KINDS: tuple[StorageStepKind, ...] = tuple(StorageStepKind)
THREAD_NAMES: dict[StorageStepKind, str] = {
    StorageStepKind.HIT_QUERY: "hicache-storage-prefetch",
    StorageStepKind.IO: "hicache-storage-prefetch-io",
    StorageStepKind.SYNC: "hicache-storage-prefetch-sync",
    StorageStepKind.BACKUP: "hicache-storage-backup",
}


def parse_step_kind(name: str) -> StorageStepKind:
    """The step kind called ``name``; anything else is refused naming the legal values."""
    from hicache_ref.errors import UnknownOptionError

    try:
        return StorageStepKind(name)
    except ValueError:
        raise UnknownOptionError(
            f"unknown storage step {name!r}; legal values: {', '.join(k.value for k in STEP_KINDS)}"
        ) from None


@dataclass(frozen=True)
class StepResult:
    """What one step did on one rank: which op, how many tokens, whether it emitted an ack.

    ``tokens`` is the hit count (hit query), the cumulative completed tokens of this rank (io),
    the published progress (sync) or the stored prefix (backup). ``final`` marks the last ack
    of a prefetch (``completed_req``) or a backup's one ack.
    """

    kind: StorageStepKind
    rank: int
    epoch: int
    op_id: int | None = None
    request_id: str | None = None
    tokens: int = 0
    acked: bool = False
    final: bool = False

    @property
    def ran(self) -> bool:
        return self.op_id is not None
