"""The oracle in lockstep: step the pure oracle with every applied harness step and compare.

``attach_lockstep(session)`` adds a ``LockstepOracle`` to ``Session.observers``. After each
applied step it

1. translates the step's tree/controller call into oracle ops that carry the pages the
   harness's own pools handed out (``Insert(node, pages, tokens)``, ``Write(node, host)``,
   ``Load(node, pages)``, ``DrainWriteAcks(count)`` with the count the tree drained, ...);
2. feeds what the ``SimDevice`` executed during the step, in execution order: every copy as
   ``CopyLanded`` (rank and pool from the tags the world's host pools put on their copies,
   slots from the copy's meta), every forward store/read as ``ForwardRan`` once every rank ran
   its part; records and waits are not fed (the oracle runs a record once the work ahead of it
   ran, so it never drains later than a device could);
3. compares (``lockstep_compare``): the oracle's own verdict (``check_invariants``), the ack
   rows of every rank, every node's lifecycle and producer slot, and the device and host pages
   every node holds (the tree's model of the harness's pools, never the implementation's word);
   at quiescence also every content tag of every held page against the actual bytes.

A difference raises ``InvariantViolation`` under the id of the quantity that diverged (ack rows
and lifecycles INV-16, producer slots INV-10, pages INV-05, content INV-06, a refusal INV-17;
the oracle's own verdict under its id) naming the step, the quantity, the oracle's value and the
implementation's. A world it cannot follow (another device, a one-rank-per-process session)
or a step the oracle cannot express turns lockstep off for the rest of the case, with the
reason counted in the session's stats (``SessionStats.lockstep``: ``cases``,
``cases_in_lockstep``, ``steps_in_lockstep``, ``cases_off`` and ``off: <reason>``).

Not compared, by design: the implementation's own bookkeeping (metadata, in-flight trackers,
pending layer states: only their effects, acks and copies, are seen); event records and waits
one by one (the oracle's streams are coarser, one FIFO per stream for every rank); the bytes of
every slot after every step (the ordinary byte checks read them at drains and reads, lockstep
reads the tags of every held token slot once, at quiescence); padding slots and free slots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hicache_ref.device.sim import ExecutedOp, SimDevice
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.campaigns.profiles import lockstep_enabled
from hicache_ref.harness.driver.node_model import FORWARD_META, ForwardKernel
from hicache_ref.harness.lockstep.compare import (
    compare_final_content,
    compare_state,
    unsupported_reason,
)
from hicache_ref.harness.rules import RULES
from hicache_ref.harness.rules.record import UntranslatedRuleError
from hicache_ref.harness.step_types import Outcome
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.world import COPY_POOL_TAG, COPY_RANK_TAG
from hicache_ref.oracle import ops as o
from hicache_ref.oracle.config import OracleConfig, Pool
from hicache_ref.oracle.invariants import check_invariants
from hicache_ref.oracle.state import OracleState, initial_state
from hicache_ref.oracle.step import OpNotEnabledError, step

if TYPE_CHECKING:
    import torch

    from hicache_ref.harness.steps.session import Session


UnitKey = tuple[str, int, int]
"""A forward kernel: (``store`` or ``read``, tree handle, layer)."""


def attach_lockstep(session: Session, enabled: bool | None = None) -> LockstepOracle | None:
    """Follow ``session`` with the oracle in lockstep (call before its first step).

    Returns None when ``enabled`` is False (a campaign passes its profile's choice) or, left
    None, when the environment's profile turns lockstep off (``profiles.lockstep_enabled``: how
    a pytest run chooses); else the observer, whose ``off_reason`` says why it does not follow
    this case, if it does not.
    """
    if not (lockstep_enabled() if enabled is None else enabled):
        return None
    from hicache_ref.harness.lockstep.storage import attach_storage_lockstep

    attach_storage_lockstep(
        session, enabled=True
    )  # the storage oracle follows the L3 verbs (storage.py)
    oracle = LockstepOracle(session)
    session.stats.lockstep["cases"] += 1
    # observed even when off from the start: it then does nothing, and the report counts its
    # reason beside the cases it followed (``CampaignReport.lockstep_off``)
    session.observers.append(oracle)
    return oracle


def oracle_config_for(session: Session) -> OracleConfig:
    """The oracle's world for a harness world: same geometry, a universe that grows."""
    config = session.config
    page = config.page_size
    rank = session.world.ranks[0]
    host_pages = rank.host_pool.size // page
    draft_pages = 0
    if config.has_draft:  # a non-CP draft copy lives in the target's slots of its own buffer
        assert rank.draft_host_pool is not None
        draft_pages = rank.draft_host_pool.size // page if config.uses_cp else host_pages
    return OracleConfig(
        page_size=page,
        layer_num=config.layer_num,
        draft_layer_num=config.draft_layer_num,
        device_pages=config.device_pages + 1,  # logical pages 1..device_pages; 0 is padding
        host_pages=host_pages,
        draft_host_pages=draft_pages,
        cp_size=config.cp_size,
        num_counters=config.num_counters,
        node_tokens=(),
        max_tokens=(config.device_pages + 1) * page,
        settle_records=True,
        harness_schedule=True,
    )


