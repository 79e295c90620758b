"""The one home of every invariant the harness checks: one ``check_inv_NN_*`` per id.

Each checker registers itself (``checker.registered``: its id, the evidence kinds it judges, its
phases); ``REGISTERED`` and every phase's ids are derived from those registrations, here and in
``checks_storage_*.py``, so no table lists an id a second time.

Each registered checker takes one piece of evidence (``evidence.py``: a state view after a step,
a refusal, indices an implementation returned, what every rank reported, bytes read back, a
backup copy's reads) and raises that invariant's ``InvariantViolation`` when the evidence shows
a breach; evidence of another kind is a harness bug (``TypeError``). The harness never raises an
invariant of its own: the session hands each step's state view to the ids of its phase, and the
tree, the byte checks and the device watch hand what they observe to the id it bears on
(``CheckRunner.run``), which also counts the runs per id. The checkers read only what the harness
built from its own pools and model (``snapshot.py``), so every implementation is checked the same
way and none is trusted; the pure rules they apply live in ``checks_*.py``.

The phases, in the order a case meets them (each checker's phase keyword orders it within):

- ``STEP_IDS`` after every applied step: one live write per node (INV-02), identical ack rows
  (INV-14), producer slots not oversubscribed (INV-10), no write ack before every layer was
  stored (INV-04), every page free or owned once (INV-05), no page of a busy node free (INV-08);
- ``REFUSAL_IDS`` around a refused operation: it changed nothing (INV-17);
- ``RESET_IDS`` after ``reset``: nothing queued, pending or claimed (INV-18);
- ``QUIESCENCE_IDS`` once every ack drained: no ack left (INV-16), every page free or owned
  once (INV-05), no per-layer write outliving its backup (INV-15);
- ``STORAGE_IDS`` (INV-19 .. INV-35) after each storage step, each reset and at quiescence, over
  the storage tier's snapshot (``checks_storage*.py``).

A checker is a pure function of its evidence: the session and the storage driver do not hand
a phase's ids evidence equal to the last evidence that passed them (half the steps leave every
rank and the model as they were). Dict order is the order the session runs them, so the first
violation reported is the same one on every run. A message names the rank before the
checker's own text (node, page, fix).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from types import MappingProxyType, TracebackType

import torch

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants._convert import shorten, to_ints
from hicache_ref.invariants.checker import collect, phase_ids, registered
from hicache_ref.invariants.checks_acks import (
    check_ack_queues_empty,
    check_ack_rows_identical,
    check_producer_slots_held,
    check_reset_clean,
    check_single_write_ack,
    check_undrained_gate_agrees,
)
from hicache_ref.invariants.checks_layout import (
    check_cp_metadata,
    check_host_slot_count,
    check_owner_replay,
    check_page_aligned,
)
from hicache_ref.invariants.checks_ownership import (
    check_no_device_free_in_flight,
    check_pages_owned_once,
    check_pool_indices_own,
    check_state_slot_count,
    check_unchanged,
)
from hicache_ref.invariants.checks_storage import STORAGE_MODULES
from hicache_ref.invariants.checks_storage_l3 import (
    check_inv_25_one_ack,
    check_inv_26_ack_is_stored_prefix,
    check_inv_27_prefix_keys,
    check_inv_28_key_namespace,
    check_inv_30_l3_bytes,
    check_inv_31_prefix_closed,
)
from hicache_ref.invariants.checks_storage_prefetch import (
    check_inv_19_prefetch_ranges,
    check_inv_20_storage_collectives,
    check_inv_21_min_progress,
    check_inv_22_verdict_after_hit,
    check_inv_23_io_owned_pages,
    check_inv_24_storage_epochs,
    check_inv_29_hit_endpoint,
)
from hicache_ref.invariants.checks_transfer import (
    check_bytes_equal,
    check_layers_submitted,
    check_no_stale_layer_writes,
)
from hicache_ref.invariants.evidence import (
    BackupRead,
    DrainedAck,
    Evidence,
    OwnerReplay,
    PoolIndices,
    RankValues,
    Refusal,
    ReturnedIndices,
    Rows,
    SlotCount,
    SlotReuse,
    StateSlots,
    StateView,
)
from hicache_ref.invariants.snapshot import RankSnapshot

Checker = Callable[[Evidence], None]


class on_rank:  # lower case: used like contextlib's context managers
    """Prefix a checker's violation with the rank (and what was checked) it was raised for.

    A class rather than a ``@contextmanager`` generator: it is entered per rank per check on
    every step, where a generator's setup is a measurable share of the check.
    """

    __slots__ = ("rank", "what")

    def __init__(self, rank: int, what: str = "") -> None:
        self.rank, self.what = rank, what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, InvariantViolation):
            where = f"rank {self.rank}{' ' + self.what if self.what else ''}"
            raise InvariantViolation(exc.inv_id, f"{where}: {exc.detail}") from None


def _other(inv_id: str, evidence: Evidence) -> TypeError:
    return TypeError(f"{inv_id} is not checked from {type(evidence).__name__} evidence")


def _gate(snapshot: RankSnapshot) -> Callable[[int], bool]:
    answers = dict(snapshot.gate_answers or ())
    return answers.__getitem__


def _bytes(inv_id: str, evidence: Rows) -> None:
    if torch.equal(evidence.actual, evidence.expected):
        return  # exact: the oracle's rows are never 0 or NaN, so equal values are equal bytes
    check_bytes_equal(
        evidence.actual,
        evidence.expected,
        evidence.where,
        inv_id=inv_id,
        describe_row=evidence.describe_row,
        fix=evidence.fix,
    )


# -- INV-01 .. INV-19 -----------------------------------------------------------------------------
@registered("INV-01", ReturnedIndices)
def check_inv_01_page_alignment(evidence: Evidence) -> None:
    """INV-01: indices an implementation returned are whole, aligned pages."""
    if not isinstance(evidence, ReturnedIndices):
        raise _other("INV-01", evidence)
    check_page_aligned(evidence.indices, evidence.page_size, evidence.what)


@registered("INV-02", DrainedAck, StateView, step=1)
def check_inv_02_one_live_write(evidence: Evidence) -> None:
    """INV-02: no node twice among a rank's write acks, a gate that agrees with a scan of the
    queue, and no drained write ack for a node whose backup is not in flight."""
    if isinstance(evidence, DrainedAck):
        # Verify the drained write ack belongs to a backup in flight
        if not evidence.in_flight:
            raise InvariantViolation(
                "INV-02",
                f"write ack for node_id {evidence.node_id}, which has no backup in flight (an "
                "extra ack, or an ack for a node already acked)",
            )
        return
    if not isinstance(evidence, StateView):
        raise _other("INV-02", evidence)
    for snap in evidence.snapshots:
        with on_rank(snap.rank):
            check_single_write_ack(snap.write_rows)
            if snap.gate_answers is not None:
                ids = [node_id for node_id, _ in snap.gate_answers]
                check_undrained_gate_agrees(_gate(snap), snap.write_rows, ids)


@registered("INV-03", OwnerReplay)
def check_inv_03_owner_replay(evidence: Evidence) -> None:
    """INV-03: a CP load's fresh pages repeat, page by page, the owners recorded at write time."""
    if not isinstance(evidence, OwnerReplay):
        raise _other("INV-03", evidence)
    try:
        check_owner_replay(
            evidence.allocated,
            evidence.page_owners,
            evidence.page_size,
            evidence.cp_size,
            owner_of_page=evidence.owner_of_page,
        )
    except InvariantViolation as violation:
        raise InvariantViolation("INV-03", f"node {evidence.node}: {violation.detail}") from None


