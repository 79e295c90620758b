"""Which steps read how far the streams got, and when their answer is the same for every
conforming implementation (the generator's side of normalization).

How many device ops a transfer takes is the implementation's choice, so after
``advance(stream, n)`` one implementation's ack may have finished and another's not. A step
that reads completion (``COMPLETION``) is kept in a vector only where every conforming
implementation must answer alike:

- an ack is *surely finished* once its stream was synchronized after it was appended;
- an ack is *surely in flight* while no copy or kernel ran on its stream since it was appended
  and its rank copies something for it (nothing runs until the replayer runs it: true on a
  simulated device only, so a vector relying on it is ``schedule: sim``).

Before a drain whose answer would depend on the implementation, the generator synchronizes the
streams concerned (``unsettled_streams``); a step that needs a copy in flight (a misuse probe,
a reset or a scribble with copies queued) is offered only when one surely is
(``in_flight_determinate``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from hicache_ref.device.sim import ExecutedOp, SimDevice, SimStream
from hicache_ref.harness.steps.rules import RULES
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step

Reads = Literal["nothing", "acks", "in_flight"]
COMPLETION: Mapping[str, Reads] = MappingProxyType(
    {
        "drain_write": "acks",
        "drain_load": "acks",
        "drain_acks": "acks",
        "probe_evict_host": "in_flight",
        "probe_evict_device": "in_flight",
        "reset_in_flight": "in_flight",
        "scribble_free_host": "in_flight",
    }
)
"""The rules that read completion: ``acks`` (what is drained depends on finished acks),
``in_flight`` (enabled only while a copy is still queued). Every other rule reads nothing of
it; ``tests/vectors`` checks that each rule of ``rules.RULES`` is classified on purpose
(``CLASSIFIED_NOTHING``), so a new rule is looked at before it lands in a vector."""
CLASSIFIED_NOTHING = frozenset(
    {
        "prefill",
        "forward_layer",
        "store_layer",
        "layer_end",
        "write",
        "start_writing",
        "reserve",
        "submit_layer",
        "cancel",
        "load",
        "start_loading",
        "forward_read",
        "forward_read_batch",
        "evict_device",
        "drop",
        "evict_host",
        "advance",
        "advance_to_record",
        "synchronize",
        "probe_rewrite",
        "reset",
        "noop",
        # the storage tier's rules: its threads run only when a vector's storage_step says
        # so, on host memory and the backend, never on a device stream; what a drain of
        # storage acks answers is fixed by the storage steps before it
        "write_storage",
        "storage_step",
        "prefetch",
        "check_prefetch",
        "terminate_prefetch",
        "drain_prefetch_acks",
        "drain_backup_acks",
        "inject_fault",
        "detach_storage",
        "attach_storage",
        "clear_storage",
        "reset_storage_in_flight",
        # a schedule point's grant: one storage thread to its next point, never a device stream
        "schedule_point",
    }
)
QUEUES = ("write", "load")
WORK_KINDS = ("copy", "kernel")


def reads_completion(rule: str) -> Reads:
    return COMPLETION.get(rule, "nothing")


@dataclass
class _Stamp:
    ack: object  # held so its id stays unique while stamped
    ran: int  # copies/kernels run on its stream before the step that appended it
    epoch: int  # host synchronizations of its stream before that step


class CompletionTracker:
    """Follows one generating session: when each ack was appended, what ran since."""

    def __init__(self, session: Session) -> None:
        self.session = session
        device = session.world.device
        assert isinstance(device, SimDevice), "vectors are generated on the simulator"
        self.ran: Counter[int] = Counter()  # stream id -> copies/kernels executed
        self.epoch: Counter[str] = Counter()  # "write" / "load" -> synchronizations
        self.stamps: dict[int, _Stamp] = {}
        self._ran_before: Counter[int] = Counter()
        self._epoch_before: Counter[str] = Counter()
        device.on_execute.append(self._on_execute)

    def _on_execute(self, op: ExecutedOp) -> None:
        if op.kind in WORK_KINDS:
            self.ran[op.stream_id] += 1

    def _stream_id(self, rank: int, queue: str) -> int:
        controller = self.session.world.ranks[rank].controller
        stream = controller.write_stream if queue == "write" else controller.load_stream
        assert isinstance(stream, SimStream)
        return stream.stream_id

    def _queue(self, rank: int, queue: str) -> list[object]:
        controller = self.session.world.ranks[rank].controller
        return list(controller.ack_write_queue if queue == "write" else controller.ack_load_queue)

    # -- around each applied step -------------------------------------------------------------
    def before_step(self) -> None:
        self._ran_before = Counter(self.ran)
        self._epoch_before = Counter(self.epoch)

    def after_step(self, step: Step) -> None:
        if step.rule == "synchronize" and step.args.get("stream") in QUEUES:
            self.epoch[str(step.args["stream"])] += 1
        live: dict[int, _Stamp] = {}
        for rank in range(len(self.session.world.ranks)):
            for queue in QUEUES:
                stream = self._stream_id(rank, queue)
                for ack in self._queue(rank, queue):
                    old = self.stamps.get(id(ack))
                    live[id(ack)] = old or _Stamp(
                        ack, self._ran_before[stream], self._epoch_before[queue]
                    )
        self.stamps = live

    # -- questions ----------------------------------------------------------------------------
    def _surely_finished(self, ack: object, queue: str) -> bool:
        stamp = self.stamps.get(id(ack))
        return stamp is not None and self.epoch[queue] > stamp.epoch

    def _surely_in_flight(self, ack: object, rank: int, queue: str) -> bool:
        stamp = self.stamps.get(id(ack))
        if stamp is None or self.ran[self._stream_id(rank, queue)] != stamp.ran:
            return False
        return self._copies_something(ack, rank)

    def _copies_something(self, ack: object, rank: int) -> bool:
        """Whether ``rank`` moves bytes for one of the ack's nodes (the harness's layout)."""
        tree = self.session.tree
        by_id = {n.node_id: n for n in tree.nodes.values()}
        for node_id in getattr(ack, "node_ids", ()):
            node = by_id.get(int(node_id))
            if node is None:
                continue
            if not self.session.config.uses_cp:
                return True
            if node.owned_positions and len(node.owned_positions[rank]):
                return True
            if node.value is not None and len(tree.geometry.placement(rank, node)[0]):
                return True
        return False

    def queue_verdict(self, queue: str) -> Literal["settled", "in_flight", "unsettled"]:
        """How a drain of ``queue`` would end on every conforming implementation: each ack in
        order surely finished (on every rank), until one that is surely in flight (on some
        rank) stops the drain; ``unsettled`` if an ack is neither before that."""
        ranks = range(len(self.session.world.ranks))
        per_rank = [self._queue(rank, queue) for rank in ranks]
        depth = min((len(q) for q in per_rank), default=0)
        for position in range(depth):
            if all(self._surely_finished(q[position], queue) for q in per_rank):
                continue
            if any(self._surely_in_flight(per_rank[r][position], r, queue) for r in ranks):
                return "in_flight"
            return "unsettled"
        return "settled"

    def unsettled_streams(self, step: Step) -> list[str]:
        """The copy streams to synchronize before ``step`` so its drain is determinate."""
        if reads_completion(step.rule) != "acks":
            return []
        queues = {"drain_write": ("write",), "drain_load": ("load",)}.get(step.rule, QUEUES)
        return [q for q in queues if self.queue_verdict(q) == "unsettled"]

    def relies_on_in_flight(self, step: Step) -> bool:
        """Whether ``step``'s answer counts on a copy not having run (``schedule: sim``)."""
        kind = reads_completion(step.rule)
        if kind == "in_flight":
            return True
        if kind != "acks":
            return False
        queues = {"drain_write": ("write",), "drain_load": ("load",)}.get(step.rule, QUEUES)
        return any(self.queue_verdict(q) == "in_flight" for q in queues)

    def in_flight_determinate(self, step: Step) -> bool:
        """For an ``in_flight`` step: a copy it needs queued surely is (for its node, if any)."""
        if reads_completion(step.rule) != "in_flight":
            return True
        node_id = None
        if "node" in step.args:
            node = self.session.tree.nodes.get(int(step.args["node"]))
            if node is None:
                return False
            node_id = node.node_id
            per_layer = [r.per_layer for r in self.session.world.ranks]
            if any(p is not None and node_id in p.pending_layer_writes for p in per_layer):
                return True  # a pending per-layer write is the implementation's state, no timing
        for rank in range(len(self.session.world.ranks)):
            for queue in QUEUES:
                if step.rule == "probe_evict_host" and queue == "load":
                    continue
                for ack in self._queue(rank, queue):
                    ids = list(getattr(ack, "node_ids", ()))
                    if node_id is not None and node_id not in ids:
                        continue
                    if self._surely_in_flight(ack, rank, queue):
                        return True
        return False


def check_classified() -> list[str]:
    """Rules of ``RULES`` that are neither in ``COMPLETION`` nor ``CLASSIFIED_NOTHING``."""
    return [name for name in RULES if name not in COMPLETION and name not in CLASSIFIED_NOTHING]
