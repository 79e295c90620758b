"""A Session applies trace steps to one world: preconditions, the rule, then every check.

The Hypothesis machines, the trace replayer and the minimizer all go through ``Session.apply``,
so a step means the same thing everywhere. A step whose precondition does not hold is recorded
as skipped (this is what lets the minimizer delete steps freely). After every applied step the
session checks the invariants that are cheap enough to check always; ``finish()`` runs the
quiescence checks: every stream idle, every ack drained exactly once, every slot free or owned
by one node, every resident copy holding the bytes the content oracle predicts.

The checks live in ``invariants/registry.py``, one entry per invariant id, over per-rank snapshots
(``adapters/base.snapshot_rank``: ack rows from the implementation, pages from the harness's own
pools) and the tree's model of its nodes; the session only decides when each runs and counts the
runs per id (``SessionStats.checks_by_id``), and a round whose evidence equals the last that passed
is counted as reused, not run again (``step_checks_reused``). What each rule needs and does is its
record in its family module (``harness/rules/``, ``RULES``); a step whose rule is not enabled now (a node that is not a
candidate, a capability the implementation lacks, e.g. no ``per_layer_write``) is skipped with the
record's reason (``skip_reasons``), so traces stay replayable. While the free slots hold the
harness's poison (``scribble_free_host``, ``reset_in_flight``) every step also verifies it
(``byte_checks.FreeSlotWatch``). On a GPU a forward read is compared once it has run
(``byte_checks.DeferredReads``): after the step in which its gather passed, at the latest in
``finish()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hicache_ref.errors import HiCacheInputError, InvariantViolation
from hicache_ref.harness.adapters.base import (
    Implementation,
    RankLike,
    unsupported_reasons,
)
from hicache_ref.harness.driver.storage_driver import StorageDriver
from hicache_ref.harness.driver.tree import TreeDriver
from hicache_ref.harness.rules import RULES, STREAMS
from hicache_ref.harness.rules.forward import forward_layer, layer_end, store_layer
from hicache_ref.harness.rules.load import start_loading
from hicache_ref.harness.step_types import SKIPPED, Outcome
from hicache_ref.harness.steps.trace import Step, Trace, TraceHeader
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.world import WorldBuilder, build_world
from hicache_ref.invariants.evidence import Refusal, StateView
from hicache_ref.invariants.registry import (
    QUIESCENCE_IDS,
    REFUSAL_IDS,
    RESET_IDS,
    STEP_IDS,
    CheckRunner,
)
from hicache_ref.invariants.snapshot import HarnessModel, RankSnapshot

DRAIN_ROUNDS_MAX = 10_000
__all__ = ["DRAIN_ROUNDS_MAX", "STREAMS", "Session", "SessionStats", "StepObserver"]
SnapshotFn = Callable[[RankLike, Iterable[int]], RankSnapshot]


class StepObserver(Protocol):
    """Something that follows a session step by step (the lockstep oracle, a CP collective).

    ``after_step`` runs after each applied step's own checks, ``after_finish`` after the
    quiescence checks; raising ``InvariantViolation`` fails the case like any other check.
    """

    def after_step(self, session: Session, step: Step, outcome: Outcome) -> None: ...

    def after_finish(self, session: Session) -> None: ...


@dataclass
class SessionStats:
    steps: int = 0
    skipped: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    invariant_checks: int = 0  # rounds of step checks (one per applied step)
    step_checks_reused: int = 0  # of those, rounds whose evidence had already passed them
    checks_by_id: Counter[str] = field(default_factory=Counter)  # check runs per invariant id
    lockstep: Counter[str] = field(default_factory=Counter)  # what the lockstep oracle followed


class Session:
    """One case: a world, its tree driver, the steps applied so far, and the checks."""

    def __init__(
        self,
        config: HarnessConfig,
        implementation: Implementation,
        impl_name: str,
        *,
        build: WorldBuilder = build_world,
    ) -> None:
        """``build`` makes the case's world (``world.world_builder``: a GPU campaign's device,
        one rank of a CP world across processes; default: a ``SimDevice`` and every rank)."""
        reasons = unsupported_reasons(implementation.capabilities, config)
        if config.storage_pp:  # its tree half is the radix cache's PP path, not the rules'
            raise HiCacheInputError(
                f"{config.describe()} is a PP storage world (storage_pp): the state machine's "
                "storage rules do not drive PP tickets; run it with the PP gate "
                "(harness/campaigns/pp_gate.run_pp_gate)"
            )
        if reasons:
            raise ValueError(
                f"implementation {impl_name!r} does not support {config.describe()}: needs {reasons}"
            )
        self.config = config
        self.implementation = implementation
        self.impl_name = impl_name
        self.world = build(config, implementation)
        self.capabilities: frozenset[str] = self.world.capabilities  # declared, checked
        self.stats = SessionStats()
        self.checks = CheckRunner(self.stats.checks_by_id)  # the registry, counting per id
        self.tree: TreeDriver = TreeDriver(self.world, self.checks)
        self.storage: StorageDriver | None = None  # the L3 side: peers, the shared L3, its checks
        if config.uses_storage:
            self.storage = StorageDriver(self.tree, implementation)
        self.steps: list[Step] = []
        self.outcomes: list[str] = []
        self.skip_reasons: dict[int, str] = {}  # step index -> why its rule was not enabled
        self._candidates: dict[str, list[int]] = {}
        self.candidates_current = False
        """Set by a caller that knows nothing changed the world since the cached candidates
        were computed (the machine, right after its rule draw asked for them): the next
        ``apply`` keeps them instead of computing them again."""
        self._last_snapshots: list[RankSnapshot] | None = None  # what the last step's checks read
        self._last_step_view: StateView | None = None  # the last evidence the step checks passed
        self._snapshot_rank: SnapshotFn = implementation.snapshot  # contract: optional hook
        self.observers: list[StepObserver] = []  # called after each applied step and at finish

    # -- the trace -----------------------------------------------------------------------------
    def trace(self, note: str = "") -> Trace:
        source = self.implementation.source_tree
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
        record = RULES.get(rule)
        if record is None or record.candidates is None:
            return []
        return record.candidates(self)

    def _undrained_loads(self) -> int:
        return len(self.world.ranks[0].controller.ack_load_queue)

    def why_disabled(self, step: Step) -> str | None:
        """None when ``step`` may run now, else its rule's reason (``rules.RuleRecord.why_not``)."""
        return RULES[step.rule].why_not(self, step.args)

    def is_enabled(self, step: Step) -> bool:
        return self.why_disabled(step) is None

    # -- applying steps ------------------------------------------------------------------------
    def apply(self, step: Step) -> Outcome:
        if not self.candidates_current:
            self._candidates.clear()  # the world may have moved since they were asked for
        try:
            return self._apply(step)
        finally:
            self._candidates.clear()
            self.candidates_current = False

    def _apply(self, step: Step) -> Outcome:
        record = RULES[step.rule]
        if record.pins is not None:
            step = Step(rule=step.rule, args=dict(record.pins(self, step.args)))
        self.steps.append(step)
        self.stats.steps += 1
        reason = record.why_not(self, step.args)
        if reason is not None:
            self.stats.skipped += 1
            self.skip_reasons[len(self.outcomes)] = reason
            self.outcomes.append(SKIPPED.text)
            return SKIPPED
        self.stats.rules[step.rule] += 1
        watch_refusal = record.refusable or record.probe
        # the state before this step is the state the previous step's checks read
        before = (self._last_snapshots or self.snapshots()) if watch_refusal else None
        gate_ids = list(range(self.tree.next_node_id)) if record.resets else []
        self._last_snapshots = None
        outcome = record.process(self, step.args)
        self.outcomes.append(outcome.text)
        if self.tree.watch.active:
            self.tree.watch.verify()  # Verify no copy landed in a poisoned free slot
        self.tree.reads.collect()  # Verify the forward reads that have run on a GPU (INV-11)
        after = self.snapshots()
        if before is not None and (outcome.refused or record.probe):
            self.check_refusal_changed_nothing(before, after, f"{step.rule} ({outcome})")
        elif before is not None and outcome.reservation == "refused":
            # the node's pages stay; its refused early reservation must leave nothing behind
            self.check_refusal_changed_nothing(
                before, after, f"early reservation ({outcome})", may_change=("device pages",)
            )
        if record.resets:
            self._run_checks(RESET_IDS, self.snapshots(gate_ids))
        self.check_step_invariants(after)
        self._last_snapshots = after
        for observer in self.observers:
            observer.after_step(self, step, outcome)
        return outcome

    # -- checks --------------------------------------------------------------------------------
    def snapshots(self, gate_ids: Iterable[int] | None = None) -> list[RankSnapshot]:
        """Every rank as plain data; the gate is asked about ``gate_ids`` (default: live nodes)."""
        ids = [n.node_id for n in self.tree.nodes.values()] if gate_ids is None else list(gate_ids)
        return [self._snapshot_rank(rank, ids) for rank in self.world.ranks]

    def model(self) -> HarnessModel:
        """The harness's model of every page: the tree's nodes, and the host pages the storage
        driver holds (sources, bounce buffers)."""
        return self.tree.model(self.storage.holdings() if self.storage is not None else ())

    def _run_checks(self, inv_ids: tuple[str, ...], snapshots: Sequence[RankSnapshot]) -> None:
        self.checks.run_all(inv_ids, StateView(snapshots, self.model()))

    def check_step_invariants(self, snapshots: Sequence[RankSnapshot] | None = None) -> None:
        """After every step: the registry's ``STEP_IDS`` (INV-02, INV-14, INV-10, INV-04,
        INV-05, INV-08).

        A checker is a pure function of its evidence, so evidence equal to the last round's
        (which passed, or the case would have ended) is not judged again: about half the
        steps (a synchronize with nothing queued, a drain with nothing done, a forward read)
        leave every rank and the tree's model as they were (``stats.step_checks_reused``)."""
        self.stats.invariant_checks += 1
        view = StateView(self.snapshots() if snapshots is None else snapshots, self.model())
        if view == self._last_step_view:
            self.stats.step_checks_reused += 1
            return
        self.checks.run_all(STEP_IDS, view)
        self._last_step_view = view

    def check_refusal_changed_nothing(
        self,
        before: Sequence[RankSnapshot],
        after: Sequence[RankSnapshot],
        what: str,
        may_change: Sequence[str] = (),
    ) -> None:
        """A refused operation left every rank as it was (INV-17)."""
        self.checks.run_all(REFUSAL_IDS, Refusal(before, after, what, may_change))

    def close(self) -> None:
        """The case is over: a storage tier that runs threads of its own stops them now
        (upstream's, ``adapters/sglang_storage.py``, the gated executor's, the lockstep's),
        not when the collector finds the world (which a running thread keeps alive)."""
        if self.storage is not None:
            self.storage.l3.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def finish(self) -> None:
        """Quiescence: run everything, drain everything, then check every byte and slot (INV-16)."""
        self._last_snapshots = None
        t = self.tree
        if self.storage is not None:  # every prefetch and backup ends, every storage check at rest
            self.storage.settle()
        # The forward finishes computing every node (early-reserved backups ack only then)
        while t.batch:
            forward_layer(t)
        # Nodes stored layer by layer (oracle traces): the forward finishes their layers too
        # (only nodes still on device: a stale pending state of a host-only node is a finding,
        # which the quiescence checks report, not layers to store)
        pending = [h for h, n in t.nodes.items() if n.on_device and t.has_pending_layer_write(h)]
        for handle in pending:
            for draft, layer_num in t.layer_kinds():
                for layer in range(layer_num):
                    store_layer(t, handle, layer, draft)
        if pending:
            for draft, layer_num in t.layer_kinds():
                for layer in range(layer_num):
                    layer_end(t, layer, draft)
        if t.queued_loads:
            while self._undrained_loads() >= self.config.num_counters:
                self.world.device.run_until_idle()
                t.loading_check()
            start_loading(t)
        for _ in range(DRAIN_ROUNDS_MAX):
            self.world.device.run_until_idle()
            t.writing_check()
            t.loading_check()
            if not t.ongoing_write and not t.ongoing_load:
                break
        else:
            raise InvariantViolation("INV-16", "acks never drained at quiescence")
        if t.watch.active:
            t.watch.verify()  # Verify no late copy landed in a poisoned free slot
        t.reads.collect(wait=True)  # Verify every forward read still unchecked (INV-11)
        # Verify no ack is left once every submission was acked (INV-16), then every resident
        # copy's bytes (INV-06), then the pages (INV-05) and the per-layer states (INV-15)
        first, *rest = QUIESCENCE_IDS
        snapshots = self.snapshots()
        self._run_checks((first,), snapshots)
        for node in t.nodes.values():
            if node.on_device and node.layers_stored == t.total_layers:
                t.check_device_bytes(node, "INV-06", "quiescence")
            if node.backup == "done":
                t.check_host_bytes(node, "INV-06", "quiescence")
        self._run_checks(tuple(rest), snapshots)
        for observer in self.observers:
            observer.after_finish(self)
