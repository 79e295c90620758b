"""One storage step in lockstep: each rank's thread advanced through one loop body, every
backend call's outcome read from what the backend answered (``follow_step``).

A hit query step is ``Advance`` from ``prefetch_queue.get`` through its ``batch_exists`` calls
(an answer below the oracle's run is a hole, a raise a raise, one above it a divergence, INV-30),
the ``hits`` collective once every rank is in it, and the publish; an IO step the termination
check, the ``batch_get`` (a page the backend did not return although the oracle holds it is a
hole; bytes for a page the oracle never saw written diverge), the progress ack and, after the
last batch, the final ack; a sync step the ``get``, the ``completion`` collective and the
publish; a backup step each ``batch_set`` (refused: ``fail``, with the leading pages the store
holds all the same) and the ack. Calls the oracle would not make (after a miss, a failed batch
or a termination) and key names that change prefix diverge; pages a write reported stored that
the store does not hold are lost to a fault (``LosePage``).
"""

from __future__ import annotations

from typing import Any

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.harness.lockstep.storage_compare import compare_step
from hicache_ref.harness.lockstep.storage_follower import StorageFollower
from hicache_ref.harness.world.recording_storage import BackendCall
from hicache_ref.oracle.storage import (
    BACKUP,
    HIT_QUERY,
    IO,
    SYNC,
    Advance,
    Collective,
    LosePage,
)
from hicache_ref.oracle.storage.keys import compute_batch_range
from hicache_ref.oracle.storage.state import ABSENT

THREAD_OF = {
    StorageStepKind.HIT_QUERY: HIT_QUERY,
    StorageStepKind.IO: IO,
    StorageStepKind.SYNC: SYNC,
    StorageStepKind.BACKUP: BACKUP,
}
GROUP_OF = {HIT_QUERY: "hits", SYNC: "completion"}
_EXTRA_CALL_ID = {"exists": "INV-29", "get": "INV-19", "set": "INV-31"}
"""The id a backend call the oracle did not make is reported under, by call kind."""


def follow_step(ls: StorageFollower, kind: StorageStepKind) -> None:
    with ls.lock:
        results = dict(ls.results)
    thread = THREAD_OF[kind]
    calls = [list(c) for c in ls.calls]
    for rank in sorted(results):
        _run_body(ls, rank, thread, calls[rank])
        if calls[rank]:
            extra = calls[rank][0]
            raise ls.divergence(
                _EXTRA_CALL_ID[extra.kind], f"{kind.value} step", f"rank {rank} backend "
                f"calls: oracle none more, implementation batch_{extra.kind} of "
                f"{len(extra.keys)} keys (after a miss, a failed batch or a termination)",
            )  # fmt: skip
    group = GROUP_OF.get(thread)
    if group is not None and any(
        ls.state.ranks[r].threads[thread].point == "reduce" for r in results
    ):
        ls.apply_op(Collective(group), f"{kind.value} step")
        ls.collectives[group] += 1
        for rank in sorted(results):
            if ls.state.ranks[rank].threads[thread].point == "publish":
                ls.apply_op(Advance(rank, thread), f"{kind.value} step")
    for rank in sorted(results):
        drop_lost(ls, rank, ls.calls[rank])
    ls.steps += 1
    ls.session.stats.lockstep["storage_steps_in_lockstep"] += 1
    compare_step(ls, kind, results)


def _run_body(ls: StorageFollower, rank: int, thread: int, calls: list[BackendCall]) -> None:
    """Advance one rank's thread through one loop body, each call's outcome from ``calls``:
    up to the collective (hit query, progress sync) or to its end."""
    what = f"rank {rank} {('hit_query', 'io', 'sync', 'backup')[thread]} step"

    def point() -> str:
        return ls.state.ranks[rank].threads[thread].point

    if thread != IO or point() == "idle":
        ls.apply_op(Advance(rank, thread), what)  # the get on its input queue
    if thread == HIT_QUERY:
        while point() == "exists":
            record = ls.state.ranks[rank].threads[thread]
            ls.apply_op(exists_outcome(ls, rank, record, calls), what)
    elif thread == IO:
        ls.apply_op(Advance(rank, IO), what)  # the termination check
        if point() == "get":
            record = ls.state.ranks[rank].threads[thread]
            ls.apply_op(get_outcome(ls, rank, record, calls), what)
        ls.apply_op(Advance(rank, IO), what)  # the progress ack
        if point() == "final":
            ls.apply_op(Advance(rank, IO), what)
    elif thread == SYNC:
        if point() == "publish":  # a final ack: no collective
            ls.apply_op(Advance(rank, SYNC), what)
    else:
        while point() == "set":
            ls.apply_op(set_outcome(ls, rank, calls), what)
        if point() == "ack":
            ls.apply_op(Advance(rank, BACKUP), what)


def _batch_keys(ls: StorageFollower, op: int, batch: int, pages: int) -> tuple[int, ...]:
    start, end = compute_batch_range(batch, ls.state.config.batch_pages, pages)
    return ls.state.config.op_keys(op)[start:end]


