"""Workers: one campaign per process, each on its own seed lane, merged into one report.

``plan_workers`` gives every worker its lane (``shards.py``) and the campaign settings they
share; ``run_fleet`` runs one in this process, or spawns one process per worker (``spawn``: a
fresh interpreter, never a fork of a process holding torch threads or a CUDA context) and
merges their reports (``merge.py``). Nothing crosses between processes while they fuzz: each
worker builds its own worlds (on ``cuda`` its own streams on the shared GPU), opens its own
database connection, keeps its own traces, and sends at most one progress ``Snapshot`` a
second and its report at the end. A worker that finds a new failure sets the fleet's ``stop``
event (unless ``--keep-going``), and the others end after their current round.

Ctrl-C, SIGINT or SIGTERM (``campaign/interrupts.py``): the workers start with both held back
(a signal mask, inherited through exec, so a signal to the process group while they import can
neither kill them half-started nor be lost); each then takes either as the end of its campaign,
and ignores both once its campaign has ended and its report is on the way. The fleet sets ``interrupt`` (seen between
rounds), sends SIGINT to each worker still running (seen between steps) every ``RESEND_S``,
stops a worker that had not started its campaign after ``UNSTARTED_GRACE_S`` (it has nothing to
report), and waits ``INTERRUPT_GRACE_S`` for the others' reports; a second signal stops
waiting. A worker stopped early is a part with no cases, so the merged report still says which
seeds ran.
"""

from __future__ import annotations

import os
import queue as queue_module
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from hicache_ref.campaign.interrupts import (
    EitherSet,
    Interrupt,
    catching_stop_signals,
    ignore_stop_signals,
    noting_stop_signals,
    stop_signals_blocked,
    unblock_stop_signals,
)
from hicache_ref.campaign.report import CampaignReport
from hicache_ref.campaign.rounds import CampaignSignals
from hicache_ref.campaign.run import MINIMIZE_REPLAYS_MAX, run_campaign
from hicache_ref.device.perturb import Perturbation
from hicache_ref.errors import HiCacheInputError, HiCacheSetupError
from hicache_ref.fleet.database import DatabaseSpec
from hicache_ref.fleet.merge import merge_reports
from hicache_ref.fleet.progress import ProgressView, get_snapshot
from hicache_ref.fleet.shards import SeedLane, Shard, get_lanes
from hicache_ref.harness.campaigns.known_findings import KnownFinding

INTERRUPT_GRACE_S = 6.0
"""How long the fleet waits for its workers' reports after Ctrl-C (a worker stops between two
steps, well within it; one that does not is stopped and its part is empty)."""
UNSTARTED_GRACE_S = 1.5
"""How long the fleet waits, after Ctrl-C, for a worker that had not started its campaign."""
RESEND_S = 1.0
"""After Ctrl-C, SIGINT again to each worker still running this often (one may be lost)."""
SNAPSHOT_INTERVAL_S = 1.0
POLL_S = 0.5
LOST_AFTER_S = 3.0
"""A worker that exited this long ago without a report is lost (its last message would have
arrived by then)."""


def get_default_workers() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class WorkerTask:
    """Everything one worker needs (picklable: it crosses into the worker's process)."""

    impl: str
    lane: SeedLane
    seconds: float
    profile: str
    out_dir: str
    stop_on_failure: bool = True
    shrink: bool = False
    known: tuple[KnownFinding, ...] = ()
    device: str = "sim"
    perturbation: Perturbation | None = None
    database: DatabaseSpec | None = None
    examples_per_round: int | None = None
    rounds_max: int | None = None
    cases_max: int | None = None
    """The case budget (``--max-cases``): this worker stops after that many cases."""
    minimize_replays: int = MINIMIZE_REPLAYS_MAX
    """ddmin's replay budget per new failure (0: keep the trace as it failed)."""
    source: str = ""
    """The sglang tree a ``sglang``/``seed`` implementation reads (``--sglang-src``)."""
    coverage: bool = False
    """Measure the implementation's code as it runs (``campaign/coverage.py``)."""
    live_report: str = ""
    """The page ``live_report.py`` rewrites while the fleet runs (empty: none)."""
    report_every_s: float = 10.0


