"""Mutation score of the stateful suite over controller/ and pools/ (mutmut; issue 8). Not in CI.

    pip install -e '.[dev,cpu,bench]'
    nice -n 19 .venv/bin/python benchmarks/mutation.py --sample 300 --seed 0 --budget-s 3600 \
        --append benchmarks/RESULTS.md

Flow: stage -> configure -> generate -> sample -> run -> collect -> summarize.

- stage: ``git archive REV`` into ``WORKDIR/src``, so edits to the working tree during a run
  change nothing and mutmut's ``mutants/`` folder never appears in the repository;
- configure: a ``[tool.mutmut]`` section (the paths, the test selection, one worker,
  ``forkserver`` isolation because torch is not fork-safe) and a ``tests/conftest.py`` that
  orders the selected tests (controller, then pools, then the harness machine: ``-x`` stops at
  the first failure, so cheap tests kill first) and loads a Hypothesis profile with no example
  database (a failure saved under one mutant must not replay under the next), derandomized and
  without deadlines (mutmut's trampolines slow every call; a deadline miss is not a kill);
- generate: mutmut writes every mutant of the paths (``mutants/**/*.meta`` lists them);
- sample: a seeded uniform sample of those names (``--sample 0``: all of them);
- run: ``mutmut run --max-children 1 NAMES...``; at ``--budget-s`` it gets SIGINT (mutmut
  keeps every verdict it reached), mutants it never reached are reported as ``not run``.
  mutmut runs, for each mutant, only the selected tests that executed the mutated function
  in its stats run; a mutant no selected test executes is ``no tests``;
- collect: each sampled mutant's verdict, duration and diff, and an operator class read off the
  diff (``== -> !=``, ``number``, ``-> None``, ``argument removed``, ...);
- summarize: the JSON (``--json``), a markdown section (counts, score, survivors grouped by
  module and operator, one line each, and the exact command), ``--append`` adds it to a file.

Score = (killed + timeout) / (killed + timeout + survived + no tests): a mutant the selected
tests never execute counts as surviving. ``--from-json`` re-renders a finished run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PATHS = ["hicache_ref/controller", "hicache_ref/pools"]
DEFAULT_TESTS = ["tests/controller", "tests/pools", "tests/harness/test_machine.py"]
TEST_ORDER = ["tests/controller/", "tests/pools/", "tests/harness/"]

# mutmut 3.8's exit-code table (mutmut/__main__.py status_by_exit_code), folded into our columns
STATUS_BY_EXIT_CODE: dict[int | None, str] = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    34: "skipped",
    35: "suspicious",
    36: "timeout",
    24: "timeout",
    -24: "timeout",
    152: "timeout",
    255: "timeout",
    37: "killed",
    -11: "crashed",
    -9: "crashed",
    2: "not run",
    None: "not run",
}
COLUMNS = [
    "killed",
    "survived",
    "timeout",
    "no tests",
    "suspicious",
    "crashed",
    "skipped",
    "not run",
]

CONFTEST = '''"""Written by benchmarks/mutation.py into the mutation snapshot only (never the repo)."""
from hypothesis import settings

settings.register_profile("mutation", database=None, derandomize=True, deadline=None)
settings.load_profile("mutation")
_ORDER = {order!r}


def _rank(item):
    path = item.nodeid.removeprefix("mutants/")
    return next((i for i, p in enumerate(_ORDER) if path.startswith(p)), len(_ORDER))


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_rank)  # stable: collection order inside a group
'''

GENERATE = """
import os
from mutmut.__main__ import create_mutants
from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths()
print(create_mutants(1))
"""

COLLECT = """
import json, sys
from pathlib import Path
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.utils.file_utils import walk_mutatable_files
wanted = set(json.load(open(sys.argv[1])))
out = {}
for path in walk_mutatable_files():
    m = SourceFileMutationData(path=path)
    m.load()
    for name, code in m.exit_code_by_key.items():
        if name in wanted:
            try:
                diff = get_diff_for_mutant(name, path=path)
            except Exception as e:  # a diff is a report nicety, never a verdict
                diff = f"<no diff: {e!r}>"
            out[name] = {"path": str(path), "exit_code": code,
                         "duration_s": m.durations_by_key.get(name), "diff": diff}
