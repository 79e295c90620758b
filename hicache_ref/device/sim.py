"""SimDevice: a CPU stand-in for torch.cuda where the test decides when stream work runs.

Each stream is a FIFO of queued operations (copies, kernels, event records, event waits).
Nothing executes until the caller advances a stream (``advance(stream, n)``) or asks for
completion (``run_until_idle()``, ``Event.synchronize()``, ``Stream.synchronize()``). A wait op
blocks its stream until the record it is bound to has executed, so cross-stream ordering is
exactly what the events say and nothing more. Copies are closures over real CPU tensors that run
when executed, so a missing wait shows up as wrong bytes.

CUDA semantics reproduced on purpose:
- ``query()`` on a never-recorded event is True;
- ``wait`` binds to the event's most recent ``record`` at the time of the ``wait`` call;
  re-recording the event later affects only later waits;
- ``wait`` on a never-recorded event is a no-op.

Every executed op is appended to ``log`` (the happens-before log: stream order plus the record
each wait was bound to) and handed to every ``on_execute`` listener, and all scheduling
choices come from one seed. ``tagged(**tags)`` is a view of the device whose launches carry
``tags`` in their meta, so a listener can tell whose op ran (the lockstep oracle hands each
rank's host pools one, to learn which rank and pool a copy moved).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hicache_ref.device.protocol import EventT, OpKind, StreamT
from hicache_ref.errors import HiCacheInputError

SIM_QUEUE_BOUND = 1_000_000
"""Upper bound on queued ops per stream; exceeding it means a runaway producer (TigerStyle)."""


class SimDeadlock(RuntimeError):
    """No stream can make progress, yet work is queued (a wait on a record that can never run)."""


@dataclass(eq=False)
class _SimOp:
    seq: int
    stream: SimStream
    kind: OpKind
    label: str
    fn: Callable[[], None] | None = None
    waits_for: _SimOp | None = None
    done: bool = False
    meta: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecutedOp:
    """One entry of the happens-before log."""

    seq: int
    stream_id: int
    kind: OpKind
    label: str
    waited_for_seq: int | None
    meta: dict[str, object]


class SimStream:
    """A FIFO of queued operations; see the module docstring."""

    def __init__(self, device: SimDevice, stream_id: int, name: str) -> None:
        self._device = device
        self.stream_id = stream_id
        self.name = name
        self._queue: deque[_SimOp] = deque()

    def __repr__(self) -> str:
        return f"SimStream({self.name}, pending={len(self._queue)})"

    # -- torch.cuda.Stream surface -------------------------------------------------------------
    def wait_event(self, event: EventT) -> None:
        _as_sim_event(event).wait(self)

    def wait_stream(self, stream: StreamT) -> None:
        marker = SimEvent(self._device)
        marker.record(stream)
        marker.wait(self)

    def synchronize(self) -> None:
        if self._queue:
            self._device._run_to(self._queue[-1])

    def query(self) -> bool:
        return not self._queue

    # -- simulator surface -----------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._queue)

    def head_is_runnable(self) -> bool:
        if not self._queue:
            return False
        head = self._queue[0]
        return head.waits_for is None or head.waits_for.done

    def _enqueue(self, op: _SimOp) -> None:
        if len(self._queue) >= SIM_QUEUE_BOUND:
            raise SimDeadlock(
                f"stream {self.name} has {SIM_QUEUE_BOUND} queued ops; nothing advances it "
                "(advance the stream or call run_until_idle())"
            )
        self._queue.append(op)


def _as_sim_event(event: EventT) -> SimEvent:
    if not isinstance(event, SimEvent):
        raise HiCacheInputError(
            f"SimDevice streams only accept SimEvent, got {type(event).__name__} "
            "(create events with device.Event())"
        )
    return event


def _as_sim_stream(stream: StreamT) -> SimStream:
    if not isinstance(stream, SimStream):
        raise HiCacheInputError(
            f"SimDevice expects SimStream, got {type(stream).__name__} "
            "(create streams with device.Stream())"
        )
    return stream


class SimEvent:
    """An event whose completion is decided by stream execution."""

    def __init__(self, device: SimDevice, enable_timing: bool = False) -> None:
        self._device = device
        self.enable_timing = enable_timing
        self._latest: _SimOp | None = None

    def record(self, stream: StreamT | None = None) -> None:
        target = self._device._resolve(stream)
        op = self._device._new_op(target, "record", "event.record")
        self._latest = op
        target._enqueue(op)
        self._device._settle()

    def wait(self, stream: StreamT | None = None) -> None:
        target = self._device._resolve(stream)
        bound = self._latest
        if bound is None:
            return  # CUDA: waiting on a never-recorded event is a no-op
        op = self._device._new_op(target, "wait", "event.wait")
        op.waits_for = bound
        target._enqueue(op)
        self._device._settle()

    def query(self) -> bool:
        return self._latest is None or self._latest.done

    def synchronize(self) -> None:
        if self._latest is not None:
            self._device._run_to(self._latest)

    def elapsed_time(self, end_event: SimEvent) -> float:
        return 0.0

    @property
    def recorded(self) -> bool:
        return self._latest is not None


class SimDevice:
    """A simulated accelerator: seeded, deterministic, controlled by the caller."""

    name = "sim"

    def __init__(self, seed: int = 0, *, settle_records: bool = False) -> None:
        self.device = torch.device("cpu")
        self.settle_records = settle_records
        """When True, event records and satisfied waits run as soon as they reach the head of
        their stream (a GPU completes them with the work ahead); copies and kernels still run
        only when advanced. The oracle models this schedule (``OracleConfig.settle_records``)."""
        self.pin_memory = False
        self.seed = seed
        self._rng = random.Random(seed)
        self._seq = 0
        self._streams: list[SimStream] = []
        self.default_stream = self._make_stream("default")
        self._current: SimStream = self.default_stream
        self.log: list[ExecutedOp] = []
        self.log_enabled = True
        self.on_execute: list[Callable[[ExecutedOp], None]] = []
        self._records_done: dict[int, int] = {}  # stream id -> event records it executed

    # -- torch.cuda surface ----------------------------------------------------------------------
    def Event(self, enable_timing: bool = False) -> SimEvent:
        return SimEvent(self, enable_timing)

    def Stream(self, name: str | None = None) -> SimStream:
        return self._make_stream(name or f"stream{len(self._streams)}")

    @contextmanager
    def stream(self, stream: StreamT) -> Iterator[SimStream]:
        target = _as_sim_stream(stream)
        previous = self._current
        self._current = target
        try:
            yield target
        finally:
            self._current = previous

    def current_stream(self) -> SimStream:
        return self._current

    def synchronize(self) -> None:
        self.run_until_idle()

    def record_stream(self, tensor: torch.Tensor, stream: StreamT) -> None:
        _as_sim_stream(stream)  # CPU tensors need no lifetime extension; validate the argument

    def launch(
        self,
        fn: Callable[[], None],
        *,
        label: str,
        kind: OpKind = "copy",
        meta: dict[str, object] | None = None,
    ) -> None:
        op = self._new_op(self._current, kind, label)
        op.fn = fn
        if meta:
            op.meta = dict(meta)
        self._current._enqueue(op)

    def tagged(self, **tags: object) -> TaggedLaunch:
        """A view of this device whose ``launch`` adds ``tags`` to every op's meta."""
        return TaggedLaunch(self, tags)

    # -- simulator surface -----------------------------------------------------------------------
    @property
    def streams(self) -> tuple[SimStream, ...]:
        return tuple(self._streams)

    def advance(self, stream: StreamT, n: int = 1) -> int:
        """Execute up to ``n`` ops from the head of ``stream``; stops at a blocked wait."""
        if n < 0:
            raise HiCacheInputError(f"advance(n={n}): n must be >= 0")
        target = _as_sim_stream(stream)
        executed = 0
        while executed < n and target.head_is_runnable():
            self._execute(target)
            executed += 1
        return executed

    def advance_to_record(self, stream: StreamT) -> int:
        """Execute ``stream``'s ops up to and including its next event record (what makes an ack
        or a layer visible), leaving every op queued behind it; stops early at a blocked wait.
        Returns how many ops ran on the stream (a record settled on its own counts too)."""
        target = _as_sim_stream(stream)
        records = self._records_done.get(target.stream_id, 0)
        executed = 0
        while target.head_is_runnable() and self._records_done.get(target.stream_id, 0) == records:
            self._execute(target)
            executed += 1
        return executed

    def runnable_streams(self) -> list[SimStream]:
        return [s for s in self._streams if s.head_is_runnable()]

    def is_idle(self) -> bool:
        return all(s.pending == 0 for s in self._streams)

    def pending_ops(self) -> int:
        return sum(s.pending for s in self._streams)

    def step_random(self) -> bool:
        """Execute the head of one runnable stream chosen by the seeded RNG."""
        runnable = self.runnable_streams()
        if not runnable:
            return False
        self._execute(self._rng.choice(runnable))
        return True

    def run_until_idle(self) -> None:
        """Run every stream to empty, interleaving runnable heads by the seeded RNG."""
        while not self.is_idle():
            if not self.step_random():
                self._raise_deadlock()

    # -- internals -------------------------------------------------------------------------------
    def _make_stream(self, name: str) -> SimStream:
        stream = SimStream(self, len(self._streams), name)
        self._streams.append(stream)
        return stream

    def _resolve(self, stream: StreamT | None) -> SimStream:
        return self._current if stream is None else _as_sim_stream(stream)

    def _new_op(self, stream: SimStream, kind: OpKind, label: str) -> _SimOp:
        self._seq += 1
        return _SimOp(seq=self._seq, stream=stream, kind=kind, label=label)

    def _settle(self) -> None:
        if not self.settle_records:
            return
        progressed = True
        while progressed:
            progressed = False
            for stream in self._streams:
                while (
                    stream._queue
                    and stream._queue[0].kind in ("record", "wait")
                    and (stream.head_is_runnable())
                ):
                    self._execute(stream, settle=False)
                    progressed = True

    def _execute(self, stream: SimStream, *, settle: bool = True) -> None:
        op = stream._queue.popleft()
        if op.fn is not None:
            op.fn()
        op.done = True
        if op.kind == "record":
            self._records_done[stream.stream_id] = self._records_done.get(stream.stream_id, 0) + 1
        entry = ExecutedOp(
            seq=op.seq,
            stream_id=stream.stream_id,
            kind=op.kind,
            label=op.label,
            waited_for_seq=op.waits_for.seq if op.waits_for is not None else None,
            meta=op.meta,
        )
        if self.log_enabled:
            self.log.append(entry)
        for hook in self.on_execute:
            hook(entry)
        if settle:
            self._settle()

    def _run_to(self, target: _SimOp) -> None:
        """Execute the minimum work needed for ``target`` to be done (what a host sync does)."""
        while not target.done:
            stream = target.stream
            if not stream._queue:
                raise SimDeadlock(f"op {target.seq} ({target.label}) is not queued anywhere")
            head = stream._queue[0]
            if head.waits_for is not None and not head.waits_for.done:
                self._run_to(head.waits_for)
                continue
            self._execute(stream)

    def _raise_deadlock(self) -> None:
        blocked = [
            f"{s.name}: head {s._queue[0].label} waits for op "
            f"{s._queue[0].waits_for.seq if s._queue[0].waits_for else '?'}"
            for s in self._streams
            if s._queue
        ]
        raise SimDeadlock("no stream can make progress: " + "; ".join(blocked))


class TaggedLaunch:
    """A ``SimDevice`` whose launches carry fixed tags in their meta (see ``SimDevice.tagged``).

    Everything but ``launch`` is the device's own (streams, events, the log), so the view can
    stand wherever the device does; only the meta of the ops it launches differs.
    """

    def __init__(self, device: SimDevice, tags: dict[str, object]) -> None:
        self.sim = device
        self.tags = dict(tags)

    def launch(
        self,
        fn: Callable[[], None],
        *,
        label: str,
        kind: OpKind = "copy",
        meta: dict[str, object] | None = None,
    ) -> None:
        self.sim.launch(fn, label=label, kind=kind, meta={**(meta or {}), **self.tags})

    def __getattr__(self, name: str) -> object:
        return getattr(self.sim, name)
