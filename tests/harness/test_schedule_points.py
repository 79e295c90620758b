"""Schedule points reach every storage thread of every implementation the gate drives storage for.

One story per implementation (the reference, upstream 0.5.10 and 0.5.23, the seed fork): a
chain goes to L3 and comes back, one thread kind granted per step, on two ranks. After every
grant the test asks each rank where each thread parks (the gate's own record), and shows that
every thread parked at its wait for work, at each backend call it makes, at each put on a
control queue and at its collectives, at the return of a deferred call, at each look at an
operation's termination under its lock, and the IO before each host page it writes. Then the
story's
trace, schedule steps and drawn outcomes included, replays bit-for-bit: the same outcome text at
every step, without Hypothesis, on a fresh world.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from hicache_ref.controller.storage.records import STEP_KINDS
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.adapters.reference import ReferenceImplementation
from hicache_ref.harness.adapters.sglang_gate import GatedEvent, GatedLock
from hicache_ref.harness.driver.storage_points import position
from hicache_ref.harness.schedule.gate import GatedThread, StepGate
from hicache_ref.harness.schedule.points import Grant
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step, Trace, TraceHeader
from hicache_ref.harness.world.config import HarnessConfig

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("HICACHE_SHARED_DIR", REPO.parent / "shared"))
SEED_FILE = SHARED / "seeds" / "cache_controller_seed_reindented.py.txt"
STORY_STEPS_MAX = 24  # grants per thread kind before a story gives up (a body has fewer)


def implementation(name: str, monkeypatch: pytest.MonkeyPatch) -> Implementation:
    from hicache_ref.harness.adapters.sglang import SeedImplementation, SglangImplementation
    from hicache_ref.harness.adapters.sglang_tree import fetch_wheel_tree

    if name == "reference":
        return ReferenceImplementation()
    if name == "seed":
        if not SEED_FILE.is_file():
            pytest.skip(f"the seed's re-indented controller {SEED_FILE} is absent")
        monkeypatch.setenv("HICACHE_SEED_FILE", str(SEED_FILE))
        monkeypatch.delenv("HICACHE_SGLANG_SRC", raising=False)
        return SeedImplementation()
    return SglangImplementation(fetch_wheel_tree(name))


class Story:
    """A session whose steps are kept, with where every thread parked after each."""

    def __init__(self, impl: Implementation, name: str) -> None:
        config = HarnessConfig(
            host_pages=24,
            storage_ranks=2,
            storage_batch_pages=1,
            storage_points=True,
            storage_page_points=True,
            storage_lock_points=True,
        )
        self.config = impl.refine_config(config)
        self.session = Session(self.config, impl, name)
        self.steps: list[Step] = []
        self.texts: list[str] = []
        self.parked: dict[str, set[str]] = {}

    def apply(self, rule: str, **args: object) -> str:
        step = Step(rule=rule, args=args)  # type: ignore[arg-type]
        outcome = self.session.apply(step)
        assert not outcome.skipped, (rule, args, outcome)
        self.steps.append(step)
        self.texts.append(outcome.text)
        storage = self.session.storage
        assert storage is not None
        for tier in storage.l3.tiers:
            for kind in STEP_KINDS:
                at = position(tier, kind)
                if at is not None:
                    self.parked.setdefault(kind.value, set()).add(at.kind)
        return outcome.text

    def run(self, kind: str, defer: bool = False) -> None:
        """Grant the ``kind`` threads until their loop bodies end (a deferred first call)."""
        storage = self.session.storage
        assert storage is not None
        for _ in range(STORY_STEPS_MAX):
            runnable = [k.value for k in storage.runnable()]
            if kind not in runnable:
                return
            if defer and self.apply_defer(kind):
                defer = False
                continue
            self.apply("storage_step", kind=kind)
        raise AssertionError(f"the {kind} threads did not finish in {STORY_STEPS_MAX} grants")

    def round_trip(self) -> None:
        """A chain of two pages (one per batch) to L3 and back, every thread kind granted to
        the end of its bodies, the first backend call of the backup and of the IO deferred."""
        self.apply("write_storage", pick=1, new=True)
        self.run("backup", defer=True)
        self.apply("drain_backup_acks")
        self.apply("prefetch", pick=0)
        self.run("hit_query")
        self.apply("drain_prefetch_acks")
        self.run("io", defer=True)
        self.run("sync")
        self.apply("drain_prefetch_acks")
        self.session.finish()

    def apply_defer(self, kind: str) -> bool:
        from hicache_ref.harness.rules.schedule import SCHEDULE_POINT

        args = {"thread": kind, "outcome": "defer", "rank": 0, "at": 0}
        if SCHEDULE_POINT.why_not(self.session, args) is not None:
            return False
        self.apply("schedule_point", **args)
        return True


@pytest.mark.parametrize("name", ["reference", "0.5.10", "0.5.23", "seed"])
def test_every_storage_thread_parks_at_every_kind_of_point(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    story = Story(implementation(name, monkeypatch), name)
    story.round_trip()

    has_sync = "sync" in story.parked  # 0.5.10 and the seed have no sync thread
    expected = {
        "backup": {"wait", "batch_set", "return", "put"},
        # the reference's and 0.5.23's hit query look at termination under the operation's lock
        "hit_query": {"wait", "batch_exists", "all_reduce", "put"}
        | ({"lock"} if name in ("reference", "0.5.23") else set()),
        # every IO takes the operation's lock between batches (is_terminated; upstream's
        # increment too) and parks before each host page it writes (page points)
        "io": {"wait", "batch_get", "return", "page_write", "lock"}
        | ({"put"} if has_sync else set()),
    }
    if has_sync:
        expected["sync"] = {"wait", "all_reduce", "put"}
    for kind, points in expected.items():
        assert points <= story.parked[kind], (kind, story.parked[kind])
    assert has_sync == (name in ("reference", "0.5.23"))

    # the trace, with its schedule steps and drawn outcomes, replays bit-for-bit
    again = Story(implementation(name, monkeypatch), name)
    for step in story.steps:
        again.apply(step.rule, **step.args)
    again.session.finish()
    assert again.texts == story.texts
    if name == "reference":  # and through the trace file, as a failure's replay line runs it
        trace = Trace(header=TraceHeader(config=story.config), steps=tuple(story.steps))
        assert not replay(Trace.from_jsonl(trace.to_jsonl())).failed


class Operation:
    """Stands for upstream's ``PrefetchOperation``: a lock and an event made in its ``__init__``
    from the ``threading`` the harness hands the tree's module."""

    def __init__(self) -> None:
        self._lock = GatedLock()
        self.done = GatedEvent()


