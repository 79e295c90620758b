"""The storage oracle in lockstep: every storage verb of a case fed to ``oracle.storage`` and what
each predicts compared.

``attach_storage_lockstep(session)`` follows a storage world of this project's tier (any
implementation whose tiers are ``StorageTier``: the reference and its mutants). It wraps the
storage driver's verbs on the instance (``VERBS``: also the calls the driver makes of itself, as
``detach`` and ``settle`` do), tees each rank's recording backend (``take``) and listens to each
tier's ``step_observer``; so it sees, in order, every tree call and every storage step with the
backend calls the step made. Each becomes oracle ops at whole-step granularity: a tree call here,
a storage step in ``storage_steps.follow_step`` (each call's outcome, a hole, a raise, a refused
write, a dropped page, read from what the backend answered).

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

from hicache_ref.controller.storage.records import StepResult
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.campaigns.profiles import lockstep_enabled
from hicache_ref.harness.driver.storage_driver import StorageDriver
from hicache_ref.harness.lockstep.storage_compare import compare_after_verb
from hicache_ref.harness.lockstep.storage_point_steps import (
    before_point_step,
    finish_stopped_bodies,
    follow_point_step,
)
from hicache_ref.harness.lockstep.storage_steps import follow_step
from hicache_ref.harness.world.recording_storage import BackendCall
from hicache_ref.invariants.storage_snapshot import Prefix
from hicache_ref.oracle.step import OpNotEnabledError
from hicache_ref.oracle.storage import (
    Attach,
    Clear,
    Detach,
    DrainAcks,
    DrainBackupAcks,
    DrainHits,
    DrainReleases,
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
from hicache_ref.oracle.storage.universe import add_key, add_op, growing_config

if TYPE_CHECKING:
    from hicache_ref.harness.driver.storage_chains import Chain
    from hicache_ref.harness.steps.session import Session

STORAGE_LOCKSTEP_ENV = "HICACHE_STORAGE_LOCKSTEP"
"""``0`` leaves the storage oracle out where lockstep is on (to measure what it costs)."""

VERBS = tuple(
    verb.__name__
    for verb in (
        StorageDriver.write_storage,
        StorageDriver.prefetch,
        StorageDriver.check_prefetch,
        StorageDriver.terminate,
        StorageDriver.run_step,
        StorageDriver.drain_prefetch,
        StorageDriver.drain_backups,
        StorageDriver.detach,
        StorageDriver.attach,
        StorageDriver.clear,
        StorageDriver.on_reset,
    )
)
"""The storage driver's verbs the lockstep wraps (each translated after it returns)."""