def plan_workers(
    impl: str, *, seed: int, shard: Shard, workers: int, **common: Any
) -> list[WorkerTask]:
    """One task per worker of this runner, each on its own lane."""
    return [WorkerTask(impl, lane=lane, **common) for lane in get_lanes(seed, shard, workers)]


def run_worker(
    task: WorkerTask,
    *,
    signals: CampaignSignals | None = None,
    view: ProgressView | None = None,
    on_round: Any = None,
    on_case: Any = None,
) -> CampaignReport:
    """One worker's campaign, in this process; its report names its place in the fleet."""
    database = task.database.open() if task.database is not None else None
    report = run_campaign(
        task.impl,
        seconds=task.seconds,
        profile=task.profile,
        seed=task.lane.first,
        seed_stride=task.lane.stride,
        out_dir=Path(task.out_dir),
        examples_per_round=task.examples_per_round,
        stop_on_failure=task.stop_on_failure,
        progress=False,
        shrink=task.shrink,
        known=task.known,
        device=task.device,
        perturbation=task.perturbation,
        database=database,
        signals=signals,
        on_round=on_round if on_round is not None else (view.on_round if view else None),
        rounds_max=task.rounds_max,
        cases_max=task.cases_max,
        minimize_replays=task.minimize_replays,
        source=task.source,
        coverage=task.coverage,
        on_case=on_case,
    )
    report.worker, report.workers = task.lane.worker, task.lane.workers
    report.shard = task.lane.shard.label
    for failure in report.failures:
        failure.update(worker=task.lane.worker, shard=report.shard)
    return report


def run_fleet(
    tasks: list[WorkerTask], view: ProgressView | None = None, interrupt: Interrupt | None = None
) -> CampaignReport:
    """Run every task (in this process when there is one) and merge their reports; with a
    ``live_report`` its page is rewritten as they run and once more at the end.

    ``interrupt``: what this process's stop-signal handler sets (``catching_stop_signals``);
    a campaign in this process treats an error after it as no finding."""
    assert tasks, "a fleet needs a worker"
    from hicache_ref.fleet.live_report import open_live_report

    first = tasks[0]
    live = open_live_report(
        first.live_report, first.report_every_s, first.impl, first.profile, first.lane.first
    )
    try:
        if len(tasks) == 1:
            signals = CampaignSignals(interrupt or Interrupt(), threading.Event())
            on_case = live.on_case if live is not None else None
            report = run_worker(tasks[0], view=view, signals=signals, on_case=on_case)
        else:
            report = _Fleet(tasks, view, interrupt or Interrupt(), live).run()
    except BaseException:
        if live is not None:
            live.abandon()  # no page may say RUNNING for a campaign that is gone
        raise
    if live is not None:
        live.finish(report)
    return report


# -- the worker process --------------------------------------------------------------------------
def _worker_main(task: WorkerTask, messages: Any, interrupt: Any, stop: Any) -> None:
    """A spawned worker: SIGINT or SIGTERM ends its campaign, torch keeps to one thread, then
    run."""
    local = Interrupt()
    try:
        with catching_stop_signals(local):
            signals = CampaignSignals(EitherSet(interrupt, local), stop)
            run_and_report(task, messages, signals, ending=ignore_stop_signals, prepare=_prepare)
    finally:  # the process exits next (joining its queue's feeder thread): no signal cuts that
        ignore_stop_signals()


def _prepare() -> None:
    """Take the stop signals held back since the worker started (one sent meanwhile arrives
    now, at its handler), and keep torch to one thread: N processes on N cores, no intra-op
    threads fighting them."""
    unblock_stop_signals()
    import torch

    torch.set_num_threads(1)