def test_a_storage_thread_parks_at_each_lock_acquire_and_event_set_and_wait() -> None:
    """No storage thread of 0.5.10 or 0.5.23 sets or waits an event inside its loop body today,
    so the stories above never meet an ``event`` point: this thread does, on the same gate."""
    stop = threading.Event()
    gate = StepGate(stop.is_set, points=True)
    op = Operation()

    def body() -> None:
        with op._lock:
            pass
        op.done.set()
        op.done.wait(0)

    thread = GatedThread(target=body, gate=gate, function="io", daemon=True)
    thread.start()
    gate.settle()
    parked = []
    while thread.is_alive() and gate.positions("io"):
        parked.append(gate.positions("io")[0][1].describe())
        gate.resume(thread, Grant(), "io")
    thread.join(5)
    assert parked == [
        "lock Operation._lock",
        "event Operation.event set",
        "event Operation.event wait",
    ]
    assert [g.point for g in gate.grants] == parked  # the harness's record names each point
    # a thread the gate does not know (the tree's) passes every one of them at once
    with op._lock:
        op.done.wait(0)


def test_a_grant_wakes_only_the_thread_granted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four threads parked at points; twenty grants to one of them. Each grant wakes that
    thread alone: the other three never return from their wait (one shared condition woke all
    four at every grant and every park, and three went back to sleep each time)."""
    stop = threading.Event()
    gate = StepGate(stop.is_set, points=True)
    woken: dict[str, int] = {}
    wait = threading.Condition.wait

    def counted_wait(self: threading.Condition, timeout: float | None = None) -> bool:
        got = wait(self, timeout)
        name = threading.current_thread().name
        woken[name] = woken.get(name, 0) + 1
        return got

    def body() -> None:
        thread = threading.current_thread()
        assert isinstance(thread, GatedThread)
        for _ in range(20):
            gate.park_point(thread, "put", "ack")

    threads = [
        GatedThread(target=body, gate=gate, function=f"f{i}", name=f"t{i}", daemon=True)
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    gate.settle()
    monkeypatch.setattr(threading.Condition, "wait", counted_wait)
    for _ in range(20):
        gate.resume(threads[0], Grant(), "f0")
    monkeypatch.undo()
    # t0's first wake returns from a wait entered before the count began
    assert woken.get("t0") == 19 and not any(woken.get(f"t{i}") for i in (1, 2, 3)), woken
    stop.set()
    gate.close()  # the world is gone: every parked thread is woken and sees the stop
    for thread in threads:
        threading.Thread.join(thread, 0.5)  # well inside the threads' poll (1 s)
    assert not any(t.is_alive() for t in threads)


def test_a_joined_thread_leaves_its_park_without_waiting_for_its_poll() -> None:
    """A stopped thread its stopper joins is woken by the join, not by its poll (1 s)."""
    import time

    from hicache_ref.harness.schedule.gate import PARK_POLL_S

    stop = threading.Event()
    gate = StepGate(stop.is_set, points=True)
    thread = GatedThread(
        target=lambda: gate.park_wait(threading.current_thread(), "queue"),  # type: ignore[arg-type]
        gate=gate,
        function="backup",
        daemon=True,
    )
    thread.start()
    gate.settle()
    stop.set()
    started = time.monotonic()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - started < PARK_POLL_S / 2


EXIT_SCRIPT = """
import atexit, threading
def count_alive():  # registered first, so it runs after the gate's own exit handler
    alive = [t for t in threading.enumerate() if t.name.startswith("parked-")]
    print("alive at exit:", len(alive), flush=True)
