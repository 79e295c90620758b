"""The storage oracle in lockstep: every storage verb of a case fed to ``oracle.storage`` and what
each predicts compared.

``attach_storage_lockstep(session)`` follows a storage world of this project's tier (any
implementation whose tiers are ``StorageTier``: the reference and its mutants). It wraps the
storage driver's verbs on the instance (``VERBS``: also the calls the driver makes of itself, as
``detach`` and ``settle`` do), tees each rank's recording backend (``take``) and listens to each
tier's ``step_observer``; so it sees, in order, every tree call and every storage step with the
backend calls the step made. Each becomes oracle ops at whole-step granularity (a hit query step
is ``Advance`` from ``prefetch_queue.get`` through its ``batch_exists`` calls, the ``hits``
collective once every rank is in it, and the publish); each backend call's outcome (a hole, a
raise, a refused write, a dropped page) is read from what the backend answered.

After every verb it compares (``storage_compare``): the oracle's own verdict
(``check_storage_invariants``); each step's result on every rank (the published hit INV-29, the
pages read back INV-19, the progress published INV-21, the stored prefix acked INV-26, the final
ack INV-25); which ranks ran a step and which op (INV-20 / INV-24); every rank's eight storage
queues (INV-24); the collectives each rank issued per group (INV-20); what ``terminate_prefetch``
returned (INV-19). A difference raises ``InvariantViolation``: ``storage lockstep divergence at
verb N (verb): <quantity>: oracle <value>, implementation <value>``; ``StorageLockstep.trace``
is the oracle op trace that replays it (``oracle.storage.run_storage_ops`` on ``start``).

Not followed (``off_reason``, counted in ``SessionStats.lockstep``): an MLA world (one namespace
every rank shares), a tier of another protocol (0.5.10's), a thread executor.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.campaigns.profiles import lockstep_enabled
from hicache_ref.harness.lockstep.storage_compare import compare_after_verb, compare_step
from hicache_ref.harness.world.recording_storage import BackendCall
from hicache_ref.invariants.storage_snapshot import Prefix
from hicache_ref.oracle.step import OpNotEnabledError
from hicache_ref.oracle.storage import (
    BACKUP,
    HIT_QUERY,
    IO,
    SYNC,
    Advance,
    Attach,
    Clear,
    Collective,
    Detach,
    DrainAcks,
    DrainBackupAcks,
    DrainHits,
    DrainReleases,
    LosePage,
    Prefetch,
    Reset,
    StorageOp,
    StorageState,
    Terminate,
    WriteStorage,
    check_storage_invariants,
    initial_storage_state,
    storage_step,
    why_storage_disabled,
)
from hicache_ref.oracle.storage.keys import compute_batch_range
from hicache_ref.oracle.storage.state import ABSENT
from hicache_ref.oracle.storage.universe import add_key, add_op, growing_config

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_chains import Chain
    from hicache_ref.harness.driver.storage_driver import StorageDriver
    from hicache_ref.harness.steps.session import Session

STORAGE_LOCKSTEP_ENV = "HICACHE_STORAGE_LOCKSTEP"
"""``0`` leaves the storage oracle out where lockstep is on (to measure what it costs)."""

VERBS = (
    "write_storage",
    "prefetch",
    "check_prefetch",
    "terminate",
    "run_step",
    "drain_prefetch",
    "drain_backups",
    "detach",
    "attach",
    "clear",
    "on_reset",
)
"""The storage driver's verbs the lockstep wraps (each translated after it returns)."""

THREAD_OF = {
    StorageStepKind.HIT_QUERY: HIT_QUERY,
    StorageStepKind.IO: IO,
    StorageStepKind.SYNC: SYNC,
    StorageStepKind.BACKUP: BACKUP,
}
GROUP_OF = {HIT_QUERY: "hits", SYNC: "completion"}
_EXTRA_CALL_ID = {"exists": "INV-29", "get": "INV-19", "set": "INV-31"}
"""The id a backend call the oracle did not make is reported under, by call kind."""


