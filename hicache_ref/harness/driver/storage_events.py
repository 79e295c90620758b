"""What the storage driver writes down: the tree half's decisions and the backend's calls.

``on_storage_event`` hears every decision of a rank's ``StorageTreeRank`` (a hit drained, a
bounce buffer given, an ack applied, a result inserted, a page freed, a verdict, a backup
acked) and ``observe_calls`` turns the recording backend's calls of one storage step into the
L3 model: the keys queried with the prefix each stands for and the leading run the backend
answered, the pages stored and read back with their digests. Both fill ``StorageLog``; nothing
here reads the implementation's bookkeeping, only what it emitted on its queues.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.harness.driver.byte_checks import BOUNCE_DRAFT_ROW_VALUE
from hicache_ref.harness.driver.node_model import Node
from hicache_ref.harness.driver.storage_buffer import BufferBook
from hicache_ref.harness.driver.storage_chains import Chain, scribble_draft_rows
from hicache_ref.harness.driver.storage_log import PrefetchLog, StorageLog
from hicache_ref.harness.driver.storage_side_book import SideBook
from hicache_ref.harness.driver.storage_side_events import (
    adopt_window,
    free_side_source,
    on_side_free,
    on_side_staging,
    on_side_verdict,
    swa_restorable,
)
from hicache_ref.harness.driver.storage_tree import StorageTree
from hicache_ref.harness.driver.storage_windows import (
    note_termination,
    observe_reads,
    read_acked_pages,
)
from hicache_ref.harness.world.recording_storage import BackendCall, page_digest
from hicache_ref.harness.world.storage_world import StorageWorld
from hicache_ref.invariants.storage_snapshot import (
    BouncePageEvent,
    KeyUse,
    ProgressAck,
    StaleAct,
    StoreRead,
    StoreWrite,
    VerdictRecord,
)
from hicache_ref.storage.operations import PrefetchOperation
from hicache_ref.storage.pool_transfers import MAMBA_POOL, WINDOW_POOLS


class DriverView(Protocol):
    """What the events read and write of the storage driver that hears them (it passes
    itself): its world, its chains, the log the checks read, its step clock, whether schedule
    points are on and whether the tree polls (0.5.10), and the checks themselves."""

    page: int
    n: int
    mla: bool
    epoch: int
    l3: StorageWorld
    log: StorageLog
    known_ops: dict[int, tuple[object, int]]
    sources: list[dict[int, torch.Tensor]]
    side: SideBook
    steps_run: int
    buffer: BufferBook | None  # a buffer_only world's pipeline (INV-41)
    tree: Any  # the tree driver (its nodes: a fetched chain becomes one)
    config: Any

    @property
    def points(self) -> object | None: ...
    @property
    def polled(self) -> object | None: ...
    @property
    def chains(self) -> dict[int, Chain]: ...
    @property
    def storage_tree(self) -> StorageTree: ...
    def polled_kind(self, kind: StorageStepKind) -> bool: ...
    def check(self) -> None: ...


def _current(driver: DriverView, rank: int, op: Any, what: str) -> bool:
    """Whether ``op`` is a prefetch of this epoch the driver started; else a stale act."""
    entry = driver.known_ops.get(id(op))
    if entry is not None and entry[0] is op and entry[1] == driver.epoch:
        return True
    rid = getattr(op, "request_id", "?")
    op_epoch = entry[1] if entry is not None and entry[0] is op else driver.epoch - 1
    driver.log.stale.append(StaleAct(rank, what, f"prefetch {rid!r}", op_epoch))
    return False


def _landed_pages(driver: DriverView, rank: int, log: PrefetchLog, op: Any) -> int:
    """Leading pages of the bounce buffer whose host bytes are the oracle's (INV-19)."""
    host = op.host_indices
    if host is None:
        return 0
    page = driver.page
    pool = driver.l3.ranks[rank].host_pool
    tokens = driver.chains[log.chain_uid].tokens(page)
    landed = 0
    for i in range(int(op.completed_tokens) // page):
        want = driver.log.expected.get((rank, log.anchor_prefix + tokens[: (i + 1) * page]))
        got = page_digest(pool.get_data_page(int(host[i * page]), True))
        if want != got:
            break
        landed += 1
    return landed


def _judge_sidecar(driver: DriverView, rank: int, log: PrefetchLog, op: Any) -> None:
    """In a sidecar world: how many leading pages of the progress just published also hold
    the oracle's draft bytes (INV-37 compares it with the progress)."""
    progress = log.published_progress[-1] if log.published_progress else 0
    pages = _sidecar_pages(driver, rank, log, op, progress)
    if pages is not None:
        log.sidecar_pages += (pages,)


def _sidecar_pages(
    driver: DriverView, rank: int, log: PrefetchLog, op: Any, progress: int
) -> int | None:
    """The leading pages of ``progress`` whose draft rows hold the oracle's bytes at the
    bounce slots; None outside a sidecar world."""
    draft = driver.l3.ranks[rank].draft_host_pool
    host: Any = getattr(op, "host_indices", None)
    if draft is None:
        return None
    page = driver.page
    tokens = driver.chains[log.chain_uid].tokens(page)
    pages = 0
    for i in range(progress // page if host is not None else 0):
        prefix = log.anchor_prefix + tokens[: (i + 1) * page]
        want = driver.log.expected_sidecar.get((rank, prefix))
        if want != page_digest(draft.get_data_page(int(host[i * page]), True)):
            break
        pages += 1
    return pages


def on_io_ack_put(driver: DriverView, rank: int, ack: Any) -> None:
    """Under schedule points, an IO progress ack just became visible on ``prefetch_sync_queue``:
    the pages it counts beyond the last one must hold the oracle's bytes now (INV-19), before
    any other thread can read the count. A final ack or one of another epoch is not judged."""
    tokens = getattr(ack, "completed_tokens", None)
    rid = getattr(ack, "rid", None)
    if tokens is None or getattr(ack, "completed_req", False) or not isinstance(rid, str):
        return
    _judge_io_count(driver, rank, rid, getattr(ack, "operation", None), int(tokens))


def on_polled_progress(driver: DriverView, rank: int, rid: str | None) -> None:
    """Under schedule points, after a grant of a polling release's IO (0.5.10 - 0.5.18, whose
    tree reads ``operation.completed_tokens`` itself): the progress is visible the moment the
    IO's ``increment`` returns, so the pages it newly counts must hold the oracle's bytes now
    (INV-19), judged like an IO progress ack at its put."""
    log = driver.log.prefetches[rank].get(rid or "")
    op = None if log is None else log.operation
    tokens = getattr(op, "completed_tokens", None)
    if rid is None or op is None or tokens is None:
        return
    _judge_io_count(driver, rank, rid, op, int(tokens))


def _judge_io_count(driver: DriverView, rank: int, rid: str, op: Any, tokens: int) -> None:
    """Record (before, after, landed) for the pages of ``op`` that ``tokens`` newly counts."""
    log = driver.log.prefetches[rank].get(rid)
    entry = driver.known_ops.get(id(op))
    if log is None or entry is None or entry[0] is not op or entry[1] != driver.epoch:
        return
    host = getattr(op, "host_indices", None)
    before = log.io_counted[-1][1] if log.io_counted else 0
    if tokens <= before or host is None:
        return
    page = driver.page
    pool = driver.l3.ranks[rank].host_pool
    chain = driver.chains[log.chain_uid].tokens(page)
    landed = 0
    for i in range(before // page, tokens // page):
        prefix = log.anchor_prefix + chain[: (i + 1) * page]
        want = driver.log.expected.get((rank, prefix))
        landed += want == page_digest(pool.get_data_page(int(host[i * page]), True))
    log.io_counted += ((before, tokens, landed),)


def _give_back(
    log: PrefetchLog,
    slots: list[int],
    action: str,
    final: bool,
    page: int,
    published: int | None = None,
) -> None:
    """``published``: 0.5.10's MIN over ranks for an insert (its tree inserts by it); else the
    progress the tree drained (INV-23 judges by it)."""
    if published is None:
        published = log.published_tokens
    seen: set[int] = set()
    for slot in slots:
        index = log.owned_slots.pop(slot, None)
        if index is None or index // page in seen:
            continue
        if log.bounce_tokens is None or index >= log.bounce_tokens:
            continue  # 0.5.10: a page allocated up front past the hit, the hit thread's to give
        seen.add(index // page)
        log.events += (BouncePageEvent(log.request_id, index // page, action, published, final),)


def on_storage_event(driver: DriverView, rank: int, kind: str, data: dict[str, Any]) -> None:
    logs = driver.log.prefetches[rank]
    op: Any = data.get("operation")
    # told apart by shape: upstream's prefetch operations are of its own class
    log = logs.get(op.request_id) if isinstance(getattr(op, "request_id", None), str) else None
    if kind == "hit":
        if driver.buffer is not None:  # the drained query heals the beliefs (INV-41)
            driver.buffer.hit(rank, op)
        if _current(driver, rank, op, "prefetch_hit_queue entry") and log and data["current"]:
            log.published_hit_tokens = int(op.storage_hit_count)
            log.hash_pages = len(op.hash_value)
    elif kind == "shorten" and log is not None:  # host pressure: the tree serves less
        log.cut_tokens = int(data["tokens"])
        log.hash_pages = len(op.hash_value)
    elif kind == "bounce" and log is not None:
        host: torch.Tensor = data["host_indices"]
        log.operation = op
        log.bounce_tokens = int(host.numel())
        log.owned_slots = {int(s): i for i, s in enumerate(host.tolist())}
        _reowned(driver, rank, log.owned_slots)
        _scribble_bounce(driver, rank, host)
    elif kind == "ack":
        _on_ack(driver, rank, data)
    elif kind == "allocated" and log is not None:  # 0.5.10: every token's page up front
        log.operation = op
        log.owned_slots = {int(s): i for i, s in enumerate(data["host_indices"].tolist())}
        _reowned(driver, rank, log.owned_slots)
        _scribble_bounce(driver, rank, data["host_indices"])
    elif kind == "release" and log is not None and "end" in data:  # 0.5.10's tree releases
        log.released += ((int(data["start"]), int(data["end"]), str(data["how"])),)
    elif kind == "release" and log is not None and op.host_indices is not None:
        log.released += ((int(data["start"]), int(op.host_indices.numel()), "tail"),)
    elif kind == "published" and log is not None:
        _on_published(driver, rank, log, int(data["agreed"]))
    elif kind == "insert" and log is not None:
        if driver.buffer is not None and int(data["end"]):  # a completed fetch teaches
            driver.buffer.fetched(rank, log.request_id, int(data["end"]) // driver.page)
        agreed = data.get("agreed")
        _on_insert(driver, rank, log, int(data["matched"]), int(data["end"]), agreed)
    elif kind == "terminate" and log is not None:
        log.terminated_at = int(data["completed"])
        if op is not None and int(op.completed_tokens) == log.terminated_at:
            log.landed_at_termination = _landed_pages(driver, rank, log, op)
            log.sidecar_at_termination = _sidecar_pages(driver, rank, log, op, log.terminated_at)
        note_termination(driver, rank, log.request_id)
    elif kind == "retire" and log is not None:
        log.retired = True
    elif kind == "verdict" and log is not None:
        log.verdicts += (
            VerdictRecord(
                log.request_id,
                bool(data["complete"]),
                log.published_hit_tokens is not None,
                log.published_tokens,
                log.published_hit_tokens if log.cut_tokens is None else log.cut_tokens,
            ),
        )
    elif kind == "free":
        freed = [int(s) for s in data["slots"].tolist()]
        _judge_late_release(driver, rank, freed)
        for each in logs.values():
            owned = [s for s in freed if s in each.owned_slots]
            if owned:
                # 0.5.10's terminate_prefetch freezes completed_tokens (increment refuses after
                # it) and every page below it was set before it was counted: the tree owns
                # [0:terminated_at) from then on, before the IO's body ends (schedule points)
                frozen = each.terminated_at if driver.polled is not None else None
                published = max(each.published_tokens, frozen or 0) if frozen else None
                _give_back(each, owned, "free", each.final_acks > 0, driver.page, published)
                driver.check()  # before the pool frees them: an IO may still write (INV-23)
    elif kind == "backup_ack":
        _on_backup_ack(driver, rank, data["operation"])
        if driver.buffer is not None:  # finish_storage_write_ack
            driver.buffer.storage_ack(rank, int(data["operation"].id))
    elif kind == "side_staging":
        on_side_staging(driver, rank, log, data["slots"])
    elif kind == "side_free":
        on_side_free(driver, rank, data["slots"], str(data["how"]))
    elif kind == "side_verdict" and log is not None:
        on_side_verdict(driver, rank, log, op, bool(data["accepted"]))


def insert_callback(driver: DriverView, rank: int) -> Any:
    """The tree's ``on_insert`` of ``rank``: a fetched chain becomes a host-only node of the
    tree driver on rank 0 (a peer, or a chain cached already, gives every page back)."""

    def on_insert(rid: str, operation: PrefetchOperation, host: torch.Tensor) -> int:
        log = driver.log.prefetches[rank].get(rid)
        chain = driver.chains[log.chain_uid] if log is not None else None
        if rank != 0 or chain is None or chain.uid in driver.tree.nodes:
            return int(host.numel())  # cached already (or a peer): every page goes back
        side_host: list[torch.Tensor | None] = []
        if driver.config.storage_swa_window and log is not None:
            side_host = [adopt_window(driver, rank, log, host)]  # None: no node
            if side_host[0] is None:
                return int(host.numel())
        node = Node(
            handle=chain.uid,
            node_id=driver.tree.next_node_id,
            logical_len=int(host.numel()),
            value=None,
            layers_stored=driver.tree.total_layers,
            backup="done",
            host_value=[host.clone()],
            side_host=side_host,
        )
        driver.tree.next_node_id += 1
        driver.tree.nodes[chain.uid] = node
        return 0

    return on_insert


def _scribble_bounce(driver: DriverView, rank: int, host: torch.Tensor) -> None:
    """A sidecar world's fresh bounce buffer: its draft rows scribbled (INV-37 then tells a
    draft page read from L3 from one the slot held before)."""
    draft = driver.l3.ranks[rank].draft_host_pool
    if draft is not None and host.numel():
        scribble_draft_rows(draft, host, BOUNCE_DRAFT_ROW_VALUE)


def _reowned(driver: DriverView, rank: int, slots: dict[int, int]) -> None:
    """A current prefetch owns these slots now: no ended epoch's release is judged on them."""
    stale = driver.log.stale_slots[rank]
    for slot in slots:
        stale.pop(slot, None)


def _judge_late_release(driver: DriverView, rank: int, freed: list[int]) -> None:
    """A release of bounce slots a reset already took back (still free) is the ended epoch's
    thread acting after the reset: recorded as its act (INV-24), before the pool's double free
    could hide whose release it was."""
    stale = driver.log.stale_slots[rank]
    pool = driver.l3.ranks[rank].host_pool
    late = [s for s in freed if s in stale and pool.is_page_free(s // driver.page)]
    if not late:
        return
    request, epoch = stale[late[0]]
    driver.log.stale.append(StaleAct(rank, "io step", f"prefetch {request!r}", epoch))
    driver.check()


def _on_ack(driver: DriverView, rank: int, data: dict[str, Any]) -> None:
    ack = data["ack"]
    driver.log.acks[rank].append(
        ProgressAck(ack.rid, ack.completed_tokens, bool(ack.completed_req))
    )
    if not _current(driver, rank, ack.operation, "ack_prefetch_queue entry"):
        return
    log = driver.log.prefetches[rank].get(ack.rid)
    if log is None:
        return
    if ack.completed_tokens is not None and data["current"]:
        log.published_progress += (int(ack.completed_tokens),)
        log.landed_pages += (_landed_pages(driver, rank, log, ack.operation),)
        _judge_sidecar(driver, rank, log, ack.operation)
    if ack.completed_req:
        log.final_acks += 1


def _on_insert(
    driver: DriverView,
    rank: int,
    log: PrefetchLog,
    matched: int,
    end: int,
    agreed: int | None = None,
) -> None:
    """``[0:matched)`` freed, ``[matched:end)`` inserted; ``agreed`` is 0.5.10's MIN over ranks
    (its operation keeps the rank's own progress), None where the operation holds it."""
    op = log.operation
    host = getattr(op, "host_indices", None)
    if matched:
        log.released += ((0, matched, "matched"),)
    if end > matched:
        log.released += ((matched, end, "inserted"),)
    if host is None:
        return
    final, page = log.final_acks > 0, driver.page
    _give_back(log, [int(s) for s in host[:matched].tolist()], "free", final, page, agreed)
    _give_back(log, [int(s) for s in host[matched:end].tolist()], "insert", final, page, agreed)


def _on_published(driver: DriverView, rank: int, log: PrefetchLog, agreed: int) -> None:
    """0.5.10's agreed progress: the MIN over ranks of what ``terminate_prefetch`` returned,
    the one value its tree inserts by (its ack, for INV-21; inserts are judged by it)."""
    driver.log.acks[rank].append(ProgressAck(log.request_id, agreed, True))


def _on_backup_ack(driver: DriverView, rank: int, op: Any) -> None:
    backup = driver.log.backups[rank].get(int(op.id))
    if backup is None:
        driver.log.stale.append(
            StaleAct(rank, "ack_backup_queue entry", f"op {op.id}", driver.epoch - 1)
        )
        return
    backup.acks += 1
    backup.acked_tokens = int(op.completed_tokens)
    read_acked_pages(driver, rank, op, backup.acked_tokens // driver.page)  # INV-32
    source = driver.sources[rank].pop(int(op.id), None)
    if source is not None:
        driver.l3.ranks[rank].host_pool.free(source)
    free_side_source(driver, rank, int(op.id))
    page = driver.page
    keys = list(op.hash_value)[: backup.acked_tokens // page]
    if not backup.skipped:
        driver.log.believed.update((rank, key) for key in keys)
    chain = driver.chains.get(backup.chain_uid)
    if chain is None:
        return
    chain.acked[rank] = backup.acked_tokens // page
    if rank == 0:
        chain.keys = tuple(op.hash_value)[: chain.pages]
    if len(chain.acked) == driver.n:  # every rank acked: the chain is where its worst rank is
        pages = chain.acked[0] if driver.mla else min(chain.acked.values())
        chain.state = "stored" if pages == chain.pages else "partial" if pages else "none"


def observe_calls(
    driver: DriverView,
    result: StepResult,
    calls: list[BackendCall],
    steps: list[int] | None = None,
) -> None:
    """One loop body's calls; ``steps``: the step each ran in (default: this one)."""
    rank, page = result.rank, driver.page
    if result.kind is StorageStepKind.HIT_QUERY:
        log = driver.log.prefetches[rank].get(result.request_id or "")
        if log is None:
            driver.log.stale.append(
                StaleAct(
                    rank, "hit query step", f"prefetch {result.request_id!r}", driver.epoch - 1
                )
            )
            return
        tokens = driver.chains[log.chain_uid].tokens(page)
        seen, run, stopped = 0, 0, False
        for call in (c for c in calls if c.kind == "exists"):
            for key in call.keys:
                seen += 1
                prefix = log.anchor_prefix + tokens[: seen * page]
                driver.log.use_key(KeyUse(rank, key, prefix, "queried"))
            if not stopped:
                run += call.answer
                stopped = call.answer < len(call.keys)
        keys = list(chain_keys_of(calls))
        run = _sidecar_run(calls, keys, run)
        if log.swa_trailing:  # an SWA window: restorable where its trailing pages are stored
            log.local_restorable = swa_restorable(calls, keys[:run], log.swa_trailing)
            run = max(log.local_restorable, default=0)
        # a query the backend failed (raised) is a miss for the whole prefetch, as the tier has it
        failed = any(c.raised for c in calls if c.kind in ("exists", "sidecar_exists"))
        log.local_hit_tokens = 0 if failed else run * page
        if driver.buffer is not None:  # no answer, no verdict: the query failed or never ran
            asked = any(c.kind == "exists" for c in calls)
            driver.buffer.queried(rank, log.request_id, run if asked and not failed else None)
        if failed and log.local_restorable is not None:
            log.local_restorable = ()
    elif result.kind is StorageStepKind.IO:
        ran_in = steps if steps is not None else [driver.steps_run] * len(calls)
        observe_reads(driver, rank, result.request_id, calls, ran_in)  # INV-33, INV-34
        for call in (c for c in calls if c.kind == "get"):
            for key, digest in zip(call.keys, call.digests, strict=True):
                if digest is not None:
                    driver.log.reads.append(StoreRead(rank, key, digest))
    elif result.kind is StorageStepKind.BACKUP:
        _observe_backup(driver, result, calls)


def chain_keys_of(calls: list[BackendCall]) -> list[str]:
    """The KV keys the hit query asked, in order."""
    return [key for call in calls if call.kind == "exists" for key in call.keys]


def _sidecar_run(calls: list[BackendCall], keys: list[str], run: int) -> int:
    """The KV run ``run`` cut at the first page a sidecar's exists did not find (a sidecar
    must hold every page of the hit: the usable run is the fewest, INV-37)."""
    found: dict[str, set[str]] = {}
    for call in (c for c in calls if c.kind == "sidecar_exists" and c.pool not in WINDOW_POOLS):
        hit = found.setdefault(call.pool, set())
        hit.update(k.rsplit(".", 1)[0] for k in call.keys[: max(0, call.answer)])
    for present in found.values():
        run = next((i for i, key in enumerate(keys[:run]) if key not in present), run)
    return run


def _observe_backup(driver: DriverView, result: StepResult, calls: list[BackendCall]) -> None:
    rank, page = result.rank, driver.page
    backup = driver.log.backups[rank].get(-1 if result.op_id is None else int(result.op_id))
    if backup is None:
        driver.log.stale.append(
            StaleAct(rank, "backup step", f"op {result.op_id}", driver.epoch - 1)
        )
        return
    chain = driver.chains[backup.chain_uid]
    prefix = chain.prefix(page)
    start = len(prefix) - chain.pages * page
    index, stored, failed = 0, 0, False
    for call in (c for c in calls if c.kind == "set"):
        for j, key in enumerate(call.keys):
            driver.log.use_key(
                KeyUse(rank, key, prefix[: start + (index + j + 1) * page], "stored")
            )
            if call.ok:
                digest = call.digests[j] if j < len(call.digests) else None
                driver.log.writes.append(StoreWrite(rank, call.stored_keys[j], key, digest or ""))
                driver.log.written.add((rank, key))
        index += len(call.keys)
        if call.ok and not failed:
            stored += len(call.keys)
        else:
            failed = True
    backup.stored_pages = stored
    states = [c for c in calls if c.kind == "sidecar_set" and c.pool == MAMBA_POOL]
    if backup.skipped and states:  # a skipped rank's own (sharded) Mamba state (INV-26)
        backup.state_stored = all(c.ok for c in states)
    faults = driver.l3.ranks[rank].faults
    if faults is not None:
        driver.log.lost.update((rank, key) for key in faults.dropped_keys)


# -- 0.5.10: what its hit and IO threads left on the operation -----------------------------------
def observe_polled_step(
    driver: DriverView, result: StepResult, released: list[torch.Tensor]
) -> None:
    """After a 0.5.10 hit or IO step: the operation's agreed hit (its bounce buffer, the pages
    the IO fills: ``host_indices`` cut to the hit), or the IO's end with the pages it gave
    back during the step (``released``, from ``host_mem_release_queue``)."""
    rank = result.rank
    log = driver.log.prefetches[rank].get(result.request_id or "")
    op: Any = log.operation if log is not None else None
    if log is None or op is None or getattr(op, "id", None) != result.op_id:
        if result.kind is StorageStepKind.IO:  # an operation of an earlier epoch surfaced
            old = [op for op, _ in driver.known_ops.values() if op.id == result.op_id]  # type: ignore[attr-defined]
            if old:
                _current(driver, rank, old[0], "io step")
        return  # (observe_calls records a hit query of an unknown prefetch as stale)
    if not _current(driver, rank, op, f"{result.kind.value} step"):
        return
    if result.kind is StorageStepKind.HIT_QUERY:
        if op.hash_value:  # not revoked: the IO will fill host_indices[:hit]
            log.published_hit_tokens = len(op.hash_value) * driver.page
            log.hash_pages = len(op.hash_value)
            log.bounce_tokens = int(op.host_indices.numel())
        return
    # the IO is done with the operation: its progress is what this rank's tree reads (INV-19
    # checks it against the bytes that landed), and nothing of the operation is written again
    completed = int(op.completed_tokens)
    log.published_progress += (completed,)
    if completed == log.terminated_at and log.landed_at_termination is not None:
        # frozen at termination: those pages went to the tree then, and it may have freed and
        # reused them since; their bytes were judged when the progress froze
        log.landed_pages += (log.landed_at_termination,)
        if log.sidecar_at_termination is not None:
            log.sidecar_pages += (log.sidecar_at_termination,)
    else:
        log.landed_pages += (_landed_pages(driver, rank, log, op),)
        _judge_sidecar(driver, rank, log, op)  # the draft releases' draft pages (INV-37)
    log.final_acks += 1
    for tensor in released:
        indices = sorted(log.owned_slots[s] for s in tensor.tolist() if s in log.owned_slots)
        if indices:
            log.released += ((indices[0], indices[-1] + 1, "io"),)
