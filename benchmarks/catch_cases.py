"""At which case a planted bug is caught: plant one bug of ``tests/harness/sglang_bugs.py`` in a
copy of a release and gate it (or PP-gate it), then print one JSON line with the cases.

    python benchmarks/catch_cases.py trailing_window_not_shrunk --release 0.5.23
    python benchmarks/catch_cases.py pp_release_frees_under_the_io --release 0.5.23 --pp

The gate runs as the planted-bug tests run it (``--profile ci --seed 0 --workers 1``), under a
case budget (``--max-cases``, default 9999) and a wall cap (``--budget``, default 900 s) it
should not meet. Run it on an idle host and under load (``python -c 'while True: pass' &``
four times): the same case at the catch says the gate's cases do not hang on the host's load
(``benchmarks/RESULTS.md``, the case budget).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hicache_ref.cli import main  # noqa: E402
from hicache_ref.harness.adapters.sglang_tree import SRC_ENV, fetch_wheel_tree, fork_tree  # noqa: E402

BUGS_FILE = ROOT / "tests" / "harness" / "sglang_bugs.py"


def load_bugs() -> ModuleType:
    """``tests/harness/sglang_bugs.py``, loaded by path (the tests are no package to import)."""
    spec = importlib.util.spec_from_file_location("hicache_sglang_bugs", BUGS_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def find_bug(name: str) -> Any:
    """The planted bug named ``name`` in any of the catalogue's tuples."""
    bugs = load_bugs()
    for value in vars(bugs).values():
        for bug in value if isinstance(value, tuple) else ():
            if getattr(bug, "NAME", None) == name:
                return bug
    raise SystemExit(f"no planted bug {name!r} in {BUGS_FILE}")


def gate_cases(tree: Path, scratch: Path, cases: int, budget: str) -> dict[str, Any]:
    """``hicache-fuzz gate`` on ``tree`` as the tests run it: the cases and where it failed."""
    report_path = scratch / "gate.json"
    argv = ["gate", "--impl", "sglang", "--sglang-src", str(tree), "--profile", "ci"]
    argv += ["--seed", "0", "--out", str(scratch / "out"), "--json", str(report_path)]
    argv += ["--no-progress", "--workers", "1", "--max-cases", str(cases), "--budget", budget]
    os.environ.pop(SRC_ENV, None)
    status = main(argv)
    report = json.loads(report_path.read_text())
    failure = report["failures"][0] if report["failures"] else {}
    pp = report.get("pp_gate") or {}
    return {
        "status": status,
        "cases": report["cases"],
        "steps": report["steps"],
        "rounds": report["rounds"],
        "seconds": report["seconds"],
        "failed": failure.get("invariant"),
        "round_seed": failure.get("seed"),
        "pp_cases": pp.get("cases"),
    }


def pp_cases(tree: Path, cases: int, seconds: float) -> dict[str, Any]:
    """``run_pp_gate`` on ``tree`` as the PP planted-bug tests run it."""
    from hicache_ref.harness.adapters.sglang import SglangImplementation
    from hicache_ref.harness.campaigns.pp_gate import run_pp_gate

    started = time.monotonic()
    report = run_pp_gate(SglangImplementation(tree), seconds=seconds, cases_max=cases)
    return {
        "cases_at_failure": report.cases_at_failure,
        "cases": report.cases,
        "failed": report.failure_id,
        "flaky": report.flaky,
        "seconds": round(time.monotonic() - started, 1),
    }


def main_catch() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bug", help="a planted bug's NAME (tests/harness/sglang_bugs.py)")
    parser.add_argument("--release", default="0.5.23")
    parser.add_argument("--pp", action="store_true", help="the PP gate alone (run_pp_gate)")
    parser.add_argument("--max-cases", type=int, default=9999)
    parser.add_argument("--budget", default="900s", help="the wall cap (default 900s)")
    args = parser.parse_args()
    bug = find_bug(args.bug)
    base = fetch_wheel_tree(args.release)
    scratch = Path(tempfile.mkdtemp(prefix="catch-cases-"))
    target = Path(bug.TARGET)
    tree = fork_tree(bug.write_patched(base / target, scratch / target.name), base, target)
    load = os.getloadavg()[0]
    if args.pp:
        found = pp_cases(tree, args.max_cases, float(args.budget.rstrip("s")))
    else:
        found = gate_cases(tree, scratch, args.max_cases, args.budget)
    print(json.dumps({"bug": args.bug, "release": args.release, "load_at_start": load, **found}))


if __name__ == "__main__":
    main_catch()
