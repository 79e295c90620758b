"""The mutant catalogue: run every seeded mutant, in parallel, and say what caught each one.

run_catalogue -> one bounded campaign per mutant (``campaign.run_campaign``) -> ddmin the first
failure -> replay the minimized trace -> a ``MutantRow``: killed, seconds to the first failure,
shrunk length, the invariant that fired and whether it is one the mutant declares (``INVARIANTS``
in ``fuzz/mutants/<name>.py``). ``guards=False`` runs each mutant with the ``guards`` capability
off, as for upstream SGLang (the machine's misuse probes are then disabled); mutants with
``NEEDS_GUARDS = True`` are skipped there, since only a probe can see them.

``device="cuda"`` runs the catalogue on a GPU, one mutant after another in this process (one
device): a GPU campaign has no misuse probes, so ``NEEDS_GUARDS`` mutants are skipped, and so are
mutants built from the simulator's internals (their module holds ``device.sim`` objects such as
``SimEvent``), which cannot run on a real device.

A catalogue entry is a mutant file's name, or an outside mutant named ``pkg.module:factory``
(``--impl``): its module may declare ``INVARIANTS`` and ``NEEDS_GUARDS`` as a mutant file does
(without ``INVARIANTS`` any failure pins it).

The ``hicache-fuzz mutants`` subcommand is ``cli_mutants.py``.
"""

from __future__ import annotations

import importlib
import os
import re
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from hicache_ref.campaign.budgets import CASES_FLAG, check_cases_max
from hicache_ref.campaign.run import run_campaign
from hicache_ref.errors import UnknownOptionError
from hicache_ref.harness.adapters.mutant import unguarded_name
from hicache_ref.harness.adapters.registry import list_mutants, load_mutant_module
from hicache_ref.harness.campaigns.profiles import PROFILES
from hicache_ref.harness.steps.replay import minimize, replay
from hicache_ref.harness.steps.trace import Trace
from hicache_ref.harness.world.world import check_device_kind

SIM_MODULE = "hicache_ref.device.sim"

MINIMIZE_REPLAYS_MAX = 1000
CUDA_MINIMIZE_REPLAYS_MAX = 80
"""ddmin's replays on a GPU (each replay runs real copies and spins: ~0.1-1 s)."""
_INV_ID = re.compile(r"INV-\d\d")


@dataclass(frozen=True)
class MutantRow:
    """What one bounded campaign against one mutant found."""

    name: str
    killed: bool
    seconds_to_first_failure: float | None
    shrunk_length: int | None
    fired: str | None  # the minimized trace's failure: an invariant id, else the exception type
    declared: tuple[str, ...]
    needs_guards: bool
    cases: int
    campaign_seconds: float
    trace: str
    error: str

    @property
    def pinned(self) -> bool:
        """The failure is one the mutant declares (not a harness artefact or another bug); an
        outside mutant that declares nothing is pinned by any failure."""
        return self.killed and (self.fired in self.declared or not self.declared)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "declared": list(self.declared), "pinned": self.pinned}


