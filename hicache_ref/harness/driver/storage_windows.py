"""What the storage driver records of the windows inside a loop body (INV-32 .. INV-35).

Each function turns something the harness saw itself into the ``WindowEvidence`` of the next
snapshot (``checks_storage_windows.py`` judges it), in the order a case meets them:

- ``note_termination``: the harness's step clock when the tree's termination of a prefetch
  returned (``terminate_prefetch``, or the policy's verdict);
- ``observe_reads``: a loop body's backend reads of one prefetch, with the step each ran in:
  reads after the termination (INV-33), and the first page that came back empty (INV-34);
- ``read_acked_pages``: when the tree drains a backup ack, every page it counts read back from
  the store below the fault layer, with the oracle's digest for its prefix (INV-32);
- ``stale_grants``: the grants each rank's gate gave a thread of an earlier epoch (INV-35).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.harness.schedule.points import BATCH_GET
from hicache_ref.harness.world.recording_storage import BackendCall, page_digest
from hicache_ref.invariants.storage_snapshot import AckedPageRead, LateRead, ReadHole, StaleGrant

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_chains import Chain
    from hicache_ref.harness.driver.storage_log import StorageLog
    from hicache_ref.harness.world.storage_world import StorageWorld


class WindowsDriver(Protocol):
    """What the window records read of the storage driver: its page size, its world, its log,
    its chains, its step clock and whether schedule points are on."""

    page: int
    l3: StorageWorld
    log: StorageLog
    steps_run: int

    @property
    def points(self) -> object | None: ...
    @property
    def chains(self) -> dict[int, Chain]: ...


def note_termination(driver: WindowsDriver, rank: int, request_id: str) -> None:
    """The step clock now, and whether one read may still run: the rank's IO thread is parked
    at a read's call (its termination check already passed), or the IO has not read this
    prefetch yet (an IO that looks after each batch, 0.5.10's, sees it only after one)."""
    key = (rank, request_id)
    if key in driver.log.terminated_step:
        return
    driver.log.terminated_step[key] = driver.steps_run
    if key not in driver.log.read_started:
        driver.log.in_flight.add(key)
    elif driver.points is not None:
        from hicache_ref.harness.schedule.points import position

        at = position(driver.l3.tiers[rank], StorageStepKind.IO)
        if at is not None and at.kind == BATCH_GET:
            driver.log.in_flight.add(key)


def mark_reads(
    driver: WindowsDriver, rank: int, request_id: str | None, calls: Sequence[BackendCall]
) -> None:
    """``request_id``'s IO read its pages on ``rank`` (if one of ``calls`` is a read), as the
    calls run: under points a body's calls are observed only when it ends."""
    if request_id is not None and any(call.kind == "get" for call in calls):
        driver.log.read_started.add((rank, request_id))


def observe_reads(
    driver: WindowsDriver,
    rank: int,
    request_id: str | None,
    calls: Sequence[BackendCall],
    steps: Sequence[int],
) -> None:
    """One IO body's reads of ``request_id`` on ``rank``; ``steps[i]``: the step call i ran in."""
    log = driver.log.prefetches[rank].get(request_id or "")
    if log is None:
        return
    mark_reads(driver, rank, log.request_id, calls)
    terminated = driver.log.terminated_step.get((rank, log.request_id))
    chain = driver.chains.get(log.chain_uid)
    keys = list(chain.keys) if chain is not None else []
    begun = _batches_begun_before(calls, steps, terminated)
    for call, step in zip(calls, steps, strict=True):
        if call.kind != "get":
            continue
        if terminated is not None and step > terminated and call.keys not in begun:
            op_key = (rank, log.request_id)
            in_flight = op_key in driver.log.in_flight
            driver.log.in_flight.discard(op_key)  # one read may still run, and only the first
            driver.log.late_reads.append(LateRead(rank, log.request_id, call.keys, in_flight))
        for page_key, digest in zip(call.keys, call.digests, strict=True):
            if digest is None and page_key in keys:
                driver.log.holes.append(ReadHole(rank, log.request_id, keys.index(page_key)))
                break


def _batches_begun_before(
    calls: Sequence[BackendCall], steps: Sequence[int], terminated: int | None
) -> set[tuple[str, ...]]:
    """The KV keys of each batch whose sidecar read ran before the termination: the draft
    releases (0.5.11 - 0.5.18) read a batch's draft pages, then its KV pages, and look at
    termination only after both, so the KV read of a batch begun before the termination is
    that batch's in-flight read, as a parked read is (INV-33)."""
    if terminated is None:
        return set()
    return {
        tuple(key.rsplit(".", 1)[0] for key in call.keys)
        for call, step in zip(calls, steps, strict=True)
        if call.kind == "sidecar_get" and step <= terminated
    }


def read_acked_pages(driver: WindowsDriver, rank: int, op: Any, acked_pages: int) -> None:
    """The pages a drained backup ack counts, read back from the store (below the faults)."""
    backup = driver.log.backups[rank].get(int(op.id))
    faults = driver.l3.ranks[rank].faults
    if backup is None or backup.skipped or faults is None or not acked_pages:
        return
    chain = driver.chains.get(backup.chain_uid)
    if chain is None:
        return
    page = driver.page
    prefix = chain.prefix(page)
    start = len(prefix) - chain.pages * page
    for i, key in enumerate(list(op.hash_value)[:acked_pages]):
        data = faults.inner.batch_get([key])[0]
        expected = driver.log.expected.get((rank, prefix[: start + (i + 1) * page]))
        lost = key in faults.dropped_keys or key in faults.evicted
        digest = None if data is None else page_digest(data)
        driver.log.acked_reads.append(AckedPageRead(rank, int(op.id), key, digest, expected, lost))


def stale_grants(tiers: Sequence[Any]) -> tuple[StaleGrant, ...]:
    """Every grant a rank's gate gave a thread started before the gate's epoch then."""
    found: list[StaleGrant] = []
    for rank, tier in enumerate(tiers):
        gate = getattr(tier, "gate", None) or getattr(getattr(tier, "executor", None), "gate", None)
        for g in getattr(gate, "grants", ()):
            if g.thread_epoch != g.epoch:
                found.append(StaleGrant(rank, g.thread, g.thread_epoch, g.epoch, g.point))
    return tuple(found)
