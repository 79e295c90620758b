"""Timing perturbation for a real device: seeded spin kernels before stream work.

On a GPU the harness cannot choose when a copy finishes, so it makes the timing vary instead: a
spin kernel of random length (``torch.cuda._sleep(cycles)`` on CUDA) is queued on the stream
right before a launched copy or kernel, and on the stream a machine ``advance`` step names. A
missing event wait then lets a consumer run before its producer, and the harness's byte checks
(forward reads, ack drains, quiescence; freed pages are poisoned) see the wrong bytes.

In flow order:

- ``Perturbation``: the recorded parameters (probability, spin length range); a trace header
  holds them, so a replay draws the same schedule;
- ``PerturbationSchedule``: one seeded RNG per world (the case's config seed plus the
  parameters); the k-th perturbation site draws the k-th decision, and every decision is logged;
  with ``paces`` each stream also runs at one pace for the whole world (``StreamPace``: quiet,
  as drawn, or slow), so a world explores one stream running far ahead of another;
- ``PerturbedDevice``: the campaign device over a real ``DeviceModule`` (``HarnessDevice``'s
  surface: ``default_stream`` is the forward stream, ``advance`` perturbs, ``is_idle`` queries
  every stream, ``run_until_idle`` synchronizes).

Nothing here imports torch.cuda: the spin is a callable, so the schedule is tested on the CPU
with a fake (``tests/device/test_perturb.py``) and bound to ``torch.cuda._sleep`` in
``device/cuda.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator

from hicache_ref.device.protocol import DeviceModule, EventT, OpKind, StreamT

PERTURB_LOG_BOUND = 1_000_000
"""Upper bound on logged decisions per world; more means a runaway case (TigerStyle)."""

PERTURBED_KINDS: frozenset[OpKind] = frozenset({"copy", "kernel"})
"""Launches that get a spin before them: transfers and compute (KV stores, reads, poison)."""


class Perturbation(BaseModel):
    """The parameters of a perturbation schedule (recorded in a trace header)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    probability: float = 0.5
    """Chance that a perturbation site gets a spin."""
    cycles_min: int = 4_096
    cycles_max: int = 8_388_608
    """Spin lengths are log-uniform in [cycles_min, cycles_max] GPU clock cycles (about 2 us to
    4 ms at 2 GHz): long enough to outlast the host's next steps, short enough to keep a case
    in milliseconds."""
    paces: bool = False
    """Each stream of a world draws one ``StreamPace`` (seeded by the world's seed and the
    stream's role) and keeps it: a quiet stream never spins, a slow one spins at every site
    from the upper half of the range. Independent spins rarely keep one stream behind another
    for several steps; a missing wait between them needs exactly that (the per-thread
    priorities of probabilistic concurrency testing). Campaigns turn it on
    (``DEFAULT_PERTURBATION``); off, as in traces recorded before it existed, every stream
    spins alike."""

    @model_validator(mode="after")
    def _check(self) -> Perturbation:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability={self.probability} must be in [0, 1]")
        if not 1 <= self.cycles_min <= self.cycles_max:
            raise ValueError(
                f"spin cycles [{self.cycles_min}, {self.cycles_max}] must satisfy "
                "1 <= cycles_min <= cycles_max"
            )
        return self

    def describe(self) -> str:
        paces = ", stream paces" if self.paces else ""
        return f"p={self.probability:g} spins {self.cycles_min}..{self.cycles_max} cycles{paces}"


DEFAULT_PERTURBATION = Perturbation(paces=True)
"""What a GPU campaign perturbs with unless told otherwise (``--spins`` keeps the paces)."""

StreamPace = Literal["quiet", "as drawn", "slow"]
STREAM_PACES: tuple[StreamPace, ...] = ("quiet", "as drawn", "slow")


@dataclass(frozen=True)
class SpinDecision:
    """One perturbation site: where it was and how long a spin it got (0: none)."""

    index: int
    site: str
    cycles: int