@registered("INV-04", StateView, step=4)
def check_inv_04_every_layer_before_ack(evidence: Evidence) -> None:
    """INV-04: no write ack is in a queue for a node whose forward has not stored every layer
    (the harness's own count of stored layers; a layer's D2H can only follow its store)."""
    if not isinstance(evidence, StateView):
        raise _other("INV-04", evidence)
    model = evidence.model
    stored = {n.node_id: n.layers_stored for n in evidence.model.nodes}
    for snap in evidence.snapshots:
        for row in snap.write_rows:
            for node_id in row:
                done = stored.get(node_id, model.total_layers)
                if done >= model.total_layers:
                    continue
                with on_rank(snap.rank):
                    layers = range(done)
                    draft = None if model.draft_layer_num == 0 else range(done)
                    check_layers_submitted(
                        node_id,
                        layers,
                        draft or (),
                        model.layer_num,
                        None if draft is None else model.draft_layer_num,
                    )


@registered("INV-05", StateView, step=5, quiescence=2)
def check_inv_05_slot_conservation(evidence: Evidence) -> None:
    """INV-05 on every rank: the pools' allocated pages are exactly the nodes' pages, once each."""
    if not isinstance(evidence, StateView):
        raise _other("INV-05", evidence)
    nodes = evidence.model.nodes
    device = {n.handle: n.device_pages for n in nodes}  # logical: the same on every rank
    # the model lists holdings by the world's rank list (one rank per process in a
    # multi-process CP world), so index by position and name the rank by its id
    for position, snap in enumerate(evidence.snapshots):
        r = snap.rank
        check_pages_owned_once(snap.device_pages, device, f"rank {r} device allocator")
        host = {n.handle: n.host_pages[position] for n in nodes}
        check_pages_owned_once(snap.host_pages, host, f"rank {r} host pool")
        if snap.draft_host_pages is not None:
            draft = {n.handle: n.draft_host_pages[position] for n in nodes}
            check_pages_owned_once(snap.draft_host_pages, draft, f"rank {r} draft host pool")
        if snap.side_device_pages is not None:
            side = {n.handle: n.side_device_pages for n in nodes}
            check_pages_owned_once(snap.side_device_pages, side, f"rank {r} side device allocator")