json.dump(out, open(sys.argv[2], "w"), indent=1)
"""


@dataclass
class MutantResult:
    name: str
    module: str
    function: str
    status: str
    exit_code: int | None
    duration_s: float | None
    operator: str
    removed: str
    added: str


@dataclass
class Run:
    command: str
    rev: str
    commit: str
    paths: list[str]
    tests: list[str]
    profile: str
    seed: int
    sample_size: int
    population: int
    population_by_module: dict[str, int]
    budget_s: float
    started_utc: str
    wall_s: float = 0.0
    stopped_by_budget: bool = False
    mutmut_version: str = ""
    python: str = ""
    machine: str = ""
    mutants: list[MutantResult] = field(default_factory=list)


# ---- stage and configure ---------------------------------------------------------------------


def stage_snapshot(rev: str, src: Path) -> str:
    """Export REV (committed files only) into SRC; returns its commit id."""
    commit = subprocess.run(
        ["git", "rev-parse", rev], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    src.mkdir(parents=True)
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "archive", commit], cwd=REPO, check=True, stdout=archive)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(src)  # our own repository's archive: trusted
    return commit


def toml_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def configure(src: Path, paths: list[str], tests: list[str]) -> None:
    """Point mutmut at PATHS with TESTS as the test command; order the tests; quiet Hypothesis."""
    pyproject = src / "pyproject.toml"
    text = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[|\Z)", "", pyproject.read_text())
    text += (
        "\n[tool.mutmut]\n"
        'source_paths = ["hicache_ref"]\n'
        f"only_mutate = {toml_list([p.rstrip('/') + '/*' for p in paths])}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
        'process_isolation = "forkserver"\n'
        "use_git_change_detection = false\n"
    )
    pyproject.write_text(text)
    (src / "tests" / "conftest.py").write_text(CONFTEST.format(order=TEST_ORDER))


def mutmut_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    return env


# ---- generate and sample ---------------------------------------------------------------------


def generate(src: Path, python: str) -> dict[str, list[str]]:
    """Every mutant name of the configured paths, by source module."""
    subprocess.run(
        [python, "-c", GENERATE], cwd=src, env=mutmut_env(), check=True, capture_output=True
    )
    names: dict[str, list[str]] = {}
    for meta in sorted((src / "mutants").rglob("*.py.meta")):
        keys = sorted(json.loads(meta.read_text())["exit_code_by_key"])
        if keys:
            names[str(meta.relative_to(src / "mutants"))[: -len(".meta")]] = keys
    return names


def draw_sample(names: dict[str, list[str]], size: int, seed: int) -> list[str]:
    population = sorted(n for keys in names.values() for n in keys)
    if size <= 0 or size >= len(population):
        return population
    return sorted(random.Random(seed).sample(population, size))


# ---- run -------------------------------------------------------------------------------------


def run_mutmut(src: Path, mutmut: str, sample: list[str], budget_s: float, log: Path) -> bool:
    """Run mutmut on SAMPLE with one worker; SIGINT at the budget. True when the budget hit."""
    args_file = src / "mutants" / "sample.txt"
    args_file.write_text("\n".join(sample) + "\n")
    cmd = ["nice", "-n", "19", mutmut, "run", "--max-children", "1", *sample]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=src,
            env=mutmut_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=budget_s)
            return False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # mutmut saves each verdict as it lands
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # our own session, started above
                proc.wait()
            return True


# ---- collect ---------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""[A-Za-z_]\w*|\d[\w.]*|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|==|!=|<=|>=|//|\*\*|->|\S"""
)


def changed_lines(diff: str) -> tuple[str, str]:
    body = [line for line in diff.splitlines()[2:] if line[:1] in "+-"]
    removed = " ".join(line[1:].strip() for line in body if line.startswith("-"))
    added = " ".join(line[1:].strip() for line in body if line.startswith("+"))
    return removed, added


def classify(removed: str, added: str) -> str:
    """An operator class read off a mutant's changed line: the tokens that changed."""
    a, b = _TOKEN.findall(removed), _TOKEN.findall(added)
    gone: list[str] = []
    new: list[str] = []
    for tag, i1, i2, j1, j2 in SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag != "equal":
            gone += a[i1:i2]
            new += b[j1:j2]
    if not gone and not new:
        return "other"
    if all(re.fullmatch(r"-?\d[\w.]*|[+-]", t) for t in gone + new):
        return "number"
    if all(t[:1] in "\"'" for t in gone + new) or (any(t.startswith(('"XX', "'XX")) for t in new)):
        return "string"
    if new == ["None"]:
        return "-> None"
    if not new:
        return f"{gone[0]} removed" if gone in (["not"], ["-"], ["~"]) else "argument removed"
    if not gone:
        return f"{' '.join(new)} added"
    return f"{' '.join(gone)} -> {' '.join(new)}"