def attach_storage_lockstep(session: Session) -> StorageLockstep | None:
    """Follow ``session``'s storage world with the storage oracle (before its first step);
    None without a storage world or when the profile turns lockstep off."""
    driver = session.tree.storage
    if driver is None or not lockstep_enabled():
        return None
    if os.environ.get(STORAGE_LOCKSTEP_ENV, "1") in ("", "0", "false", "off"):
        return None
    follower = StorageLockstep(session, driver)
    stats = session.stats.lockstep
    stats["storage_cases"] += 1
    if follower.off_reason is not None:
        stats[f"storage off: {follower.off_reason}"] += 1
    return follower


def unsupported_storage_reason(driver: StorageDriver) -> str | None:
    """Why the storage oracle cannot follow this world, or None."""
    from hicache_ref.controller.storage.tier import StorageTier

    missing = [name for name in VERBS if not callable(getattr(driver, name, None))]
    if missing:
        return f"the storage driver has no verb {missing[0]} (update lockstep/storage.py VERBS)"
    if driver.mla:
        return "an MLA world (one namespace every rank shares)"
    if driver.polled is not None or not all(isinstance(t, StorageTier) for t in driver.l3.tiers):
        return "a tier of another protocol than this project's StorageTier"
    if any(t.executor.name != "manual" for t in driver.l3.tiers):
        return "a thread executor (steps are not the harness's to order)"
    return None