atexit.register(count_alive)
import torch
from hicache_ref.harness.schedule.gate import GatedThread, StepGate
gate = StepGate(lambda: False, points=True)
def body():
    held = torch.zeros(1024)  # freed by the unwind: torch code on the way out
    gate.park_point(threading.current_thread(), "put", "never granted")
    held.add_(1)
threads = [
    GatedThread(target=body, gate=gate, function="io", name=f"parked-{i}", daemon=True)
    for i in range(32)
]
for thread in threads:
    thread.start()
gate.settle()
print("parked:", len(gate.positions("io")), flush=True)
"""


def test_at_exit_every_parked_storage_thread_unwinds_before_the_interpreter_finalizes() -> None:
    """A storage thread left parked (a case that never closed its world, a mutant that forgets
    its threads) must not be running when the interpreter finalizes: a daemon thread that then
    takes the GIL inside torch's C++ aborts the process after every test passed. The gate's exit
    handler unwinds each parked thread and joins it."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "parked: 32" in done.stdout and "alive at exit: 0" in done.stdout, done.stdout


ONE_CORE_REPLAY = """
import json, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, before torch starts threads
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace
result = replay(Trace.read(sys.argv[1]))
print(json.dumps({"cores": len(os.sched_getaffinity(0)), "outcomes": list(result.outcomes),
                  "failed": result.failed}))
"""


def test_a_trace_with_schedule_steps_replays_alike_on_one_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grants, not the host, decide what a trace does: the reference's story (two ranks,
    page and lock points, deferred calls) replays in a process pinned to one core with the same
    outcome text at every step as in this one."""
    import json
    import subprocess
    import sys

    story = Story(implementation("reference", monkeypatch), "reference")
    story.round_trip()
    trace = Trace(header=TraceHeader(config=story.config), steps=tuple(story.steps))
    path = tmp_path / "story.jsonl"
    path.write_text(trace.to_jsonl())
    here = replay(Trace.read(path))
    done = subprocess.run(
        [sys.executable, "-c", ONE_CORE_REPLAY, str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there["cores"] == 1 and not there["failed"] and not here.failed
    assert there["outcomes"] == list(here.outcomes) == story.texts