class PerturbationSchedule:
    """Seeded spin decisions: the k-th site draws the k-th decision (two RNG draws each)."""

    def __init__(self, seed: int, perturbation: Perturbation = DEFAULT_PERTURBATION) -> None:
        self.seed = seed
        self.perturbation = perturbation
        p = perturbation
        self._rng = random.Random(
            f"hicache-perturb/{seed}/{p.probability}/{p.cycles_min}/{p.cycles_max}"
        )
        self.log: list[SpinDecision] = []
        self.paces: dict[str, StreamPace] = {}
        """Each stream role's pace, drawn when the role is first seen (with ``paces``)."""

    def pace(self, role: str) -> StreamPace:
        """The pace of the stream ``role`` in this world: its own seeded draw, so it does not
        depend on the order streams are first seen."""
        if not self.perturbation.paces:
            return "as drawn"
        known = self.paces.get(role)
        if known is not None:
            return known
        pace = random.Random(f"hicache-pace/{self.seed}/{role}").choice(STREAM_PACES)
        self.paces[role] = pace
        return pace

    def draw(self, site: str, role: str = "") -> int:
        """The spin length for the next site on stream ``role`` (0: no spin), logged."""
        p = self.perturbation
        # always consume two draws, so a site's decision depends only on how many came before
        hit, length = self._rng.random(), self._rng.random()
        pace = self.pace(role)
        low, high = math.log(p.cycles_min), math.log(p.cycles_max)
        if pace == "slow":
            hit, low = 0.0, (low + high) / 2
        cycles = 0
        if hit < p.probability and pace != "quiet":
            cycles = min(
                p.cycles_max, max(p.cycles_min, round(math.exp(low + length * (high - low))))
            )
        if len(self.log) >= PERTURB_LOG_BOUND:
            raise RuntimeError(
                f"perturbation log holds {PERTURB_LOG_BOUND} decisions; a case this long is a "
                "runaway (bound the machine's step count)"
            )
        self.log.append(SpinDecision(len(self.log), site, cycles))
        return cycles

    def spins(self) -> list[tuple[str, int]]:
        """The sites that got a spin, in order (what a replay must reproduce)."""
        return [(d.site, d.cycles) for d in self.log if d.cycles]


Spin = Callable[[int], None]
"""Queue a spin of ``cycles`` on the current stream (``torch.cuda._sleep`` on CUDA)."""


class PerturbedDevice:
    """A real ``DeviceModule`` with seeded spins before stream work: a ``HarnessDevice``.

    Streams and events are the base device's own objects (the controller and upstream's code
    hand them to torch directly); the forward stream is ``default_stream``, which the caller
    makes the base's current stream.
    """

    def __init__(
        self,
        base: DeviceModule,
        schedule: PerturbationSchedule,
        spin: Spin,
        forward_stream: StreamT,
    ) -> None:
        self.base = base
        self.name = base.name
        self.device: torch.device = base.device
        self.pin_memory = base.pin_memory
        self.schedule = schedule
        self._spin = spin
        self.default_stream = forward_stream
        self._streams: list[StreamT] = [forward_stream]

    # -- torch.cuda surface ----------------------------------------------------------------------
    def Event(self, enable_timing: bool = False) -> EventT:
        return self.base.Event(enable_timing)

    def Stream(self) -> StreamT:
        stream = self.base.Stream()
        self._streams.append(stream)
        return stream

    def stream(self, stream: StreamT) -> AbstractContextManager[object]:
        return self.base.stream(stream)

    def current_stream(self) -> StreamT:
        return self.base.current_stream()

    def synchronize(self) -> None:
        self.base.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: StreamT) -> None:
        self.base.record_stream(tensor, stream)

    def launch(
        self,
        fn: Callable[[], None],
        *,
        label: str,
        kind: OpKind = "copy",
        meta: dict[str, object] | None = None,
    ) -> None:
        """A spin (maybe) on the current stream, then the work itself, queued behind it."""
        if kind in PERTURBED_KINDS:
            self._perturb_current(f"{kind} {label}")
        self.base.launch(fn, label=label, kind=kind, meta=meta)

    # -- the harness's surface -------------------------------------------------------------------
    def advance(self, stream: StreamT, n: int = 1) -> int:
        """A real stream runs by itself: ``advance`` only perturbs it (a spin, maybe, queued
        there); it runs no op, so it returns 0."""
        assert n >= 0, f"advance(n={n}): n must be >= 0"
        with self.base.stream(stream):
            self._perturb_current(f"advance {n}")
        return 0

    def advance_to_record(self, stream: StreamT) -> int:
        """As ``advance``: a real stream reaches its records by itself; only a spin is queued."""
        return self.advance(stream, 1)

    def is_idle(self) -> bool:
        """Whether every stream of this world has finished its queued work (``query``)."""
        return all(stream.query() for stream in self._streams)

    def run_until_idle(self) -> None:
        self.base.synchronize()

    @property
    def streams(self) -> tuple[StreamT, ...]:
        return tuple(self._streams)

    # -- internals -------------------------------------------------------------------------------
    def _role(self, stream: StreamT) -> str:
        """``forward``, or ``stream<k>`` for the k-th stream this world created (in a
        controller's order: its write stream, then its load stream, per rank)."""
        for index, known in enumerate(self._streams):
            if known is stream or known == stream:
                return "forward" if index == 0 else f"stream{index}"
        return "foreign"

    def _perturb_current(self, what: str) -> None:
        role = self._role(self.current_stream())
        cycles = self.schedule.draw(f"{role}: {what}", role)
        if cycles:
            self._spin(cycles)