@dataclass(frozen=True)
class CatalogueReport:
    """One row per mutant, in the order asked for."""

    rows: tuple[MutantRow, ...]
    profile: str
    seed: int
    guards: bool
    seconds: float
    skipped: tuple[str, ...] = ()  # NEEDS_GUARDS mutants left out of a guards-off run
    device: str = "sim"
    sim_only: tuple[str, ...] = ()  # mutants built from SimDevice internals, left out on cuda
    cases_max: int | None = None  # each mutant's case budget (--max-cases; None: time alone)

    @property
    def missed(self) -> list[str]:
        return [row.name for row in self.rows if not row.killed]

    @property
    def unpinned(self) -> list[str]:
        return [row.name for row in self.rows if row.killed and not row.pinned]

    @property
    def median_seconds_to_kill(self) -> float | None:
        """Median seconds to the first failure over the killed mutants (None if none died)."""
        times = [
            r.seconds_to_first_failure for r in self.rows if r.seconds_to_first_failure is not None
        ]
        return statistics.median(times) if times else None

    def is_clean(self) -> bool:
        return not self.missed and not self.unpinned

    def as_json(self) -> dict[str, Any]:
        median = self.median_seconds_to_kill
        return {
            "profile": self.profile,
            "seed": self.seed,
            "guards": self.guards,
            "seconds_per_mutant_max": self.seconds,
            "cases_per_mutant_max": self.cases_max,
            "mutants": len(self.rows),
            "killed": sum(row.killed for row in self.rows),
            "missed": self.missed,
            "unpinned": self.unpinned,
            "skipped_needs_guards": list(self.skipped),
            "device": self.device,
            "skipped_sim_only": list(self.sim_only),
            "median_seconds_to_kill": None if median is None else round(median, 2),
            "rows": [row.as_json() for row in self.rows],
        }

    def render(self) -> str:
        header = (
            f"{'mutant':36} {'status':8} {'s_kill':>7} {'steps':>5} {'fired':8} "
            f"{'declared':20} {'guards':6} cases"
        )
        lines = [
            f"hicache-fuzz mutants: profile {self.profile}, seed {self.seed}, up to "
            f"{self.seconds:g}s"
            + ("" if self.cases_max is None else f" or {self.cases_max} cases")
            + f" each, guards {'on' if self.guards else 'off'}, "
            f"device {self.device}",
            header,
            "-" * len(header),
        ]
        lines += [_render_row(row) for row in self.rows]
        if self.skipped:
            why = "guards off" if self.device == "sim" else "no probes on a GPU"
            lines.append(f"skipped (NEEDS_GUARDS, {why}): {', '.join(self.skipped)}")
        if self.sim_only:
            lines.append(f"skipped (built from SimDevice internals): {', '.join(self.sim_only)}")
        median = self.median_seconds_to_kill
        killed = sum(row.killed for row in self.rows)
        lines.append(
            f"{killed}/{len(self.rows)} mutants caught, {len(self.unpinned)} by an undeclared "
            f"check; median time to kill " + ("n/a" if median is None else f"{median:.2f}s")
        )
        return "\n".join(lines)


def _render_row(row: MutantRow) -> str:
    status = "MISSED" if not row.killed else ("caught" if row.pinned else "UNPINNED")
    kill = "-" if row.seconds_to_first_failure is None else f"{row.seconds_to_first_failure:.2f}"
    steps = "-" if row.shrunk_length is None else str(row.shrunk_length)
    return (
        f"{row.name:36} {status:8} {kill:>7} {steps:>5} {row.fired or '-':8} "
        f"{','.join(row.declared):20} {'needs' if row.needs_guards else '-':6} {row.cases}"
    )


# -- running ---------------------------------------------------------------------------------
def run_catalogue(
    names: list[str] | None = None,
    *,
    seconds: float,
    profile: str,
    seed: int,
    out_dir: Path,
    guards: bool = True,
    jobs: int | None = None,
    shrink: bool = True,
    device: str = "sim",
    cases_max: int | None = None,
) -> CatalogueReport:
    """Run a bounded campaign against each mutant (``jobs`` processes at once) and report.

    With ``guards=False`` the mutants that declare ``NEEDS_GUARDS = True`` are left out: with
    the probes disabled nothing can see them, by construction. ``shrink=False`` skips ddmin
    (``shrunk_length`` is then None); the invariant that fired is the same, since ddmin keeps
    only candidates that fail with the same signature. ``device="cuda"`` runs on the GPU, in
    this process (see the module docstring for what it leaves out). ``cases_max`` ends each
    mutant's campaign after that many cases (``--max-cases``), whichever of it and ``seconds``
    comes first: a fixed seed then searches the same cases on a busy host as on an idle one.
    """
    assert seconds > 0, f"seconds must be positive, got {seconds}"
    check_cases_max(CASES_FLAG, cases_max)
    if profile not in PROFILES:
        raise UnknownOptionError(f"unknown profile {profile!r}; legal: {', '.join(PROFILES)}")
    kind = check_device_kind(device)
    asked = list(names) if names else list_mutants()
    probes = guards and kind == "sim"  # a GPU campaign runs no misuse probes
    skipped = () if probes else tuple(name for name in asked if is_guard_mutant(name))
    sim_only = () if kind == "sim" else tuple(n for n in asked if is_sim_only_mutant(n))
    chosen = [name for name in asked if name not in skipped and name not in sim_only]
    assert jobs is None or jobs >= 1, f"jobs must be at least 1, got {jobs}"
    workers = max(1, min(jobs or os.cpu_count() or 1, len(chosen) or 1))
    if kind != "sim":
        workers = 1  # one GPU: the mutants take turns on it
    tasks = [
        (name, seconds, profile, seed, str(out_dir), guards, shrink, kind, cases_max)
        for name in chosen
    ]
    if workers == 1:
        rows = [_run_one(*task) for task in tasks]
    else:
        # spawn: a fresh interpreter per worker, never a fork of a process holding torch threads
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            rows = list(pool.map(_run_one, *zip(*tasks, strict=True)))
    return CatalogueReport(
        tuple(rows), profile, seed, guards, seconds, skipped, kind, sim_only, cases_max
    )


