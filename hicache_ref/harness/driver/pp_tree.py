"""The tree's half of 0.5.21+'s PP prefetch protocol, over a world of 2 PP storage ranks.

A PP world (``HarnessConfig.storage_pp``) is a storage world whose 2 ranks are pipeline-parallel
ranks (TP 1 each) of upstream's own ``HybridCacheController`` in ``buffer_only`` host memory,
in one process: its storage threads and its PP command thread (``pp_prefetch_command_thread_func``)
run upstream's code on gated threads, the PP group and its command group are the harness's
(``adapters/sglang_world.py``: ``broadcast_pyobj`` on ``PpBroadcast``), and every rank's backend
is a client of one shared L3 (``world/storage_world.py``). ``PpTree`` is the scheduler side of
every rank, modelled on 0.5.23's ``UnifiedRadixCache`` (our own code), in protocol order:

- ``back_up``: a chain's pages, filled with each rank's own bytes, go to L3 through every rank's
  ``write_storage`` and backup thread (a PP rank stores its own layers: its keys carry its rank);
- ``submit``: PP rank 0 alone asks ``get_prefetch_submission`` and, with none, ``submit_prefetch``
  (a ticket recorded under ``pp_prefetch_state_lock`` and queued for the command thread), as
  ``prefetch_from_storage`` does in buffer mode; the other ranks follow the tickets;
- ``command_step``: one loop body of every rank's PP command thread together: rank 0 takes the
  ticket and broadcasts it, then every rank queries its backend, allocates its host slots
  (``_allocate_pp_prefetch_buffers``, off the scheduler thread), MIN-reduces the hit over the PP
  ranks and stages the operation for its IO thread; with ``points`` (the command threads park
  at schedule points, alone unless ``storage_points``), ``point(rank)`` runs one rank's to its
  next point (the collective on every rank at once), so the scheduler's steps land in between;
- ``storage_step``: the IO or sync thread of every rank in lockstep (the sync thread publishes
  a ticket's completion by setting its ``ready_event``); with ``storage_points`` (and
  ``page_points``) to its next point (``pp_storage_threads``), so a release, a progress check or
  a command step lands inside a ticket's IO or sync body;
- ``check_progress``: ``_check_pp_prefetch_progress``: PP rank 0's readiness (MAX over the ranks),
  then ``take_ready_pp_prefetch`` on every rank; a staged hit is consumed as the buffer pipeline
  consumes it (the tail past the completed tokens goes back through ``append_host_mem_release``,
  the landed pages are freed after their load);
- ``release``: the request finished: ``release_pp_prefetch`` on every rank (``claim_kv_row``);
- ``reset``: every rank's ``reset()``, PP rank 0 first (its command thread broadcasts the stop).

On 0.5.21 - 0.5.22 (``carries_rank_0_hit``) the ticket carries the hit: ``submit`` is where PP
rank 0 queries every rank's shard (the world attaches as "mooncake", the only backend those
releases open the command group for, and routes a query naming another PP rank to its backend),
and ``command_step`` stages that hit on every rank with no query and no hit collective.

The harness's own records, never the controller's word: the tickets each rank took off the
broadcast (``PpBroadcast.received``), the keys its command thread queried and the pages its IO
read back (the recording backend), and its host slots' holders (``pp_books``). After every step
they become a ``StorageSnapshot`` handed to INV-38 (PP ranks agree on tickets; a retired ticket
holds no slot; a carried hit is no longer than each rank's shard held at PP rank 0's query; a
ticket's IO writes only slots the ticket holds) and INV-30 (a rank reads its own shard's bytes).
"""

from __future__ import annotations

import inspect
from array import array
from typing import Any