def module_of(name: str) -> str:
    return name.split(".x", 1)[0] if ".x" in name else name.rsplit(".", 1)[0]


def function_of(name: str) -> str:
    tail = name.rsplit(".", 1)[-1].split("__mutmut_")[0]
    return tail[2:] if tail.startswith("x_") else tail.replace("xǁ", "").replace("ǁ", ".")


def collect(src: Path, python: str, sample: list[str]) -> list[MutantResult]:
    wanted = src / "mutants" / "wanted.json"
    raw_path = src / "mutants" / "collected.json"
    wanted.write_text(json.dumps(sample))
    subprocess.run(
        [python, "-c", COLLECT, str(wanted), str(raw_path)], cwd=src, env=mutmut_env(), check=True
    )
    raw: dict[str, dict[str, Any]] = json.loads(raw_path.read_text())
    results = []
    for name in sample:
        entry = raw.get(name, {"exit_code": None, "duration_s": None, "diff": ""})
        removed, added = changed_lines(entry["diff"])
        results.append(
            MutantResult(
                name=name,
                module=module_of(name),
                function=function_of(name),
                status=STATUS_BY_EXIT_CODE.get(entry["exit_code"], "suspicious"),
                exit_code=entry["exit_code"],
                duration_s=entry["duration_s"],
                operator=classify(removed, added),
                removed=removed,
                added=added,
            )
        )
    return results


# ---- summarize -------------------------------------------------------------------------------


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def score(counts: Counter[str]) -> tuple[int, int]:
    caught = counts["killed"] + counts["timeout"]
    return caught, caught + counts["survived"] + counts["no tests"]


def render(run: Run) -> str:
    counts = Counter(m.status for m in run.mutants)
    caught, judged = score(counts)
    lo, hi = wilson(caught, judged)
    ran = sum(counts[c] for c in COLUMNS if c != "not run")
    by_module: dict[str, Counter[str]] = defaultdict(Counter)
    for m in run.mutants:
        by_module[m.module][m.status] += 1
    lines = [
        f"## Mutation score of the stateful suite (benchmarks/mutation.py), {run.started_utc[:10]}",
        "",
        f"Command: `{run.command}`  ",
        f"Tool: mutmut {run.mutmut_version} (one worker, forkserver isolation, `nice -n 19`), "
        f"{run.python}; machine: {run.machine}  ",
        f"Source: `git archive {run.rev}` = {run.commit[:12]}; mutated: "
        f"{', '.join(f'`{p}/`' for p in run.paths)}  ",
        f"Test command (per mutant, only the selected tests that execute the mutated function, "
        f"`-x`): `pytest {' '.join(run.tests)}`, HICACHE_PROFILE={run.profile}, ordered "
        "controller -> pools -> machine; Hypothesis derandomized, no database, no deadline  ",
        f"Sample: {run.sample_size} of {run.population} mutants, uniform, seed {run.seed}; "
        f"{ran} ran in {run.wall_s / 60:.1f} min"
        + (
            f" (budget {run.budget_s / 60:.0f} min reached: {counts['not run']} not run)"
            if run.stopped_by_budget
            else ""
        ),
        "",
        "| module | population | sampled | " + " | ".join(COLUMNS) + " | score |",
        "|---|---:|---:|" + "---:|" * len(COLUMNS) + "---:|",
    ]
    for module in sorted(by_module):
        c = by_module[module]
        k, n = score(c)
        path = module.replace(".", "/") + ".py"
        lines.append(
            f"| {module.removeprefix('hicache_ref.')} | {run.population_by_module.get(path, 0)} | "
            f"{sum(c.values())} | "
            + " | ".join(str(c[col]) for col in COLUMNS)
            + f" | {f'{k / n:.0%}' if n else '-'} |"
        )
    total = f"**{caught / judged:.1%}**" if judged else "-"
    lines.append(
        f"| **all** | {run.population} | {len(run.mutants)} | "
        + " | ".join(f"**{counts[c]}**" for c in COLUMNS)
        + f" | {total} |"
    )
    lines += [
        "",
        f"Score = (killed + timeout) / (killed + timeout + survived + no tests) = {caught}/{judged}"
        f" = **{caught / judged:.1%}** (95% Wilson interval {lo:.1%}-{hi:.1%})."
        if judged
        else "No mutant was judged.",
        "",
    ]
    survivors = [m for m in run.mutants if m.status in ("survived", "no tests", "suspicious")]
    if survivors:
        lines += ["Survivors by module and operator (`removed` => `added`):", ""]
        groups: dict[tuple[str, str], list[MutantResult]] = defaultdict(list)
        for m in survivors:
            groups[(m.module, m.operator)].append(m)
        for (module, operator), members in sorted(groups.items()):
            lines.append(
                f"- `{module.removeprefix('hicache_ref.')}` / {operator} ({len(members)}):"
            )
            for m in members:
                tag = "" if m.status == "survived" else f" [{m.status}]"
                lines.append(
                    f"  - `{m.function}` #{m.name.rsplit('_', 1)[-1]}{tag}: "
                    f"`{shorten(m.removed)}` => `{shorten(m.added)}`"
                )
        lines.append("")
    return "\n".join(lines)