def run_and_report(
    task: WorkerTask,
    messages: Any,
    signals: CampaignSignals,
    ending: Callable[[], object] | None = None,
    prepare: Callable[[], object] | None = None,
) -> None:
    """A worker's campaign, then one final message: its report, an input error's one line, or
    a bug's traceback (``messages.put`` of ``(kind, worker, payload)``). ``prepare`` runs
    first; ``ending`` runs once the campaign is past its last round (interrupted, or done): the
    spawned worker ignores SIGINT and SIGTERM from there on, so its wrap-up and its report get
    out whole. Whatever goes wrong once a stop signal arrived (an import cut in half, a world
    half-built) is that signal's doing: the part says interrupted, never a crash."""
    worker = task.lane.worker
    sent = [0.0, time.monotonic()]  # the last progress snapshot, the last live report

    def on_round(report: CampaignReport, elapsed_s: float) -> None:
        if ending is not None and signals.interrupt.is_set():
            ending()  # the rounds loop stops at its next check: nothing left to interrupt
        now = time.monotonic()
        if now - sent[0] >= SNAPSHOT_INTERVAL_S:
            sent[0] = now
            messages.put(("progress", worker, get_snapshot(report, elapsed_s)))

    def on_case(report: CampaignReport, elapsed_s: float) -> None:
        """After each case: the report so far for the live page, every ``report_every_s``."""
        if time.monotonic() - sent[1] >= task.report_every_s:
            sent[1] = time.monotonic()
            partial = {**report.as_json(), "seconds": round(elapsed_s, 2)}  # still running
            messages.put(("partial", worker, partial))

    try:
        if prepare is not None:
            prepare()
        messages.put(("started", worker, None))
        live = on_case if task.live_report else None
        report = run_worker(task, signals=signals, on_round=on_round, on_case=live)
        if ending is not None:
            ending()
        messages.put(("done", worker, report))
    except KeyboardInterrupt:  # before its campaign began: nothing ran, and its part says so
        if ending is not None:
            ending()
        messages.put(("done", worker, _report_of_nothing(task)))
    except BaseException as exc:
        if signals.interrupt.is_set():  # the signal cut something in half: no finding, no bug
            if ending is not None:
                ending()
            messages.put(("done", worker, _report_of_nothing(task)))
        elif isinstance(exc, HiCacheInputError):  # a setup problem: the one line the CLI prints
            messages.put(("input_error", worker, str(exc)))
        else:
            messages.put(("crash", worker, traceback.format_exc()))


def _report_of_nothing(task: WorkerTask) -> CampaignReport:
    """The part of a worker stopped before its campaign began (a Ctrl-C while it set up):
    no case ran, but the merged report still has one part per worker, with its seeds."""
    report = CampaignReport(
        task.impl, task.profile, task.lane.first, device=task.device, interrupted=True
    )
    report.seed_stride = task.lane.stride
    report.worker, report.workers = task.lane.worker, task.lane.workers
    report.shard = task.lane.shard.label
    return report