import torch

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.errors import HiCacheInputError, HiCacheSetupError, InvariantViolation
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.adapters.sglang_storage import PP_TICKET_FUNC, sidecar_transfers
from hicache_ref.harness.adapters.sglang_stubs import RadixKey
from hicache_ref.harness.adapters.sglang_world import PpBroadcast, pp_broadcast_for
from hicache_ref.harness.driver.pp_books import RankBook, TicketLog, watch_host_pool
from hicache_ref.harness.driver.pp_commands import PpCommandThreads
from hicache_ref.harness.driver.pp_side import (
    drain_side_releases,
    fill_side,
    free_window,
    side_held,
    side_pool_of,
    side_room,
    taken_window,
    window_pool,
    window_record,
    window_transfer,
)
from hicache_ref.harness.driver.pp_storage_threads import TICKET_KINDS, PpStorageThreads
from hicache_ref.harness.driver.pp_world import (
    Chain,
    RequestHandle,
    build_pp_world,
    page_keys_of,
    page_value,
)
from hicache_ref.harness.schedule.points import WAIT
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.harness.world.recording_storage import page_digest
from hicache_ref.invariants.registry import CheckRunner
from hicache_ref.invariants.storage_snapshot import (
    L3Model,
    PpTicketRecord,
    SideWindowRecord,
    StorageSnapshot,
    StoreRead,
)

IDLE_ROUNDS_MAX = 200  # rounds of run_until_idle with whole bodies (a round runs every kind)
IDLE_ROUNDS_POINTS_MAX = 4_000  # ... stepped point by point (a body has up to a dozen)
STOP_POINTS_MAX = 64  # points storage_to runs a kind at most (a 4-page ticket's IO: about 14)


