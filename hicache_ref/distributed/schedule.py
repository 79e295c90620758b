"""The schedule every rank follows: a seeded configuration per case, and a seeded step program
that rank 0 draws from its own session (the ranks agree, so its candidates are everyone's).

``draw_cp_config`` picks a CP world the implementation supports. ``StepProgram`` draws, by
weight, among the atomic rule records (``rules.RULES``, each record's ``weight`` and ``draw``)
and the compound programs the Hypothesis machine uses too (``programs.PROGRAMS``: ``new_request``
keeps half the nodes within one page per rank, so zero-owned ranks are common; ``round_trip``:
write -> sync -> drain -> evict_device -> load -> start_loading -> reads while it loads -> part
of the H2D -> drain). A program yields one step at a time against rank 0's session as it is
after the steps before (a step the ranks left out by agreement is simply not there). Layer-end
hooks fire only inside ``forward_layer`` (after that layer's stores) and a layer is submitted
only once stored: a hook or submit ahead of the store would copy bytes never written, a fault of
the schedule and not of the implementation.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hicache_ref.harness.adapters.base import supports
from hicache_ref.harness.rules import RULES, STREAMS
from hicache_ref.harness.rules.load import DRAIN_ACKS
from hicache_ref.harness.rules.record import Param, RuleRecord, sample_params
from hicache_ref.harness.rules.reset import NOOP
from hicache_ref.harness.rules.streams import SYNCHRONIZE
from hicache_ref.harness.steps.programs import NEW_REQUEST, PROGRAMS, atomic_steps, step
from hicache_ref.harness.steps.session import Session
from hicache_ref.harness.steps.trace import Step
from hicache_ref.harness.world.config import LEGAL_LAYOUTS, MHA_ONLY_LAYOUTS, HarnessConfig

CONFIG_DRAWS_MAX = 200


def draw_cp_config(
    rng: random.Random, cp_size: int, capabilities: frozenset[str]
) -> HarnessConfig | None:
    """A CP configuration of ``cp_size`` ranks the implementation supports (None: none found)."""
    assert cp_size >= 1, f"cp_size must be >= 1, got {cp_size}"
    for _ in range(CONFIG_DRAWS_MAX):
        io_backend = rng.choice(["direct", "kernel"])
        layouts = [name for name in LEGAL_LAYOUTS[io_backend] if name not in MHA_ONLY_LAYOUTS]
        layer_num = rng.randint(1, 3)
        draft = max(0, rng.choice([0, 0, layer_num - 1, layer_num + 1]))
        config = HarnessConfig.model_validate(
            {
                "page_size": rng.choice([1, 2, 2, 4]),
                "layer_num": layer_num,
                "draft_layer_num": draft,
                "pool_kind": "nsa",
                "layout": rng.choice(layouts),
                "io_backend": io_backend,
                "cp_size": cp_size,
                "device_pages": rng.randint(2 * cp_size + 6, 2 * cp_size + 30),
                "host_pages": rng.randint(2, 24),
                "alloc_policy": rng.choice(["fifo", "lifo", "random"]),
                "draft_alloc_policy": rng.choice(["fifo", "lifo", "random"]),
                "draft_host_pages": rng.randint(1, 24) if draft else 0,
                "num_counters": rng.choice([2, 5]),
                "settle_records": rng.random() < 0.5,
                "copy_path": rng.choice(["gather", "runs"]),
                "hybrid": rng.random() < 0.2,
                "seed": rng.randint(0, 2**16),
            }
        )
        if supports(capabilities, config):
            return config
    return None


@dataclass(frozen=True)
class Entry:
    """Something the schedule draws by weight: an atomic record or a compound program."""

    name: str
    weight: int
    params: Mapping[str, Param]
    offered: Callable[[Session], bool]
    run: Callable[[Session, Mapping[str, Any]], Iterator[Step]]


def _atomic(record: RuleRecord) -> Entry:
    draw = record.draw
    assert draw is not None, f"rule {record.name} has a weight but no draw"
    return Entry(record.name, record.weight, draw.params, draw.offered, atomic_steps(record))


def schedule_entries(*, probes: bool = True) -> tuple[Entry, ...]:
    """Every record and program with a weight (misuse probes only with ``probes``)."""
    atomic = [_atomic(r) for r in RULES.values() if r.weight > 0 and (probes or not r.probe)]
    compound = [
        Entry(p.name, p.weight, p.params, p.offered, p.run) for p in PROGRAMS.values() if p.weight
    ]
    return (*atomic, *compound)


class StepProgram:
    """Rank 0's seeded program: ``next_step(session)`` is the next step, None when it ends."""

    def __init__(self, seed: int, steps_max: int, *, probes: bool = True) -> None:
        assert steps_max >= 1, f"a program needs at least one step, got {steps_max}"
        self.rng = random.Random(seed)
        self.entries = schedule_entries(probes=probes)
        self.weights = [entry.weight for entry in self.entries]
        self.steps_left = steps_max
        self.running: Iterator[Step] | None = None
        self.fallback = next(e for e in self.entries if e.name == NEW_REQUEST.name)

    def next_step(self, session: Session) -> Step | None:
        if self.steps_left <= 0:
            return None
        self.steps_left -= 1
        if self.running is not None:
            following = next(self.running, None)
            if following is not None:
                return following
            self.running = None
        return self._draw(session)

    def _draw(self, session: Session) -> Step:
        for _ in range(8):
            entry = self.rng.choices(self.entries, weights=self.weights)[0]
            first = self._start(session, entry)
            if first is not None:
                return first
        first = self._start(session, self.fallback)  # a prefill is always offered
        return first if first is not None else step(NOOP)

    def _start(self, session: Session, entry: Entry) -> Step | None:
        if not entry.offered(session):
            return None
        steps = entry.run(session, sample_params(entry.params, self.rng))
        first = next(steps, None)
        if first is not None:
            self.running = steps
        return first


def quiesce_steps() -> list[Step]:
    """What every case ends with before ``finish``: every stream run, then one agreed drain."""
    return [step(SYNCHRONIZE, stream=s) for s in STREAMS] + [step(DRAIN_ACKS)]