def shorten(code: str, width: int = 110) -> str:
    code = code.replace("`", "'")
    return code if len(code) <= width else code[: width - 3] + "..."


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", nargs="+", default=DEFAULT_PATHS, help="folders to mutate")
    p.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="pytest selection")
    p.add_argument("--sample", type=int, default=300, help="mutants to draw (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=3600.0, help="wall-clock limit of mutmut")
    p.add_argument("--rev", default="HEAD", help="commit to snapshot (git archive)")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hicache-mutation")
    p.add_argument("--mutmut", default=str(Path(sys.executable).with_name("mutmut")))
    p.add_argument("--json", type=Path, help="results JSON (default: WORKDIR/mutation.json)")
    p.add_argument("--append", type=Path, help="append the markdown section to this file")
    p.add_argument("--from-json", type=Path, help="render a finished run's JSON; run nothing")
    return p.parse_args(argv)


def load_run(path: Path) -> Run:
    data = json.loads(path.read_text())
    data["mutants"] = [MutantResult(**m) for m in data["mutants"]]
    return Run(**data)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        run = load_run(args.from_json)
    else:
        run = measure(args, argv if argv is not None else sys.argv[1:])
    markdown = render(run)
    print(markdown)
    if args.append:
        with args.append.open("a") as f:
            f.write("\n" + markdown)
    return 0


def measure(args: argparse.Namespace, argv: list[str]) -> Run:
    import importlib.metadata

    src = args.workdir / "src"
    if args.workdir.exists() and any(args.workdir.iterdir()):
        raise SystemExit(f"--workdir {args.workdir} is not empty: remove it or pick another")
    started = time.monotonic()
    commit = stage_snapshot(args.rev, src)
    configure(src, args.paths, args.tests)
    names = generate(src, sys.executable)
    sample = draw_sample(names, args.sample, args.seed)
    run = Run(
        command="python benchmarks/mutation.py " + shlex.join(argv),
        rev=args.rev,
        commit=commit,
        paths=args.paths,
        tests=args.tests,
        profile=os.environ.get("HICACHE_PROFILE", "ci"),
        seed=args.seed,
        sample_size=len(sample),
        population=sum(len(v) for v in names.values()),
        population_by_module={k: len(v) for k, v in names.items()},
        budget_s=args.budget_s,
        started_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        mutmut_version=importlib.metadata.version("mutmut"),
        python=f"Python {platform.python_version()}",
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
    )
    print(
        f"{run.sample_size} of {run.population} mutants sampled; mutmut log: "
        f"{args.workdir / 'mutmut.log'}",
        file=sys.stderr,
    )
    run.stopped_by_budget = run_mutmut(
        src, args.mutmut, sample, args.budget_s, args.workdir / "mutmut.log"
    )
    run.mutants = collect(src, sys.executable, sample)
    run.wall_s = time.monotonic() - started
    out = args.json or args.workdir / "mutation.json"
    out.write_text(json.dumps(asdict(run), indent=1, ensure_ascii=False))
    print(f"results: {out}", file=sys.stderr)
    return run


if __name__ == "__main__":
    sys.exit(main())