@registered("INV-06", Rows)
def check_inv_06_byte_equality(evidence: Evidence) -> None:
    """INV-06: a resident copy holds the bytes the content oracle predicts."""
    if not isinstance(evidence, Rows):
        raise _other("INV-06", evidence)
    _bytes("INV-06", evidence)


@registered("INV-07", Rows)
def check_inv_07_no_host_free_in_flight(evidence: Evidence) -> None:
    """INV-07: no copy wrote a host slot after it was freed (the free slots still hold the
    harness's poison)."""
    if not isinstance(evidence, Rows):
        raise _other("INV-07", evidence)
    _bytes("INV-07", evidence)


@registered("INV-08", StateView, step=6)
def check_inv_08_no_device_free_in_flight(evidence: Evidence) -> None:
    """INV-08 on every rank: no device page of a node with a copy or a read in flight is free."""
    if not isinstance(evidence, StateView):
        raise _other("INV-08", evidence)
    busy = {n.node_id: n for n in evidence.model.nodes if n.busy}
    for snap in evidence.snapshots:
        freed = {
            page: node_id
            for node_id, node in busy.items()
            for page in node.device_pages
            if page not in snap.device_pages
        }
        if freed:
            in_flight = {page: f"node {i} ({busy[i].busy})" for page, i in freed.items()}
            with on_rank(snap.rank):
                check_no_device_free_in_flight(sorted(freed), in_flight, "the allocator")


@registered("INV-09", Rows)
def check_inv_09_fifo_ack_drain(evidence: Evidence) -> None:
    """INV-09: a drained ack's transfer has landed: the node's copy holds the predicted bytes
    when the tree drains its ack."""
    if not isinstance(evidence, Rows):
        raise _other("INV-09", evidence)
    _bytes("INV-09", evidence)


@registered("INV-10", SlotReuse, StateView, step=3)
def check_inv_10_producer_slots(evidence: Evidence) -> None:
    """INV-10: no rank holds more undrained load acks than slots, and no slot is handed out
    while an undrained load still holds it."""
    if isinstance(evidence, SlotReuse):
        # Verify the slot is not still held by a load whose ack is undrained
        if evidence.busy_handles:
            raise InvariantViolation(
                "INV-10",
                f"start_loading handed out producer slot {evidence.slot}, still held by the "
                f"undrained load of node(s) {list(evidence.busy_handles)} (a consumer of that "
                "slot would wait on the wrong events)",
            )
        return
    if not isinstance(evidence, StateView):
        raise _other("INV-10", evidence)
    for snap in evidence.snapshots:
        with on_rank(snap.rank):
            check_producer_slots_held(len(snap.load_acks), evidence.model.num_counters)


@registered("INV-11", Rows)
def check_inv_11_layer_gate(evidence: Evidence) -> None:
    """INV-11: a forward read of a layer sees the bytes that layer's load brought in."""
    if not isinstance(evidence, Rows):
        raise _other("INV-11", evidence)
    _bytes("INV-11", evidence)


