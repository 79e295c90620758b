"""The timeout stop policy's PP verdict: upstream's own methods, run from the tree per PP rank.

0.5.20+'s unified radix cache asks ``_can_terminate_prefetch(operation)`` of a prefetch without a
PP ticket (a cache-mode PP group) on every rank at once; under the ``timeout`` policy PP rank 0
alone reads its deadline and ``_all_reduce`` hands the verdict along PP (``_pp_sync``: each rank
receives from the one before and sends to the one after). The gate loads no radix cache, so
this module reads just those methods from the tree's ``unified_radix_cache.py`` (the class's
functions by name, ``VERDICT_METHODS``) and runs them on a small stand-in of each rank's cache,
in flow order:

- ``verdict_methods``: the tree's methods, compiled once per tree (None: the tree has no
  PP-rank-0 verdict, before 0.5.20);
- ``RankClock``: the rank's wall clock, which the harness moves (its ``time`` module for the
  methods: 0.5.20 - 0.5.22 read ``time.monotonic()`` against the operation's start, 0.5.23+ a
  poll timer started at the first blocked poll);
- ``PpPipe``: the point-to-point sends between the in-process PP ranks (``isend`` queues,
  ``recv`` takes, rank 0 first; a ``recv`` with nothing sent is a rank waiting forever: INV-20);
- ``RankVerdict``: one rank's cache as the methods see it (``pp_rank``, the policy and its
  budget, no TP or attention groups), each method bound to it over the rank's own ``torch`` and
  ``time`` (each rank a process of its own); ``can_terminate`` is the verdict, ``start_wait``
  and ``mark_expired`` what ``check_prefetch_progress`` does around it.

What every rank returned is the evidence of INV-38's verdict rule (``driver/pp_verdict``).

Our own stand-ins replace what the methods need beyond plain torch: upstream's ``rank_consensus``
decorator (a debug check, the identity here), its ``P2PTag`` and its ``PollTimer`` /
``_StoragePrefetchWait`` records (``msgspec`` structs: the timer here reads the rank's clock).
"""

from __future__ import annotations

import ast
import functools
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache_ref.errors import InvariantViolation

UNIFIED_RELPATH = Path("sglang/srt/mem_cache/unified_radix_cache.py")
VERDICT_METHODS = (
    "_all_reduce_attn_groups",
    "_all_reduce",
    "_pp_sync",
    "_prefetch_timeout_check_linear_func",  # 0.5.20 - 0.5.22: the operation's start
    "_start_storage_prefetch_wait",  # 0.5.23+: a timer from the first blocked poll
    "_prefetch_deadline_expired",
    "_mark_prefetch_deadline_expired",
    "_can_terminate_prefetch",
)
VERDICT_MARK = "PP0 decides"
"""The comment that marks the PP-rank-0 verdict in the tree's ``_can_terminate_prefetch``."""
TIMEOUT_BASE_S = 1.0
TIMEOUT_PER_PAGE_S = 0.25
"""The radix cache's defaults (``prefetch_timeout_base``, ``prefetch_timeout_per_page``)."""


@functools.cache
def verdict_methods(tree: Path) -> dict[str, types.CodeType] | None:
    """The tree's verdict methods, compiled (None: no PP-rank-0 verdict in this tree)."""
    path = tree / UNIFIED_RELPATH
    if not path.is_file() or VERDICT_MARK not in path.read_text(errors="replace"):
        return None
    parsed = ast.parse(path.read_text(), str(path))
    (cls,) = [
        n for n in parsed.body if isinstance(n, ast.ClassDef) and n.name == "UnifiedRadixCache"
    ]
    found = {
        n.name: n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in VERDICT_METHODS
    }
    return {
        name: compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
        for name, node in found.items()
    }


class RankClock:
    """A PP rank's wall clock, moved by the harness (ranks' clocks differ)."""

    def __init__(self, origin: float) -> None:
        self.now = origin

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


@dataclass
class PollTimer:
    """Our stand-in for upstream's ``PollTimer``: from the first blocked poll, on ``clock``."""

    clock: RankClock
    started_at: float | None = None

    @property
    def running(self) -> bool:
        return self.started_at is not None

    def elapsed(self) -> float:
        return self.clock.now - self.started_at if self.started_at is not None else 0.0

    def observe(self, ready: bool) -> float:
        if ready:
            elapsed, self.started_at = self.elapsed(), None
            return elapsed
        if self.started_at is None:
            self.started_at = self.clock.now
        return 0.0


