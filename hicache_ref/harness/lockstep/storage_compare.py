"""What the storage lockstep compares, and the id a difference is reported under.

After each storage step (``compare_step``): which ranks ran it (a rank the oracle says had the
work and did not run it, or ran work the oracle says it had not: INV-20), and each rank's
result against the oracle's: the published hit (INV-29), the pages the IO counted and its final
ack (INV-19, INV-25), the progress the sync thread published (INV-21), the stored prefix a
backup acked (INV-26). After every verb (``compare_after_verb``): every rank's eight storage
queues (the ack queues INV-25, the release queue INV-23, the others and every queue right after
a reset INV-24), the collectives each rank issued per group (INV-20; the same progress
reductions missing on every rank INV-21), which prefetches the tree
still follows (INV-25), their bounce buffers (INV-29) and applied progress (INV-21), what
``terminate_prefetch`` returned (INV-19), and each backup's drained acks (INV-25).

What an implementation says of itself is never compared: queue lengths, collective logs and
what the tree drained are the harness's own records or what the tier emitted.
"""

from __future__ import annotations

from hicache_ref.controller.storage.collectives import PREFETCH_COMPLETION, PREFETCH_HITS
from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.harness.lockstep.storage_follower import StorageFollower
from hicache_ref.oracle.storage import BACKUP, HIT_QUERY, IO, SYNC
from hicache_ref.oracle.storage.state import FINAL
from hicache_ref.oracle.storage.step import thread_ops

QUEUES = (
    ("prefetch_queue", "prefetch_queue", "INV-24"),
    ("prefetch_hit_queue", "hit_queue", "INV-24"),
    ("prefetch_buffer", "buffer", "INV-24"),
    ("prefetch_sync_queue", "sync_queue", "INV-25"),
    ("ack_prefetch_queue", "ack_queue", "INV-25"),
    ("backup_queue", "backup_queue", "INV-24"),
    ("ack_backup_queue", "backup_acks", "INV-25"),
    ("host_mem_release_queue", "release_queue", "INV-23"),
)
"""Each tier queue, the oracle's name for it, and the id a length that differs is reported
under: an ack queue one ack per operation (INV-25), the release queue the pages the IO gave up
(INV-23), the rest the queues of an epoch (INV-24; right after a reset every queue is INV-24)."""
GROUPS = ((PREFETCH_HITS.name, "hits"), (PREFETCH_COMPLETION.name, "completion"))
THREAD_OF = {
    StorageStepKind.HIT_QUERY: HIT_QUERY,
    StorageStepKind.IO: IO,
    StorageStepKind.SYNC: SYNC,
    StorageStepKind.BACKUP: BACKUP,
}


def compare_step(
    lockstep: StorageFollower, kind: StorageStepKind, results: dict[int, StepResult]
) -> None:
    """One storage step: who ran it and what each rank's result says."""
    state = lockstep.state
    thread = THREAD_OF[kind]
    what = f"{kind.value} step"
    for rank in range(lockstep.driver.n):
        if rank not in results and thread_ops(state, rank, thread):
            record = state.ranks[rank].threads[thread]
            if record.point == "idle" or kind is StorageStepKind.IO:
                raise lockstep.divergence(
                    "INV-20", what, f"rank {rank} ran: oracle yes, implementation no"
                )
    compare_results(lockstep, kind, results, what)


def compare_results(
    lockstep: StorageFollower, kind: StorageStepKind, results: dict[int, StepResult], what: str
) -> None:
    """What each rank's loop body that ended reports, against the oracle."""
    state = lockstep.state
    thread = THREAD_OF[kind]
    for rank, result in sorted(results.items()):
        want = _expected_tokens(lockstep, rank, thread, result)
        if want is not None and want != result.tokens:
            inv = {HIT_QUERY: "INV-29", IO: "INV-19", SYNC: "INV-21", BACKUP: "INV-26"}[thread]
            raise lockstep.divergence(
                inv,
                what,
                f"rank {rank} {_QUANTITY[thread]}: oracle {want}, implementation {result.tokens}",
            )
        if thread == IO:
            io = state.ranks[rank].threads[IO]
            finished = io.point == "idle"
            if finished != result.final:
                raise lockstep.divergence(
                    "INV-25",
                    what,
                    f"rank {rank} final ack put: oracle {finished}, implementation {result.final}",
                )


_QUANTITY = {
    HIT_QUERY: "published hit (tokens)",
    IO: "pages read back (tokens counted)",
    SYNC: "published progress (tokens)",
    BACKUP: "stored prefix acked (tokens)",
}


