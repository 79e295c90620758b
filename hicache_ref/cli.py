"""``hicache-fuzz``: run campaigns, replay and minimize traces, and check the mutant catalogue.

hicache-fuzz run                      # default campaign: reference controller, SimDevice
hicache-fuzz run --impl mutant:extra_write_ack --seconds 30 --json report.json
hicache-fuzz replay fuzz/out/failure-reference.jsonl
hicache-fuzz minimize TRACE -o fuzz/corpus/my_finding.jsonl
hicache-fuzz mutants                  # every seeded mutant must be caught
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import run_state_machine_as_test

from hicache_ref.harness import machine as machine_module
from hicache_ref.harness.machine import machine_for
from hicache_ref.harness.profiles import make_settings
from hicache_ref.harness.adapters.registry import get_implementation, list_mutants
from hicache_ref.harness.replay import minimize, replay
from hicache_ref.harness.session import Session
from hicache_ref.harness.trace import Trace


@dataclass
class CampaignReport:
    implementation: str
    profile: str
    seed: int
    seconds: float = 0.0
    rounds: int = 0
    cases: int = 0
    steps: int = 0
    skipped_steps: int = 0
    invariant_checks: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    configs: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, str]] = field(default_factory=list)

    def absorb(self, session: Session) -> None:
        self.cases += 1
        self.steps += session.stats.steps
        self.skipped_steps += session.stats.skipped
        self.invariant_checks += session.stats.invariant_checks
        self.rules.update(session.stats.rules)
        self.configs[session.config.describe().split(" alloc=")[0]] += 1

    def as_json(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "profile": self.profile,
            "seed": self.seed,
            "seconds": round(self.seconds, 2),
            "rounds": self.rounds,
            "cases": self.cases,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "invariant_checks": self.invariant_checks,
            "steps_per_second": round(self.steps / self.seconds, 1) if self.seconds else 0.0,
            "rules": dict(sorted(self.rules.items())),
            "distinct_configs": len(self.configs),
            "failures": self.failures,
        }

    def render(self) -> str:
        lines = [
            f"hicache-fuzz: {self.implementation} on SimDevice, profile {self.profile}, seed {self.seed}",
            f"  {self.cases} cases, {self.steps} steps ({self.skipped_steps} skipped) in "
            f"{self.seconds:.1f}s = {self.steps / max(self.seconds, 1e-9):.0f} steps/s; "
            f"{self.invariant_checks} invariant checks; {len(self.configs)} distinct configs",
            "  rules hit: " + ", ".join(f"{k}={v}" for k, v in sorted(self.rules.items())),
        ]
        if self.failures:
            lines.append(f"  FAILURES: {len(self.failures)}")
            for failure in self.failures:
                lines.append(f"    {failure['error']}")
                lines.append(f"    replay: hicache-fuzz replay {failure['trace']}")
        else:
            lines.append("  failures: none")
        return "\n".join(lines)


def run_campaign(
    impl: str,
    *,
    seconds: float,
    profile: str,
    seed: int,
    out_dir: Path,
    examples_per_round: int | None = None,
    stop_on_failure: bool = True,
    progress: bool = True,
    minimize_failures: bool = True,
    shrink: bool = True,
) -> CampaignReport:
    """Run rounds of the state machine until ``seconds`` pass (or a failure, by default)."""
    implementation = get_implementation(impl)
    machine_class = machine_for(implementation, impl)
    report = CampaignReport(impl, profile, seed)
    machine_module.STATS_SINKS.append(report.absorb)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    bar = _progress_bar(seconds, progress)
    import os

    os.environ[machine_module.FAILURE_DIR_ENV] = str(out_dir)
    per_round = examples_per_round or (10 if profile != "campaign" else 50)
    try:
        while time.monotonic() - start < seconds:
            round_seed = seed + report.rounds
            seeded = hypothesis_seed(round_seed)(machine_class)
            machine_module.LAST_FAILURE.clear()
            try:
                run_state_machine_as_test(
                    seeded,
                    settings=make_settings(
                        profile, shrink=shrink, max_examples=per_round, derandomize=False
                    ),
                )
            except Exception as exc:  # a found bug: record it, keep its trace
                report.failures.append(
                    _record_failure(exc, out_dir, impl, round_seed, minimize_failures)
                )
                if stop_on_failure:
                    break
            finally:
                report.rounds += 1
                elapsed = time.monotonic() - start
                if bar is not None:
                    bar.n = min(seconds, round(elapsed, 1))
                    bar.set_postfix(
                        cases=report.cases, steps=report.steps, failures=len(report.failures)
                    )
                    bar.refresh()
    finally:
        machine_module.STATS_SINKS.remove(report.absorb)
        if bar is not None:
            bar.close()
    report.seconds = time.monotonic() - start
    return report


def _record_failure(
    exc: BaseException, out_dir: Path, impl: str, round_seed: int, do_minimize: bool
) -> dict[str, str]:
    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    last = machine_module.LAST_FAILURE.get("path")
    record = {"error": error, "seed": str(round_seed), "trace": ""}
    if last is None:
        return record
    stamp = f"{impl.replace(':', '-')}-seed{round_seed}"
    kept = out_dir / f"failure-{stamp}.jsonl"
    shutil.copyfile(last, kept)
    record["trace"] = str(kept)
    if do_minimize:
        small = minimize(Trace.read(kept), max_replays=1000)
        small_path = small.write(out_dir / f"failure-{stamp}-min.jsonl")
        record["trace"] = str(small_path)
        record["steps"] = str(len(small.steps))
    return record


def _progress_bar(total: float, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; without it the campaign still runs
        return None
    return tqdm(
        total=total,
        unit="s",
        desc="fuzzing",
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}",
    )


def cmd_run(args: argparse.Namespace) -> int:
    report = run_campaign(
        args.impl,
        seconds=args.seconds,
        profile=args.profile,
        seed=args.seed,
        out_dir=Path(args.out),
        stop_on_failure=not args.keep_going,
        progress=not args.no_progress,
        shrink=args.hypothesis_shrink,
    )
    print(report.render())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=2) + "\n")
        print(f"  report: {args.json}")
    return 1 if report.failures else 0


def cmd_replay(args: argparse.Namespace) -> int:
    trace = Trace.read(Path(args.trace))
    result = replay(trace, implementation=args.impl)
    for step, outcome in zip(trace.steps, result.outcomes, strict=False):
        print(f"  {step.render():<48} -> {outcome}")
    if result.error is not None:
        print(
            f"FAILED after {result.steps_applied} step(s): {type(result.error).__name__}: {result.error}"
        )
        return 1
    print(
        f"passed: {len(trace.steps)} step(s) and the quiescence checks ({trace.header.config.describe()})"
    )
    return 0


def cmd_minimize(args: argparse.Namespace) -> int:
    trace = Trace.read(Path(args.trace))
    small = minimize(trace, implementation=args.impl)
    path = small.write(Path(args.output))
    print(f"minimized {len(trace.steps)} -> {len(small.steps)} steps: {path}")
    return 0


def cmd_mutants(args: argparse.Namespace) -> int:
    names = args.names or list_mutants()
    missed = []
    for name in names:
        report = run_campaign(
            f"mutant:{name}",
            seconds=args.seconds,
            profile=args.profile,
            seed=args.seed,
            out_dir=Path(args.out),
            progress=False,
            minimize_failures=True,
            shrink=False,
        )
        status = "caught" if report.failures else "MISSED"
        detail = ""
        if report.failures:
            first = report.failures[0]
            detail = f"{first.get('steps', '?')} steps  {first['error'][:70]}"
        print(f"{status:7} {name:34} {report.cases:5} cases {report.seconds:6.1f}s  {detail}")
        if not report.failures:
            missed.append(name)
    print(f"{len(names) - len(missed)}/{len(names)} mutants caught")
    return 1 if missed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hicache-fuzz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run a fuzz campaign and print a summary")
    run.add_argument("--impl", default="reference", help="reference | mutant:<name>")
    run.add_argument("--seconds", type=float, default=60.0)
    run.add_argument("--profile", default="ci", choices=["ci", "dev", "campaign"])
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", default="fuzz/out", help="where failing traces are written")
    run.add_argument("--json", help="write a machine-readable report here")
    run.add_argument("--keep-going", action="store_true", help="do not stop at the first failure")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument(
        "--hypothesis-shrink",
        action="store_true",
        help="also let Hypothesis shrink failures (can take minutes; ddmin always runs after)",
    )
    run.set_defaults(func=cmd_run)
    rep = sub.add_parser("replay", help="replay a trace without Hypothesis")
    rep.add_argument("trace")
    rep.add_argument("--impl", default=None, help="override the trace's implementation")
    rep.set_defaults(func=cmd_replay)
    mini = sub.add_parser("minimize", help="delta-debug a failing trace to fewer steps")
    mini.add_argument("trace")
    mini.add_argument("-o", "--output", required=True)
    mini.add_argument("--impl", default=None)
    mini.set_defaults(func=cmd_minimize)
    mut = sub.add_parser("mutants", help="check that every seeded mutant is caught")
    mut.add_argument("names", nargs="*")
    mut.add_argument("--seconds", type=float, default=20.0)
    mut.add_argument("--profile", default="ci", choices=["ci", "dev", "campaign"])
    mut.add_argument("--seed", type=int, default=0)
    mut.add_argument("--out", default="fuzz/out")
    mut.set_defaults(func=cmd_mutants)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        args = parser.parse_args(["run", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