# -- the fleet ----------------------------------------------------------------------------------
class _Fleet:
    """Spawned workers and what the parent hears from them."""

    def __init__(
        self,
        tasks: list[WorkerTask],
        view: ProgressView | None,
        received: Interrupt,
        live: Any = None,
    ) -> None:
        self.tasks = tasks
        self.view = view
        self.received = received  # this process's stop signals, noted while it waits
        self.live = live
        context = get_context("spawn")
        self.messages = context.Queue()
        self.interrupt = context.Event()
        self.stop = context.Event()
        self.processes = [
            context.Process(
                target=_worker_main,
                args=(task, self.messages, self.interrupt, self.stop),
                name=f"hicache-fuzz-worker-{task.lane.worker}",
            )
            for task in tasks
        ]
        self.reports: dict[int, CampaignReport] = {}
        self.pending = {task.lane.worker for task in tasks}
        self.started: set[int] = set()
        self.dead_since: dict[int, float] = {}
        self.lost: list[str] = []
        self.error: str | None = None
        self.grace_until: float | None = None
        self.forwarded_at = 0.0

    def run(self) -> CampaignReport:
        seen = self.received.count
        try:
            # noted, never raised: not while a child is half-started, nor inside a queue's lock
            with noting_stop_signals(self.received):
                with stop_signals_blocked():  # the children hold them until they can take them
                    for process in self.processes:
                        process.start()
                self._collect(seen)
        finally:
            self._reap()
        return self._result()

    def _collect(self, seen: int) -> None:
        """Messages until every worker reported; ``seen``: stop signals before the fleet began."""
        while self.pending:
            if self.received.count > seen:  # a stop signal since the last poll
                if self.grace_until is not None:
                    return  # a second one: stop waiting for the rest
                seen = self.received.count
                self._interrupt()
            if not self._step():
                return

    def _step(self) -> bool:
        """Handle one message (or a quiet poll); False when waiting is over."""
        if self.grace_until is not None:
            if time.monotonic() > self.grace_until:
                return False
            if time.monotonic() - self.forwarded_at >= RESEND_S:
                self._forward_interrupt()
            if time.monotonic() > self.grace_until - INTERRUPT_GRACE_S + UNSTARTED_GRACE_S:
                self._drop_unstarted()
        try:
            kind, worker, payload = self.messages.get(timeout=POLL_S)
        except queue_module.Empty:
            self._notice_dead()
            return True
        if kind == "progress":
            if self.view is not None:
                self.view.update(worker, payload)
        elif kind == "partial":
            if self.live is not None:
                self.live.update(worker, payload)
        elif kind == "started":
            self._on_started(worker)
        elif kind == "done":
            self.reports[worker] = payload
            self.pending.discard(worker)
        elif kind == "interrupted":
            self.pending.discard(worker)
        else:  # input_error or crash: stop the others, keep the first
            self.error = self.error or f"{kind}\n{payload}"
            self.pending.discard(worker)
            self.stop.set()
            return False
        return True

    def _on_started(self, worker: int) -> None:
        self.started.add(worker)
        if len(self.started) == len(self.tasks) and self.view is not None:
            self.view.say(f"hicache-fuzz: all {len(self.tasks)} workers running")

    def _interrupt(self) -> None:
        self.interrupt.set()
        self.grace_until = time.monotonic() + INTERRUPT_GRACE_S
        self._forward_interrupt()

    def _forward_interrupt(self) -> None:
        """SIGINT to every worker that has not reported yet (it ends its campaign there)."""
        self.forwarded_at = time.monotonic()
        for task, process in zip(self.tasks, self.processes, strict=True):
            if task.lane.worker in self.pending and process.is_alive() and process.pid:
                try:
                    os.kill(process.pid, signal.SIGINT)
                except ProcessLookupError:  # it exited in between
                    pass

    def _drop_unstarted(self) -> None:
        """After Ctrl-C, a worker still starting up has run nothing: stop it, its part empty."""
        for task, process in zip(self.tasks, self.processes, strict=True):
            worker = task.lane.worker
            if worker in self.pending and worker not in self.started:
                self.pending.discard(worker)
                self.reports[worker] = _report_of_nothing(task)
                if process.is_alive():
                    process.kill()

    def _notice_dead(self) -> None:
        now = time.monotonic()
        for task, process in zip(self.tasks, self.processes, strict=True):
            worker = task.lane.worker
            if worker not in self.pending or process.is_alive():
                continue
            since = self.dead_since.setdefault(worker, now)
            if now - since > LOST_AFTER_S:
                self.pending.discard(worker)
                self.lost.append(
                    f"worker {worker} exited (code {process.exitcode}) before it reported"
                )

    def _reap(self) -> None:
        for process in self.processes:
            process.join(timeout=5.0 if self.error is None else 0.5)
            if process.is_alive():  # it ignores SIGTERM once its report is out: kill it
                process.kill()
                process.join(timeout=5.0)
        self.messages.close()
        self.messages.cancel_join_thread()

    def _result(self) -> CampaignReport:
        if self.error is not None:
            kind, _, text = self.error.partition("\n")
            if kind == "input_error":
                raise HiCacheSetupError(text)
            raise RuntimeError(f"a worker crashed; its traceback:\n{text}")
        interrupted = self.interrupt.is_set()
        missing = [t.lane.worker for t in self.tasks if t.lane.worker not in self.reports]
        if missing and not interrupted:
            raise HiCacheSetupError(
                "; ".join(self.lost)
                or f"workers {missing} sent no report"
                + "; their rounds are lost, so the run proves nothing: run again"
            )
        if not self.reports:
            empty = CampaignReport(self.tasks[0].impl, self.tasks[0].profile, 0)
            empty.interrupted = True
            return empty
        merged = merge_reports([self.reports[w] for w in sorted(self.reports)])
        merged.interrupted = merged.interrupted or interrupted
        merged.workers = len(self.tasks)
        return merged
