"""Upstream's own storage threads, one loop iteration at a time, under the harness's storage world.

0.5.10's controller has three storage threads (``prefetch_thread_func`` starts
``prefetch_io_aux_func`` itself; no sync thread, no PrefetchAck: ``ACK_PROTOCOL_FUNC``), and its
tree polls the operation instead, so the storage driver pairs it with the tree half of that
protocol (``driver/storage_tree_0510.py``; ``UpstreamTier.protocol``). SGLang 0.5.23's
controller runs its L3 tier on four threads (``prefetch_thread_func``,
``prefetch_io_aux_func``, ``prefetch_sync_thread_func``, ``backup_thread_func``), each a loop
whose body starts with a blocking ``get`` on its queue. The gate runs those real functions on
real threads, but every such ``get`` is *served* by the harness (``StepGate``): a thread parks
at its ``get`` until the machine's ``storage_step`` grants it one item, runs one loop body of
upstream's code, and parks again at its next ``get``. So a step is exactly one iteration of
upstream's loop, and the machine draws the interleaving of the four threads, as it does for the
reference's manual executor. Nothing of upstream's logic is rewritten here; what this module adds,
in the order a case meets it:

- ``ServedQueue`` / ``GatedThread``: the module's ``Queue`` and ``threading.Thread`` (a thread's
  exception is kept for the step that ran it, so an ``InvariantViolation`` raised in upstream's
  collective reaches the machine; a parked thread sees a stop only once upstream joins it, so a
  thread its stopper forgets sleeps through the stop, as with an unlucky ``get(timeout=1)``);
- ``harness_torch``: the module's ``torch``, whose ``distributed`` serves upstream's
  ``get_world_size`` / ``all_reduce`` / ``destroy_process_group`` on ``tp_group`` handles
  (``TpHandle``) backed by the storage world's ``RankGroup``, which records every collective per
  rank and fails on any asymmetry (INV-20); ``create_custom_parallel_group`` (upstream's gloo
  sync groups) and ``get_parallel`` (the rank's TP coordinates for its storage config) answer
  per rank while that rank attaches;
- ``storage_controller_class``: upstream's ``HiCacheController`` subclassed with the shapes the
  harness's tree half calls (``storage`` for the lockstep driver, keys for ``write_storage``
  computed with the tree's hash functions as upstream's radix cache does, ``is_prefetch_complete``
  as 0.5.23's radix cache decides it, ``alloc_prefetch_host_buffers`` where 0.5.20 - 0.5.21's
  radix cache allocates the bounce buffer itself, ``prefetch`` in either release's signature,
  ``clear_storage_backend`` as the clear endpoint runs it);
- ``UpstreamTier``: what the storage driver reads as ``controller.storage``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import logging
import queue
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hicache_ref.controller.storage.collectives import (
    PREFETCH_COMPLETION,
    PREFETCH_HITS,
    RankCollectives,
    SingleRank,
    StorageInterrupted,
    SyncGroup,
)
from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.errors import HiCacheSetupError, InvariantViolation

STEP_TIMEOUT_S = 20.0
"""How long a served step may run (a collective's own timeout, 5 s, fires well before)."""
PARK_TIMEOUT_S = 10.0
"""How long a step waits for its thread to reach its ``get`` (right after attach or reset)."""
PARK_POLL_S = 1.0
"""A parked thread re-checks its stop this often even unwoken (a grant or a stop wakes it)."""
SYNC_GROUP_NAMES = (PREFETCH_HITS, PREFETCH_COMPLETION)
"""0.5.23's attach creates the hit-query groups, then the completion groups, in that order."""
THREAD_FUNCS: dict[StorageStepKind, str] = {
    StorageStepKind.HIT_QUERY: "prefetch_thread_func",
    StorageStepKind.IO: "prefetch_io_aux_func",
    StorageStepKind.SYNC: "prefetch_sync_thread_func",
    StorageStepKind.BACKUP: "backup_thread_func",
}
SOURCE_QUEUES: dict[StorageStepKind, str] = {
    StorageStepKind.HIT_QUERY: "prefetch_queue",
    StorageStepKind.IO: "prefetch_buffer",
    StorageStepKind.SYNC: "prefetch_sync_queue",
    StorageStepKind.BACKUP: "backup_queue",
}
CONTROL_QUEUES = (
    "prefetch_queue",
    "prefetch_buffer",
    "prefetch_sync_queue",
    "backup_queue",
    "prefetch_hit_queue",
    "ack_prefetch_queue",
    "prefetch_revoke_queue",
    "ack_backup_queue",
    "host_mem_release_queue",
)
STORAGE_THREAD_FUNCS = ("prefetch_thread_func", "prefetch_io_aux_func", "backup_thread_func")
"""Every release since runtime attach (0.5.10) has these three; 0.5.23 adds the sync thread."""
ACK_PROTOCOL_FUNC = "prefetch_sync_thread_func"
"""0.5.23's PrefetchAck stream: the hit queue, the tree's bounce buffer and the sync thread.
Without it (0.5.10) the tree allocates the whole prefetch up front, reads ``completed_tokens``
off the operation and reduces it itself (``PROTOCOL_POLL``, ``driver/storage_tree_0510.py``)."""
PROTOCOL_ACK = "ack"
PROTOCOL_POLL = "poll"
TP_COORDINATES = (
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_attention_tp_rank",
    "get_attention_tp_size",
)
"""What 0.5.10's storage config reads for the rank (0.5.16+ read ``get_parallel()``)."""


def supports_storage(module: types.ModuleType) -> bool:
    """Whether the tree's controller has upstream's storage threads (0.5.10+)."""
    cls = getattr(module, "HiCacheController", None)
    return cls is not None and all(callable(getattr(cls, f, None)) for f in STORAGE_THREAD_FUNCS)


def has_ack_protocol(cls: type[Any]) -> bool:
    return callable(getattr(cls, ACK_PROTOCOL_FUNC, None))


# -- served queues and gated threads --------------------------------------------------------------
class GatedThread(threading.Thread):
    """A storage thread of upstream's controller: its ``get``s are served by its gate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        target = kwargs.get("target")
        owner = getattr(target, "__self__", None)
        self.gate: StepGate | None = getattr(owner, "_harness_gate", None)
        self.function = str(getattr(target, "__name__", ""))

    def start(self) -> None:
        """Started, then known to its gate: a thread created but not started yet is not alive,
        and one upstream starts from another storage thread (0.5.10's IO thread) registers
        under the gate's lock, so ``forget_dead`` never drops it."""
        super().start()
        if self.gate is not None:
            self.gate.register(self)

    def run(self) -> None:
        try:
            super().run()
        except BaseException as exc:  # kept for the step that ran this iteration
            if self.gate is not None:
                self.gate.record_error(self, exc)

    def join(self, timeout: float | None = None) -> None:
        """Upstream joins a thread it stopped: only now does the parked thread see the stop."""
        if self.gate is not None:
            self.gate.release(self)
        super().join(timeout)


class ServedQueue(queue.Queue[Any]):
    """``queue.Queue`` whose blocking ``get`` from a gated storage thread waits for the harness."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        thread = threading.current_thread()
        if not isinstance(thread, GatedThread) or thread.gate is None or not block:
            return super().get(block, timeout)
        return thread.gate.park(self, thread, timeout)


class StepGate:
    """Where one controller's storage threads park, and the harness grants one iteration."""

    def __init__(self, stop_event: Callable[[], bool]) -> None:
        self._stopping = stop_event
        self._cond = threading.Condition()
        self.threads: list[GatedThread] = []
        self._parked: dict[GatedThread, ServedQueue] = {}
        self._granted: set[GatedThread] = set()
        self._errors: dict[GatedThread, BaseException] = {}
        self._released: set[GatedThread] = set()  # joined by upstream while stopping
        self._closing = False
        self.deaths: list[str] = []  # storage threads upstream's code let die, and of what

    def park(self, source: ServedQueue, thread: GatedThread, timeout: float | None) -> Any:
        """Wait for a grant. A stop ends the wait only for a thread upstream joins (or when the
        world goes): upstream's ``get(timeout=1)`` poll is taken as not firing within the stop,
        so a thread its stopper never joins sleeps through it, the schedule that exposes a
        missing join (F23); every thread a stopper joins sees the stop at once, as before."""
        with self._cond:
            self._parked[thread] = source
            self._cond.notify_all()
            while thread not in self._granted:
                if self._stopping() and (thread in self._released or self._closing):
                    self._parked.pop(thread, None)
                    self._cond.notify_all()
                    break
                self._cond.wait(PARK_POLL_S)  # woken by a grant or a stop (GateStopEvent)
            else:
                self._granted.discard(thread)
                self._parked.pop(thread, None)
                return source.get_nowait()
        # stopping: take what is queued (a wake-up sentinel, or work upstream drains on stop),
        # else Empty at once, as its get would after its timeout (the thread then sees the stop)
        return queue.Queue.get(source, False)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def register(self, thread: GatedThread) -> None:
        with self._cond:
            self.threads.append(thread)
            self._cond.notify_all()

    def release(self, thread: GatedThread) -> None:
        """``thread`` is being joined: once stopped, it leaves its park."""
        with self._cond:
            self._released.add(thread)
            self._cond.notify_all()

    def close(self) -> None:
        """The world is gone: every parked thread sees the stop (no step follows)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def record_error(self, thread: GatedThread, exc: BaseException) -> None:
        with self._cond:
            self._errors[thread] = exc
            self._cond.notify_all()

    def serves(self, function: str) -> bool:
        """Whether a live thread runs upstream's ``function`` (its queue can still be served)."""
        with self._cond:
            return any(t.function == function and t.is_alive() for t in self.threads)

    def settle(self) -> None:
        """Wait until every live thread upstream started waits at its queue (or exited): a
        thread that starts another (0.5.10's prefetch thread starts its IO thread) registers it
        before it parks, so the next step meets every thread at its ``get``, whatever the host's
        load. Without it a reset right after attach raced the IO thread's start: started after
        the stop, it exited at once instead of parking, and F23 replayed one time in three."""
        with self._cond:
            self._cond.wait_for(
                lambda: all(t in self._parked or not t.is_alive() for t in self.threads),
                timeout=PARK_TIMEOUT_S,
            )

    def alive(self) -> list[str]:
        with self._cond:
            return [t.name for t in self.threads if t.is_alive()]

    def forget_dead(self) -> None:
        with self._cond:
            self.threads = [t for t in self.threads if t.is_alive()]
            self._released = {t for t in self._released if t.is_alive()}

    def serve(self, source: ServedQueue, what: str, rank: int = 0) -> None:
        """Grant one item of ``source`` to the thread parked on it; return once that thread
        finished the loop body (parked again, or exited). Its exception, if any, is raised."""
        with self._cond:
            thread = self._wait_parked(source, what)
            self._granted.add(thread)
            self._cond.notify_all()
            ended = self._cond.wait_for(
                lambda: (
                    (thread not in self._granted and thread in self._parked)
                    or not thread.is_alive()
                    or thread in self._errors
                ),
                timeout=STEP_TIMEOUT_S,
            )
            error = self._errors.pop(thread, None)
            state = (
                f"{thread.name}: alive={thread.is_alive()} granted={thread in self._granted} "
                f"parked={thread in self._parked}"
            )
        if isinstance(error, InvariantViolation):
            raise error  # a harness check inside the iteration (the rank group's collectives)
        if error is not None and not isinstance(error, StorageInterrupted):
            # upstream's thread died of it, as it would in production: nothing serves its queue
            # again (has_work), so the op it held and every one queued after it never acks
            self.deaths.append(f"{thread.function}: {type(error).__name__}: {error}")
            raise InvariantViolation(
                "INV-25",
                f"rank {rank}: upstream's {thread.function} died of {type(error).__name__} "
                f"({error}) in one {what} iteration; nothing serves its queue again, so its "
                "operation and every one queued after it are never acked (exactly one ack per "
                "operation, whatever the backend does; sglang#38427)",
            )
        # Verify the iteration ended: a thread stuck inside upstream's loop body is a hang
        if not ended:
            raise InvariantViolation(
                "INV-20",
                f"upstream's {what} thread did not finish one loop iteration within "
                f"{STEP_TIMEOUT_S:g} s (a wait inside its loop body that no rank answers; {state})",
            )

    def _wait_parked(self, source: ServedQueue, what: str) -> GatedThread:
        def parked() -> GatedThread | None:
            return next((t for t, q in self._parked.items() if q is source), None)

        self._cond.wait_for(lambda: parked() is not None, timeout=PARK_TIMEOUT_S)
        thread = parked()
        if thread is None:
            raise HiCacheSetupError(
                f"no upstream {what} thread waits on its queue (it exited or never started); "
                "the gate can only step a live storage thread"
            )
        return thread


class GateStopEvent(threading.Event):
    """Upstream's ``storage_stop_event``: setting it also wakes every parked thread at once."""

    def __init__(self, gate: StepGate) -> None:
        super().__init__()
        self._gate = weakref.ref(gate)

    def set(self) -> None:
        super().set()
        gate = self._gate()
        if gate is not None:
            gate.wake()


# -- the harness process group ------------------------------------------------------------------
class TpHandle:
    """What upstream holds as ``tp_group`` (and as each gloo sync group): one rank's view of the
    storage world's ``RankGroup``, under one group name."""

    def __init__(self, collectives: RankCollectives | SingleRank, name: SyncGroup) -> None:
        self.collectives = collectives
        self.name = name

    def sync_group(self, name: SyncGroup) -> TpHandle:
        return TpHandle(self.collectives, name)


class _HarnessDistributed:
    """``torch.distributed`` as upstream's controller calls it, on ``TpHandle`` groups."""

    ReduceOp = torch.distributed.ReduceOp
    ProcessGroup = object

    @staticmethod
    def _handle(group: object, what: str) -> TpHandle:
        if not isinstance(group, TpHandle):
            raise HiCacheSetupError(
                f"upstream called torch.distributed.{what} on {group!r}, not a harness group"
            )
        return group

    def get_world_size(self, group: object = None) -> int:
        return int(self._handle(group, "get_world_size").collectives.world_size)

    def get_rank(self, group: object = None) -> int:
        return int(self._handle(group, "get_rank").collectives.rank)

    def get_process_group_ranks(self, group: object) -> list[int]:
        return list(range(self.get_world_size(group)))

    def all_reduce(self, tensor: torch.Tensor, op: object = None, group: object = None) -> None:
        handle = self._handle(group, "all_reduce")
        handle.collectives.all_reduce(tensor, op if op is not None else "sum", handle.name)

    def destroy_process_group(self, group: object = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


class _HarnessTorch:
    """The controller module's ``torch``: the real one, but ``distributed`` is the harness's."""

    distributed = _HarnessDistributed()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


harness_torch = _HarnessTorch()

_ATTACHING: list[TpHandle | None] = [None]
"""The rank attaching now (the world attaches its ranks one after another, on one thread)."""
_CREATED: list[int] = [0]


def create_custom_parallel_group(group_ranks: Sequence[int], backend: str = "gloo") -> TpHandle:
    """Upstream's gloo sync group of the rank attaching now: its view under the group's name."""
    handle = _ATTACHING[0]
    if handle is None:
        raise HiCacheSetupError("the gate runs TP 1: a custom parallel group was asked for")
    name = SYNC_GROUP_NAMES[_CREATED[0] % len(SYNC_GROUP_NAMES)]
    _CREATED[0] += 1
    return handle.sync_group(name)


def _rank_parallel(handle: TpHandle) -> types.SimpleNamespace:
    rank, size = int(handle.collectives.rank), int(handle.collectives.world_size)
    return types.SimpleNamespace(
        tp_rank=rank,
        tp_size=size,
        pp_rank=0,
        pp_size=1,
        attn_tp_rank=rank,
        attn_tp_size=size,
        attn_dp_rank=0,
        attn_dp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        attn_dcp_rank=0,
        attn_dcp_size=1,
    )


@contextmanager
def attaching(module: types.ModuleType, handle: TpHandle, tree: Path) -> Iterator[None]:
    """While ``handle``'s rank attaches: its sync groups and TP coordinates answer for it, and
    ``import sglang...`` resolves against its own tree again (a storage world running
    upstream's file backend from another release installs that release's modules)."""
    from hicache_ref.harness.adapters.sglang_stubs import install_stubs

    install_stubs(tree)
    coordinates = _rank_parallel(handle)
    answers: dict[str, Callable[[], Any]] = {
        "get_parallel": lambda: coordinates,
        "get_tensor_model_parallel_rank": lambda: coordinates.tp_rank,
        "get_tensor_model_parallel_world_size": lambda: coordinates.tp_size,
        "get_attention_tp_rank": lambda: coordinates.attn_tp_rank,
        "get_attention_tp_size": lambda: coordinates.attn_tp_size,
    }
    saved = {name: module.__dict__[name] for name in answers if name in module.__dict__}
    _ATTACHING[0], _CREATED[0] = handle, 0
    install_storage_factory()  # again: loading upstream's file backend remakes the package
    module.__dict__.update({name: answers[name] for name in saved})
    try:
        yield
    finally:
        module.__dict__.update(saved)
        _ATTACHING[0] = None


# -- the tree's hash functions ----------------------------------------------------------------
UTILS_RELPATH = Path("sglang/srt/mem_cache/utils.py")
HASH_FUNCTIONS = ("get_hash_str", "storage_namespace_seed", "get_storage_hash_str")


def _python_native_hash(
    token_ids: Any, prior_digest: bytes | None, page_size: int | None = None
) -> str | list[str]:
    """What the tree's C++ ``get_native_hash`` computes for plain token lists: SHA-256 over the
    prior digest and each token as 4 little-endian bytes, one digest per page when
    ``page_size`` is given, each chained from the last (the gate builds no C++ extension)."""
    tokens = [int(t) for t in token_ids]

    def digest(chunk: Sequence[int], prior: bytes | None) -> bytes:
        hasher = hashlib.sha256()
        if prior:
            hasher.update(prior)
        for t in chunk:
            hasher.update(t.to_bytes(4, "little", signed=False))
        return hasher.digest()

    if page_size is None:
        return digest(tokens, prior_digest).hex()
    keys: list[str] = []
    prior = prior_digest
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prior = digest(tokens[start : start + page_size], prior)
        keys.append(prior.hex())
    return keys


@functools.cache
def tree_hash_functions(tree: Path) -> dict[str, Any]:
    """The tree's own ``get_hash_str`` / ``get_storage_hash_str`` (read from its ``utils.py``,
    which imports kernels the gate does not load), over the Python stand-in for its native hash."""
    path = tree / UTILS_RELPATH
    if not path.is_file():
        raise HiCacheSetupError(f"the sglang tree lacks {path}; gate a complete unpacked tree")
    parsed = ast.parse(path.read_text(), str(path))
    wanted: list[ast.stmt] = [
        n for n in parsed.body if isinstance(n, ast.FunctionDef) and n.name in HASH_FUNCTIONS
    ]
    if len(wanted) != len(HASH_FUNCTIONS):
        raise HiCacheSetupError(f"{path} lacks one of {HASH_FUNCTIONS}; its storage is not driven")
    namespace: dict[str, Any] = {"get_native_hash": _python_native_hash, "hashlib": hashlib}
    exec("from __future__ import annotations\nfrom typing import *\n", namespace)
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in HASH_FUNCTIONS}


def _page_keys_function(tree: Path) -> Callable[[list[Any], str | None, int], list[str]]:
    """The keys of a node's pages as the tree's radix cache computes them: 0.5.20+'s
    ``get_storage_hash_str`` over all pages, or 0.5.10's ``get_hash_str`` chained page by page
    (``hicache_storage.py``, loaded by the stubs)."""
    import sys

    try:
        storage_hash = tree_hash_functions(tree)["get_storage_hash_str"]
    except HiCacheSetupError:
        storage_hash = None
    if storage_hash is not None:
        return lambda tokens, prior, page: list(storage_hash(tokens, prior, page_size=page))
    get_hash_str = sys.modules["sglang.srt.mem_cache.hicache_storage"].__dict__["get_hash_str"]

    def chained(tokens: list[Any], prior: str | None, page: int) -> list[str]:
        keys: list[str] = []
        for start in range(0, len(tokens) - len(tokens) % page, page):
            prior = str(get_hash_str(tokens[start : start + page], prior))
            keys.append(prior)
        return keys

    return chained


# -- the backend factory upstream's attach imports -----------------------------------------------
class _UpstreamFacingBackend:
    """This project's backend (the world's recording layer) as upstream's attach calls it:
    0.5.23 also calls ``on_host_pools_registered()``, which our interface does not have."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def on_host_pools_registered(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class UpstreamFacingFactory:
    """``sglang.srt.mem_cache.storage.StorageBackendFactory``: this project's factory, handed
    upstream's ``HiCacheStorageConfig`` as ours (the fields both have)."""

    @staticmethod
    def create_backend(name: str, config: Any, mem_pool_host: Any = None) -> Any:
        import dataclasses

        from hicache_ref.storage.backend import HiCacheStorageConfig
        from hicache_ref.storage.factory import StorageBackendFactory

        ours = {f.name for f in dataclasses.fields(HiCacheStorageConfig)}
        values = {k: v for k, v in vars(config).items() if k in ours}
        values["extra_config"] = dict(values.get("extra_config") or {})
        backend = StorageBackendFactory.create_backend(
            name, HiCacheStorageConfig(**values), mem_pool_host
        )
        return _UpstreamFacingBackend(backend)


def install_storage_factory() -> None:
    """What upstream's attach imports: the backend factory, and the pool class its storage
    config tests the device pool against."""
    import sys

    name = "sglang.srt.mem_cache.storage"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module
    module.__dict__["StorageBackendFactory"] = UpstreamFacingFactory
    pools = "sglang.srt.mem_cache.deepseek_v4_memory_pool"  # imported by the storage config
    if pools not in sys.modules:  # its kernels are not loaded; the gate's pools are none of it
        stub = types.ModuleType(pools)
        stub.__dict__["DeepSeekV4TokenToKVPool"] = type("DeepSeekV4TokenToKVPool", (), {})
        sys.modules[pools] = stub


# -- the controller, and its tier as the driver reads it --------------------------------------------
class _Executor:
    name = "manual"  # the harness serves every step (lockstep.detach_ranks runs them)


class UpstreamTier:
    """``controller.storage`` for the storage driver: upstream's threads, served step by step."""

    executor = _Executor()

    def __init__(
        self, controller: Any, gate: StepGate, collectives: Any, *, protocol: str = PROTOCOL_ACK
    ) -> None:
        self.protocol = protocol  # which tree half drives its prefetches (ACK_PROTOCOL_FUNC)
        self._controller = weakref.proxy(controller)
        self.gate = gate
        self.collectives = collectives
        self.epoch = 0
        self.live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.queues = types.SimpleNamespace(sizes=self.queue_sizes)

    @property
    def rank(self) -> int:
        return int(self.collectives.rank)

    @property
    def enable_storage(self) -> bool:
        return bool(self._controller.enable_storage)

    def queue_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for name in CONTROL_QUEUES:
            q = getattr(self._controller, name, None)
            sizes[name] = 0 if q is None else sum(1 for item in list(q.queue) if item is not None)
        return sizes

    def _source(self, kind: StorageStepKind) -> ServedQueue | None:
        q = getattr(self._controller, SOURCE_QUEUES[kind], None)
        return q if isinstance(q, ServedQueue) else None

    def has_work(self, kind: StorageStepKind) -> bool:
        q = self._source(kind)
        return (
            self.enable_storage
            and q is not None
            and any(i is not None for i in list(q.queue))
            and self.gate.serves(THREAD_FUNCS[kind])
        )

    def has_any_work(self) -> bool:
        return any(self.has_work(kind) for kind in SOURCE_QUEUES)

    def run_step(self, kind: StorageStepKind) -> StepResult:
        """One iteration of upstream's ``kind`` thread, on the item at the head of its queue."""
        q = self._source(kind)
        if q is None or not self.has_work(kind):
            return StepResult(kind, self.rank, self.epoch)
        item = q.queue[0]
        out = getattr(self._controller, "prefetch_sync_queue", None)
        out = out if kind is StorageStepKind.IO else None
        before = len(out.queue) if out is not None else 0
        self.gate.serve(q, kind.value, self.rank)
        if self.protocol == PROTOCOL_POLL and kind is not StorageStepKind.BACKUP:
            return self._polled_result(kind, item)
        return self._result(kind, item, out, before)

    def _polled_result(self, kind: StorageStepKind, item: Any) -> StepResult:
        """0.5.10: the hit thread leaves the agreed hit in ``hash_value`` (empty when it
        revoked), the IO thread its progress in ``completed_tokens``; neither acks."""
        if kind is StorageStepKind.HIT_QUERY:
            tokens = len(item.hash_value) * int(self._controller.page_size)
        else:
            tokens = int(item.completed_tokens)
        return StepResult(kind, self.rank, self.epoch, item.id, item.request_id, tokens, False)

    def release_queue_items(self) -> list[torch.Tensor]:
        """What ``host_mem_release_queue`` holds now (0.5.10's threads release into it)."""
        q = getattr(self._controller, "host_mem_release_queue", None)
        return [] if q is None else [t for t in list(q.queue) if t is not None]

    def _result(self, kind: StorageStepKind, item: Any, out: Any, before: int) -> StepResult:
        rank, epoch = self.rank, self.epoch
        if kind is StorageStepKind.SYNC:
            operation = item.operation
            tokens = int(item.completed_tokens or 0)
            return StepResult(
                kind, rank, epoch, operation.id, item.rid, tokens, True, bool(item.completed_req)
            )
        request_id = getattr(item, "request_id", None)
        if kind is StorageStepKind.HIT_QUERY:
            tokens = int(item.storage_hit_count)
        elif kind is StorageStepKind.IO:
            acks = list(out.queue)[before:] if out is not None else []
            tokens = max((int(a.completed_tokens or 0) for a in acks), default=0)
        else:
            tokens = int(item.completed_tokens)
        return StepResult(
            kind, rank, epoch, item.id, request_id, tokens, True, kind.value == "backup"
        )

    def terminate_live_prefetches(self) -> int:
        live = list(self.live.values())
        for operation in live:
            operation.mark_terminate()
        return len(live)

    def detach_storage_backend(self) -> None:
        self._controller.detach_storage_backend()

    def close(self) -> None:
        """The world is gone: stop this rank's threads without waiting (no step follows)."""
        group = getattr(self.collectives, "group", None)
        if group is not None:
            group.interrupt()  # a thread draining its queue waits for no peer
        self.gate.close()
        try:
            self._controller.storage_stop_event.set()
        except ReferenceError:
            return

    def alive_threads(self) -> list[str]:
        self.gate.forget_dead()
        return self.gate.alive()


def build_storage_controller(
    module: types.ModuleType, tree: Path, *args: Any, **kwargs: Any
) -> Any:
    """Upstream's controller of one storage rank (``collectives`` keyword: its rank's view)."""
    return storage_controller_class(module, tree)(*args, **kwargs)


def storage_controller_class(module: types.ModuleType, tree: Path) -> type[Any]:
    """Upstream's ``HiCacheController`` with the shapes the harness's tree half calls.

    The module's ``Queue``, ``threading`` and ``torch`` become the served queue, the gated thread
    and the harness's process group; the storage tier's own code is upstream's, unchanged.
    """
    cached = module.__dict__.get("_harness_storage_class")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    acks = has_ack_protocol(module.HiCacheController)
    page_keys = _page_keys_function(tree)
    module.__dict__["Queue"] = ServedQueue
    module.__dict__["threading"] = types.SimpleNamespace(
        **{k: getattr(threading, k) for k in ("Event", "Lock", "RLock", "Condition")},
        Thread=GatedThread,
    )
    module.__dict__["torch"] = harness_torch
    # upstream logs every backend failure with its traceback; the harness checks what follows
    logging.getLogger(module.__name__).setLevel(logging.CRITICAL)
    base: type[Any] = module.HiCacheController

    class HarnessStorageController(base):  # type: ignore[misc]
        """Upstream's controller; only the tree-facing shapes are added (see the module doc)."""

        def __init__(self, *args: Any, collectives: Any = None, **kwargs: Any) -> None:
            self._harness_gate = StepGate(lambda: bool(self.storage_stop_event.is_set()))
            self._harness_collectives = collectives or SingleRank()
            self._harness_tp = TpHandle(self._harness_collectives, SyncGroup("tp"))
            super().__init__(*args, **kwargs)
            self.storage_stop_event = GateStopEvent(self._harness_gate)  # no thread runs yet
            self.tp_group = self._harness_tp
            self.storage = UpstreamTier(
                self,
                self._harness_gate,
                self._harness_collectives,
                protocol=PROTOCOL_ACK if acks else PROTOCOL_POLL,
            )
            if not acks:  # 0.5.10: no hit or ack queue; the tree's drains find them empty
                self.prefetch_hit_queue: queue.Queue[Any] = queue.Queue()
                self.ack_prefetch_queue: queue.Queue[Any] = queue.Queue()

        @property
        def storage_batch_size(self) -> int:
            return int(module.__dict__.get("STORAGE_BATCH_SIZE", 128))

        @storage_batch_size.setter
        def storage_batch_size(self, pages: int) -> None:
            module.__dict__["STORAGE_BATCH_SIZE"] = int(pages)

        def attach_storage_backend(self, *args: Any, **kwargs: Any) -> None:
            with attaching(module, self._harness_tp, tree):
                super().attach_storage_backend(*args, **kwargs)
            self._harness_gate.settle()
            self.storage.epoch += 1

        def reset(self) -> None:
            group = getattr(self._harness_collectives, "group", None)
            if group is not None and getattr(self, "enable_storage", False):
                group.interrupt()  # a thread draining its queue on stop waits for no peer
            try:
                super().reset()
            finally:
                if group is not None and getattr(self, "enable_storage", False):
                    group.resume()
            self._harness_gate.settle()  # the new epoch's threads, each at its queue
            backend = getattr(self, "storage_backend", None)
            take = getattr(backend, "take", None)
            if callable(take):
                take()  # what the stopping threads did is no step's
            self.storage.epoch += 1

        def prefetch(self, request_id: str, *args: Any) -> Any:
            """0.5.23: ``(rid, tokens, last_hash, prefix_keys)``; 0.5.10: ``(rid,
            host_indices, tokens, last_hash, prefix_keys)`` (the tree allocated the pages)."""
            head, tokens, rest = (
                (args[:1], args[1], args[2:]) if not acks else ((), args[0], args[1:])
            )
            operation = super().prefetch(request_id, *head, list(tokens), *rest)
            self.storage.live[operation.id] = operation
            return operation

        def write_storage(
            self,
            host_indices: torch.Tensor,
            token_ids: Sequence[Any],
            hash_value: Sequence[str] | None = None,
            prefix_keys: Sequence[str] | None = None,
        ) -> int:
            if (
                hash_value is None
            ):  # the radix cache computes a node's keys (compute_node_hash_values)
                prior = prefix_keys[-1] if prefix_keys else None
                hash_value = page_keys(list(token_ids), prior, self.page_size)
            keys = None if prefix_keys is None else list(prefix_keys)
            op_id: int = super().write_storage(
                host_indices, list(token_ids), list(hash_value), keys
            )
            return op_id

        if acks and not callable(getattr(base, "alloc_prefetch_host_buffers", None)):

            def alloc_prefetch_host_buffers(self: Any, operation: Any, need_size: int) -> Any:
                """0.5.20 - 0.5.21: the radix cache allocates the bounce buffer from the host
                pool itself (0.5.22 moved that one line into the controller)."""
                return self.mem_pool_host.alloc(need_size)

        def clear_storage_backend(self) -> bool:
            """The scheduler's clear endpoint: 0.5.23's ``HybridCacheController`` and 0.5.10's
            radix cache both end in ``storage_backend.clear()``, which this class lacks."""
            if callable(getattr(base, "clear_storage_backend", None)):
                return bool(super().clear_storage_backend())
            if not self.enable_storage:
                return False
            self.storage_backend.clear()
            return True

        def is_prefetch_complete(self, operation: Any) -> bool:
            """0.5.23's radix cache: complete once ``completed_tokens`` reached the hit."""
            return bool(
                operation.host_indices is not None
                and operation.completed_tokens >= operation.storage_hit_count
            )

    HarnessStorageController.__name__ = base.__name__
    module.__dict__["_harness_storage_class"] = HarnessStorageController
    return HarnessStorageController
