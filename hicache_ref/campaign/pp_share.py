"""The PP gate's share of a gate: the one home of "a tree with ``storage:pp`` spends a share of
its budget on the PP gate", for ``hicache-fuzz gate`` and the release matrix alike.

PP worlds (0.5.21+'s PP prefetch tickets, capability ``storage:pp``) are not drawn by the state
machine: ``harness/campaigns/pp_gate.py`` drives them. A gate on such a tree spends
``PP_GATE_SHARE`` of its budget there, after the state machine's campaign, and only when that
campaign did not stop at a new failure (``--keep-going`` runs it anyway). In the order a gate
uses them:

- ``get_pp_share``: the share of the budget (0 on a tree without ``storage:pp``): the state
  machine's campaign gets the rest, of the time and of ``--max-cases`` alike
  (``budgets.split_cases``);
- ``gate_pp_share``: after that campaign, the PP gate for its share, its failure added to the
  campaign's report as a new failure (what ``gate`` and each matrix row call);
- ``run_pp_share``: the PP gate for its seconds; a failure's shrunk program is written under
  ``--out`` (``pp_program_file``), so it has one replay line like a trace;
- ``PpShare``: what ran and found (``as_json``: the ``pp_gate`` section of ``--json``;
  ``failure_record``: the new failure a gate report or matrix row carries; ``render``: the
  summary's line);
- ``replay_program``: ``hicache-fuzz replay`` of such a file, exit 0 passed, 1 failed.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache_ref.campaign.budgets import split_cases
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.base import STORAGE_PP_CAPABILITY, Implementation
from hicache_ref.harness.campaigns.known_findings import KnownFinding
from hicache_ref.invariant_titles import get_invariant_label
from hicache_ref.replay_lines import get_replay_line

if TYPE_CHECKING:
    from hicache_ref.campaign.report import CampaignReport
    from hicache_ref.harness.campaigns.pp_gate import PpGateReport, PpProgram

PP_GATE_SHARE = 0.2
"""A tree with 0.5.21+'s PP prefetch tickets (``storage:pp``) spends this share of its budget on
the PP gate: PP worlds are not drawn by the state machine."""
PP_GATE = "PP gate"
"""The invariant a PP failure is filed under when no check fired (upstream's code raised)."""
EXIT_OK, EXIT_FAILED = 0, 1


def get_pp_share(capabilities: Collection[str]) -> float:
    """``PP_GATE_SHARE`` for a tree with ``storage:pp``, else 0."""
    return PP_GATE_SHARE if STORAGE_PP_CAPABILITY in capabilities else 0.0


@dataclass
class PpShare:
    """What the PP gate's share ran and found (``skipped``: why it did not run)."""

    seconds_budget: float
    cases_max: int | None = None  # its share of --max-cases (None: time alone)
    cases: int = 0
    checks: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    seed: int = 0
    invariant: str = ""
    error: str = ""
    program: str = ""
    ops: list[str] = field(default_factory=list)
    world: str = ""
    program_file: str = ""
    replay: str = ""
    flaky: bool = False
    interrupted: bool = False
    skipped: str = ""
    known_hits: dict[str, int] = field(default_factory=dict)  # cases a known finding explained
    worlds: dict[str, int] = field(default_factory=dict)  # cases per pool group (pp_gate.WORLDS)

    @property
    def failed(self) -> bool:
        return bool(self.error)

    def as_json(self) -> dict[str, Any]:
        return {
            "ran": not self.skipped,
            "skipped": self.skipped or None,
            "share": PP_GATE_SHARE,
            "budget_s": round(self.seconds_budget, 1),
            "cases_max": self.cases_max,
            "cases": self.cases,
            "checks": dict(sorted(self.checks.items())),
            "known_hits": dict(sorted(self.known_hits.items())),
            "worlds": self.world_shares(),
            "seconds": round(self.seconds, 1),
            "seed": self.seed,
            "passed": not self.failed and not self.interrupted and not self.skipped,
            "failure": self.failure_record() if self.failed else None,
            "interrupted": self.interrupted,
        }

    def world_shares(self) -> dict[str, float]:
        """Each pool group's share of the cases (anchor, sidecar, swa, mamba), to a hundredth."""
        from hicache_ref.harness.campaigns.pp_gate import WORLDS

        total = sum(self.worlds.values())
        return {w: round(self.worlds.get(w, 0) / total, 2) if total else 0.0 for w in WORLDS}

    def failure_record(self) -> dict[str, Any]:
        """The new failure, as a campaign report's ``failures`` holds one (its ``trace``: the
        program file, which ``hicache-fuzz replay`` reads)."""
        assert self.failed, "a PP share that passed has no failure record"
        return {
            "invariant": self.invariant,
            "error": self.error,
            "seed": str(self.seed),
            "steps": str(len(self.ops)),
            "trace": self.program_file,
            "replay": self.replay,
            "config": self.world,
            "program": self.ops,
            "flaky": self.flaky,
            "source": "pp gate",
        }

    def render(self) -> str:
        """``  PP gate (storage:pp, 20% of the budget): 41 cases in 12.0s (anchor 27%, sidecar
        24%, swa 24%, mamba 24%); INV-38=230`` (``41 of 80 cases`` under ``--max-cases``; the
        failure itself is the gate's NEW line)."""
        head = f"  PP gate ({STORAGE_PP_CAPABILITY}, {PP_GATE_SHARE:.0%} of the budget): "
        if self.skipped:
            return head + f"not run: {self.skipped}"
        checks = " ".join(f"{get_invariant_label(k)}={v}" for k, v in sorted(self.checks.items()))
        found = "; FAILED (below)" if self.failed else ""
        cut = "; INTERRUPTED" if self.interrupted else ""
        of = f" of {self.cases_max}" if self.cases_max is not None else ""  # --max-cases' share
        shares = ", ".join(f"{w} {share:.0%}" for w, share in self.world_shares().items())
        worlds = f" ({shares})" if self.cases else ""
        return (
            f"{head}{self.cases}{of} cases in {self.seconds:.1f}s{worlds}; "
            f"{checks or 'no checks'}{found}{cut}"
        )


def gate_pp_share(
    report: CampaignReport,
    implementation: Implementation,
    *,
    impl: str,
    budget_s: float,
    seed: int,
    out_dir: Path,
    keep_going: bool,
    known: Sequence[KnownFinding] = (),
    cases_max: int | None = None,
) -> PpShare | None:
    """The PP gate's share of a ``budget_s`` gate (and of its ``cases_max``, ``--max-cases``:
    ``budgets.split_cases``) whose state machine campaign ran the rest and wrote ``report``:
    None on a tree without ``storage:pp``; not run after a new failure (unless ``keep_going``)
    or an interrupt; its failure joins ``report.failures``, a Ctrl-C in it marks ``report``
    interrupted."""
    share = get_pp_share(implementation.capabilities)
    if not share:
        return None
    seconds = budget_s * share
    _, cases = split_cases(cases_max, share)
    if report.interrupted:
        skipped = "the gate was interrupted before it"
        return PpShare(seconds, cases_max=cases, seed=seed, skipped=skipped)
    if report.failures and not keep_going:
        skipped = "the gate stopped at its first new failure (--keep-going runs it)"
        return PpShare(seconds, cases_max=cases, seed=seed, skipped=skipped)
    pp = run_pp_share(
        implementation,
        impl=impl,
        seconds=seconds,
        seed=seed,
        out_dir=out_dir,
        known=known,
        release=report.release or None,
        cases_max=cases,
    )
    report.known_hits.update(pp.known_hits)  # the gate's known line counts the PP cases too
    report.interrupted = report.interrupted or pp.interrupted
    if pp.failed:
        report.failures.append(pp.failure_record())
    return pp


def run_pp_share(
    implementation: Implementation,
    *,
    impl: str,
    seconds: float,
    seed: int,
    out_dir: Path,
    known: Sequence[KnownFinding] = (),
    release: str | None = None,
    cases_max: int | None = None,
) -> PpShare:
    """The PP gate for ``seconds`` or ``cases_max`` programs, whichever ends first (shrinking a
    failure may take as long again); a failure's program is written under ``out_dir``. Ctrl-C
    ends it with ``interrupted`` set."""
    from hicache_ref.harness.campaigns.pp_gate import run_pp_gate

    assert seconds > 0, f"the PP gate needs a positive time, got {seconds}"
    share = PpShare(seconds, cases_max=cases_max, seed=seed)
    started = time.monotonic()
    try:
        pp = run_pp_gate(
            implementation,
            seconds=seconds,
            seed=seed,
            known=known,
            impl=impl,
            release=release,
            cases_max=cases_max,
        )
    except KeyboardInterrupt:  # the stop signal's handler raised it: no verdict, no finding
        share.interrupted = True
        share.seconds = time.monotonic() - started
        return share
    share.seconds = time.monotonic() - started
    share.cases, share.checks = pp.cases, dict(pp.checks)
    share.known_hits = dict(pp.known_hits)
    share.worlds = dict(pp.worlds)
    if pp.failed:
        _keep_program(share, pp, implementation, impl, out_dir)
    return share


def _keep_program(
    share: PpShare, pp: PpGateReport, implementation: Implementation, impl: str, out_dir: Path
) -> None:
    """File the failure and write its shrunk program where its replay line points."""
    from hicache_ref.harness.campaigns.pp_program_file import PpProgramHeader, write_program_file

    share.invariant = pp.failure_id or PP_GATE
    share.error = pp.failure.removeprefix(f"{pp.failure_id}: ") if pp.failure_id else pp.failure
    share.program, share.flaky = pp.program, pp.flaky
    found: PpProgram | None = pp.found
    assert found is not None, "a failed PP gate keeps its failing program"
    share.ops = [op.describe() for op in found.ops]
    share.world = f"PP world faults={found.faults} backend={found.backend} points={found.points}"
    header = PpProgramHeader(
        implementation=impl,
        source=implementation.source_tree,
        seed=share.seed,
        invariant=share.invariant,
        error=share.error[:300],
        flaky=pp.flaky,
    )
    path = write_program_file(out_dir, header, found)
    share.program_file, share.replay = str(path), get_replay_line(path, impl)


def replay_program(path_text: str, *, impl: str | None, sglang_src: str | None) -> int:
    """``hicache-fuzz replay`` of a PP program file: run it once on its implementation and tree
    (or ``impl`` / ``sglang_src``); exit 0 when every step and the finish pass, 1 on a failure."""
    from hicache_ref.campaign.cli_inputs import check_sglang_src
    from hicache_ref.harness.adapters.registry import checked_implementation
    from hicache_ref.harness.adapters.sglang_tree import recorded_tree
    from hicache_ref.harness.campaigns.pp_gate import run_program
    from hicache_ref.harness.campaigns.pp_program_file import read_program_file

    header, program = read_program_file(path_text)
    name = impl or header.implementation
    recorded = header.source if name == header.implementation else ""
    source = str(check_sglang_src(sglang_src)) if sglang_src else recorded_tree(recorded)
    implementation = checked_implementation(name, source)
    if STORAGE_PP_CAPABILITY not in implementation.capabilities:
        raise HiCacheInputError(
            f"implementation {name!r} cannot replay PP program {path_text}: it lacks "
            f"{STORAGE_PP_CAPABILITY} (0.5.21+'s PP prefetch tickets); pick a tree that has them"
        )
    print(f"  PP program ({len(program.ops)} steps): {program.describe()}")
    try:
        run_program(implementation, program, header.seed)
    except Exception as exc:  # an InvariantViolation names its id; upstream's raise is one too
        print(f"FAILED: {type(exc).__name__}: {' '.join(str(exc).split())}")
        return EXIT_FAILED
    flaky = "; the gate saw it fail once only (thread timing)" if header.flaky else ""
    print(f"passed: {len(program.ops)} PP step(s) and the finish (every ticket judged){flaky}")
    return EXIT_OK