class PpTree:
    """Every PP rank's scheduler side of the storage protocol (see the module doc)."""

    def __init__(
        self,
        implementation: Implementation,
        config: HarnessConfig,
        *,
        points: bool = False,
        storage_points: bool = False,
        page_points: bool = False,
    ) -> None:
        if not config.storage_pp:
            raise HiCacheInputError("a PP tree needs a PP world (storage_pp=True)")
        # Verify the storage threads park only in a world whose command threads do
        if (storage_points and not points) or (page_points and not storage_points):
            raise HiCacheInputError(
                f"points={points} storage_points={storage_points} page_points={page_points}: "
                "page points need storage points, which need points (each narrows the last)"
            )
        built = build_pp_world(implementation, config)
        self.config = config = built.config
        self.page = config.page_size
        self.storage = built.storage
        self.world = built.world
        self.cc: list[Any] = built.cc
        self.hybrid = built.hybrid
        self.carries_hit = built.carries_hit
        self.broadcast: PpBroadcast = pp_broadcast_for(self.cc[0]._harness_collectives)
        self.books = [RankBook() for _ in self.cc]
        for rank, controller in enumerate(self.cc):
            watch_host_pool(self.books[rank], controller, self.broadcast.received[rank], self)
        self.points = points
        self.storage_points = storage_points
        self.threads = PpStorageThreads(
            self.cc, self.storage.group, self.storage.threads, points=storage_points
        )
        self.commands = PpCommandThreads(self.cc, self.broadcast, self.storage.group)
        if points:  # the command threads park at every point of their loop bodies; with
            for controller in self.cc:  # storage points every storage thread parks too
                gate = controller._harness_gate
                gate.points = gate.lock_points = True
                gate.page_points = page_points
                gate.points_only = None if storage_points else frozenset({PP_TICKET_FUNC})
        for rank, inbox in enumerate(self.broadcast.inboxes[1:], start=1):
            self.cc[rank]._harness_gate.queue_names[id(inbox)] = "pp_command_inbox"
        self.epoch = 0
        self.chains: list[Chain] = []
        self.requests = 0
        self.live: set[str] = set()  # submitted, not yet released
        self.checks = CheckRunner()
        self.stored: list[list[str]] = [[] for _ in self.cc]
        self.queried: list[list[str]] = [[] for _ in self.cc]
        self.reads: list[StoreRead] = []  # pages read back from L3, by rank and content key
        self.expected: dict[tuple[int, str], str] = {}  # (rank, content key) -> oracle digest
        # (epoch, request) -> per rank, the tokens its shard held when PP rank 0 queried them
        self.shards_at_query: dict[tuple[int, str], list[int]] = {}
        # the radix cache's assume_stored (0.5.20+'s submit_prefetch takes it): a chain's end
        # (in tokens) every rank's backup ack or a taken ticket's completion confirmed, and each
        # request's (chain, start); a submit drawn with it assumes the span to there stored
        self.assumes = "assume_stored" in inspect.signature(self.cc[0].submit_prefetch).parameters
        self.confirmed: dict[int, int] = {}
        self.spans: dict[str, tuple[int, int]] = {}
        self.assumed: set[str] = set()  # requests submitted with assume_stored
        # an SWA or Mamba world (pp_config(swa_window=N), (mamba=True)): a window per ticket
        self.swa_window = config.storage_swa_window
        self.windows: dict[str, int] = {}  # request -> the window pages its ticket names
        self.expected_side: dict[tuple[int, str], str] = {}  # (rank, key) -> its SWA digest
        self.side_windows: list[SideWindowRecord] = []  # taken windows, judged next (INV-39)
        self.steps = 0

    def held_by(self, rank: int, rid: str) -> int:
        return sum(1 for owner in self.books[rank].owners.values() if owner == rid)

    # -- L3 ----------------------------------------------------------------------------------------
    def has_room(self, pages: int) -> bool:
        """Every rank's host pool (and side pool, in an SWA or Mamba world) has room to stage
        a ``pages``-page backup (tickets hold the rest)."""
        need = pages * self.page
        kv = all(int(c.mem_pool_host.available_size()) >= need for c in self.cc)
        return kv and all(not self.swa_window or side_room(c, pages) for c in self.cc)

    def back_up(self, pages: int) -> Chain:
        """Store a new chain of ``pages`` pages on every rank (each rank's own bytes)."""
        index = len(self.chains)
        tokens = tuple(range(index * 4096 + 1, index * 4096 + 1 + pages * self.page))
        slots: list[Any] = []
        sides: list[Any] = []  # an SWA world's side source pages, per rank
        digests: list[tuple[int, str]] = []  # (rank, the oracle's digest) per page, in order
        for rank, controller in enumerate(self.cc):
            host = controller.mem_pool_host.alloc(pages * self.page)
            if host is None:
                raise HiCacheInputError(f"no host room for a {pages}-page backup on rank {rank}")
            pool = controller.mem_pool_host.anchor_entry.host_pool
            for page in range(pages):
                first = int(host[page * self.page])
                flat = pool.get_dummy_flat_data_page()
                ramp = torch.arange(flat.numel(), dtype=flat.dtype) / 1024
                data = ramp + page_value(rank, index, page)
                pool.set_from_flat_data_page(first, data)
                digests.append((rank, page_digest(data)))
            side = None  # the side source: the chain's SWA pages (its Mamba state), the rank's
            if self.swa_window:
                keys = page_keys_of(tokens, self.page, controller)
                side = fill_side(controller, (rank, index), keys, self.page, self.expected_side)
            controller.write_storage(host, list(tokens), side_host=side)
            slots.append(host)
            sides.append(side)
        self.run_until_idle()
        acked: list[int] = []  # per rank, the tokens its backup ack says it stored
        for rank, controller in enumerate(self.cc):
            stored = 0
            while not controller.ack_backup_queue.empty():
                ack = controller.ack_backup_queue.get_nowait()
                stored = max(stored, int(getattr(ack, "completed_tokens", 0) or 0))
            acked.append(stored)
            controller.mem_pool_host.free(slots[rank])
            if sides[rank] is not None:
                side_pool_of(controller).free(sides[rank])
            self._stored_keys(rank)  # what the backups stored is INV-30's expectation's
        page_keys = page_keys_of(tokens, self.page, self.cc[0])
        for position, (rank, digest) in enumerate(digests):
            self.expected[(rank, page_keys[position % pages])] = digest
        chain = Chain(index, tokens, tuple(page_keys))  # whether or not a fault kept one out
        self.chains.append(chain)
        if min(acked) > 0:  # writes are prefix-covered: every rank holds the acked prefix
            self.confirmed[index] = min(acked)
        return chain

    def _stored_keys(self, rank: int) -> list[str]:
        self._take_calls()
        stored, self.stored[rank] = self.stored[rank], []
        return stored

    def _take_calls(self) -> None:
        """Every backend call since the last look, routed: the keys each rank stored, the keys
        its command thread queried (for ``_take_broadcasts``), the pages it read back (INV-30)."""
        for rank, storage_rank in enumerate(self.storage.ranks):
            recording = storage_rank.recording
            for call in [] if recording is None else recording.take():
                if call.kind == "set":
                    self.stored[rank].extend(call.keys)
                elif call.kind == "exists" and call.thread == PP_TICKET_FUNC:
                    self.queried[rank].extend(call.keys)
                elif call.kind == "get":
                    self.reads.extend(
                        StoreRead(rank, key, digest)
                        for key, digest in zip(call.keys, call.digests, strict=False)
                        if digest is not None
                    )

    # -- a request's prefetch ----------------------------------------------------------------------
    def submit(self, chain: Chain, skip_pages: int, *, assume: bool = False) -> str | None:
        """PP rank 0's ``prefetch_from_storage`` of ``chain`` after its first ``skip_pages``
        pages (already on the device): the request's id, or None when it asked for nothing.
        ``assume``: the scheduler hands the end of the span the tree believes stored
        (``storage_hit_end``: every rank's backup ack, or a taken ticket's completion), so the
        span is cut there and submitted with ``assume_stored``, as the radix cache does."""
        rid = f"req-{self.requests}"
        self.requests += 1
        controller = self.cc[0]
        if controller.get_prefetch_submission(rid) is not None:
            return None
        start = skip_pages * self.page
        # a span a taken ticket confirmed is assumed stored up to that end (storage_hit_end)
        end = self.confirmed.get(chain.index) if assume else None
        assume_stored = end is not None and start < end <= len(chain.tokens)
        tokens = chain.tokens[start:end] if assume_stored else chain.tokens[start:]
        if len(tokens) < controller.prefetch_threshold:
            return None
        last_hash = chain.keys[skip_pages - 1] if skip_pages and chain.keys else None
        prefix_keys = list(chain.keys[:skip_pages]) if skip_pages else None
        handle = RequestHandle(rid)
        key = RadixKey(array("q", tokens)).page_aligned(self.page)
        assumed = {"assume_stored": True} if assume_stored and self.assumes else {}
        sidecars = sidecar_transfers() if controller._harness_sidecar() else None
        if self.swa_window:  # the window's placeholder keys, no slots (num_slots 0)
            span = len(tokens) // self.page
            sidecars = window_transfer(controller, span, self.swa_window, start == 0)
        submission = controller.submit_prefetch(
            handle, key, last_hash, prefix_keys, list(chain.tokens[:start]), sidecars, **assumed
        )
        self.spans[rid] = (chain.index, start)
        if assumed:
            self.assumed.add(rid)
        if self.carries_hit:  # PP rank 0 just queried every rank's shard for the hit
            pages = chain.keys[skip_pages : skip_pages + len(tokens) // self.page]
            self.shards_at_query[(self.epoch, rid)] = [
                self._shard_run(rank, pages) * self.page for rank in range(len(self.cc))
            ]
        if submission.operation is None:
            return None
        self._bind(0, rid, bool(submission.decision))
        self.live.add(rid)
        self.windows[rid] = len(sidecars[0].keys) if self.swa_window and sidecars else 0
        return rid

    def _shard_run(self, rank: int, keys: tuple[str, ...]) -> int:
        """The leading run of ``keys`` rank ``rank``'s shard holds: the harness's own look at
        L3, under the recording and the drawn faults (an evicted page is gone)."""
        faults = self.storage.ranks[rank].faults
        assert faults is not None, "a storage world's backend is built at attach"
        for position, key in enumerate(keys):
            if key in faults.evicted or not faults.inner.exists(key):
                return position
        return len(keys)

    def _bind(self, rank: int, rid: str, decision: bool = True) -> None:
        """``bind_prefetch_ticket``: PP rank 0 records its decision; another rank records the
        one the request relay carries, when the request reaches its scheduler."""
        controller, decisions = self.cc[rank], self.hybrid.PPPrefetchDecision
        with controller.pp_prefetch_state_lock:
            controller.pp_prefetch_decisions[rid] = (
                decisions.TICKETED if decision else decisions.SKIPPED
            )
        self.books[rank].relayed.add(rid)

    def relay(self, rid: str) -> None:
        """The request (ticketed) reaches every other PP rank's scheduler."""
        for rank in range(1, len(self.cc)):
            if rid not in self.books[rank].relayed:
                self._bind(rank, rid)

    def command_step(self) -> bool:
        """One loop body of every rank's PP command thread (False: no ticket was queued); with
        points, every point of it (the ticket's whole round)."""
        ran = self.commands.round() if self.points else self.commands.bodies()
        if ran:
            self._take_broadcasts()
            self.check()
        return ran

    def point(self, rank: int, *, start: bool = True) -> bool:
        return self.commands.point(rank, start=start)

    def position(self, rank: int) -> tuple[Any, Any] | None:
        return self.commands.position(rank)

    def at_rest(self, rank: int) -> bool:
        return self.commands.at_rest(rank)

    def command_point(self, rank: int) -> bool:
        """One point of one rank's command thread (a program's ``point`` step)."""
        if not self.points:
            return self.command_step()
        moved = self.commands.point(rank) or self.commands.point(1 - rank)
        if moved:
            self._take_broadcasts()
            self.check()
        return moved

    def _take_broadcasts(self, *, ending: bool = False) -> None:
        """What each rank's command thread did since the last look: the tickets it took off
        the broadcast, the keys it queried (for the ticket it is on), and, once its loop body
        ended (it waits again, or ``ending``: a reset stopped it), the hit it staged."""
        self._take_calls()
        for rank, book in enumerate(self.books):
            received = self.broadcast.received[rank][book.seen :]
            book.seen += len(received)
            queried, self.queried[rank] = tuple(self.queried[rank]), []
            for message in received:
                ticket = message.objects[0] if message.objects else None
                if ticket is not None:
                    rid = str(ticket.handle.rid)
                    log = TicketLog(rid, self.epoch)
                    shards = self.shards_at_query.get((self.epoch, rid))
                    log.shard_tokens = None if shards is None else shards[rank]
                    book.tickets.append(log)
            current = [t for t in book.tickets if t.epoch == self.epoch and not t.ended]
            if current and queried:
                current[-1].keys += queried
            position = self.position(rank)
            if ending or position is None or position[1].kind == WAIT:
                for log in current:
                    log.ended = True
                    state = self.cc[rank].pp_prefetch_states.get(log.request_id)
                    if state is not None and not ending:
                        log.hit_tokens = int(state.operation.storage_hit_count)

    def storage_step(self, kind: StorageStepKind) -> bool:
        """The ``kind`` thread of every rank in lockstep (False: no rank had work); with
        storage points, every rank's to its next point (a rank parked at a collective waits
        there until every rank's is: then all go at once)."""
        if not self.threads.step(kind):
            return False
        self._take_calls()
        self._mark_ready()
        self.check()
        return True

    def storage_to(self, kind: StorageStepKind, stop: str) -> int:
        """With storage points: every rank's ``kind`` thread, point by point, until one parks
        at a point of kind ``stop`` (``wait``: until every rank's waits again) or none can
        move; how many steps ran."""
        for steps in range(STOP_POINTS_MAX):
            if not self.storage_step(kind):
                return steps
            if self.threads.stopped_at(kind, stop):
                return steps + 1
        return STOP_POINTS_MAX

    def _mark_ready(self) -> None:
        for rank, book in enumerate(self.books):
            for log in book.tickets:
                if log.epoch != self.epoch or log.ready:
                    continue
                state = self.cc[rank].pp_prefetch_states.get(log.request_id)
                log.ready = state is None or bool(state.ready_event.is_set())

    def run_until_idle(self) -> None:
        """Every queued ticket, IO, sync and backup, until no rank has work (with storage
        points: until no thread can move; one parked at a collective no peer reaches is INV-20)."""
        rounds_max = IDLE_ROUNDS_POINTS_MAX if self.storage_points else IDLE_ROUNDS_MAX
        for _ in range(rounds_max):
            ran = self.command_step()
            for kind in (StorageStepKind.IO, StorageStepKind.SYNC, StorageStepKind.BACKUP):
                ran = self.storage_step(kind) or ran
            if not ran:
                self._verify_no_thread_stuck()
                return
        raise HiCacheSetupError(f"the PP world did not go idle within {rounds_max} rounds")

    def _verify_no_thread_stuck(self) -> None:
        stuck = self.threads.stuck()
        # Verify no storage thread waits at a collective its peers never reach (INV-20)
        if stuck is not None:
            raise InvariantViolation("INV-20", f"the PP world is idle but {stuck}")

    def check_progress(self, rid: str) -> bool:
        """``_check_pp_prefetch_progress``: whether the ticket was ready and taken."""
        self.relay(rid)  # every rank's scheduler polls the request it holds
        ready = bool(self.cc[0].is_pp_prefetch_ready(rid))  # MAX over ranks: PP rank 0 decides
        if not ready:
            return False
        self._await_ready(rid)
        for rank, controller in enumerate(self.cc):
            state_of = controller.pp_prefetch_states.get(rid)
            log = self.books[rank].ticket(rid, self.epoch)
            if state_of is None or not state_of.ready_event.is_set():
                if log is not None:
                    log.ready = False
                self.check()  # every rank holds the ticket, ready, once PP rank 0's is (INV-38)
                raise HiCacheSetupError(f"rank {rank} has no ready state for {rid}")
            state = controller.take_ready_pp_prefetch(rid)
            operation = state.operation
            host, completed = operation.host_indices, int(operation.completed_tokens)
            if self.windows.get(rid):  # judged before the tree gives the window back
                self._judge_window(rank, rid, log, operation, completed)
            if rank == 0 and host is not None and completed > 0 and rid in self.spans:
                chain, start = self.spans[rid]  # every rank's completion: the MIN over them
                self.confirmed[chain] = max(self.confirmed.get(chain, 0), start + completed)
            if host is not None and completed > 0:
                controller.append_host_mem_release(host[completed:])
                self._drain_releases(controller)
                self._consume(rank, host[:completed])
                free_window(controller, operation)
        self.check()
        return True

    def _judge_window(self, rank: int, rid: str, log: Any, operation: Any, done: int) -> None:
        """A taken ticket's SWA window on rank ``rank``, against the harness's byte model."""
        chain, start = self.spans[rid]
        span_keys = self.chains[chain].keys[start // self.page :]
        hit = int(log.hit_tokens or 0) if log is not None else 0
        taken = taken_window(
            self.books[rank], self.cc[rank], (rank, rid, self.epoch), (hit, done),
            span_keys, self.windows[rid], operation,
        )  # fmt: skip
        faults, pool = self.storage.ranks[rank].faults, side_pool_of(self.cc[rank])
        name = window_pool(self.cc[rank])
        record = window_record(taken, self.page, pool, self.expected_side, faults, name)
        self.side_windows.append(record)

    def _await_ready(self, rid: str) -> None:
        """Every rank's ``take_ready_pp_prefetch`` waits on its ticket's ``ready_event``: under
        storage points a follower's sync thread may publish after PP rank 0's, so the threads
        run on (a point at a time) until every rank's is set or none can move."""
        for _ in range(IDLE_ROUNDS_POINTS_MAX):
            states = [c.pp_prefetch_states.get(rid) for c in self.cc]
            if all(s is None or s.ready_event.is_set() for s in states):
                return
            if not any([self.storage_step(kind) for kind in TICKET_KINDS]):
                return

    def _consume(self, rank: int, host: Any) -> None:
        """The buffer pipeline loads the staged pages to the device, then frees them."""
        self.cc[rank].mem_pool_host.free(host)

    def _drain_releases(self, controller: Any) -> None:
        release = controller.host_mem_release_queue
        while not release.empty():
            indices = release.get_nowait()
            if indices is not None and len(indices):
                controller.mem_pool_host.free(indices)
        if self.swa_window:  # the window tails the IO gave back (_sync_trailing_keys)
            book = self.books[self.cc.index(controller)]
            holders = dict(book.side_owners)
            for slot in drain_side_releases(controller):
                holder = (self.epoch, holders.get(slot, ""))
                book.side_given_back.setdefault(holder, set()).add(slot)

    def release(self, rid: str) -> None:
        """The request finished: every rank retires its ticket (``claim_kv_row``)."""
        self.relay(rid)  # a rank finishes only a request it received
        for rank, controller in enumerate(self.cc):
            controller.release_pp_prefetch(rid)
            self._drain_releases(controller)
            self.books[rank].released.add((self.epoch, rid))
        self.live.discard(rid)
        self.check()

    def reset(self) -> None:
        """Every rank's ``reset()``, PP rank 0 first; the tree's host pools are cleared."""
        for controller in self.cc:
            controller.reset()
        self._take_broadcasts(ending=True)  # a stopping command thread drains its ticket
        for rank, controller in enumerate(self.cc):
            controller.mem_pool_host.anchor_entry.host_pool.clear()
            self.books[rank].owners.clear()
            if self.swa_window:
                side_pool_of(controller).clear()
                self.books[rank].side_owners.clear()
            self.books[rank].relayed.clear()
            self._stored_keys(rank)
        self.epoch += 1
        self.live.clear()
        self.check()

    # -- INV-38 ------------------------------------------------------------------------------------
    def snapshot(self) -> StorageSnapshot:
        tickets = tuple(
            tuple(
                PpTicketRecord(
                    log.request_id,
                    log.epoch,
                    log.keys,
                    log.hit_tokens,
                    held_tokens=self.held_by(rank, log.request_id)
                    if log.epoch == self.epoch
                    else 0,
                    ready=log.ready,
                    retired=(log.epoch, log.request_id) in book.released,
                    ended=log.ended,
                    shard_tokens=log.shard_tokens,
                    stray_writes=log.stray_writes,
                    side_held_tokens=self._side_held(rank, log.request_id)
                    if log.epoch == self.epoch
                    else 0,
                    side_window_tokens=self.windows.get(log.request_id, 0)
                    * self.config.side_page_size,
                    side_pool=self.config.pool_group if self.swa_window else "",
                )
                for log in book.tickets
            )
            for rank, book in enumerate(self.books)
        )
        return StorageSnapshot(
            page_size=self.page,
            world_size=len(self.cc),
            epoch=self.epoch,
            tiers=(),
            prefetches=tuple(() for _ in self.cc),
            backups=tuple(() for _ in self.cc),
            acks=tuple(() for _ in self.cc),
            collectives=tuple(() for _ in self.cc),
            pp_tickets=tickets,
            pp_at_rest=self._at_rest(),
            side_windows=tuple(self.side_windows),
            l3=L3Model(
                reads=tuple(self.reads),
                expected=tuple((r, k, d) for (r, k), d in sorted(self.expected.items())),
            ),
        )

    def _side_held(self, rank: int, rid: str) -> int:
        return side_held(self.books[rank], self.cc[rank], rid) if self.swa_window else 0

    def _at_rest(self) -> bool:
        """Every command thread waits with no ticket for it, and no IO or sync thread has work
        (under storage points a follower's may still be on its way to a ticket's completion)."""
        return not self.threads.busy() and all(self.at_rest(r) for r in range(len(self.cc)))

    def check(self) -> None:
        self.steps += 1
        snapshot = self.snapshot()
        self.checks.run("INV-38", snapshot)
        self.checks.run("INV-30", snapshot)  # each rank reads back its own shard's bytes
        if snapshot.side_windows:  # the windows taken since the last look (INV-39)
            self.checks.run("INV-39", snapshot)
            self.side_windows.clear()
        self.reads.clear()  # judged: the next snapshot carries the reads since

    def finish(self) -> None:
        """Release every live request, run to idle, take what is ready: nothing stays held."""
        for rid in sorted(self.live):
            self.run_until_idle()
            self.check_progress(rid)
            self.release(rid)
        self.run_until_idle()
        self.storage.close()
