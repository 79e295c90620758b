"""The checks a session runs, by invariant id, over snapshots and the harness's own model.

Each entry adapts one checker of ``checks_*.py`` to plain per-rank data (``snapshot.py``), so
the harness checks every implementation the same way and trusts none of them:

- ``STEP_CHECKS`` after every applied step: one undrained write ack per node and a gate that
  agrees with the queue (INV-02), identical ack rows on every rank (INV-14), producer slots
  never oversubscribed (INV-10), every page free or owned by one node (INV-05);
- ``REFUSAL_CHECKS`` around a refused operation: it changed nothing (INV-17);
- ``RESET_CHECKS`` after ``reset``: nothing queued, pending or claimed (INV-18);
- ``QUIESCENCE_CHECKS`` once every ack drained: no ack left over (INV-16), no per-layer
  write outliving its backup (INV-15), every page free or owned by one node (INV-05).

Dict order is the order the session runs them, so the first violation reported is the same one
on every run. A message names the rank before the checker's own text (node, page, fix).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType, TracebackType

from hicache_ref.errors import InvariantViolation
from hicache_ref.invariants.checks_acks import (
    check_ack_queues_empty,
    check_ack_rows_identical,
    check_producer_slots_held,
    check_reset_clean,
    check_single_write_ack,
    check_undrained_gate_agrees,
)
from hicache_ref.invariants.checks_ownership import check_pages_owned_once, check_unchanged
from hicache_ref.invariants.checks_transfer import check_no_stale_layer_writes
from hicache_ref.invariants.snapshot import HarnessModel, RankSnapshot

Snapshots = Sequence[RankSnapshot]
StateCheck = Callable[[Snapshots, HarnessModel], None]
RefusalCheck = Callable[[Snapshots, Snapshots, str, Collection[str]], None]


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


def _gate(snapshot: RankSnapshot) -> Callable[[int], bool]:
    answers = dict(snapshot.gate_answers or ())
    return answers.__getitem__


# -- after every step ---------------------------------------------------------------------------
def check_one_write_ack_per_node(snapshots: Snapshots, model: HarnessModel) -> None:
    """INV-02 on every rank: no node twice among the write acks; the gate agrees with a scan."""
    for snap in snapshots:
        with on_rank(snap.rank):
            check_single_write_ack(snap.write_rows)
            if snap.gate_answers is not None:
                ids = [node_id for node_id, _ in snap.gate_answers]
                check_undrained_gate_agrees(_gate(snap), snap.write_rows, ids)


def check_ranks_ack_alike(snapshots: Snapshots, model: HarnessModel) -> None:
    """INV-14: every rank's write-ack and load-ack rows equal rank 0's (lockstep: no lag)."""
    for queue in ("ack_write_queue", "ack_load_queue"):
        rows = [s.write_rows if queue == "ack_write_queue" else s.load_rows for s in snapshots]
        try:
            check_ack_rows_identical(rows, allow_lag=model.allow_lag)
        except InvariantViolation as violation:
            raise InvariantViolation("INV-14", f"{queue}: {violation.detail}") from None


def check_producer_slots(snapshots: Snapshots, model: HarnessModel) -> None:
    """INV-10: no rank holds more undrained load acks than the harness configured slots."""
    for snap in snapshots:
        with on_rank(snap.rank):
            check_producer_slots_held(len(snap.load_acks), model.num_counters)


def check_pages_conserved(snapshots: Snapshots, model: HarnessModel) -> None:
    """INV-05 on every rank: the pools' allocated pages are exactly the nodes' pages, once each."""
    device = {n.handle: n.device_pages for n in model.nodes}  # logical: the same on every rank
    # the model lists holdings by the world's rank list (one rank per process in a
    # multi-process CP world), so index by position and name the rank by its id
    for position, snap in enumerate(snapshots):
        r = snap.rank
        check_pages_owned_once(snap.device_pages, device, f"rank {r} device allocator")
        host = {n.handle: n.host_pages[position] for n in model.nodes}
        check_pages_owned_once(snap.host_pages, host, f"rank {r} host pool")
        if snap.draft_host_pages is not None:
            draft = {n.handle: n.draft_host_pages[position] for n in model.nodes}
            check_pages_owned_once(snap.draft_host_pages, draft, f"rank {r} draft host pool")


STEP_CHECKS: Mapping[str, StateCheck] = MappingProxyType(
    {
        "INV-02": check_one_write_ack_per_node,
        "INV-14": check_ranks_ack_alike,
        "INV-10": check_producer_slots,
        "INV-05": check_pages_conserved,
    }
)


# -- around a refused operation -----------------------------------------------------------------
def check_refusal_changed_nothing(
    before: Snapshots, after: Snapshots, what: str, may_change: Collection[str] = ()
) -> None:
    """INV-17 on every rank: pages, ack rows and pending writes are as before the refusal.

    ``may_change`` names parts the step changed before the refused call (a prefill's device
    pages, when only its early reservation was refused).
    """
    for old, new in zip(before, after, strict=True):
        if old.same_state(new, may_change):
            continue  # the common case, without building the named parts
        with on_rank(new.rank):
            check_unchanged(old.parts(may_change), new.parts(may_change), what)


REFUSAL_CHECKS: Mapping[str, RefusalCheck] = MappingProxyType(
    {"INV-17": check_refusal_changed_nothing}
)


# -- after reset --------------------------------------------------------------------------------
def check_reset_left_nothing(snapshots: Snapshots, model: HarnessModel) -> None:
    """INV-18 on every rank: empty ack queues, no pending write, no slot claimed, gate False."""
    for snap in snapshots:
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


RESET_CHECKS: Mapping[str, StateCheck] = MappingProxyType({"INV-18": check_reset_left_nothing})


# -- at quiescence ------------------------------------------------------------------------------
def check_no_ack_left(snapshots: Snapshots, model: HarnessModel) -> None:
    """INV-16 on every rank: once every submission was acked, both ack queues are empty."""
    for snap in snapshots:
        with on_rank(snap.rank):
            check_ack_queues_empty(
                {"ack_write_queue": snap.write_rows, "ack_load_queue": snap.load_rows}
            )


def check_no_stale_pending_write(snapshots: Snapshots, model: HarnessModel) -> None:
    """INV-15 on every rank: a pending per-layer write belongs to a backup still in flight."""
    in_flight = {n.node_id for n in model.nodes if n.backup == "in_flight"}
    for snap in snapshots:
        check_no_stale_layer_writes(snap.pending_layer_writes, in_flight, f"rank {snap.rank}")


QUIESCENCE_CHECKS: Mapping[str, StateCheck] = MappingProxyType(
    {
        "INV-16": check_no_ack_left,
        "INV-05": check_pages_conserved,
        "INV-15": check_no_stale_pending_write,
    }
)

__all__ = [
    "QUIESCENCE_CHECKS",
    "REFUSAL_CHECKS",
    "RESET_CHECKS",
    "STEP_CHECKS",
    "RefusalCheck",
    "StateCheck",
    "on_rank",
]