class StorageLockstep:
    """Steps the storage oracle beside one case's storage driver; see the module docstring."""

    def __init__(self, session: Session, driver: StorageDriver) -> None:
        self.session = session
        self.driver = driver
        self.off_reason = unsupported_storage_reason(driver)
        self.start: StorageState = initial_storage_state(
            growing_config(driver.n, driver.config.storage_batch_pages)
        )
        self.state = self.start
        self.trace: list[StorageOp] = []
        self.verbs = 0  # verbs compared
        self.steps = 0  # storage steps compared
        self.keys: dict[Prefix, int] = {}
        self.prefixes: list[Prefix] = []  # key id -> its token prefix
        self.prefetch_ops: dict[str, int] = {}  # request id -> oracle op, this epoch
        self.backup_ops: list[dict[int, int]] = [{} for _ in range(driver.n)]
        self.key_names: list[dict[str, int]] = [{} for _ in range(driver.n)]
        self.collectives = {"hits": 0, "completion": 0}
        self._calls: list[list[BackendCall]] = [[] for _ in range(driver.n)]
        self._results: dict[int, StepResult] = {}
        self._verdicts_seen: list[dict[str, int]] = [{} for _ in range(driver.n)]
        self._lock = threading.Lock()
        self._depth = 0
        if self.off_reason is None:
            self._wrap_verbs()

    # -- hooks ---------------------------------------------------------------------------------
    def _wrap_verbs(self) -> None:
        for name in VERBS:
            original = getattr(self.driver, name)
            setattr(self.driver, name, self._wrapped(name, original))
        self._tee_backends()

    def _wrapped(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def verb(*args: Any, **kwargs: Any) -> Any:
            self._tee_backends()
            before = self._before(name)
            self._depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            if self.off_reason is None:
                self._after(name, args, before)
            return result

        return verb

    def _tee_backends(self) -> None:
        """Tee every rank's recording backend and hear every tier's steps (again after an
        attach, which builds new backends)."""
        for rank, storage_rank in enumerate(self.driver.l3.ranks):
            recording = storage_rank.recording
            if recording is not None and not getattr(recording, "_lockstep_tee", False):
                take = recording.take

                def tee(rank: int = rank, take: Callable[[], list[BackendCall]] = take) -> Any:
                    calls = take()
                    self._calls[rank].extend(calls)
                    return calls

                recording.take = tee  # type: ignore[method-assign]
                recording._lockstep_tee = True  # type: ignore[attr-defined]
        for tier in self.driver.l3.tiers:
            tier.step_observer = self._on_result

    def _on_result(self, result: StepResult) -> None:
        with self._lock:
            self._results[result.rank] = result

    # -- translation ---------------------------------------------------------------------------
    def _before(self, name: str) -> Any:
        if name == "write_storage":
            return [set(logs) for logs in self.driver.log.backups]
        if name == "prefetch":
            return set(self.driver.log.prefetches[0])
        if name == "check_prefetch":
            self._verdicts_seen = [
                {rid: len(log.verdicts) for rid, log in logs.items()}
                for logs in self.driver.log.prefetches
            ]
        if name in ("check_prefetch", "terminate"):
            return {rid for rid, op in self.prefetch_ops.items() if self._current(op)}
        if name == "drain_prefetch":
            return {rid for rid, op in self.prefetch_ops.items() if self._current(op)}
        if name == "run_step":
            with self._lock:
                self._results = {}
            self._calls = [[] for _ in range(self.driver.n)]
        return None

    def _after(self, name: str, args: tuple[Any, ...], before: Any) -> None:
        self.verbs += 1
        if name == "write_storage":
            self._after_write(before)
        elif name == "prefetch":
            self._after_prefetch(before)
        elif name in ("check_prefetch", "terminate"):
            if name == "check_prefetch":
                self._compare_verdicts()
            self._after_terminations(before)
        elif name == "run_step":
            self._after_step(args[0])
        elif name == "drain_prefetch":
            self._apply_if_enabled(DrainHits(self._no_room(before)))
            self._apply_if_enabled(DrainAcks())
        elif name == "drain_backups":
            self._apply_if_enabled(DrainBackupAcks())
            self._apply_if_enabled(DrainReleases())
        elif name == "detach":
            self._apply(Detach(), name)
        elif name == "attach":
            self._apply(Attach(), name)
            self._forget_epoch()
        elif name == "clear":
            self._apply(Clear(0 if self.driver.mla else int(args[0]) % self.driver.n), name)
        elif name == "on_reset":
            self._apply(Reset(), name)
            self._forget_epoch()
        if self._depth == 0 or name == "run_step":
            self._judge(name)
            compare_after_verb(self, name)

    def _no_room(self, current: set[str]) -> tuple[int, ...]:
        """Prefetches the tree revoked at this drain though the oracle would start them: some
        rank's host pool had no room for the bounce buffer (the tree's business)."""
        ranks = self.driver.storage_tree.ranks
        gone = [rid for rid in current if all(rid not in r.ongoing_prefetch for r in ranks)]
        return tuple(sorted(self.prefetch_ops[rid] for rid in gone))

    def _forget_epoch(self) -> None:
        self.prefetch_ops = {}
        self.backup_ops = [{} for _ in range(self.driver.n)]

    def _chain_keys(self, chain: Chain) -> tuple[int, ...]:
        """The oracle's key id of every page of ``chain`` (its token prefix names it)."""
        page = self.driver.page
        prefix = chain.prefix(page)
        start = len(prefix) - chain.pages * page
        ids: list[int] = []
        for i in range(chain.pages):
            ids.append(self._key(prefix[: start + (i + 1) * page], page))
        return tuple(ids)

    def _key(self, prefix: Prefix, page: int) -> int:
        known = self.keys.get(prefix)
        if known is not None:
            return known
        parent = self.keys.get(prefix[:-page], -1) if len(prefix) > page else -1
        self.state, key = add_key(self.state, parent)
        self.start, _ = add_key(self.start, parent)
        self.keys[prefix] = key
        self.prefixes.append(prefix)
        return key

    def _new_op(self, kind: str, keys: tuple[int, ...]) -> int:
        self.state, index = add_op(self.state, kind, keys)  # type: ignore[arg-type]
        self.start, _ = add_op(self.start, kind, keys)  # type: ignore[arg-type]
        return index

    def _after_write(self, before: list[set[int]]) -> None:
        logs = self.driver.log.backups
        fresh = [sorted(set(logs[r]) - before[r]) for r in range(self.driver.n)]
        if not fresh[0]:
            return  # refused: nothing was queued
        chain = self.driver.chains[logs[0][fresh[0][0]].chain_uid]
        op = self._new_op("backup", self._chain_keys(chain))
        for rank, ids in enumerate(fresh):
            for op_id in ids:
                self.backup_ops[rank][op_id] = op
        self._apply(WriteStorage(op), "write_storage")

    def _after_prefetch(self, before: set[str]) -> None:
        logs = self.driver.log.prefetches[0]
        for rid in sorted(set(logs) - before):
            op = self._new_op("prefetch", self._chain_keys(self.driver.chains[logs[rid].chain_uid]))
            self.prefetch_ops[rid] = op
            self._apply(Prefetch(op), "prefetch")

    def _current(self, op: int) -> bool:
        return all(r.prefetches[op].current for r in self.state.ranks)

    def _compare_verdicts(self) -> None:
        """Each completion verdict the tier gave (``is_prefetch_complete``) against the
        oracle's: complete once the hit was drained into a buffer and every page published."""
        for rank, logs in enumerate(self.driver.log.prefetches):
            for rid, log in logs.items():
                op = self.prefetch_ops.get(rid)
                seen = self._verdicts_seen[rank].get(rid, 0)
                if op is None or len(log.verdicts) <= seen:
                    continue
                view = self.state.ranks[rank].prefetches[op]
                want = bool(view.bounce) and view.published >= len(view.bounce)
                got = log.verdicts[-1].claimed_complete
                if want != got:
                    raise self.divergence(
                        "INV-22", "check_prefetch", f"rank {rank} is_prefetch_complete("
                        f"{rid!r}): oracle {want}, implementation {got}",
                    )  # fmt: skip

    def _after_terminations(self, before: set[str]) -> None:
        """A prefetch the tree retired by terminating it (``terminate`` or the policy)."""
        for rid in sorted(before):
            info = [r.ongoing_prefetch.get(rid) for r in self.driver.storage_tree.ranks]
            if all(i is None for i in info) and self._current(self.prefetch_ops[rid]):
                logs = [self.driver.log.prefetches[r].get(rid) for r in range(self.driver.n)]
                if any(log is not None and log.terminated_at is not None for log in logs):
                    self._apply(Terminate(self.prefetch_ops[rid]), "terminate_prefetch")

    # -- one storage step ------------------------------------------------------------------------
    def _after_step(self, kind: StorageStepKind) -> None:
        with self._lock:
            results = dict(self._results)
        thread = THREAD_OF[kind]
        calls = [list(c) for c in self._calls]
        for rank in sorted(results):
            self._run_body(rank, thread, calls[rank])
            if calls[rank]:
                extra = calls[rank][0]
                raise self.divergence(
                    _EXTRA_CALL_ID[extra.kind], f"{kind.value} step", f"rank {rank} backend "
                    f"calls: oracle none more, implementation batch_{extra.kind} of "
                    f"{len(extra.keys)} keys (after a miss, a failed batch or a termination)",
                )  # fmt: skip
        group = GROUP_OF.get(thread)
        if group is not None and any(
            self.state.ranks[r].threads[thread].point == "reduce" for r in results
        ):
            self._apply(Collective(group), f"{kind.value} step")
            self.collectives[group] += 1
            for rank in sorted(results):
                if self.state.ranks[rank].threads[thread].point == "publish":
                    self._apply(Advance(rank, thread), f"{kind.value} step")
        for rank in sorted(results):
            self._drop_lost(rank, self._calls[rank])
        self.steps += 1
        self.session.stats.lockstep["storage_steps_in_lockstep"] += 1
        compare_step(self, kind, results)

    def _run_body(self, rank: int, thread: int, calls: list[BackendCall]) -> None:
        """Advance one rank's thread through one loop body, each call's outcome from ``calls``:
        up to the collective (hit query, progress sync) or to its end."""
        what = f"rank {rank} {('hit_query', 'io', 'sync', 'backup')[thread]} step"

        def point() -> str:
            return self.state.ranks[rank].threads[thread].point

        if thread != IO or point() == "idle":
            self._apply(Advance(rank, thread), what)  # the get on its input queue
        if thread == HIT_QUERY:
            while point() == "exists":
                record = self.state.ranks[rank].threads[thread]
                self._apply(self._exists_outcome(rank, record, calls), what)
        elif thread == IO:
            self._apply(Advance(rank, IO), what)  # the termination check
            if point() == "get":
                record = self.state.ranks[rank].threads[thread]
                self._apply(self._get_outcome(rank, record, calls), what)
            self._apply(Advance(rank, IO), what)  # the progress ack
            if point() == "final":
                self._apply(Advance(rank, IO), what)
        elif thread == SYNC:
            if point() == "publish":  # a final ack: no collective
                self._apply(Advance(rank, SYNC), what)
        else:
            while point() == "set":
                self._apply(self._set_outcome(rank, calls), what)
            if point() == "ack":
                self._apply(Advance(rank, BACKUP), what)

    def _batch_keys(self, op: int, batch: int, pages: int) -> tuple[int, ...]:
        start, end = compute_batch_range(batch, self.state.config.batch_pages, pages)
        return self.state.config.op_keys(op)[start:end]

    def _exists_outcome(self, rank: int, record: Any, calls: list[BackendCall]) -> Advance:
        keys = self._batch_keys(record.op, record.batch, self.state.config.ops[record.op].pages)
        call = _next_call(calls, "exists")
        if call is None or call.raised:
            return Advance(rank, HIT_QUERY, "raise")
        self._learn(rank, call.keys, keys)
        l3 = self.state.ranks[rank].l3
        run = next((i for i, k in enumerate(keys) if l3[k] == ABSENT), len(keys))
        if call.answer > run:
            raise self.divergence(
                "INV-30", f"rank {rank} batch_exists", f"pages present: oracle {run}, "
                f"implementation's backend {call.answer}",
            )  # fmt: skip
        if call.answer < run:
            return Advance(rank, HIT_QUERY, "hole", call.answer)
        return Advance(rank, HIT_QUERY)

    def _get_outcome(self, rank: int, record: Any, calls: list[BackendCall]) -> Advance:
        view = self.state.ranks[rank].prefetches[record.op]
        keys = self._batch_keys(record.op, record.batch, len(view.bounce))
        call = _next_call(calls, "get")
        if call is None:
            return Advance(rank, IO, "raise")
        self._learn(rank, call.keys, keys)
        self._check_bytes(rank, call, keys)
        l3 = self.state.ranks[rank].l3
        for i, key in enumerate(keys):
            got = i < len(call.digests) and call.digests[i] is not None
            if got and l3[key] == ABSENT:
                raise self.divergence(
                    "INV-30", f"rank {rank} batch_get", f"page {i} of the batch read back: "
                    "oracle absent (never written), implementation's backend returned bytes",
                )  # fmt: skip
            if l3[key] != ABSENT and not got:
                return Advance(rank, IO, "hole", i)
        return Advance(rank, IO)

    def _set_outcome(self, rank: int, calls: list[BackendCall]) -> Advance:
        call = _next_call(calls, "set")
        if call is None:
            return Advance(rank, BACKUP, "raise")
        record = self.state.ranks[rank].threads[BACKUP]
        keys = self._batch_keys(record.op, record.batch, self.state.config.ops[record.op].pages)
        self._learn(rank, call.keys, keys)
        self._check_bytes(rank, call, keys)
        if call.ok:
            return Advance(rank, BACKUP)
        landed = 0  # a refused batch may still have stored its first pages (the store says)
        while landed < len(call.keys) - 1 and self._store_has(rank, call.keys[landed]):
            landed += 1
        return Advance(rank, BACKUP, "fail", landed)

    def _store_has(self, rank: int, name: str) -> bool:
        """Whether the harness's own store (under the fault wrapper) holds ``name``."""
        storage_rank = self.driver.l3.ranks[rank]
        faults, recording = storage_rank.faults, storage_rank.recording
        store = faults.inner if faults is not None else getattr(recording, "inner", None)
        return bool(store is not None and store.exists(name))

    def _learn(self, rank: int, names: tuple[str, ...], keys: tuple[int, ...]) -> None:
        """Which backend key names which prefix: one key per prefix and one prefix per key."""
        for name, key in zip(names, keys, strict=False):
            known = self.key_names[rank].setdefault(name, key)
            if known != key:
                raise self.divergence(
                    "INV-27", f"rank {rank} backend call", f"key {name[:16]} names the prefix "
                    f"of oracle key {key}; it named oracle key {known} before (a key commits "
                    "to its whole prefix)",
                )  # fmt: skip

    def _check_bytes(self, rank: int, call: BackendCall, keys: tuple[int, ...]) -> None:
        """Each page a call wrote or read back holds the bytes the harness's content oracle
        made for its prefix on this rank (what the oracle's GOOD tag stands for, INV-30)."""
        expected = self.driver.log.expected
        for i, digest in enumerate(call.digests[: len(keys)]):
            want = expected.get((rank, self.prefixes[keys[i]]))
            if digest is not None and want is not None and digest != want:
                raise self.divergence(
                    "INV-30", f"rank {rank} batch_{call.kind}", f"bytes of page {i} of the "
                    f"batch: oracle {want[:12]} (its key's), implementation {digest[:12]}",
                )  # fmt: skip

    def _drop_lost(self, rank: int, calls: list[BackendCall]) -> None:
        """Pages a write reported stored that the store does not hold (an injected
        ``set_drop``): lost to a fault, as the oracle's ``LosePage``."""
        for call in calls:
            if call.kind != "set" or not call.ok:
                continue
            for name in call.keys:
                key = self.key_names[rank].get(name)
                if key is None or self.state.ranks[rank].l3[key] == ABSENT:
                    continue
                if not self._store_has(rank, name):
                    self._apply(LosePage(rank, key), f"rank {rank} backend dropped a page")

    # -- stepping the oracle ---------------------------------------------------------------------
    def _apply_if_enabled(self, op: StorageOp) -> None:
        if why_storage_disabled(self.state, op) is None:
            self._apply(op, type(op).__name__)

    def _apply(self, op: StorageOp, what: str) -> None:
        try:
            self.state, _ = storage_step(self.state, op)
        except OpNotEnabledError as exc:
            raise self.divergence(
                "INV-24" if isinstance(op, Reset | Attach | Detach) else "INV-20",
                what,
                f"the implementation did what the oracle refuses ({exc})",
            ) from None
        self.trace.append(op)
        if self.state.faults:  # a step broke a rule: report it at the op that did
            self._judge(what)

    def _judge(self, what: str) -> None:
        """The oracle's own verdict on what it was fed (once per verb, and at a fault)."""
        found = check_storage_invariants(self.state)
        if found:
            first = found[0]
            raise InvariantViolation(
                first.inv_id,
                f"storage lockstep at verb {self.verbs} ({what}): the oracle, fed what the tier "
                f"did, reports {first.message} (oracle trace: {len(self.trace)} ops)",
            )

    def divergence(self, inv_id: str, what: str, detail: str) -> InvariantViolation:
        """A difference between what the oracle and the implementation predict."""
        return InvariantViolation(
            inv_id,
            f"storage lockstep divergence at verb {self.verbs} ({what}): {detail} (oracle "
            f"trace: {len(self.trace)} ops)",
        )


def _next_call(calls: list[BackendCall], kind: str) -> BackendCall | None:
    for index, call in enumerate(calls):
        if call.kind == kind:
            del calls[index]
            return call
    return None