class PpPipe:
    """Sends between in-process PP ranks: (source, destination) -> tensors in flight."""

    def __init__(self) -> None:
        self.inflight: dict[tuple[int, int], deque[torch.Tensor]] = {}

    def send(self, src: int, dst: int, data: torch.Tensor) -> None:
        self.inflight.setdefault((src, dst), deque()).append(data.clone())

    def recv(self, src: int, dst: int, into: torch.Tensor) -> None:
        queue = self.inflight.get((src, dst))
        # Verify a rank receives only what its PP neighbour sent (INV-20: a recv nobody serves)
        if not queue:
            raise InvariantViolation(
                "INV-20",
                f"PP rank {dst} waits in _pp_sync's recv for PP rank {src}'s verdict, which PP "
                f"rank {src} never sent (every rank reaches the verdict's collective together: "
                "PP rank 0 sends, each follower receives then sends on)",
            )
        into.copy_(queue.popleft())

    def pending(self) -> int:
        return sum(len(queue) for queue in self.inflight.values())


class _Work:
    def wait(self) -> None:
        """A queued send is delivered at once."""


class _RankDistributed:
    """The ``torch.distributed`` the methods of one rank see: the PP group is the pipe."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, pipe: PpPipe, rank: int, size: int) -> None:
        self.pipe, self.rank, self.size = pipe, rank, size

    def get_world_size(self, group: Any = None) -> int:
        return self.size

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        """TP 1: a reduce over one rank leaves the tensor as it is."""

    def recv(
        self, tensor: torch.Tensor, group_src: int, group: Any = None, tag: Any = None
    ) -> None:
        self.pipe.recv(group_src, self.rank, tensor)

    def isend(
        self, tensor: torch.Tensor, group_dst: int, group: Any = None, tag: Any = None
    ) -> _Work:
        self.pipe.send(self.rank, group_dst, tensor)
        return _Work()


class _Tags:
    def __getattr__(self, name: str) -> str:
        return name


class _Retries:
    def cancel(self, rid: str) -> None:
        """Retries are the machine's concern: a PP verdict world schedules none."""


@dataclass
class _StoragePrefetchWait:
    """Our stand-in for upstream's record of a blocked prefetch's deadline."""

    timer: PollTimer
    timeout_s: float = 0.0
    expired: bool = False


@dataclass
class RankVerdict:
    """One PP rank's cache as upstream's verdict methods see it (see the module doc)."""

    pp_rank: int
    pp_size: int
    clock: RankClock
    pipe: PpPipe
    page_size: int
    prefetch_stop_policy: str = "timeout"
    prefetch_timeout_base: float = TIMEOUT_BASE_S
    prefetch_timeout_per_page: float = TIMEOUT_PER_PAGE_S
    pp_group: str = "pp"
    tp_group: None = None
    attn_cp_group: None = None
    attn_tp_group: None = None
    tp_world_size: int = 1
    work_list: list[Any] = field(default_factory=list)
    _storage_prefetch_wait: dict[Any, Any] = field(default_factory=dict)
    storage_prefetch_retries: _Retries = field(default_factory=_Retries)
    bound: dict[str, Callable[..., Any]] = field(default_factory=dict)  # the tree's methods

    def bind(self, methods: dict[str, types.CodeType]) -> None:
        """Each of the tree's methods as this rank's own, over the rank's ``torch`` and clock."""
        facade = types.SimpleNamespace(
            tensor=torch.tensor,
            int=torch.int,
            distributed=_RankDistributed(self.pipe, self.pp_rank, self.pp_size),
        )
        clock = self.clock
        namespace: dict[str, Any] = {
            "torch": facade,
            "time": clock,
            "P2PTag": _Tags(),
            "rank_consensus": _identity_decorator,
            "_StoragePrefetchWait": lambda **kw: _StoragePrefetchWait(PollTimer(clock), **kw),
            "PrefetchOperation": Any,
        }
        exec("from __future__ import annotations\n", namespace)
        for code in methods.values():
            exec(code, namespace)
        for name in methods:  # attributes too: the methods call each other on self
            self.bound[name] = types.MethodType(namespace[name], self)
            setattr(self, name, self.bound[name])

    def can_terminate(self, operation: Any) -> bool:
        return bool(self.bound["_can_terminate_prefetch"](operation))

    @property
    def waits_from_first_poll(self) -> bool:
        """0.5.23+: the deadline runs from the first blocked poll (``_start_storage_prefetch_wait``)."""
        return "_start_storage_prefetch_wait" in self.bound

    def start_wait(self, operation: Any) -> None:
        if self.waits_from_first_poll:
            self.bound["_start_storage_prefetch_wait"](operation)

    def mark_expired(self, operation: Any) -> None:
        if "_mark_prefetch_deadline_expired" in self.bound:
            self.bound["_mark_prefetch_deadline_expired"](operation)


def _identity_decorator(func: Callable[..., Any] | None = None, **_: Any) -> Any:
    """Upstream's ``rank_consensus`` (a debug check of results across ranks), as the identity."""
    if func is None:
        return lambda inner: inner
    return func
