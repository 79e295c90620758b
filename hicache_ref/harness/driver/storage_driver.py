"""The storage driver: the tree's side of L3 in the machines, and the checks after every step.

It owns, per case: the storage world (``storage_world.py``: ranks, rank group, shared L3),
the tree half of every rank (``storage_tree.StorageTree``), the *chains* the harness backs up
and prefetches, and the log the checks read (``storage_log.py``). Its verbs, in protocol order:

- ``write_storage``: a chain of 1-3 pages under a parent chain already in L3 (or the root);
  every rank fills host pages with the oracle's rows for it and ``write_storage``s them, the
  keys chained from the parent's keys (``prefix_keys``), never passed in;
- ``run_step``: one storage thread's step on every rank at once (``lockstep.run_lockstep``);
  the recording backend's calls of that step become key uses, writes, reads and hit runs;
- ``prefetch`` of a chain after its parent -> ``drain_prefetch`` (hits, acks, releases; a
  fetched ``[0:completed]`` on rank 0 becomes a host-only node the tree driver knows) ->
  ``check_prefetch`` (the policy) / ``terminate``; a tier of 0.5.10's protocol (no
  PrefetchAck, ``UpstreamTier.protocol``) gets that release's tree half instead
  (``storage_tree_0510``: pages allocated up front, the revoke queue, the tree's own MIN);
- ``drain_backups`` (acks release the source pages), ``inject_fault``, ``detach`` / ``attach``,
  ``clear`` (one rank's clear endpoint at rest: what it removed, whose it was, and the L3 model
  forgets that namespace), and the storage half of a tree reset (``on_reset``: peers reset, a
  new epoch);
- ``check``: a ``StorageSnapshot`` handed to every ``STORAGE_IDS`` checker, counted per id.

Chains use two token patterns, so pages that end alike sit under different parents (a key that
restarts its chain collides, INV-27), but never two chains with one prefix.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch

from hicache_ref.controller.storage.lockstep import (
    detach_ranks,
    run_lockstep,
    runnable_steps,
)
from hicache_ref.controller.storage.records import StepResult, StorageStepKind
from hicache_ref.errors import InvariantViolation
from hicache_ref.harness.driver.node_model import pages_covered
from hicache_ref.harness.driver.storage_buffer import BufferBook
from hicache_ref.harness.driver.storage_chains import Chain, ChainBook, fill_chain
from hicache_ref.harness.driver.storage_events import insert_callback
from hicache_ref.harness.driver.storage_log import BackupLog, PrefetchLog, StorageLog
from hicache_ref.harness.driver.storage_points import PointSchedule, run_to_next_point
from hicache_ref.harness.driver.storage_side import side_release_count
from hicache_ref.harness.driver.storage_side_book import SideBook, pseudo_holding
from hicache_ref.harness.driver.storage_tree import StorageTree, StorageTreeRank
from hicache_ref.harness.driver.storage_tree_0510 import (
    HitPollTreeRank,
    PollStorageTree,
    PollTreeRank,
)
from hicache_ref.harness.driver.storage_windows import stale_grants
from hicache_ref.harness.schedule.points import Grant
from hicache_ref.harness.step_types import Outcome, done, refused
from hicache_ref.harness.world.recording_storage import BackendCall
from hicache_ref.harness.world.storage_world import StorageWorld
from hicache_ref.invariants.checks_storage import STORAGE_IDS
from hicache_ref.invariants.registry import CheckRunner
from hicache_ref.invariants.snapshot import NodeHoldings
from hicache_ref.invariants.storage_snapshot import (
    Prefix,
    StorageSnapshot,
    TierView,
)
from hicache_ref.storage.operations import PrefetchOperation

if TYPE_CHECKING:
    from hicache_ref.harness.adapters.base import Implementation
    from hicache_ref.harness.driver.tree import TreeDriver

TIMEOUT_STEPS = 4
PSEUDO_HANDLE = -1000


class StorageDriver:
    """Every storage verb of one case, and the checks that follow each."""

    def __init__(self, tree: TreeDriver, implementation: Implementation) -> None:
        self.tree = tree
        self.config = tree.config
        self.page = self.config.page_size
        self.l3 = StorageWorld(tree.world, implementation)
        self.n = self.config.storage_ranks
        self.log = StorageLog(self.n)
        self.epoch = 1
        self.book = ChainBook(self.page, mla=self.config.pool_kind != "mha")
        self.next_rid = 0
        self.known_ops: dict[int, tuple[object, int]] = {}
        self.sources: list[dict[int, torch.Tensor]] = [{} for _ in range(self.n)]
        self.side = SideBook.of(self.config)  # an SWA or Mamba world's side slots, crowds
        buffer = self.config.storage_buffer_only  # host pages as staging (storage_buffer.py)
        self.buffer = BufferBook.of(self.l3.ranks, self.page) if buffer else None
        self.mla = self.config.pool_kind != "mha"
        self.flags: dict[str, bool] = {}
        self._last_passed: StorageSnapshot | None = None  # what the storage checks last passed
        self.reused_checks = 0  # checks whose snapshot equalled the last that passed
        self.storage_tree = StorageTree(
            [self._tree_rank(StorageTreeRank, r) for r in self.l3.ranks]
        )
        self.l3.attach()
        # upstream 0.5.10's tier (``adapters/sglang_storage.py``) publishes no PrefetchAck: its
        # prefetches are driven by that release's tree half
        self.polled: PollStorageTree | None = None
        protocols = {getattr(t, "protocol", "ack") for t in self.l3.tiers}
        if protocols & {"poll", "hit-poll"}:  # 0.5.16 - 0.5.18 allocate at the hit
            cls = HitPollTreeRank if "hit-poll" in protocols else PollTreeRank
            ranks = [self._tree_rank(cls, r) for r in self.l3.ranks]
            self.polled = PollStorageTree(ranks, self.l3.group)
            self.storage_tree.ranks = list(ranks)

        # upstream's own code is under test (the gate): upstream's backend clear is drawn too
        self.gates_upstream = bool(getattr(implementation, "source_tree", ""))
        # schedule points: a step runs one thread kind to its next point (``storage_points.py``)
        self.points = (
            PointSchedule(self.n, self.config.seed) if self.config.storage_points else None
        )
        self.steps_run = 0  # the storage step clock (INV-33 orders reads after termination)

    def _tree_rank(self, cls: type[StorageTreeRank], rank: Any) -> Any:
        return cls(
            rank.controller,
            rank.host_pool,
            self.page,
            on_insert=insert_callback(self, rank.rank),
            on_event=self._event_callback(rank.rank),
            policy=self.config.storage_policy,
            timeout_steps=TIMEOUT_STEPS,
            host_pressure=self.config.storage_host_pressure,
            side_host_pool=rank.side_host_pool,
        )

    @property
    def up_front(self) -> bool:
        """0.5.10 - 0.5.15: the tree allocates the host pages of a whole prefetch up front."""
        return self.polled is not None and not isinstance(self.polled.ranks[0], HitPollTreeRank)

    def polled_kind(self, kind: StorageStepKind) -> bool:
        """Whether a ``kind`` step's result is read off the operation (0.5.10 - 0.5.18's
        threads publish no ack): the hit query where the pages were allocated up front, the
        IO on every polling release (0.5.16 - 0.5.18's hit goes through the hit queue)."""
        if self.polled is None or kind is StorageStepKind.BACKUP:
            return False
        return kind is StorageStepKind.IO or self.up_front

    @property
    def checks(self) -> CheckRunner:
        return self.tree.checks

    @property
    def attached(self) -> bool:
        return self.l3.attached

    # -- chains (``storage_chains.py``) -------------------------------------------------------
    @property
    def chains(self) -> dict[int, Chain]:
        return self.book.chains

    def backup_candidates(self) -> list[int]:
        return self.book.backup_candidates()

    def prefetch_candidates(self) -> list[int]:
        busy = {log.chain_uid for log in self.log.prefetches[0].values() if not log.retired}
        return self.book.prefetch_candidates(busy)

    def new_chain(self, pick: int) -> Chain | None:
        uid = self.tree.next_handle
        chain = self.book.new_chain(pick, uid)
        if chain is not None:
            self.tree.next_handle += 1
        return chain

    def _fill(self, rank: int, chain: Chain, slots: torch.Tensor) -> None:
        storage_rank = self.l3.ranks[rank]
        uid = self.book.content_uid(rank, chain)
        for prefix, digest in fill_chain(
            storage_rank.host_pool, uid, chain, slots, self.config.layer_num
        ):
            self.log.expected[(rank, prefix)] = digest
        draft = storage_rank.draft_host_pool
        if draft is not None:  # a sidecar world: the draft layers at the same slots (INV-37)
            layers = self.config.draft_layer_num
            for prefix, digest in fill_chain(draft, uid, chain, slots, layers, draft=True):
                self.log.expected_sidecar[(rank, prefix)] = digest

    # -- write_storage -------------------------------------------------------------------------
    def write_storage(self, pick: int, new: bool) -> Outcome:
        candidates = self.backup_candidates()
        chain = (
            self.chains[candidates[pick % len(candidates)]]
            if candidates and not new
            else self.new_chain(pick)
        )
        if chain is None:
            return refused("no chain left to back up")
        tokens = chain.pages * self.page
        keys = self._buffer_keys(chain)  # buffer mode: each rank's page keys of the chain
        if keys and self.buffer is not None and self.buffer.covered(keys):
            return refused("every page believed stored or in flight (buffer mode skips it)")
        slots = [r.host_pool.alloc(tokens) for r in self.l3.ranks]
        side = (
            None if any(s is None for s in slots) else self.side.alloc_side(self.l3.ranks, tokens)
        )
        if any(s is None for s in slots) or side is None:
            for storage_rank, got in zip(self.l3.ranks, slots, strict=True):
                if got is not None:
                    storage_rank.host_pool.free(got)
            return refused("host full")
        prefix_keys = list(chain.parent.chain_keys()) if chain.parent is not None else None
        for rank, (tree_rank, s) in enumerate(zip(self.storage_tree.ranks, slots, strict=True)):
            assert s is not None
            self._fill(rank, chain, s)
            side_host = side[rank] if side else None
            op_id = tree_rank.write_backup_storage(
                ("chain", chain.uid),
                s,
                list(chain.tokens(self.page)),
                None,
                prefix_keys,
                side_host=side_host,
            )
            self.sources[rank][op_id] = s
            if self.buffer is not None:  # staging, freed at its storage ack
                self.buffer.launch(rank, op_id, keys[rank], tokens)
            if side_host is not None:  # the chain's SWA pages (Mamba state) at its own slots
                uid = self.book.content_uid(rank, chain)
                layers = self.config.draft_layer_num
                storage_rank = self.l3.ranks[rank]
                self.side.fill_side(storage_rank, uid, chain, side_host, layers, self.log, op_id)
            skipped = self.mla and rank != 0
            self.log.backups[rank][op_id] = BackupLog(
                op_id, self.epoch, chain.uid, chain.pages, skipped
            )
        chain.state = "writing"
        chain.acked = {}
        return done(f"write_storage chain {chain.uid} ({chain.pages} pages)")

    # -- prefetch ------------------------------------------------------------------------------
    def prefetch(self, pick: int) -> Outcome:
        candidates = self.prefetch_candidates()
        chain = self.chains[candidates[pick % len(candidates)]]
        rid = f"q{self.next_rid}"
        self.next_rid += 1
        parent = chain.parent
        last_hash = parent.chain_keys()[-1] if parent is not None else None
        prefix_keys = list(parent.chain_keys()) if parent is not None else None
        anchor: Prefix = parent.prefix(self.page) if parent is not None else ()
        limited = [r.cc.prefetch_rate_limited() for r in self.storage_tree.ranks]
        if self.buffer is not None:  # what the write staging leaves to loads (INV-41)
            self.buffer.rate_limited(limited)
        if any(limited):
            return refused("prefetch rate limited")  # decided alike on every rank
        tokens = chain.pages * self.page
        if self.up_front and not self._up_front_room(tokens):
            return refused("host full")  # 0.5.10 allocates the whole prefetch up front
        window = self.side.staging(chain.pages, self.config.storage_swa_window, parent is None)
        keys = self._buffer_keys(chain)
        for rank, tree_rank in enumerate(self.storage_tree.ranks):
            if self.buffer is not None:  # the chain its hit query heals the beliefs of
                self.buffer.expect(rank, rid, keys[rank])
            self.log.prefetches[rank][rid] = PrefetchLog(
                rid, self.epoch, chain.pages * self.page, anchor, chain.uid, swa_trailing=window
            )
            operation = tree_rank.prefetch_from_storage(
                rid, ("chain", chain.uid), list(chain.tokens(self.page)), last_hash, prefix_keys
            )
            if operation is None:
                del self.log.prefetches[rank][rid]
                return refused("prefetch not started (rate limited)")
            self.known_ops[id(operation)] = (operation, self.epoch)
        if self.config.storage_swa_window and self.config.storage_host_pressure:
            # other requests' host pages while the query runs: the hit is often served cut
            self.side.crowd(rid, self.l3.ranks, leave_pages=1 + (pick // 8) % 2)
        return done(f"prefetch {rid} of chain {chain.uid}")

    def _buffer_keys(self, chain: Chain) -> list[list[str]]:
        """Each rank's page keys of ``chain`` in a buffer world (the tree's hash), else []."""
        if self.buffer is None:
            return []
        prior = chain.parent.chain_keys()[-1] if chain.parent is not None else None
        return self.buffer.chain_keys(list(chain.tokens(self.page)), prior, self.page)

    def _up_front_room(self, tokens: int) -> bool:
        """Whether every rank can allocate the prefetch up front (0.5.10 - 0.5.15), all of it
        or, under host pressure, the free whole pages cut to at least the threshold (0.5.13 -
        0.5.15's fallback; each rank's tree half cuts to its own room): decided alike on every
        rank, since a rank that does not start the prefetch joins none of its hit queries."""
        page, threshold = self.page, max(self.page, self.config.page_size)
        for rank in self.l3.ranks:
            free = int(rank.host_pool.available_size())
            if free >= tokens:
                continue
            if not self.config.storage_host_pressure or free - free % page < threshold:
                return False
        return True

    def ongoing(self) -> list[str]:
        common = set.intersection(*(set(r.ongoing_prefetch) for r in self.storage_tree.ranks))
        return sorted(common)

    def check_prefetch(self, rid: str) -> Outcome:
        if self.polled is not None:
            verdicts = [self.polled.check_prefetch_progress(rid)]
        else:
            verdicts = [r.check_prefetch_progress(rid) for r in self.storage_tree.ranks]
        return done(f"check_prefetch_progress {rid}: {'settled' if all(verdicts) else 'waits'}")

    def terminate(self, rid: str) -> Outcome:
        if self.polled is not None:
            completed = self.polled.abort(rid)  # 0.5.10's release_aborted_request
        else:
            completed = [r.terminate(rid) for r in self.storage_tree.ranks]
        return done(f"terminate {rid} at {completed}", agreed=f"terminate {rid}")

    # -- steps and drains ------------------------------------------------------------------------
    def runnable(self) -> list[StorageStepKind]:
        if not self.attached:
            return []
        if self.points is not None:
            return self.points.runnable(self.l3.tiers)
        return runnable_steps(self.l3.tiers)

    def run_step(self, kind: StorageStepKind, grant: Grant | None = None, rank: int = 0) -> Outcome:
        from hicache_ref.harness.driver.storage_events import observe_polled_step

        self.steps_run += 1
        if self.points is not None:
            return run_to_next_point(self, self.points, kind, grant or Grant(), rank)

        polled = self.polled_kind(kind)
        before = [len(t.release_queue_items()) for t in self.l3.tiers] if polled else []
        results = run_lockstep(self.l3.tiers, self.l3.group, kind, self.l3.threads)
        for result in results:
            if result.ran:  # a rank with nothing to do did nothing (not a stale act)
                self._observe_calls(result)
                if polled:
                    released = self.l3.tiers[result.rank].release_queue_items()
                    observe_polled_step(self, result, released[before[result.rank] :])
        tokens = [r.tokens for r in results]
        return done(f"{kind.value} step: {tokens}", agreed=f"{kind.value} step")

    def drain_prefetch(self) -> Outcome:
        if self.polled is not None:  # 0.5.10: revokes; its IO publishes nothing to drain
            revoked = self.polled.drain_revokes()
            hits = self.polled.drain_hits()  # 0.5.16 - 0.5.18: the hit queue too
            return done(f"drained {revoked} revoke(s), {hits} hit(s)")
        ranks = self.storage_tree.ranks
        taken = min(r.cc.prefetch_hit_queue.qsize() for r in ranks)
        self.storage_tree.drain_hits(taken)  # started or revoked on every rank alike
        self.side.release_crowds(self.l3.ranks, self.log)
        count = min(r.cc.ack_prefetch_queue.qsize() for r in ranks)
        for r in ranks:
            r.drain_acks(count)  # a final ack queues its tail on host_mem_release_queue
        return done(f"drained {taken + count} prefetch item(s)")

    def drain_backups(self) -> Outcome:
        """Backup acks, then the release queue into the host pools (the tails of settled
        prefetches wait there until now, so a reset can find them queued)."""
        ranks = self.storage_tree.ranks
        count = min(r.cc.ack_backup_queue.qsize() for r in ranks)
        for r in ranks:
            r.drain_backups(count)
        released = min(r.cc.host_mem_release_queue.qsize() for r in ranks)
        for r in ranks:
            r.drain_releases(released)
        released += self.storage_tree.drain_side_releases()  # an SWA window's tail
        return done(f"drained {count} backup ack(s), {released} release(s)")

    def inject_fault(self, kind: str, rank: int, pages: int) -> Outcome:
        faults = self.l3.ranks[rank % self.n].faults
        assert faults is not None
        faults.arm(kind, pages)  # type: ignore[arg-type]
        return done(f"armed {kind} x{pages} on rank {rank % self.n}")

    def run_until_idle(self) -> int:
        """Storage steps, observed, until no rank has one (the harness sees every call)."""
        steps = 0
        while runnable := self.runnable():
            for kind in runnable:
                self.run_step(kind)
                steps += 1
        return steps

    def detach(self) -> Outcome:
        for rid in self.ongoing():
            self.terminate(rid)
        for tier in self.l3.tiers:
            tier.terminate_live_prefetches()
        self.run_until_idle()  # detach would finish them too, unobserved
        self.check_no_thread_stuck()
        detach_ranks(self.l3.tiers, self.l3.group)
        self.settle_queues()
        self.l3.attached = False
        self.flags["detached"] = True
        return done("detach_storage_backend on every rank")

    def attach(self) -> Outcome:
        self.l3.attach()
        self.epoch += 1
        self.log.forget_epoch([len(log) for log in self.l3.group.logs()])
        return done("attach_storage_backend on every rank")

    # -- clear_storage ---------------------------------------------------------------------------
    def why_not_clear(self) -> str | None:
        """A clear is drawn at rest only: no backup or prefetch of any rank is unsettled, so
        every page L3 holds afterwards was written after the clear (INV-30, INV-31 stay exact)."""
        if any(chain.state == "writing" for chain in self.chains.values()):
            return "a backup is not yet acked on every rank (clear_storage runs at rest)"
        if any(r.ongoing_prefetch for r in self.storage_tree.ranks):
            return "a prefetch is ongoing on some rank (clear_storage runs at rest)"
        if self.config.storage_backend == "upstream_file" and not self.gates_upstream:
            return (
                "upstream's HiCacheFile.clear() wipes the shared directory (F24): its clear is "
                "gated with upstream's own controller only"
            )
        return None

    def clear(self, rank: int) -> Outcome:
        """Rank ``rank``'s clear endpoint (under MLA rank 0, the one writer of the namespace
        every rank shares): the pages it removed, each with its writer, for INV-28."""
        cleared = 0 if self.mla else rank % self.n
        before = self._present()
        ok = self.l3.ranks[cleared].controller.clear_storage_backend()
        removed = before - self._present()
        self.log.record_clear(cleared, removed)
        sharing = range(self.n) if self.mla else (cleared,)
        self.log.forget_namespace(set(sharing))
        self.book.forget_stored()  # no chain is whole on every rank now
        if self.buffer is not None and ok:  # L3 is empty: every belief is stale
            self.buffer.clear()
        return done(f"clear_storage on rank {cleared}: {len(removed)} page(s) removed ({ok})")

    def settle_queues(self) -> None:
        """Drain every control queue until nothing is left (after a detach or at the end)."""
        for _ in range(64):
            self.drain_prefetch()
            self.drain_backups()
            if self.control_empty():
                return

    def settle(self) -> None:
        """Quiescence: finish every prefetch and backup, drain everything, check at rest."""
        self.side.release_crowds(self.l3.ranks, self.log, every=True)
        if self.attached and self.config.storage_swa_window and not self.tree.watch.active:
            # an SWA world lets what is in flight finish first, so a prefetch's window read and
            # the tree's verdict on it are judged, not cut short by the end of the case (not
            # while free slots are watched: a bounce page taken and freed unseen is no copy's)
            for _ in range(8):
                self.run_until_idle()
                self.drain_prefetch()
                self.drain_backups()
        if self.attached:
            for _ in range(64):
                for rid in self.ongoing():
                    self.terminate(rid)
                for kind in self.runnable():
                    self.run_step(kind)
                self.drain_prefetch()
                self.drain_backups()
                if not self.runnable() and not self.ongoing() and self.control_empty():
                    break
            self.run_until_idle()
            self.check_no_thread_stuck()
        self.settle_queues()
        self.check(quiescent=True)

    def check_no_thread_stuck(self) -> None:
        """Under schedule points: no thread waits at a collective a peer never reaches."""
        stuck = None if self.points is None else self.points.stuck_at_collective(self.l3.tiers)
        # Verify every rank reached each collective a peer waits at (INV-20)
        if stuck is not None:
            raise InvariantViolation("INV-20", f"at rest, {stuck}")

    def control_empty(self) -> bool:
        if any(side_release_count(r.controller) for r in self.l3.ranks):
            return False
        return all(
            not any(
                getattr(r.controller, q, None) is not None and getattr(r.controller, q).qsize()
                for q in (
                    "prefetch_hit_queue",
                    "ack_prefetch_queue",
                    "ack_backup_queue",
                    "host_mem_release_queue",
                    *(("prefetch_revoke_queue",) if self.polled is not None else ()),
                )
            )
            for r in self.l3.ranks
        )

    def on_reset(self) -> None:
        """The storage half of a tree reset: peers reset, sources dropped, a new epoch."""
        self.l3.reset_peers()
        if self.points is not None:  # what stopping threads did inside their bodies is no step's
            self.points.forget_bodies(self.l3.ranks)
        self.storage_tree.reset()  # the 0.5.10 tree half's ranks too (they are its ranks)
        self.sources = [{} for _ in range(self.n)]
        self.side.reset()  # the host and side pools are cleared too
        if self.buffer is not None:  # the dropped writes reach no storage ack
            self.buffer.reset()
        for chain in self.chains.values():
            if chain.state == "writing":
                chain.state = "none"
        self.epoch += 1
        self.log.forget_epoch([len(log) for log in self.l3.group.logs()])
        # a stopping thread may run a queued backup during the reset, unobserved by any step
        # (upstream's do): a page the backend dropped there is lost to the fault, as one
        # dropped in a step is (INV-31 excuses only those)
        for rank in self.l3.ranks:
            if rank.faults is not None:
                self.log.lost.update((rank.rank, key) for key in rank.faults.dropped_keys)
        self.flags["just_reset"] = True
        self.check()  # right after the reset: nothing queued, nothing occupied (INV-24)

    # -- what the tree half reports ----------------------------------------------------------------
    def _event_callback(self, rank: int) -> Any:
        from hicache_ref.harness.driver.storage_events import on_storage_event

        return lambda kind, data: on_storage_event(self, rank, kind, data)

    # -- the recording backend's calls of one step -------------------------------------------------
    def _observe_calls(self, result: StepResult) -> None:
        from hicache_ref.harness.driver.storage_events import observe_calls

        recording = self.l3.ranks[result.rank].recording
        calls: list[BackendCall] = recording.take() if recording is not None else []
        observe_calls(self, result, calls)

    # -- the checks ------------------------------------------------------------------------------
    def holdings(self) -> tuple[NodeHoldings, ...]:
        """Rank 0's pages the storage driver holds (sources, an SWA world's side slots and
        crowds, bounce buffers), for INV-05."""
        held = [  # pages_covered is cached per tensor: a source's never change
            pseudo_holding(PSEUDO_HANDLE - k, pages_covered(slots, self.page))
            for k, slots in enumerate(self.sources[0].values())
        ]
        held.extend(self.side.holdings(PSEUDO_HANDLE - len(held)))
        bounce = {s for log in self.log.prefetches[0].values() for s in log.owned_slots}
        if bounce:
            pages = frozenset(s // self.page for s in bounce)
            held.append(pseudo_holding(PSEUDO_HANDLE - len(held), pages))
        return tuple(held)

    def snapshot(self, quiescent: bool = False) -> StorageSnapshot:
        tiers = tuple(
            TierView(
                r.rank,
                bool(r.controller.enable_storage),
                tuple(sorted(r.controller.storage.queues.sizes().items())),
                int(r.controller.prefetch_tokens_occupied),
                len(r.controller.storage.alive_threads()),
            )
            for r in self.l3.ranks
        )
        for rank, logs in enumerate(self.log.prefetches):
            for log in logs.values():
                op = self._op_of(rank, log.request_id)
                if op is None and log.terminated_at is not None:
                    # retired at termination, but an IO step may still run on it: its progress
                    # must stay where terminate_prefetch left it (INV-19)
                    op = cast("PrefetchOperation | None", log.operation)
                log.completed_now = None if op is None else op.completed_tokens
        snapshot = self.log.snapshot(
            page_size=self.page,
            epoch=self.epoch,
            tiers=tiers,
            collectives=self.l3.group.logs(),
            present=self._present(),
            quiescent=quiescent,
            just_reset=self.flags.pop("just_reset", False),
            detached=self.flags.pop("detached", False),
            stale_grants=stale_grants(self.l3.tiers),
        )
        if self.buffer is None:
            return snapshot
        return replace(snapshot, beliefs=self.buffer.views())

    def _op_of(self, rank: int, rid: str) -> PrefetchOperation | None:
        info = self.storage_tree.ranks[rank].ongoing_prefetch.get(rid)
        return None if info is None else info.operation

    def _present(self) -> set[tuple[int, str]]:
        present: set[tuple[int, str]] = set()
        for rank, key in self.log.stored_keys:
            faults = self.l3.ranks[rank].faults
            if faults is not None and faults.inner.exists(key):
                present.add((rank, key))
        return present

    def check(self, quiescent: bool = False) -> None:
        """The storage checkers over a fresh snapshot; one equal to the last that passed them
        is not judged again (each checker is a pure function of the snapshot)."""
        snapshot = self.snapshot(quiescent)
        if snapshot == self._last_passed:
            self.reused_checks += 1
            return
        self.checks.run_all(STORAGE_IDS, snapshot)
        self._last_passed = snapshot