def _expected_tokens(
    lockstep: StorageFollower, rank: int, thread: int, result: StepResult
) -> int | None:
    state = lockstep.state
    rank_state = state.ranks[rank]
    page = lockstep.driver.page
    if thread == BACKUP:
        op_id = -1 if result.op_id is None else int(result.op_id)
        op = lockstep.backup_ops[rank].get(op_id)
        if op is None or not rank_state.backup_acks:
            return None
        entry_op, value = rank_state.backup_acks[-1]
        return value * page if entry_op == op else None
    op = lockstep.prefetch_ops.get(result.request_id or "")
    if op is None:
        return None
    view = rank_state.prefetches[op]
    if thread == HIT_QUERY:
        return view.hit * page
    if thread == IO:
        return view.local * page
    if not rank_state.ack_queue:
        return None
    entry_op, value = rank_state.ack_queue[-1]
    if entry_op != op:
        return None
    return 0 if value == FINAL else value * page


def compare_after_verb(lockstep: StorageFollower, verb: str) -> None:
    """The whole storage state both sides can see, after ``verb``."""
    _compare_queues(lockstep, verb)
    _compare_collectives(lockstep, verb)
    _compare_prefetches(lockstep, verb)
    _compare_backups(lockstep, verb)


def _compare_queues(lockstep: StorageFollower, verb: str) -> None:
    for rank, tier in enumerate(lockstep.driver.l3.tiers):
        sizes = tier.queues.sizes()
        mine = lockstep.state.ranks[rank]
        for tier_name, oracle_name, inv_id in QUEUES:
            want, got = len(getattr(mine, oracle_name)), sizes[tier_name]
            if want != got:
                raise lockstep.divergence(
                    "INV-24" if lockstep.state.fresh_epoch else inv_id, verb, f"rank {rank} {tier_name} length: oracle {want}, "
                    f"implementation {got}",
                )  # fmt: skip


def _compare_collectives(lockstep: StorageFollower, verb: str) -> None:
    """Every rank's collectives per group. Ranks that differ among themselves break INV-20; all
    ranks missing (or adding) the same progress reductions publish progress that is no MIN
    (INV-21)."""
    logs = lockstep.driver.l3.group.logs()
    for name, group in GROUPS:
        counts = [sum(1 for record in log if record.group == name) for log in logs]
        want = lockstep.collectives[group]
        for rank, got in enumerate(counts):
            if want != got:
                alike = len(set(counts)) == 1
                inv_id = "INV-21" if alike and group == "completion" else "INV-20"
                detail = f"rank {rank} {name} collectives: oracle {want}, implementation {got}"
                raise lockstep.divergence(inv_id, verb, detail)


def _compare_prefetches(lockstep: StorageFollower, verb: str) -> None:
    driver = lockstep.driver
    page = driver.page
    for rid, op in lockstep.prefetch_ops.items():
        for rank, tree_rank in enumerate(driver.storage_tree.ranks):
            view = lockstep.state.ranks[rank].prefetches[op]
            info = tree_rank.ongoing_prefetch.get(rid)
            if (info is not None) != view.current:
                raise lockstep.divergence(
                    "INV-25", verb, f"rank {rank} prefetch {rid!r} still followed by the tree: "
                    f"oracle {view.current}, implementation {info is not None}",
                )  # fmt: skip
            log = driver.log.prefetches[rank].get(rid)
            if log is not None and log.terminated_at is not None:
                want = view.published * page
                if want != log.terminated_at:
                    raise lockstep.divergence(
                        "INV-19", verb, f"rank {rank} terminate_prefetch({rid!r}) returned: "
                        f"oracle {want}, implementation {log.terminated_at}",
                    )  # fmt: skip
            if info is None:
                continue
            bounce = 0 if info.host_indices is None else int(info.host_indices.numel())
            if bounce != len(view.bounce) * page:
                raise lockstep.divergence(
                    "INV-29", verb, f"rank {rank} bounce buffer of {rid!r} (tokens): oracle "
                    f"{len(view.bounce) * page}, implementation {bounce}",
                )  # fmt: skip
            applied = int(info.operation.completed_tokens)
            if applied != view.published * page:
                raise lockstep.divergence(
                    "INV-21", verb, f"rank {rank} progress the tree applied to {rid!r}: oracle "
                    f"{view.published * page}, implementation {applied}",
                )  # fmt: skip


def _compare_backups(lockstep: StorageFollower, verb: str) -> None:
    for rank, ops in enumerate(lockstep.backup_ops):
        logs = lockstep.driver.log.backups[rank]
        for op_id, op in ops.items():
            log = logs.get(op_id)
            want = lockstep.state.ranks[rank].backups[op].acks_drained
            if log is not None and log.acks != want:
                raise lockstep.divergence(
                    "INV-25", verb, f"rank {rank} acks drained of backup {op_id}: oracle "
                    f"{want}, implementation {log.acks}",
                )  # fmt: skip
