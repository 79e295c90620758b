"""Time to detect stream-order bugs on a GPU: the CUDA campaign against mutants and planted bugs.

On a GPU the harness cannot choose when a copy finishes; the campaign queues seeded spins before
stream work (``hicache_ref/device/perturb.py``) so a missing happens-before shows as wrong bytes.
This script measures how fast that finds real stream-order bugs:

- seeded mutants whose bug is a missing or misplaced event (they run on any device):
  ``write_ack_on_current_stream``, ``load_ack_before_last_layer``, ``draft_read_without_wait``,
  and the three missing fences ``skip_load_fence``, ``skip_write_fence``,
  ``layer_backup_without_store_fence``;
- the ``STREAM_ORDER`` bugs planted in upstream sglang 0.5.10's controller
  (``tests/harness/sglang_bugs.py``), gated through ``--impl sglang`` with the patched file
  executed against the CUDA campaign device.

For each target: a CUDA campaign until the first failure (``--budget`` seconds at most) gives
the seconds to detect and the invariant that fired; a bounded ddmin of its trace gives the
shrunk length. The baselines (the reference, and upstream 0.5.10 unpatched with its known
findings baselined) run for the same budget first and must not fail: a failure there is a false
alarm of the GPU harness, and the script exits 1. It prints a markdown table and its command;
``--append benchmarks/RESULTS.md`` appends both. ``--deadline`` bounds the whole run.

    PYTHONPATH=. python benchmarks/cuda_detect.py --budget 40 --append benchmarks/RESULTS.md

The tree it plants bugs in is ``HICACHE_SGLANG_SRC`` when set, else the 0.5.10 release from the
cache. A GPU machine without network access fills the cache from a wheel or a tree first
(``hicache-fuzz setup --from sglang-0.5.10-py3-none-any.whl``), or gets the tree carried along:
here, run ``python benchmarks/cuda_detect.py --pack-tree .sglang_min`` (the four files the gate
executes, ~100 KB), carry ``.sglang_min`` and set ``HICACHE_CACHE_DIR=.sglang_min`` there.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hicache_ref.campaign.report import CampaignReport  # noqa: E402
from hicache_ref.campaign.run import run_campaign  # noqa: E402
from hicache_ref.device.perturb import DEFAULT_PERTURBATION  # noqa: E402
from hicache_ref.harness.adapters.registry import load_mutant_module  # noqa: E402
from hicache_ref.harness.adapters.sglang_tree import (  # noqa: E402
    CONTROLLER_RELPATH,
    SGLANG_VERSION,
    fetch_wheel_tree,
    fork_tree,
    resolve_tree,
)
from hicache_ref.harness.campaigns.known_findings import get_known_findings  # noqa: E402
from hicache_ref.harness.steps.replay import minimize, replay  # noqa: E402
from hicache_ref.harness.steps.trace import Trace  # noqa: E402

MUTANTS = (
    "write_ack_on_current_stream",
    "load_ack_before_last_layer",
    "draft_read_without_wait",
    "skip_load_fence",
    "skip_write_fence",
    "layer_backup_without_store_fence",
)
"""The catalogue's stream-order mutants; each runs on a GPU (the fence mutants drop a wait
through ``adapters.unfenced``, over the device's own events)."""
BUGS_FILE = ROOT / "tests" / "harness" / "sglang_bugs.py"
TREE_FILES = (
    "sglang/srt/environ.py",
    "sglang/srt/debug_utils/cuda_coredump.py",
    "sglang/srt/mem_cache/hicache_storage.py",
    str(CONTROLLER_RELPATH),
)
"""What the gate executes of a 0.5.10 tree (the rest of the controller's imports are stubs)."""
EXAMPLES_PER_ROUND = 5  # small rounds: the budget is checked between rounds
REPLAY_SECONDS_FOR_DDMIN = 20.0


@dataclass
class Row:
    target: str
    kind: str  # mutant | planted | baseline
    caught: bool
    seconds: float
    invariant: str
    declared: tuple[str, ...]
    shrunk_steps: int | None
    replayed: str
    cases: int
    trace: str
    error: str

    @property
    def pinned(self) -> bool:
        return self.caught and self.invariant in self.declared