def attach_storage_lockstep(
    session: Session, enabled: bool | None = None
) -> StorageLockstep | None:
    """Follow ``session``'s storage world with the storage oracle (before its first step);
    None without a storage world or when lockstep is off (``enabled`` False, or left None,
    the environment's profile: ``profiles.lockstep_enabled``)."""
    driver = session.storage
    if driver is None or not (lockstep_enabled() if enabled is None else enabled):
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

    missing = [verb for verb in VERBS if not callable(getattr(driver, verb, None))]
    if missing:
        return f"the storage driver has no verb {missing[0]} (update lockstep/storage.py VERBS)"
    if driver.mla:
        return "an MLA world (one namespace every rank shares)"
    if driver.config.storage_host_pressure:
        return "a tree that cuts hits to its host room (the oracle serves every hit whole)"
    if driver.config.storage_buffer_only:
        return "buffer mode (the oracle models L3 and the tiers, not the tree's existence beliefs: INV-41's)"
    if driver.config.has_draft:
        return "a sidecar pool (the oracle models KV pages; a sidecar's are INV-37's and bytes')"
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
            growing_config(
                driver.n,
                driver.config.storage_batch_pages,
                driver.config.storage_page_points,
                driver.config.storage_lock_points,
            )
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
        self.calls: list[list[BackendCall]] = [[] for _ in range(driver.n)]
        self.results: dict[int, StepResult] = {}
        self._verdicts_seen: list[dict[str, int]] = [{} for _ in range(driver.n)]
        self.lock = threading.Lock()
        self._depth = 0
        if self.off_reason is None:
            self._wrap_verbs()

    # -- hooks ---------------------------------------------------------------------------------
    def _wrap_verbs(self) -> None:
        for verb in VERBS:
            original = getattr(self.driver, verb)
            setattr(self.driver, verb, self._wrapped(verb, original))
        self._tee_backends()

    def _wrapped(self, verb: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def followed(*args: Any, **kwargs: Any) -> Any:
            self._tee_backends()
            before = self._before(verb, args)
            self._depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            if self.off_reason is None:
                self._after(verb, args, before)
            return result

        return followed

    def _tee_backends(self) -> None:
        """Tee every rank's recording backend and hear every tier's steps (again after an
        attach, which builds new backends)."""
        for rank, storage_rank in enumerate(self.driver.l3.ranks):
            recording = storage_rank.recording
            if recording is not None and not getattr(recording, "_lockstep_tee", False):
                take = recording.take

                def tee(rank: int = rank, take: Callable[[], list[BackendCall]] = take) -> Any:
                    calls = take()
                    self.calls[rank].extend(calls)
                    return calls

                recording.take = tee  # type: ignore[method-assign]
                recording._lockstep_tee = True  # type: ignore[attr-defined]
        for tier in self.driver.l3.tiers:
            tier.step_observer = self._on_result

    def _on_result(self, result: StepResult) -> None:
        with self.lock:
            self.results[result.rank] = result

    # -- translation ---------------------------------------------------------------------------
    def _before(self, verb: str, args: tuple[Any, ...]) -> Any:
        if verb == "write_storage":
            return [set(logs) for logs in self.driver.log.backups]
        if verb == "prefetch":
            return set(self.driver.log.prefetches[0])
        if verb == "check_prefetch":
            self._verdicts_seen = [
                {rid: len(log.verdicts) for rid, log in logs.items()}
                for logs in self.driver.log.prefetches
            ]
        if verb in ("check_prefetch", "terminate"):
            return {rid for rid, op in self.prefetch_ops.items() if self._current(op)}
        if verb == "drain_prefetch":
            return {rid for rid, op in self.prefetch_ops.items() if self._current(op)}
        if verb == "run_step":
            with self.lock:
                self.results = {}
            if self.driver.points is not None:  # calls wait for their grant's translation
                return before_point_step(self, args[0])
            self.calls = [[] for _ in range(self.driver.n)]
        return None

    def _after(self, verb: str, args: tuple[Any, ...], before: Any) -> None:
        self.verbs += 1
        if verb == "write_storage":
            self._after_write(before)
        elif verb == "prefetch":
            self._after_prefetch(before)
        elif verb in ("check_prefetch", "terminate"):
            if verb == "check_prefetch":
                self._compare_verdicts()
            self._after_terminations(before)
        elif verb == "run_step":
            if self.driver.points is not None:
                follow_point_step(self, args[0], before)
            else:
                follow_step(self, args[0])
        elif verb == "drain_prefetch":
            self._apply_if_enabled(DrainHits(self._no_room(before)))
            self._apply_if_enabled(DrainAcks())
        elif verb == "drain_backups":
            self._apply_if_enabled(DrainBackupAcks())
            self._apply_if_enabled(DrainReleases())
        elif verb == "detach":
            self.apply_op(Detach(), verb)
        elif verb == "attach":
            self.apply_op(Attach(), verb)
            self._forget_epoch()
        elif verb == "clear":
            self.apply_op(Clear(0 if self.driver.mla else int(args[0]) % self.driver.n), verb)
        elif verb == "on_reset":
            if self.driver.points is not None:
                finish_stopped_bodies(self)
            self.apply_op(Reset(), verb)
            self._forget_epoch()
        if self._depth == 0 or verb == "run_step":
            self._judge(verb)
            compare_after_verb(self, verb)

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
        op = self._new_op(kind="backup", keys=self._chain_keys(chain))
        for rank, ids in enumerate(fresh):
            for op_id in ids:
                self.backup_ops[rank][op_id] = op
        self.apply_op(WriteStorage(op), "a backup queued")

    def _after_prefetch(self, before: set[str]) -> None:
        logs = self.driver.log.prefetches[0]
        for rid in sorted(set(logs) - before):
            keys = self._chain_keys(self.driver.chains[logs[rid].chain_uid])
            op = self._new_op(kind="prefetch", keys=keys)
            self.prefetch_ops[rid] = op
            self.apply_op(Prefetch(op), "a prefetch queued")

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
                        "INV-22", "the prefetch verdict", f"rank {rank} is_prefetch_complete("
                        f"{rid!r}): oracle {want}, implementation {got}",
                    )  # fmt: skip

    def _after_terminations(self, before: set[str]) -> None:
        """A prefetch the tree retired by terminating it (``terminate`` or the policy)."""
        for rid in sorted(before):
            info = [r.ongoing_prefetch.get(rid) for r in self.driver.storage_tree.ranks]
            if all(i is None for i in info) and self._current(self.prefetch_ops[rid]):
                logs = [self.driver.log.prefetches[r].get(rid) for r in range(self.driver.n)]
                if any(log is not None and log.terminated_at is not None for log in logs):
                    self.apply_op(Terminate(self.prefetch_ops[rid]), "a prefetch terminated")

    # -- stepping the oracle ---------------------------------------------------------------------
    def _apply_if_enabled(self, op: StorageOp) -> None:
        if why_storage_disabled(self.state, op) is None:
            self.apply_op(op, type(op).__name__)

    def apply_op(self, op: StorageOp, what: str) -> None:
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