def declared_invariants(module: Any) -> tuple[str, ...]:
    """A mutant's ``INVARIANTS`` (or its single ``INVARIANT`` in an older mutant file)."""
    declared = getattr(module, "INVARIANTS", None)
    if declared is None:
        return (str(module.INVARIANT),)
    return tuple(str(inv_id) for inv_id in declared)


def is_outside(name: str) -> bool:
    """Whether a catalogue entry is an outside mutant (``pkg.module:factory``)."""
    return ":" in name


def mutant_module(name: str) -> Any:
    """The module that declares a catalogue entry: its mutant file, or an outside factory's."""
    if is_outside(name):
        return importlib.import_module(name.split(":", 1)[0])
    return load_mutant_module(name)


def is_guard_mutant(name: str) -> bool:
    """Whether the mutant is only about refusing misuse (``NEEDS_GUARDS = True``)."""
    return bool(getattr(mutant_module(name), "NEEDS_GUARDS", False))


def is_sim_only_mutant(name: str) -> bool:
    """Whether the mutant is built from SimDevice internals (it holds ``device.sim`` objects,
    e.g. a ``SimEvent`` subclass), so it cannot run on a real device."""
    module = mutant_module(name)
    return any(
        getattr(value, "__module__", "") == SIM_MODULE
        or any(
            getattr(base, "__module__", "") == SIM_MODULE for base in getattr(value, "__mro__", ())
        )
        for value in vars(module).values()
    )


def _run_one(
    name: str,
    seconds: float,
    profile: str,
    seed: int,
    out_dir: str,
    guards: bool,
    shrink: bool,
    device: str = "sim",
    cases_max: int | None = None,
) -> MutantRow:
    """One mutant: campaign, ddmin the first failure, replay it for the invariant that fired."""
    module = mutant_module(name)
    if guards:
        impl = name if is_outside(name) else f"mutant:{name}"
    else:
        impl = unguarded_name(name)
    report = run_campaign(
        impl,
        seconds=seconds,
        cases_max=cases_max,
        profile=profile,
        seed=seed,
        out_dir=Path(out_dir),
        progress=False,
        minimize_failures=False,
        shrink=False,
        device=device,
    )
    row = MutantRow(
        name=name,
        killed=bool(report.failures),
        seconds_to_first_failure=round(report.seconds, 3) if report.failures else None,
        shrunk_length=None,
        fired=None,
        declared=declared_invariants(module),
        needs_guards=bool(getattr(module, "NEEDS_GUARDS", False)),
        cases=report.cases,
        campaign_seconds=round(report.seconds, 3),
        trace="",
        error=report.failures[0]["error"] if report.failures else "",
    )
    if not report.failures or not report.failures[0]["trace"]:
        found = _INV_ID.search(row.error)
        return replace(row, fired=found.group(0) if found else None)
    path = Path(report.failures[0]["trace"])
    if not shrink:
        return replace(row, fired=replay(Trace.read(path)).signature(), trace=str(path))
    return _shrink(
        row, path, MINIMIZE_REPLAYS_MAX if device == "sim" else CUDA_MINIMIZE_REPLAYS_MAX
    )


def _shrink(row: MutantRow, path: Path, max_replays: int = MINIMIZE_REPLAYS_MAX) -> MutantRow:
    """ddmin the failing trace next to it (``failure-<impl>-seed<N>-min.jsonl``) and replay."""
    small = minimize(Trace.read(path), max_replays=max_replays)
    small_path = small.write(path.with_name(f"{path.stem}-min.jsonl"))
    result = replay(small)
    return replace(
        row, shrunk_length=len(small.steps), fired=result.signature(), trace=str(small_path)
    )
