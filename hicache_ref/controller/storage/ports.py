"""What each part of the storage tier sees of it: narrow views of ``StorageTier``.

The step components, the step runner, the executors and the detach helpers each take the part of
the tier they use, as a ``Protocol``, instead of the tier class: ``tier.py`` imports them, and
none of them imports ``tier.py``. In the order a step meets them:

- ``StepTier``: what one loop body reads and writes (queues, geometry, the backend, the
  collectives, the window pools, ``WindowPoolsLike``, the epoch check and the result it
  returns): ``HitQuery``, ``PrefetchIO``, ``PrefetchSync``, ``Backup``;
- ``StepComponent`` / ``RunnerTier``: the four components and what ``StepRunner`` dispatches
  and bounds with;
- ``StepLoop`` / ``ExecutorTier``: what a storage thread loops over (``ThreadExecutor``);
- ``DetachTier``: what a detach waits for (``lifecycle.finish_pending_work``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from hicache_ref.controller.storage.collectives import Collectives
from hicache_ref.controller.storage.queues import StorageQueues
from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.storage.backend import HiCacheStorage
from hicache_ref.storage.hashing import Token
from hicache_ref.storage.operations import StorageOperation
from hicache_ref.storage.pool_transfers import PoolTransfer
from hicache_ref.storage.protocols import StorageHostPool


class _Executor(Protocol):
    @property
    def name(self) -> str: ...


class WindowPoolsLike(Protocol):
    """The tier's window pools as a step uses them (``side_window.WindowPools``)."""

    pools: dict[str, StorageHostPool]

    def release(self, name: str, slots: torch.Tensor) -> None: ...


class StepTier(Protocol):
    """The tier as one step component (T1 - T4) uses it."""

    queues: StorageQueues
    page_size: int
    storage_batch_size: int
    collectives: Collectives
    mem_pool_host: StorageHostPool
    backup_skip: bool
    sidecar_pools: dict[str, StorageHostPool]
    host_memory_mode: str

    @property
    def window_pools(self) -> WindowPoolsLike: ...

    def sidecar_transfers(
        self, keys: Sequence[str], host_indices: torch.Tensor | None = None
    ) -> list[PoolTransfer]: ...

    def require_backend(self, what: str) -> HiCacheStorage: ...

    def compute_page_keys(
        self, token_ids: Sequence[Token], prior_hash: str | None
    ) -> list[str]: ...

    def check_current_epoch(self, operation: StorageOperation, what: str) -> None: ...

    def result(
        self,
        kind: StorageStepKind,
        operation: StorageOperation,
        *,
        tokens: int,
        acked: bool,
        final: bool = False,
    ) -> StepResult: ...

    def idle_result(self, kind: StorageStepKind) -> StepResult: ...


class StepComponent(Protocol):
    """One thread's loop body (``HitQuery``, ``PrefetchIO``, ``PrefetchSync``, ``Backup``)."""

    def has_work(self) -> bool: ...

    def step(self) -> StepResult: ...


class RunnerTier(StepTier, Protocol):
    """The tier as ``StepRunner`` uses it: its components and who runs them."""

    @property
    def hit_query(self) -> StepComponent: ...

    @property
    def prefetch_io(self) -> StepComponent: ...

    @property
    def prefetch_sync(self) -> StepComponent: ...

    @property
    def backup(self) -> StepComponent: ...

    epoch: int
    step_observer: Callable[[StepResult], None] | None

    @property
    def executor(self) -> _Executor: ...

    @property
    def rank(self) -> int: ...


class StepLoop(Protocol):
    """What a storage thread's loop calls on the tier's step runner."""

    def has_work(self, kind: StorageStepKind) -> bool: ...

    def wait_for_work(self, kind: StorageStepKind, timeout_s: float) -> None: ...

    def run_of_epoch(self, kind: StorageStepKind, epoch: int) -> StepResult: ...

    def record_thread_error(self, exc: BaseException) -> None: ...


class ExecutorTier(Protocol):
    """The tier as a storage thread loops over it."""

    queues: StorageQueues
    collectives: Collectives
    epoch: int

    @property
    def steps(self) -> StepLoop: ...


class DetachTier(Protocol):
    """The tier as a detach waits for its work."""

    queues: StorageQueues
    collectives: Collectives

    @property
    def executor(self) -> _Executor: ...

    @property
    def rank(self) -> int: ...

    def has_any_work(self) -> bool: ...

    def run_until_idle(self) -> int: ...