@dataclass
class _Unit:
    """One oracle forward store/read: the device runs it once per rank."""

    key: UnitKey
    parts_left: int


@dataclass
class _Saved:
    """What the tree held after the last step (a step's translation reads the state before it)."""

    batch: list[int] = field(default_factory=list)
    batch_layer: int = 0
    queued_loads: list[int] = field(default_factory=list)
    ack_lens: tuple[int, int] = (0, 0)  # rank 0's undrained write / load acks


class LockstepOracle:
    """Steps the oracle beside one session; see the module docstring."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.off_reason: str | None = None
        self.steps = 0  # steps compared in lockstep
        self.handles: dict[int, int] = {}  # node id -> tree handle, this epoch
        self._executed: list[ExecutedOp] = []
        self._units: deque[_Unit] = (
            deque()
        )  # oracle forward ops the device has not run on all ranks
        self._saved = _Saved()
        self._judged: OracleState | None = None  # the last state check_invariants passed
        reason = unsupported_reason(session)
        if reason is None and session.steps:
            reason = "attached after the case's first step"
        if reason is not None:
            self._turn_off(reason)
            self.state = initial_state(OracleConfig())
            return
        self.state = initial_state(oracle_config_for(session))
        device = session.world.device
        assert isinstance(device, SimDevice)
        device.on_execute.append(self._on_execute)  # copies carry the world's rank/pool tags

    # -- the observer --------------------------------------------------------------------------
    def after_step(self, session: Session, step_: Step, outcome: Outcome) -> None:
        if self.off_reason is not None:
            return
        record = RULES[step_.rule]
        try:
            ops = record.oracle(self, step_.args, outcome)
            if record.feeds_first:
                self._feed()
            for op in ops:
                self._apply(op)
            self._feed()
        except (OpNotEnabledError, UntranslatedRuleError) as refused:
            why = str(refused).split(" is not enabled: ", 1)[-1]
            self._turn_off(f"the oracle cannot express {step_.rule}: {why}")
            return
        if record.resets:
            self.handles.clear()
        self.steps += 1
        self.session.stats.lockstep["steps_in_lockstep"] += 1
        self._compare(f"step {len(session.steps) - 1} ({step_.rule}: {outcome})")
        self._save()

    def after_finish(self, session: Session) -> None:
        """Mirror what ``Session.finish`` did (forward, pending layers, loads, drains), compare."""
        if self.off_reason is not None:
            return
        saved = self._saved
        if saved.queued_loads and saved.ack_lens[1] >= session.config.num_counters:
            self._turn_off("finish drained loads before its start_loading (not mirrored)")
            return
        try:
            for op in self._forward_ops(saved.batch, saved.batch_layer, session.tree.total_layers):
                self._apply(op)
            # the writes still pending once the forward finished (the oracle's are the tree's)
            pending = [self.handles[p.node] for p in self.state.pending_layer_writes]
            for op in self._finish_pending_ops(pending):
                self._apply(op)
            if saved.queued_loads:
                self._apply(o.StartLoading())
            self._feed()
            self._apply(o.DrainWriteAcks(count=len(self.state.write_acks[0])))
            self._apply(o.DrainLoadAcks(count=len(self.state.load_acks[0])))
        except OpNotEnabledError as refused:
            self._turn_off(f"the oracle cannot express finish: {refused}")
            return
        self.session.stats.lockstep["cases_in_lockstep"] += 1
        where = "quiescence (finish)"
        self._compare(where)
        compare_final_content(session, self.state, self.handles, where)

    # -- what a rule's translation asks (``rules/record.OracleView``) -------------------------
    def node_id(self, handle: int) -> int:
        node = self.session.tree.node(handle)
        if node is not None:
            return node.node_id
        for node_id, known in self.handles.items():
            if known == handle:
                return node_id
        raise OpNotEnabledError(f"handle {handle} names no node of this epoch")

    def prefill_ops(self, handle: int, outcome: Outcome) -> list[o.Op]:
        node = self.session.tree.nodes[handle]
        self.handles[node.node_id] = handle
        assert node.value is not None
        pages = _pages_of(node.value, self.session.config.page_size)
        ops: list[o.Op] = [o.Insert(node.node_id, device_pages=pages, tokens=node.logical_len)]
        if outcome.reservation:  # an early CP reservation inside the prefill
            ops.append(self.backup_op(handle, outcome.reservation == "refused", early=True))
        return ops

    def forward_layer_ops(self) -> list[o.Op]:
        saved = self._saved
        return self._forward_ops(saved.batch, saved.batch_layer, saved.batch_layer + 1)

    def _forward_ops(self, batch: list[int], first: int, end: int) -> list[o.Op]:
        """What ``forward_layer`` did for layers ``[first, end)``: each pool's stores of every
        batch node on device, then that pool's layer-end hook."""
        ops: list[o.Op] = []
        for layer in range(first, end):
            for draft, layer_num in self.session.tree.layer_kinds():
                if layer >= layer_num:
                    continue
                pool: Pool = "draft" if draft else "target"
                for handle in batch:
                    node = self.session.tree.node(handle)
                    if node is not None and node.on_device:
                        ops.append(o.Store(node.node_id, layer, pool))
                ops.append(o.OnLayerEnd(layer, pool))
        return ops

    def _finish_pending_ops(self, pending: list[int]) -> list[o.Op]:
        """What ``finish`` does for per-layer writes still pending: store every layer, then
        fire every layer's hook."""
        ops: list[o.Op] = []
        kinds = self.session.tree.layer_kinds()
        for handle in pending:
            node_id = self.node_id(handle)
            for draft, layer_num in kinds:
                pool: Pool = "draft" if draft else "target"
                ops += [o.Store(node_id, layer, pool) for layer in range(layer_num)]
        if pending:
            for draft, layer_num in kinds:
                pool = "draft" if draft else "target"
                ops += [o.OnLayerEnd(layer, pool) for layer in range(layer_num)]
        return ops

    def backup_op(self, handle: int, refused: bool, early: bool) -> o.Op:
        """``write`` (all layers) or an early CP reservation, with the host pages it took."""
        node = self.session.tree.nodes[handle]
        kind = o.ReserveWriteCp if early else o.Write
        if refused:
            return kind(node.node_id)  # the oracle must refuse too (checked in _apply)
        page = self.session.config.page_size
        if self.session.config.uses_cp:
            metas = [m for m in node.cp_meta if m is not None]
            host = tuple(_pages_of(m.host_indices, page) for m in metas)
            draft: tuple[tuple[int, ...], ...] | None = None
            if self.session.config.has_draft:
                draft = tuple(
                    _pages_of(m.draft_host_indices, page)
                    if m.draft_host_indices is not None
                    else ()
                    for m in metas
                )
            return kind(node.node_id, host_pages=host, draft_host_pages=draft)
        value = node.host_value[0]
        assert value is not None
        host = (_pages_of(value, page),)
        return kind(
            node.node_id,
            host_pages=host,
            draft_host_pages=host if self.session.config.has_draft else None,
        )

    def load_op(self, handle: int) -> o.Op:
        node = self.session.tree.nodes[handle]
        assert node.value is not None
        pages = _pages_of(node.value, self.session.config.page_size)
        return o.Load(node.node_id, device_pages=pages)

    def drain_ops(self, write: bool, load: bool) -> list[o.Op]:
        """The drains a step did, with the counts the tree drained (rank 0's queues)."""
        controller = self.session.world.ranks[0].controller
        writes = self._saved.ack_lens[0] - len(controller.ack_write_queue)
        loads = self._saved.ack_lens[1] - len(controller.ack_load_queue)
        ops: list[o.Op] = []
        if write:
            ops.append(o.DrainWriteAcks(count=max(0, writes)))
        if load:
            ops.append(o.DrainLoadAcks(count=max(0, loads)))
        return ops

    # -- device executions ----------------------------------------------------------------------
    def _on_execute(self, entry: ExecutedOp) -> None:
        if entry.kind in ("copy", "kernel"):
            self._executed.append(entry)

    def _feed(self) -> None:
        """Give the oracle what the device ran since the last feed, in execution order."""
        executed, self._executed = self._executed, []
        for entry in executed:
            if entry.kind == "copy":
                for op in self._landed(entry):
                    self._apply(op)
                continue
            kernel = entry.meta.get(FORWARD_META)
            if isinstance(kernel, ForwardKernel):
                self._forward_ran((kernel.kind, kernel.handle, kernel.layer))

    def _forward_ran(self, key: UnitKey) -> None:
        """One rank ran a forward kernel: the oracle runs every op all ranks have run."""
        unit = next((u for u in self._units if u.key == key and u.parts_left), None)
        if unit is None:
            raise OpNotEnabledError(f"the device ran forward kernel {key} the oracle never saw")
        unit.parts_left -= 1
        while self._units and not self._units[0].parts_left:
            self._units.popleft()
            self._apply(o.ForwardRan())

    def _landed(self, entry: ExecutedOp) -> list[o.Op]:
        meta = entry.meta
        if COPY_RANK_TAG not in meta:
            raise OpNotEnabledError(f"copy {entry.label!r} was launched outside the host pools")
        host_slots, locs = _ints(meta["host_indices"]), list(_ints(meta["device_indices"]))
        if not host_slots:
            return []
        rank = int(meta[COPY_RANK_TAG])  # type: ignore[call-overload]
        cp, page = self.session.config.cp_size, self.session.config.page_size
        if cp:  # physical page q of rank r is logical page q * cp + r (``CpSharedKVLayout``)
            locs = [((loc // page) * cp + rank) * page + loc % page for loc in locs]
        pool: Pool = "draft" if meta[COPY_POOL_TAG] == "draft" else "target"
        layers: tuple[int, ...] = meta["layer_ids"]  # type: ignore[assignment]
        direction = meta["direction"]
        device_locs = tuple(locs)
        return [
            o.CopyLanded(direction, layer, host_slots, device_locs, pool, rank)  # type: ignore[arg-type]
            for layer in layers
        ]

    # -- stepping and comparing -----------------------------------------------------------------
    def _apply(self, op: o.Op) -> None:
        if isinstance(op, o.OnLayerEnd) and not self.state.pending_layer_writes:
            return  # the hook returns at once: no per-layer write is pending
        new_state, observations = step(self.state, op)
        if isinstance(op, o.Write | o.ReserveWriteCp) and op.host_pages is None:
            # Verify a refused backup is one the oracle refuses too: a host pool was full (INV-17)
            if not any(obs.kind == "write_failure" for obs in observations):
                raise InvariantViolation(
                    "INV-17",
                    f"lockstep divergence: the backup of node {op.node} was refused (host "
                    f"capacity), but the oracle's host pools hold enough free pages for it",
                )
            return
        if isinstance(op, o.Store | o.ForwardRead):
            kind = "store" if isinstance(op, o.Store) else "read"
            key = (kind, self.handles[op.node], op.layer)
            self._units.append(_Unit(key, self.session.config.num_ranks))
        if isinstance(op, o.Reset):
            self._units.clear()
        self.state = new_state

    def _compare(self, where: str) -> None:
        # the oracle's verdict is a function of its state: judge each state once
        found = [] if self.state is self._judged else check_invariants(self.state)
        self._judged = self.state
        if found:
            raise InvariantViolation(
                found[0].inv_id,
                f"lockstep at {where}: the oracle, fed what the device ran, reports "
                f"{found[0].message}",
            )
        compare_state(self.session, self.state, where)

    def _save(self) -> None:
        tree = self.session.tree
        controller = self.session.world.ranks[0].controller
        self._saved = _Saved(
            batch=list(tree.batch),
            batch_layer=tree.batch_layer,
            queued_loads=list(tree.queued_loads),
            ack_lens=(len(controller.ack_write_queue), len(controller.ack_load_queue)),
        )

    def _turn_off(self, reason: str) -> None:
        self.off_reason = reason
        self.session.stats.lockstep["cases_off"] += 1
        self.session.stats.lockstep[f"off: {reason}"] += 1


def _ints(indices: object) -> tuple[int, ...]:
    """A copy's index values (a CPU tensor in the meta, or any sequence of ints)."""
    values = indices.tolist() if hasattr(indices, "tolist") else indices
    assert isinstance(values, list | tuple), f"copy indices of type {type(indices).__name__}"
    return tuple(int(v) for v in values)


def _pages_of(indices: torch.Tensor, page: int) -> tuple[int, ...]:
    """The pages of a whole-page index tensor, in its order (one per page chunk)."""
    return tuple(int(i) // page for i in indices[::page].tolist())