@registered("INV-12", BackupRead)
def check_inv_12_store_before_backup(evidence: Evidence) -> None:
    """INV-12: a layer's D2H read device rows only after that layer's KV store wrote them."""
    if not isinstance(evidence, BackupRead):
        raise _other("INV-12", evidence)
    # Verify every row the D2H read was written by a KV store (or a load) first
    if evidence.unstored:
        nodes = ", ".join(map(str, evidence.node_handles)) or "no live node"
        raise InvariantViolation(
            "INV-12",
            f"a D2H of {evidence.pool} layer {evidence.layer} (node(s) {nodes}) read device rows "
            f"{list(evidence.unstored)[:8]} before any KV store wrote them (they still held a "
            "freed page's poison; record a layer event on the forward stream after the store "
            "and make the write stream wait on it)",
        )


@registered("INV-13", SlotCount)
def check_inv_13_cp_metadata(evidence: Evidence) -> None:
    """INV-13: a CP reservation's metadata obeys every metadata rule and holds one host slot per
    position the harness's own layout says the rank owns."""
    if not isinstance(evidence, SlotCount):
        raise _other("INV-13", evidence)
    if evidence.meta is not None:
        try:
            check_cp_metadata(evidence.meta)
        except InvariantViolation as violation:
            detail = f"{evidence.what}: {violation.detail}"
            raise InvariantViolation(violation.inv_id, detail) from None
    check_host_slot_count(evidence.slots, evidence.owned, evidence.what, pool=evidence.pool)


@registered("INV-14", RankValues, StateView, step=2)
def check_inv_14_ranks_alike(evidence: Evidence) -> None:
    """INV-14: every CP rank reports the same rows (ack rows, pages, producer slots)."""
    if isinstance(evidence, RankValues) and not evidence.ack_rows:
        first = evidence.rows_per_rank[0]
        for rank, reported in enumerate(evidence.rows_per_rank):
            # Verify this rank reports what rank 0 reports
            if list(map(list, reported)) != list(map(list, first)):
                raise InvariantViolation(
                    "INV-14",
                    f"{evidence.what} differ: rank 0 {shorten(list(first))} vs rank {rank} "
                    f"{shorten(list(reported))} (CP ranks act in lockstep: every rank must take "
                    "the same pages and slots)",
                )
        return
    if isinstance(evidence, RankValues):
        try:
            check_ack_rows_identical(evidence.rows_per_rank, allow_lag=evidence.allow_lag)
        except InvariantViolation as violation:
            raise InvariantViolation("INV-14", f"{evidence.what}: {violation.detail}") from None
        return
    if not isinstance(evidence, StateView):
        raise _other("INV-14", evidence)
    snapshots, lag = evidence.snapshots, evidence.model.allow_lag
    if len(snapshots) < 2:
        return  # one rank agrees with itself
    for queue in ("ack_write_queue", "ack_load_queue"):
        rows = [s.write_rows if queue == "ack_write_queue" else s.load_rows for s in snapshots]
        check_inv_14_ranks_alike(RankValues(queue, rows, allow_lag=lag))


@registered("INV-15", StateView, quiescence=3)
def check_inv_15_cancel_quiesces(evidence: Evidence) -> None:
    """INV-15 on every rank: a pending per-layer write belongs to a backup still in flight."""
    if not isinstance(evidence, StateView):
        raise _other("INV-15", evidence)
    in_flight = {n.node_id for n in evidence.model.nodes if n.backup == "in_flight"}
    for snap in evidence.snapshots:
        check_no_stale_layer_writes(snap.pending_layer_writes, in_flight, f"rank {snap.rank}")


@registered("INV-16", DrainedAck, StateView, quiescence=1)
def check_inv_16_acked_once(evidence: Evidence) -> None:
    """INV-16: no load ack for a node that is not loading; once every submission was acked,
    both ack queues are empty."""
    if isinstance(evidence, DrainedAck):
        if not evidence.in_flight:
            raise InvariantViolation(
                "INV-16", f"load ack for node_id {evidence.node_id}, which has no load in flight"
            )
        return
    if not isinstance(evidence, StateView):
        raise _other("INV-16", evidence)
    for snap in evidence.snapshots:
        with on_rank(snap.rank):
            check_ack_queues_empty(
                {"ack_write_queue": snap.write_rows, "ack_load_queue": snap.load_rows}
            )


