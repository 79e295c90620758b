"""A cache-mode PP group's prefetch under the ``timeout`` stop policy: the ranks' verdicts.

A prefetch without a PP ticket (cache mode: no ``buffer_only`` command group) is polled by every
PP rank's ``check_prefetch_progress`` at once, and while it is not terminated each asks
``_can_terminate_prefetch``: under ``timeout`` PP rank 0 reads its own deadline and hands the
verdict along PP (``adapters/sglang_verdict``: upstream's methods from the tree, per rank). A
rank that terminated while another kept loading would insert a different span into its tree.
``PpVerdicts`` keeps one such prefetch per PP world beside the tickets, in flow order:

- ``open``: upstream's ``PrefetchOperation`` on every rank for the same request and span (1 - 4
  pages; its host slots reserved up front, as cache mode does), started on each rank's clock;
- ``poll``: the ranks' clocks move by different amounts (wall clocks differ), the harness's
  progress model lands a page now and then, then every rank's verdict, PP rank 0 first (its
  send precedes the follower's receive); a blocked poll starts each rank's wait
  (``_start_storage_prefetch_wait``), an agreed verdict to terminate ends the prefetch
  (``_mark_prefetch_deadline_expired``, ``mark_terminate``) and the next poll opens another;
- ``take_records``: the polls since the last look, each with the harness's own verdict (PP rank
  0's clock past its budget, its KV not all landed), for INV-38.

The operation's IO is the harness's model here, not the controller's threads: the verdict reads
only the operation's start, its pages and how many landed, which the model sets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hicache_ref.harness.adapters.sglang_verdict import (
    TIMEOUT_BASE_S,
    TIMEOUT_PER_PAGE_S,
    PpPipe,
    RankClock,
    RankVerdict,
    verdict_methods,
)
from hicache_ref.harness.driver.pp_world import RequestHandle
from hicache_ref.invariants.storage_snapshot import PpVerdictRecord

CLOCK_ORIGINS = (1000.0, 1037.0)
"""Each PP rank's wall clock when the world starts (they differ; only elapsed times matter)."""
STEP_S = 0.5
"""A poll moves a rank's clock by 0 - 3 of these (PP rank 0 and its follower by different
amounts), around budgets of 1.25 - 2 s (``TIMEOUT_BASE_S`` + 1 - 4 pages)."""
PAGES_MAX = 4
LANDS_FROM_PICK = 6
"""A poll whose pick is at least this lands one more page of the prefetch first."""


class PpVerdicts:
    """The cache-mode prefetch of a PP world and every rank's verdict on it (module doc)."""

    def __init__(self, tree: Path, hybrid: Any, page_size: int, ranks: int = 2) -> None:
        methods = verdict_methods(tree)
        self.hybrid, self.page = hybrid, page_size
        self.pipe = PpPipe()
        self.clocks = [RankClock(CLOCK_ORIGINS[r % len(CLOCK_ORIGINS)]) for r in range(ranks)]
        self.ranks: list[RankVerdict] = []
        if methods is not None:
            for index, clock in enumerate(self.clocks):
                verdict = RankVerdict(index, ranks, clock, self.pipe, page_size)
                verdict.bind(methods)
                self.ranks.append(verdict)
        self.operations: list[Any] = []  # per rank, while a prefetch is open
        self.opened = 0
        self.pages = self.landed = self.polls = 0
        self.started: list[float] = []  # each rank's clock when its deadline started
        self.records: list[PpVerdictRecord] = []

    @property
    def drives(self) -> bool:
        """The tree has the PP-rank-0 verdict (0.5.20+), so polls run it."""
        return bool(self.ranks)

    def open(self, pick: int) -> None:
        self.opened += 1
        rid = f"cache-{self.opened}"
        self.pages, self.landed, self.polls = 1 + pick % PAGES_MAX, 0, 0
        tokens = list(range(1, 1 + self.pages * self.page))
        self.operations = []
        for clock in self.clocks:
            operation = self.hybrid.PrefetchOperation(RequestHandle(rid), tokens)
            operation.start_time = clock.now  # the rank's own clock (its time.monotonic())
            operation.hash_value = [f"{rid}-p{p}" for p in range(self.pages)]
            operation.host_indices = torch.arange(self.pages * self.page)  # reserved up front
            operation.stats_requested_tokens = self.pages * self.page
            self.operations.append(operation)
        from_first_poll = self.ranks[0].waits_from_first_poll
        self.started = [] if from_first_poll else [c.now for c in self.clocks]

    def poll(self, pick: int) -> None:
        """Every rank's ``check_prefetch_progress`` on the open prefetch (opening one first)."""
        if not self.drives:
            return
        if not self.operations:
            self.open(pick)
        self.polls += 1
        self.clocks[0].advance(STEP_S * (pick % 4))
        for clock in self.clocks[1:]:
            clock.advance(STEP_S * ((pick + 2) % 4))
        if pick >= LANDS_FROM_PICK and self.landed < self.pages:
            self.landed += 1
        for operation in self.operations:
            operation.completed_tokens = self.landed * self.page
        passed = self._deadline_passed()
        verdicts = tuple(
            r.can_terminate(op) for r, op in zip(self.ranks, self.operations, strict=True)
        )
        elapsed = tuple(
            clock.now - start for clock, start in zip(self.clocks, self.started, strict=False)
        )
        self.records.append(
            PpVerdictRecord(self.operations[0].request_id, self.polls, verdicts, passed, elapsed)
        )
        if not any(verdicts):  # blocked: each rank starts its wait (0.5.23+), once
            if not self.started and self.ranks[0].waits_from_first_poll:
                self.started = [clock.now for clock in self.clocks]
            for rank, operation in zip(self.ranks, self.operations, strict=True):
                rank.start_wait(operation)
            return
        for rank, operation in zip(self.ranks, self.operations, strict=True):
            rank.mark_expired(operation)
            operation.mark_terminate()
        self.operations = []

    def _deadline_passed(self) -> bool:
        """The harness's verdict: PP rank 0's elapsed time past the budget, KV not all landed."""
        if not self.started:
            return False  # 0.5.23+: no blocked poll yet, so no deadline runs
        if self.ranks[0].waits_from_first_poll and self.landed >= self.pages:
            return False  # every KV page landed: cutting it would salvage nothing
        budget = TIMEOUT_BASE_S + self.pages * TIMEOUT_PER_PAGE_S
        return self.clocks[0].now - self.started[0] > budget

    def take_records(self) -> tuple[PpVerdictRecord, ...]:
        records, self.records = tuple(self.records), []
        return records
