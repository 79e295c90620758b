"""The PP command threads of a PP world, stepped by the harness (``pp_tree.PpTree`` drives them).

Every PP rank's ``pp_prefetch_command_thread_func`` (0.5.23) runs on a gated thread: PP rank 0's
waits on its ``pp_prefetch_command_queue``, a follower's on its inbox of the command group's
broadcast (``sglang_world.PpBroadcast``). In the order a ticket meets them:

- ``bodies``: without schedule points, one whole loop body of every rank at once (their hit
  collective meets on the PP group within the step: a lockstep scope of the ``RankGroup``);
- ``point``: with points (the command threads park at their broadcast put,
  ``pp_prefetch_state_lock``, the backend query, the collective, the put on ``prefetch_buffer``;
  alone, ``StepGate.points_only``, unless the storage threads park too:
  ``pp_storage_threads``), one rank's thread to its next point; at the collective, every rank's
  at once; ``position`` / ``at_rest`` say where each waits;
- ``round``: with points, every point of the ticket in progress (or the next queued one), until
  every rank's thread waits again with nothing for it (INV-38 judges a body once it ended).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from hicache_ref.controller.storage.collectives import RankGroup
from hicache_ref.errors import HiCacheSetupError
from hicache_ref.harness.adapters.sglang_storage import PP_TICKET_FUNC
from hicache_ref.harness.adapters.sglang_world import PpBroadcast
from hicache_ref.harness.schedule.points import ALL_REDUCE, WAIT, Grant

ROUND_POINTS_MAX = 200
"""Points one ticket's round may take on all ranks together (a body has about ten)."""
TICKET_WAIT_S = 10.0
"""How long a command step waits for PP rank 0's broadcast to reach a follower's inbox."""
COMMAND = "pp_command"


class PpCommandThreads:
    """Every PP rank's command thread, and how the harness grants them."""

    def __init__(self, controllers: list[Any], broadcast: PpBroadcast, group: RankGroup) -> None:
        self.cc = controllers
        self.broadcast = broadcast
        self.group = group

    @property
    def source(self) -> Any:
        """PP rank 0's command queue (a reset makes a new one)."""
        return self.cc[0].pp_prefetch_command_queue

    def queued(self) -> bool:
        return any(item is not None for item in list(self.source.queue))

    def bodies(self) -> bool:
        """One loop body of every rank (False: no ticket was queued)."""
        if not self.queued():
            return False
        self._command_bodies(self.source)
        return True

    def round(self) -> bool:
        return self._command_round(self.queued())

    def _command_bodies(self, source: Any) -> None:
        """Each rank's whole loop body at once (its collective meets the other's)."""
        errors: list[BaseException | None] = [None] * len(self.cc)
        group = self.group

        def serve(rank: int) -> None:
            gate = self.cc[rank]._harness_gate
            try:
                if rank == 0:
                    gate.serve(source, COMMAND, rank)
                else:
                    self._await_broadcast(rank)
                    gate.serve(self.broadcast.inboxes[rank], COMMAND, rank)
            except BaseException as exc:  # re-raised below, on the caller's thread
                errors[rank] = exc
            finally:
                group.rank_finished(rank)

        group.begin_step()
        try:
            self._on_threads(serve, TICKET_WAIT_S + group.timeout_s)
        finally:
            group.end_step()
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _await_broadcast(self, rank: int) -> None:
        inbox = self.broadcast.inboxes[rank]
        deadline = time.monotonic() + TICKET_WAIT_S
        while inbox.empty() and time.monotonic() < deadline:
            time.sleep(0.001)

    def _on_threads(self, run: Callable[[int], None], timeout_s: float) -> None:
        threads = [
            threading.Thread(target=run, args=(rank,), name=f"pp-command-r{rank}", daemon=True)
            for rank in range(len(self.cc))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)

    # -- the command threads under schedule points -------------------------------------------------
    def position(self, rank: int) -> tuple[Any, Any] | None:
        """Where rank ``rank``'s command thread parks (mid-body first), or None."""
        at = self.cc[rank]._harness_gate.positions(PP_TICKET_FUNC)
        return next((a for a in at if a[1].kind != WAIT), at[0] if at else None)

    def at_rest(self, rank: int) -> bool:
        """The rank's command thread waits for its next ticket with none there for it."""
        at = self.position(rank)
        if at is None or at[1].kind != WAIT:
            return at is None
        return rank == 0 or self.broadcast.inboxes[rank].empty()

    def point(self, rank: int, *, start: bool = True) -> bool:
        """Rank ``rank``'s command thread to its next point (both ranks' at a collective);
        ``start``: rank 0 may take a new ticket. False: it cannot move now."""
        at = self.position(rank)
        if at is None:
            return False
        thread, where = at
        gate = self.cc[rank]._harness_gate
        if where.kind == WAIT:
            queue = self.source if rank == 0 else self.broadcast.inboxes[rank]
            if not any(item is not None for item in list(queue.queue)) or (rank == 0 and not start):
                return False
            gate.serve(queue, COMMAND, rank)
            return True
        if where.kind == ALL_REDUCE:
            return self._collective()
        gate.resume(thread, Grant(), COMMAND, rank)
        return True

    def _collective(self) -> bool:
        """Every rank's command thread parked at its collective: resume them all at once."""
        parked = [self.position(rank) for rank in range(len(self.cc))]
        if any(at is None or at[1].kind != ALL_REDUCE for at in parked):
            return False
        errors: list[BaseException | None] = [None] * len(self.cc)

        def resume(rank: int) -> None:
            at = parked[rank]
            assert at is not None
            try:
                self.cc[rank]._harness_gate.resume(at[0], Grant(), COMMAND, rank)
            except BaseException as exc:  # re-raised below, on the caller's thread
                errors[rank] = exc

        self._on_threads(resume, self.group.timeout_s + TICKET_WAIT_S)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return True

    def _command_round(self, queued: bool) -> bool:
        """Under points: finish every ticket in progress, starting the next queued one if none
        is; False when nothing moved."""
        moved = False
        if all(self.at_rest(rank) for rank in range(len(self.cc))):
            if not queued:
                return False
            moved = self.point(0)
        for _ in range(ROUND_POINTS_MAX):
            if all(self.at_rest(rank) for rank in range(len(self.cc))):
                return moved
            step = [self.point(rank, start=False) for rank in range(len(self.cc))]
            if not any(step):
                raise HiCacheSetupError("the PP command threads are stuck between points")
            moved = True
        raise HiCacheSetupError(f"a PP ticket took more than {ROUND_POINTS_MAX} points")