def log(message: str) -> None:
    print(f"[cuda_detect {time.strftime('%H:%M:%S')}] {message}", flush=True)


def load_planted_bugs() -> list[Any]:
    """The ``STREAM_ORDER`` bugs of ``tests/harness/sglang_bugs.py`` (loaded by path)."""
    spec = importlib.util.spec_from_file_location("hicache_sglang_bugs", BUGS_FILE)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [bug for bug in module.BUGS if bug.STREAM_ORDER]


def pack_tree(into: Path) -> Path:
    """Write the files the gate executes of the 0.5.10 wheel under ``into/sglang-0.5.10``."""
    source = fetch_wheel_tree()
    target = into / f"sglang-{SGLANG_VERSION}"
    for relpath in TREE_FILES:
        dst = target / relpath
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / relpath, dst)
    return target


def run_target(
    target: str,
    kind: str,
    impl: str,
    declared: tuple[str, ...],
    args: argparse.Namespace,
    known: tuple[Any, ...] = (),
    source: str = "",
) -> Row:
    """One CUDA campaign until the first new failure, then a bounded ddmin and a replay."""
    log(f"{target}: campaign up to {args.budget:g}s ({impl})")
    report: CampaignReport = run_campaign(
        impl,
        seconds=args.budget,
        profile=args.profile,
        seed=args.seed,
        out_dir=Path(args.out) / target,
        examples_per_round=EXAMPLES_PER_ROUND,
        progress=False,
        minimize_failures=False,
        shrink=False,
        known=known,
        device="cuda",
        source=source,
    )
    row = Row(target, kind, bool(report.failures), round(report.seconds, 2), "-", declared,
              None, "-", report.cases, "", "")  # fmt: skip
    if report.known_hits:
        log(f"{target}: known findings hit {dict(report.known_hits)}")
    if not report.failures:
        log(f"{target}: nothing found in {report.seconds:.1f}s ({report.cases} cases)")
        return row
    failure = report.failures[0]
    row.invariant, row.error, row.trace = failure["invariant"], failure["error"], failure["trace"]
    log(f"{target}: {failure['invariant']} after {report.seconds:.1f}s: {failure['error'][:160]}")
    if row.trace:
        shrink(row, args)
    return row


def shrink(row: Row, args: argparse.Namespace) -> None:
    """ddmin with as many replays as fit ``REPLAY_SECONDS_FOR_DDMIN`` (at most --ddmin-replays)."""
    trace = Trace.read(Path(row.trace))
    started = time.monotonic()
    first = replay(trace)
    per_replay = max(time.monotonic() - started, 1e-3)
    budget = min(args.ddmin_replays, int(REPLAY_SECONDS_FOR_DDMIN / per_replay))
    log(f"{row.target}: replay -> {first.signature()} in {per_replay:.2f}s; ddmin {budget} replays")
    small = minimize(trace, max_replays=budget) if first.failed and budget > 0 else trace
    path = small.write(Path(row.trace).with_name(Path(row.trace).stem + "-min.jsonl"))
    row.trace, row.shrunk_steps = str(path), len(small.steps)
    row.replayed = replay(small).signature()
    log(f"{row.target}: {len(trace.steps)} -> {len(small.steps)} steps, replays {row.replayed}")


def planted_tree(bug: Any, base: Path, scratch: Path) -> str:
    """Plant ``bug`` in a copy of the base tree's controller: the tree ``--impl sglang`` reads."""
    patched = bug.write_patched(base / CONTROLLER_RELPATH, scratch / f"{bug.NAME}.py")
    return str(fork_tree(patched, base=base))


