"""A campaign's rounds: seeded runs of the state machine until the time is up, or a stop.

``run_rounds`` hands the machine this campaign's sink (``failures.CampaignSink``),
then runs round k with seed ``seed + k * seed_stride``: Hypothesis on a fresh seed, the
database's saved failures replayed in the first round only (``reuse``), each failure absorbed
(``failures.absorb_failure``), a timeline point and the ``on_round`` callback after
every round. It stops when the time is up (no case starts after it, so the last round ends at
the budget, between two cases: ``machine.CampaignTimeUp``), after ``cases_max`` cases (the case
budget, ``--max-cases``: the same cases on a busy host as on an idle one), at ``rounds_max``, at
the first new failure (unless it keeps going: then it also sets the fleet's ``stop``), when another worker set
``stop``, and at Ctrl-C, SIGINT or SIGTERM (``interrupt`` between rounds, ``KeyboardInterrupt`` between
steps; ``interrupts.py``): then the report says ``interrupted``, and an error the round raised
after the signal is not recorded (the signal may have cut a step in half).
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable
from hypothesis.stateful import run_state_machine_as_test

from hicache_ref.campaign.failures import (
    CampaignSink,
    FailureContext,
    absorb_failure,
    get_campaign_failure,
)
from hicache_ref.errors import HiCacheSetupError
from hicache_ref.fleet.database import get_source_key
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.campaigns.known_findings import KnownFinding
from hicache_ref.harness.campaigns.literal_pool import pinned_literal_pool
from hicache_ref.harness.campaigns.machine import CampaignTimeUp, machine_for
from hicache_ref.harness.campaigns.profiles import make_settings
from hicache_ref.harness.world.world import DeviceWorlds

if TYPE_CHECKING:
    from hicache_ref.campaign.report import CampaignReport
    from hicache_ref.fleet.database import CampaignDatabase


class EventLike(Protocol):
    """``threading.Event`` or ``multiprocessing.Event``: set by one party, seen by another."""

    def is_set(self) -> bool: ...

    def set(self) -> None: ...


@dataclass(frozen=True)
class CampaignSignals:
    """How a fleet steers a worker's campaign between rounds (``fleet/workers.py``)."""

    interrupt: EventLike
    """Ctrl-C, SIGINT or SIGTERM reached this process or its fleet: stop now and report what
    ran (``interrupted``); an error a round raises once it is set is no finding
    (``interrupts.py``)."""
    stop: EventLike
    """A worker found a new failure and the fleet stops at the first: stop, not interrupted."""


@dataclass(frozen=True)
class RoundPlan:
    """What every round of one campaign shares."""

    out_dir: Path
    examples_per_round: int
    stop_on_failure: bool
    minimize_replays: int
    shrink: bool
    known: Sequence[KnownFinding]
    database: CampaignDatabase | None
    signals: CampaignSignals | None
    on_round: Callable[[CampaignReport, float], None] | None
    rounds_max: int | None
    lockstep: bool = True
    """Whether the pure oracle follows every case (the profile's choice, ``profiles.py``)."""
    cases_max: int | None = None
    """The case budget (``--max-cases``): no case starts once this many ran (None: time alone)."""


def freeze_long_lived_objects() -> None:
    """Move every object alive now (torch's, Hypothesis', the modules') out of the collector's
    sight: a full collection then walks only what the cases allocate. Measured: the collector
    took 15-20% of a campaign's CPU walking ~190k objects that live as long as the process
    (``benchmarks/RESULTS.md``, the speed pass).

    Once per process: a frozen object is never collected, not even once it is unreachable, so
    freezing again at each campaign's start (a pytest process, the catalogue) froze the last
    campaign's leftovers (upstream's modules of its last world, say), and whatever dropped them
    later stayed for good. A 0.5.23 planted-bug gate run four times in one process grew RSS
    406, 524, 638, 752 MB that way; frozen once: 406, 427, 436, 443 MB, and each later start
    skips a collection of the last campaign's leftovers (0.34-0.45 s each). Thawing at each
    campaign's end instead kept RSS at ~530 MB but made each start's collection walk
    everything (0.55-1.59 s) (``benchmarks/RESULTS.md``, 2026-12-07)."""
    if gc.get_freeze_count():  # an earlier campaign of this process froze what lives long
        return
    gc.collect()
    gc.freeze()


