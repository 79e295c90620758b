"""A Session applies trace steps to one world: preconditions, the rule, then every check.

The Hypothesis machines, the trace replayer and the minimizer all go through ``Session.apply``,
so a step means the same thing everywhere. A step whose precondition does not hold is recorded
as skipped (this is what lets the minimizer delete steps freely). After every applied step the
session checks the invariants that are cheap enough to check always; ``finish()`` runs the
quiescence checks: every stream idle, every ack drained exactly once, every slot free or owned
by one node, every resident copy holding the bytes the content oracle predicts.

The checks live in ``invariants/registry.py``, one entry per invariant id, over per-rank
snapshots (``adapters/base.snapshot_rank``: ack rows from the implementation, pages from the
harness's own pools) and the tree's model of its nodes; the session only decides when each runs
and counts the runs per id (``SessionStats.checks_by_id``). Rules the implementation cannot do
(its capabilities, e.g. no ``per_layer_write``) are skipped, so traces stay replayable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hicache_ref.device.protocol import StreamT
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.adapters.base import (
    ControllerLike,
    Implementation,
    RankLike,
    snapshot_rank,
    unsupported_reasons,
)
from hicache_ref.harness.config import HarnessConfig
from hicache_ref.harness.trace import Step, StepArg, Trace, TraceHeader
from hicache_ref.harness.tree import TreeDriver
from hicache_ref.harness.world import build_world
from hicache_ref.invariants.registry import (
    QUIESCENCE_CHECKS,
    REFUSAL_CHECKS,
    RESET_CHECKS,
    STEP_CHECKS,
    StateCheck,
)
from hicache_ref.invariants.snapshot import RankSnapshot

STREAMS = ("forward", "write", "load")
DRAIN_ROUNDS_MAX = 10_000
REFUSABLE_RULES = ("prefill", "write", "load", "reserve")  # a "refused: ..." outcome: INV-17
SnapshotFn = Callable[[RankLike, Iterable[int]], RankSnapshot]


class StepObserver(Protocol):
    """Something that follows a session step by step (the lockstep oracle, a CP collective).

    ``after_step`` runs after each applied step's own checks, ``after_finish`` after the
    quiescence checks; raising ``InvariantViolation`` fails the case like any other check.
    """

    def after_step(self, session: Session, step: Step, outcome: str) -> None: ...

    def after_finish(self, session: Session) -> None: ...


@dataclass
class SessionStats:
    steps: int = 0
    skipped: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    invariant_checks: int = 0  # rounds of step checks (one per applied step)
    checks_by_id: Counter[str] = field(default_factory=Counter)  # check runs per invariant id


class Session:
    """One case: a world, its tree driver, the steps applied so far, and the checks."""

    def __init__(
        self, config: HarnessConfig, implementation: Implementation, impl_name: str
    ) -> None:
        reasons = unsupported_reasons(implementation.capabilities, config)
        if reasons:
            raise ValueError(
                f"implementation {impl_name!r} does not support {config.describe()}: needs {reasons}"
            )
        self.config = config
        self.implementation = implementation
        self.impl_name = impl_name
        self.world = build_world(config, implementation)
        self.capabilities = self.world.capabilities  # declared, checked against the class
        self.stats = SessionStats()
        self.tree = TreeDriver(self.world, checks=self.stats.checks_by_id)
        self.steps: list[Step] = []
        self.outcomes: list[str] = []
        self._candidates: dict[str, list[int]] = {}
        self._handlers = self._build_handlers()
        self._last_snapshots: list[RankSnapshot] | None = None  # what the last step's checks read
        override = getattr(implementation, "snapshot", None)  # an adapter may read itself
        self._snapshot_rank: SnapshotFn = override if callable(override) else snapshot_rank
        self.observers: list[StepObserver] = []  # called after each applied step and at finish

    # -- the trace -----------------------------------------------------------------------------
    def trace(self, note: str = "") -> Trace:
        source = str(getattr(self.implementation, "source_tree", "") or "")
        header = TraceHeader(
            implementation=self.impl_name, config=self.config, note=note, source=source
        )
        return Trace(header=header, steps=tuple(self.steps))

    # -- candidates (what a rule may pick) ----------------------------------------------------
    def candidates(self, rule: str) -> list[int]:
        """Node handles ``rule`` may act on now (cached until the next step is applied)."""
        cached = self._candidates.get(rule)
        if cached is None:
            cached = self._compute_candidates(rule)
            self._candidates[rule] = cached
        return cached

    def _compute_candidates(self, rule: str) -> list[int]:
        t = self.tree
        total = t.total_layers
        if rule == "write":
            return t.handles(
                lambda n: n.on_device and n.layers_stored == total and n.backup == "none"
            )
        if rule == "load":
            if self._undrained_loads() + 1 > self.config.num_counters:
                return []
            return t.handles(lambda n: not n.on_device and n.backup == "done" and not n.loading)
        if rule == "forward_read":
            return t.handles(
                lambda n: (
                    n.on_device
                    and n.layers_stored > 0
                    and (not n.loading or n.producer_id is not None)
                )
            )
        if rule == "probe_evict_host":
            return [h for h in t.handles(lambda n: n.backup == "in_flight") if t.write_in_flight(h)]
        if rule == "probe_evict_device":
            return [
                h
                for h in t.handles(lambda n: n.on_device)
                if t.write_in_flight(h) or t.load_in_flight(h)
            ]
        if rule == "probe_rewrite":
            return t.handles(lambda n: n.backup == "in_flight" and n.on_device)
        if rule == "cancel":
            return [
                h
                for h in t.handles(lambda n: n.backup == "in_flight")
                if t.has_pending_layer_write(h)
            ]
        if rule == "evict_device":
            return t.handles(
                lambda n: (
                    n.on_device and n.backup == "done" and not n.loading and n.pending_reads == 0
                )
            )
        if rule == "drop":
            return t.handles(lambda n: n.on_device and n.backup == "none" and not n.loading)
        if rule == "evict_host":
            return t.handles(lambda n: not n.on_device and n.backup == "done" and not n.loading)
        return []

    def _undrained_loads(self) -> int:
        return len(self.world.ranks[0].controller.ack_load_queue)

    def is_enabled(self, step: Step) -> bool:
        rule, args = step.rule, step.args
        if rule == "forward_layer":
            return bool(self.tree.batch)
        if rule in ("reserve", "submit_layer", "layer_end") and not self.world.per_layer_write:
            return False  # early reservations and layer-end-driven writes need per_layer_write
        if rule.startswith("probe_"):
            return "guards" in self.capabilities and int(args.get("node", -1)) in self.candidates(
                rule
            )
        if rule in ("write", "load", "cancel", "evict_device", "drop", "evict_host"):
            return int(args.get("node", -1)) in self.candidates(rule)
        if rule == "forward_read":
            node = self.tree.node(int(args.get("node", -1)))
            if node is None or int(args.get("node", -1)) not in self.candidates(rule):
                return False
            layer, draft = int(args.get("layer", 0)), bool(args.get("draft", False))
            limit = self.config.draft_layer_num if draft else self.config.layer_num
            return 0 <= layer < min(limit, node.layers_stored)
        if rule in ("store_layer", "reserve", "submit_layer"):
            node = self.tree.node(int(args.get("node", -1)))
            if node is None or not node.on_device:
                return False
            if rule == "reserve":
                return self.config.uses_cp and node.backup == "none" and not node.loading
            if rule == "submit_layer":
                return bool(node.reservations) and node.backup == "in_flight"
            draft = bool(args.get("draft", False))
            limit = self.config.draft_layer_num if draft else self.config.layer_num
            return 0 <= int(args.get("layer", -1)) < limit and not node.loading
        if rule == "layer_end":
            draft = bool(args.get("draft", False))
            limit = self.config.draft_layer_num if draft else self.config.layer_num
            return 0 <= int(args.get("layer", -1)) < limit
        if rule == "start_loading":
            return bool(self.tree.queued_loads) and (
                self._undrained_loads() < self.config.num_counters
            )
        if rule == "advance":
            return args.get("stream") in STREAMS and int(args.get("n", 0)) >= 1
        if rule == "synchronize":
            return args.get("stream") in STREAMS
        if rule == "prefill":
            handle = int(args.get("handle", self.tree.next_handle))
            return int(args.get("tokens", 0)) >= 1 and handle not in self.tree.nodes
        return rule in ("start_writing", "drain_acks", "drain_write", "drain_load", "reset", "noop")

    # -- applying steps ------------------------------------------------------------------------
    def apply(self, step: Step) -> str:
        self._candidates.clear()
        try:
            return self._apply(step)
        finally:
            self._candidates.clear()

    def _apply(self, step: Step) -> str:
        if step.rule == "prefill" and "handle" not in step.args:
            # Name the node in the step itself, so deleting earlier steps (ddmin) keeps every
            # later reference to it valid.
            step = Step(rule="prefill", args={**step.args, "handle": self.tree.next_handle})
        self.steps.append(step)
        self.stats.steps += 1
        if not self.is_enabled(step):
            self.stats.skipped += 1
            self.outcomes.append("skipped")
            return "skipped"
        self.stats.rules[step.rule] += 1
        watch_refusal = step.rule in REFUSABLE_RULES or step.rule.startswith("probe_")
        # the state before this step is the state the previous step's checks read
        before = (self._last_snapshots or self.snapshots()) if watch_refusal else None
        gate_ids = list(range(self.tree.next_node_id)) if step.rule == "reset" else []
        self._last_snapshots = None
        outcome = self._dispatch(step)
        self.outcomes.append(outcome)
        after = self.snapshots()
        if before is not None and (outcome.startswith("refused") or step.rule.startswith("probe_")):
            self.check_refusal_changed_nothing(before, after, f"{step.rule} ({outcome})")
        elif before is not None and step.rule == "prefill" and "; refused:" in outcome:
            # the node's pages stay; its refused early reservation must leave nothing behind
            self.check_refusal_changed_nothing(
                before, after, f"early reservation ({outcome})", may_change=("device pages",)
            )
        if step.rule == "reset":
            self._run_checks(RESET_CHECKS, self.snapshots(gate_ids))
        self.check_step_invariants(after)
        self._last_snapshots = after
        for observer in self.observers:
            observer.after_step(self, step, outcome)
        return outcome

    def _dispatch(self, step: Step) -> str:
        return self._handlers[step.rule](step.args)

    def _build_handlers(self) -> dict[str, Callable[[Mapping[str, StepArg]], str]]:
        """Each rule's handler over its step's args (built once per session, not per step)."""
        t = self.tree

        def node(a: Mapping[str, StepArg]) -> int:
            return int(a["node"])

        def layer(a: Mapping[str, StepArg]) -> int:
            return int(a["layer"])

        return {
            "prefill": lambda a: t.prefill(
                int(a["tokens"]),
                bool(a.get("early_reserve", False)),
                int(a["handle"]),
                batch=bool(a.get("batch", True)),
            ),
            "store_layer": lambda a: t.store_layer(node(a), layer(a), bool(a["draft"])),
            "layer_end": lambda a: t.layer_end(layer(a), bool(a["draft"])),
            "reserve": lambda a: t.reserve(node(a)),
            "submit_layer": lambda a: t.submit_layer(node(a), layer(a), bool(a["draft"])),
            "drain_write": lambda a: t.writing_check(),
            "drain_load": lambda a: t.loading_check(),
            "forward_layer": lambda a: t.forward_layer(),
            "write": lambda a: t.write_backup(node(a)),
            "start_writing": lambda a: self._start_writing(),
            "load": lambda a: t.load_back(node(a)),
            "start_loading": lambda a: t.start_loading(),
            "forward_read": lambda a: t.forward_read(node(a), layer(a), bool(a["draft"])),
            "advance": lambda a: self._advance(str(a["stream"]), int(a["n"])),
            "synchronize": lambda a: self._synchronize(str(a["stream"])),
            "drain_acks": lambda a: f"{t.writing_check()}; {t.loading_check()}",
            "cancel": lambda a: t.cancel_backup(node(a)),
            "evict_device": lambda a: t.evict_device(node(a)),
            "drop": lambda a: t.drop(node(a)),
            "evict_host": lambda a: t.evict_host(node(a)),
            "reset": lambda a: t.reset(),
            "probe_evict_host": lambda a: t.probe("evict_host", node(a)),
            "probe_evict_device": lambda a: t.probe("evict_device", node(a)),
            "probe_rewrite": lambda a: t.probe("rewrite", node(a)),
            "noop": lambda a: "noop",
        }

    def _start_writing(self) -> str:
        for rank in self.world.ranks:
            rank.controller.start_writing()
        return "start_writing"

    def _advance(self, stream: str, n: int) -> str:
        device = self.world.device
        if stream == "forward":
            return f"forward ran {device.advance(device.default_stream, n)} op(s)"
        ran = [
            device.advance(self._stream(rank.controller, stream), n) for rank in self.world.ranks
        ]
        return f"{stream} ran {ran} op(s)"

    def _synchronize(self, stream: str) -> str:
        """Host waits for a stream (what cancel_layer_write_state and a CPU read do)."""
        if stream == "forward":
            self.world.device.default_stream.synchronize()
        else:
            for rank in self.world.ranks:
                self._stream(rank.controller, stream).synchronize()
        return f"synchronized {stream}"

    @staticmethod
    def _stream(controller: ControllerLike, stream: str) -> StreamT:
        return controller.write_stream if stream == "write" else controller.load_stream

    # -- checks --------------------------------------------------------------------------------
    def snapshots(self, gate_ids: Iterable[int] | None = None) -> list[RankSnapshot]:
        """Every rank as plain data; the gate is asked about ``gate_ids`` (default: live nodes)."""
        ids = [n.node_id for n in self.tree.nodes.values()] if gate_ids is None else list(gate_ids)
        return [self._snapshot_rank(rank, ids) for rank in self.world.ranks]

    def _run_checks(
        self, checks: Mapping[str, StateCheck], snapshots: Sequence[RankSnapshot]
    ) -> None:
        model = self.tree.model()
        for inv_id, check in checks.items():
            self.stats.checks_by_id[inv_id] += 1
            check(snapshots, model)

    def check_step_invariants(self, snapshots: Sequence[RankSnapshot] | None = None) -> None:
        """After every step: the registry's ``STEP_CHECKS`` (INV-02, INV-14, INV-10, INV-05)."""
        self.stats.invariant_checks += 1
        self._run_checks(STEP_CHECKS, self.snapshots() if snapshots is None else snapshots)

    def check_refusal_changed_nothing(
        self,
        before: Sequence[RankSnapshot],
        after: Sequence[RankSnapshot],
        what: str,
        may_change: Sequence[str] = (),
    ) -> None:
        """A refused operation left every rank as it was (INV-17)."""
        for inv_id, check in REFUSAL_CHECKS.items():
            self.stats.checks_by_id[inv_id] += 1
            check(before, after, what, may_change)

    def finish(self) -> None:
        """Quiescence: run everything, drain everything, then check every byte and slot (INV-16)."""
        self._last_snapshots = None
        t = self.tree
        # The forward finishes computing every node (early-reserved backups ack only then)
        while t.batch:
            t.forward_layer()
        # Nodes stored layer by layer (oracle traces): the forward finishes their layers too
        pending = [h for h in t.nodes if t.has_pending_layer_write(h)]
        for handle in pending:
            for draft, layer_num in t._layer_kinds():
                for layer in range(layer_num):
                    t.store_layer(handle, layer, draft)
        if pending:
            for draft, layer_num in t._layer_kinds():
                for layer in range(layer_num):
                    t.layer_end(layer, draft)
        if t.queued_loads:
            while self._undrained_loads() >= self.config.num_counters:
                self.world.device.run_until_idle()
                t.loading_check()
            t.start_loading()
        for _ in range(DRAIN_ROUNDS_MAX):
            self.world.device.run_until_idle()
            t.writing_check()
            t.loading_check()
            if not t.ongoing_write and not t.ongoing_load:
                break
        else:
            raise InvariantViolation("INV-16", "acks never drained at quiescence")
        # Verify no ack is left once every submission was acked (INV-16), then every resident
        # copy's bytes (INV-06), then the pages (INV-05) and the per-layer states (INV-15)
        checks = dict(QUIESCENCE_CHECKS)
        snapshots = self.snapshots()
        self._run_checks({"INV-16": checks.pop("INV-16")}, snapshots)
        for node in t.nodes.values():
            if node.on_device and node.layers_stored == t.total_layers:
                t.check_device_bytes(node, "INV-06", "quiescence")
            if node.backup == "done":
                t.check_host_bytes(node, "INV-06", "quiescence")
        self._run_checks(checks, snapshots)
        for observer in self.observers:
            observer.after_finish(self)