@registered("INV-17", Refusal, refusal=1)
def check_inv_17_refusal_changes_nothing(evidence: Evidence) -> None:
    """INV-17 on every rank: pages, ack rows and pending writes are as before the refusal."""
    if not isinstance(evidence, Refusal):
        raise _other("INV-17", evidence)
    for old, new in zip(evidence.before, evidence.after, strict=True):
        if old.same_state(new, evidence.may_change):
            continue  # the common case, without building the named parts
        with on_rank(new.rank):
            what = evidence.what
            check_unchanged(old.parts(evidence.may_change), new.parts(evidence.may_change), what)


@registered("INV-18", Rows, StateView, reset=1)
def check_inv_18_reset_clean(evidence: Evidence) -> None:
    """INV-18: after reset nothing is queued, pending or claimed, and no copy issued before it
    landed after it (the freed pages still hold the harness's poison)."""
    if isinstance(evidence, Rows):
        _bytes("INV-18", evidence)
        return
    if not isinstance(evidence, StateView):
        raise _other("INV-18", evidence)
    for snap in evidence.snapshots:
        ids = [node_id for node_id, _ in snap.gate_answers or ()]
        gate = _gate(snap) if snap.gate_answers is not None else (lambda node_id: False)
        with on_rank(snap.rank):
            check_reset_clean(
                {"ack_write_queue": len(snap.write_acks), "ack_load_queue": len(snap.load_acks)},
                snap.pending_layer_writes,
                snap.producer_index,
                snap.consumer_indices,
                gate,
                ids,
            )


# -- INV-36: pool groups ------------------------------------------------------------------------
@registered("INV-36", PoolIndices)
def check_inv_36_pool_own_indices(evidence: Evidence) -> None:
    """INV-36: rows and slots a pool of a group handed a node come from that pool's own
    allocator and are no other node's."""
    if not isinstance(evidence, PoolIndices):
        raise _other("INV-36", evidence)
    pages = {value // evidence.page_size for value in to_ints(evidence.indices)}
    check_pool_indices_own(evidence.pool, pages, evidence.allocated, evidence.others, evidence.what)


# -- INV-40: state pools ------------------------------------------------------------------------
@registered("INV-40", StateSlots)
def check_inv_40_state_slot_per_node(evidence: Evidence) -> None:
    """INV-40: a state pool (Mamba) hands a node one state slot on a write and on a load."""
    if not isinstance(evidence, StateSlots):
        raise _other("INV-40", evidence)
    slots = to_ints(evidence.indices)
    check_state_slot_count(evidence.pool, slots, evidence.expected, evidence.what)


CHECKERS = collect([globals(), *(vars(module) for module in STORAGE_MODULES)])
"""Every registered checker (``checker.registered``), in id order: the one home of each id."""
REGISTERED: Mapping[str, Checker] = MappingProxyType({c.inv_id: c.check for c in CHECKERS})
"""Every invariant id the harness checks, and its one checker."""

STEP_IDS = phase_ids(CHECKERS, "step")
REFUSAL_IDS = phase_ids(CHECKERS, "refusal")
RESET_IDS = phase_ids(CHECKERS, "reset")
QUIESCENCE_IDS = phase_ids(CHECKERS, "quiescence")
STORAGE_IDS = phase_ids(CHECKERS, "storage")


class CheckRunner:
    """Hands evidence to the registered checker of an id and counts the runs per id."""

    def __init__(self, counts: Counter[str] | None = None) -> None:
        self.counts: Counter[str] = Counter() if counts is None else counts

    def run(self, inv_id: str, evidence: Evidence) -> None:
        self.counts[inv_id] += 1
        REGISTERED[inv_id](evidence)

    def run_all(self, inv_ids: tuple[str, ...], evidence: Evidence) -> None:
        for inv_id in inv_ids:
            self.run(inv_id, evidence)


__all__ = [
    "QUIESCENCE_IDS",
    "REFUSAL_IDS",
    "REGISTERED",
    "RESET_IDS",
    "STEP_IDS",
    "STORAGE_IDS",
    "CheckRunner",
    "Checker",
    "check_inv_19_prefetch_ranges",
    "check_inv_20_storage_collectives",
    "check_inv_21_min_progress",
    "check_inv_22_verdict_after_hit",
    "check_inv_23_io_owned_pages",
    "check_inv_24_storage_epochs",
    "check_inv_25_one_ack",
    "check_inv_26_ack_is_stored_prefix",
    "check_inv_27_prefix_keys",
    "check_inv_28_key_namespace",
    "check_inv_29_hit_endpoint",
    "check_inv_30_l3_bytes",
    "check_inv_31_prefix_closed",
    "on_rank",
]