def exists_outcome(
    ls: StorageFollower, rank: int, record: Any, calls: list[BackendCall], gone: bool = False
) -> Advance:
    """The ``batch_exists`` of ``record``'s batch as the oracle's outcome (``gone``: a page the
    store no longer holds is lost first, as a ``gone`` outcome under points evicts it)."""
    keys = _batch_keys(ls, record.op, record.batch, ls.state.config.ops[record.op].pages)
    call = next_call(calls, "exists")
    if call is None or call.raised:
        return Advance(rank, HIT_QUERY, "raise")
    _learn(ls, rank, call.keys, keys)
    l3 = ls.state.ranks[rank].l3
    run = next((i for i, k in enumerate(keys) if l3[k] == ABSENT), len(keys))
    if call.answer > run:
        raise ls.divergence(
            "INV-30", f"rank {rank} batch_exists", f"pages present: oracle {run}, "
            f"implementation's backend {call.answer}",
        )  # fmt: skip
    if call.answer < run:
        if gone and lose_gone_page(ls, rank, call.keys[call.answer], keys[call.answer]):
            return Advance(rank, HIT_QUERY)
        return Advance(rank, HIT_QUERY, "hole", call.answer)
    return Advance(rank, HIT_QUERY)


def get_outcome(
    ls: StorageFollower, rank: int, record: Any, calls: list[BackendCall], gone: bool = False
) -> Advance:
    """The ``batch_get`` of ``record``'s batch as the oracle's outcome (``gone`` as above)."""
    view = ls.state.ranks[rank].prefetches[record.op]
    keys = _batch_keys(ls, record.op, record.batch, len(view.bounce))
    call = next_call(calls, "get")
    if call is None:
        return Advance(rank, IO, "raise")
    _learn(ls, rank, call.keys, keys)
    _check_bytes(ls, rank, call, keys)
    l3 = ls.state.ranks[rank].l3
    for i, key in enumerate(keys):
        got = i < len(call.digests) and call.digests[i] is not None
        if got and l3[key] == ABSENT:
            raise ls.divergence(
                "INV-30", f"rank {rank} batch_get", f"page {i} of the batch read back: "
                "oracle absent (never written), implementation's backend returned bytes",
            )  # fmt: skip
        if l3[key] != ABSENT and not got:
            if gone and lose_gone_page(ls, rank, call.keys[i], key):
                return Advance(rank, IO)
            return Advance(rank, IO, "hole", i)
    return Advance(rank, IO)


def set_outcome(ls: StorageFollower, rank: int, calls: list[BackendCall]) -> Advance:
    call = next_call(calls, "set")
    if call is None:
        return Advance(rank, BACKUP, "raise")
    record = ls.state.ranks[rank].threads[BACKUP]
    keys = _batch_keys(ls, record.op, record.batch, ls.state.config.ops[record.op].pages)
    _learn(ls, rank, call.keys, keys)
    _check_bytes(ls, rank, call, keys)
    if call.ok:
        return Advance(rank, BACKUP)
    landed = 0  # a refused batch may still have stored its first pages (the store says)
    while landed < len(call.keys) - 1 and _store_has(ls, rank, call.keys[landed]):
        landed += 1
    return Advance(rank, BACKUP, "fail", landed)


def lose_gone_page(ls: StorageFollower, rank: int, name: str, key: int) -> bool:
    """A page the oracle holds that the harness's store lost (an eviction): ``LosePage``."""
    if _store_has(ls, rank, name):
        return False
    ls.apply_op(LosePage(rank, key), f"rank {rank} backend lost a page")
    return True


def _store_has(ls: StorageFollower, rank: int, name: str) -> bool:
    """Whether the harness's own store (under the fault wrapper) holds ``name``."""
    storage_rank = ls.driver.l3.ranks[rank]
    faults, recording = storage_rank.faults, storage_rank.recording
    store = faults.inner if faults is not None else getattr(recording, "inner", None)
    return bool(store is not None and store.exists(name))


def _learn(ls: StorageFollower, rank: int, names: tuple[str, ...], keys: tuple[int, ...]) -> None:
    """Which backend key names which prefix: one key per prefix and one prefix per key."""
    for name, key in zip(names, keys, strict=False):
        known = ls.key_names[rank].setdefault(name, key)
        if known != key:
            raise ls.divergence(
                "INV-27", f"rank {rank} backend call", f"key {name[:16]} names the prefix "
                f"of oracle key {key}; it named oracle key {known} before (a key commits "
                "to its whole prefix)",
            )  # fmt: skip


def _check_bytes(ls: StorageFollower, rank: int, call: BackendCall, keys: tuple[int, ...]) -> None:
    """Each page a call wrote or read back holds the bytes the harness's content oracle
    made for its prefix on this rank (what the oracle's GOOD tag stands for, INV-30)."""
    expected = ls.driver.log.expected
    for i, digest in enumerate(call.digests[: len(keys)]):
        want = expected.get((rank, ls.prefixes[keys[i]]))
        if digest is not None and want is not None and digest != want:
            raise ls.divergence(
                "INV-30", f"rank {rank} batch_{call.kind}", f"bytes of page {i} of the "
                f"batch: oracle {want[:12]} (its key's), implementation {digest[:12]}",
            )  # fmt: skip


def drop_lost(ls: StorageFollower, rank: int, calls: list[BackendCall]) -> None:
    """Pages a write reported stored that the store does not hold (an injected
    ``set_drop``): lost to a fault, as the oracle's ``LosePage``."""
    for call in calls:
        if call.kind != "set" or not call.ok:
            continue
        for name in call.keys:
            key = ls.key_names[rank].get(name)
            if key is None or ls.state.ranks[rank].l3[key] == ABSENT:
                continue
            if not _store_has(ls, rank, name):
                ls.apply_op(LosePage(rank, key), f"rank {rank} backend dropped a page")


def next_call(calls: list[BackendCall], kind: str) -> BackendCall | None:
    for index, call in enumerate(calls):
        if call.kind == kind:
            del calls[index]
            return call
    return None