def run_rounds(
    report: CampaignReport,
    implementation: Implementation,
    seconds: float,
    plan: RoundPlan,
    build: DeviceWorlds | None = None,
) -> None:
    """The campaign's rounds; ``build`` makes each case's world on the device
    ``run_campaign`` prepared (``world.open_device``; None: the simulator)."""
    out_dir = plan.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="hicache-fuzz-"))
    sink = CampaignSink(
        report, scratch, clock=lambda: time.monotonic() - start, known=tuple(plan.known)
    )

    def time_up() -> bool:
        """No further case starts once the time is up (a campaign's first case always runs):
        the last round ends at the budget, not a whole round later, and a fleet's workers end
        within a case of each other (the fleet lasts as long as its longest worker). The case
        budget ends it the same way, at the same case whatever the host's load."""
        return cases_spent() or (report.cases > 0 and time.monotonic() - start >= seconds)

    def cases_spent() -> bool:
        return plan.cases_max is not None and report.cases >= plan.cases_max

    machine_class = machine_for(
        implementation,
        report.implementation,
        sink,
        key=get_source_key(implementation),
        build=build,
        lockstep=plan.lockstep,
        pct=report.profile == "campaign",  # PCT's bias over the storage threads
        time_up=time_up,
    )
    report.sample(0.0)
    try:
        freeze_long_lived_objects()  # inside: a Ctrl-C during the collection still reports
        while time.monotonic() - start < seconds and not cases_spent():
            if plan.rounds_max is not None and report.rounds >= plan.rounds_max:
                break
            if plan.signals is not None and plan.signals.interrupt.is_set():
                report.interrupted = True
                break
            if plan.signals is not None and plan.signals.stop.is_set():
                break
            if _run_round(report, machine_class, sink, plan, time.monotonic() - start):
                if plan.signals is not None:
                    plan.signals.stop.set()
                break
    except CampaignTimeUp:
        pass  # the last round ended between two cases, at the budget
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        report.seconds = time.monotonic() - start
        report.sample(report.seconds, force=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _run_round(
    report: CampaignReport,
    machine_class: type[Any],
    sink: CampaignSink,
    plan: RoundPlan,
    started_s: float,
) -> bool:
    """One seeded round; True when it found a new failure and the campaign stops at the first."""
    round_seed = report.seed + report.rounds * report.seed_stride
    sink.last_failure = None
    sink.last_schedule = None
    settings = make_settings(
        report.profile,
        shrink=plan.shrink,
        max_examples=plan.examples_per_round,
        derandomize=False,
        database=plan.database.examples if plan.database is not None else None,
        reuse=report.rounds == 0,  # what any worker saved replays once, first
    )
    try:
        with pinned_literal_pool():  # the seed's programs, whatever this process imported
            run_state_machine_as_test(hypothesis_seed(round_seed)(machine_class), settings=settings)
    except HiCacheSetupError:
        raise  # the implementation cannot be built: no finding, a setup problem
    except Unsatisfiable as exc:
        raise HiCacheSetupError(
            f"implementation {report.implementation!r} supports no configuration the harness "
            f"draws (capabilities: {sorted(machine_class.implementation.capabilities)}); fix "
            "its capabilities"
        ) from exc
    except Exception as exc:  # a found bug: record it, keep its trace
        if plan.signals is not None and plan.signals.interrupt.is_set():
            # a signal cut a step short: what the case did next proves nothing
            raise KeyboardInterrupt from None
        context = FailureContext(
            out_dir=plan.out_dir,
            round_seed=round_seed,
            round_index=report.rounds,
            at_s=sink.clock(),
            last_failure=sink.last_failure,
            minimize_replays=plan.minimize_replays,
            save_trace=plan.database.save_trace if plan.database is not None else None,
            schedule=sink.last_schedule,
        )
        failure = get_campaign_failure(exc, sink.last_failure)
        is_new = absorb_failure(report, failure, context, plan.known)
        return is_new and plan.stop_on_failure
    finally:
        report.rounds += 1
        elapsed = sink.clock()
        report.sample(elapsed)
        if plan.on_round is not None:
            plan.on_round(report, elapsed)
    return False