def render(rows: list[Row], args: argparse.Namespace, command: str, elapsed: float) -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    lines = [
        f"## CUDA campaign: time to detect stream-order bugs (benchmarks/cuda_detect.py), "
        f"{datetime.date.today().isoformat()}",
        "",
        f"Command: `{command}`",
        f"Machine: {gpu}, torch {torch.__version__}, Python {platform.python_version()}; "
        f"`{args.profile}` profile, seed {args.seed}, budget {args.budget:g}s per target, "
        f"perturbation {DEFAULT_PERTURBATION.describe()}; whole run {elapsed:.0f}s.",
        "",
        "| target | kind | result | s to detect | invariant fired (declared) | shrunk steps "
        "| min trace replays | cases |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.kind == "baseline":
            result = "FALSE ALARM" if r.caught else "clean"
        else:
            result = ("caught" if r.pinned else "caught (undeclared)") if r.caught else "missed"
        detect = f"{r.seconds:.1f}" if r.caught else f"> {r.seconds:.0f}"
        declared = ",".join(r.declared) or "-"
        steps = "-" if r.shrunk_steps is None else str(r.shrunk_steps)
        lines.append(
            f"| {r.target} | {r.kind} | {result} | {detect} | {r.invariant} ({declared}) "
            f"| {steps} | {r.replayed} | {r.cases} |"
        )
    caught = [r for r in rows if r.kind != "baseline" and r.caught]
    targets = [r for r in rows if r.kind != "baseline"]
    alarms = [r for r in rows if r.kind == "baseline" and r.caught]
    lines += [
        "",
        f"{len(caught)}/{len(targets)} targets caught; baselines: "
        + ("clean" if not alarms else f"FALSE ALARM in {', '.join(r.target for r in alarms)}"),
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=40.0, help="seconds per target")
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="fuzz/out/cuda_detect")
    parser.add_argument("--ddmin-replays", type=int, default=60)
    parser.add_argument("--deadline", type=float, default=450.0, help="seconds for the whole run")
    parser.add_argument("--targets", nargs="*", help="a subset of target names")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--append", metavar="FILE", help="append the table to this file")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    parser.add_argument(
        "--pack-tree", metavar="DIR", help="only write the minimal 0.5.10 tree under DIR"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.pack_tree:
        print(f"packed {pack_tree(Path(args.pack_tree))} (set HICACHE_CACHE_DIR={args.pack_tree})")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("cuda_detect: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    command = "PYTHONPATH=. python benchmarks/cuda_detect.py " + " ".join(sys.argv[1:])
    log(f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}; budget {args.budget:g}s")
    start = time.monotonic()
    base = resolve_tree()  # HICACHE_SGLANG_SRC, else the 0.5.10 release (cache, else fetched)
    wanted = set(args.targets or [])
    plan: list[tuple[str, str, Any]] = []
    if not args.no_baselines:
        plan += [("reference", "baseline", None), (f"sglang-{SGLANG_VERSION}", "baseline", None)]
    plan += [(name, "mutant", None) for name in MUTANTS]
    plan += [(bug.NAME, "planted", bug) for bug in load_planted_bugs()]
    if wanted:
        plan = [p for p in plan if p[0] in wanted or p[1] == "baseline"]
    upstream_known = get_known_findings(["all"], "sglang")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="cuda-detect-") as scratch:
        for target, kind, bug in plan:
            if time.monotonic() - start + args.budget > args.deadline:
                log(f"{target}: not run (the {args.deadline:g}s deadline would pass)")
                continue
            if kind == "mutant":
                declared = tuple(load_mutant_module(target).INVARIANTS)
                rows.append(run_target(target, kind, f"mutant:{target}", declared, args))
            elif kind == "planted":
                tree = planted_tree(bug, base, Path(scratch))
                rows.append(run_target(target, kind, "sglang", tuple(bug.INVARIANTS), args,
                                       upstream_known, source=tree))  # fmt: skip
            elif target == "reference":
                rows.append(run_target(target, kind, "reference", (), args))
            else:
                rows.append(run_target(target, kind, "sglang", (), args, upstream_known,
                                       source=str(base)))  # fmt: skip
    text = render(rows, args, command, time.monotonic() - start)
    print(text)
    if args.append:
        with Path(args.append).open("a") as out:
            out.write("\n" + text)
        log(f"appended to {args.append}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 1 if any(r.kind == "baseline" and r.caught for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
