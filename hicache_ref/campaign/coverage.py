"""Coverage of the implementation under test while a campaign runs (``run --coverage``).

In the order a campaign uses them:

- ``get_code_under_test(implementation)``: the files whose lines count, by what the run
  drives: the reference's ``hicache_ref/controller/`` and ``pools/`` (a mutant: those and its
  own file in ``fuzz/mutants/``), the ``sglang/`` folder of a tree for ``--impl sglang``/``seed``
  (the controller file the adapter compiles from it, and whatever else of the tree runs), and
  for an outside ``pkg.mod:factory`` the folder of the factory's module;
- ``CoverageProbe``: ``coverage``'s tracer (line and branch) started around the rounds; each
  ``sample(at_s)`` takes what the tracer saw since the last, stamps each newly covered line and
  branch with the time it was first seen, and returns the counts a timeline point records
  (``on_case`` samples after a case when the last sample is old enough);
- ``CoverageProbe.as_json()``: per file its statements and branches (the denominators, from
  ``coverage``'s own parser) and the first-seen time of every covered line and branch arc, the
  record ``merge.py`` unions across workers (each keeps its earliest time).

``coverage`` is the ``fleet`` extra; the tracer costs steps (``benchmarks/RESULTS.md``,
"coverage"), so a campaign measures it only when asked.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_ref.errors import HiCacheSetupError

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
"""``hicache_ref/``: the reference's controller and pools live under it."""
REFERENCE_FOLDERS = ("controller", "pools")
SAMPLE_EVERY_S_MAX = 1.0


@dataclass(frozen=True)
class CodeUnderTest:
    """The files a run's coverage counts: every ``.py`` under ``folders`` and the ``files``,
    and whatever of ``ran_in`` runs (a tree holds all of sglang; the run executes a few files)."""

    folders: tuple[Path, ...]
    files: tuple[Path, ...] = ()
    ran_in: tuple[Path, ...] = ()
    root: Path = PACKAGE_ROOT.parent
    """File names in the report are relative to this (``hicache_ref/controller/...``)."""

    def get_files(self) -> list[Path]:
        found = {path.resolve() for folder in self.folders for path in folder.rglob("*.py")}
        return sorted(found | {path.resolve() for path in self.files})

    def get_name(self, filename: str) -> str:
        path = Path(filename).resolve()
        for base in (self.root, *self.folders, *self.ran_in):
            if path.is_relative_to(base):
                return str(path.relative_to(base if base == self.root else base.parent))
        return path.name


def get_code_under_test(implementation: object) -> CodeUnderTest:
    """What ``implementation`` runs of its own (see the module docstring)."""
    inner = implementation
    while hasattr(inner, "inner"):  # contract.AdoptedImplementation, the GPU wrapper
        inner = inner.inner
    tree = str(getattr(implementation, "source_tree", "") or "")
    if tree:
        from hicache_ref.harness.adapters.sglang_tree import CONTROLLER_RELPATH

        root = Path(tree).resolve()
        return CodeUnderTest(
            folders=(), files=(root / CONTROLLER_RELPATH,), ran_in=(root / "sglang",), root=root
        )
    reference = tuple(PACKAGE_ROOT / name for name in REFERENCE_FOLDERS)
    controller_class = getattr(inner, "controller_class", None)
    if controller_class is not None and _is_in_package(controller_class):
        return CodeUnderTest(folders=reference)
    if controller_class is not None:  # a mutant: the reference and the file it overrides in
        own = _get_class_file(controller_class)
        return CodeUnderTest(folders=reference, files=(own,), root=own.parents[2])
    module = _get_class_file(type(inner))  # an outside package's own folder
    return CodeUnderTest(folders=(module.parent,), root=module.parent.parent)


def _is_in_package(cls: type) -> bool:
    return _get_class_file(cls).is_relative_to(PACKAGE_ROOT)


def _get_class_file(cls: type) -> Path:
    """The file that defines ``cls`` (a mutant's module is loaded from its path and is not in
    ``sys.modules``, so its methods' code says where it came from)."""
    for value in vars(cls).values():
        code = getattr(value, "__code__", None)
        if code is not None:
            return Path(code.co_filename).resolve()
    return Path(inspect.getfile(cls)).resolve()


@dataclass
class FileCoverage:
    """One file: its denominators and when each covered line and branch was first seen."""

    reporter: Any
    """``coverage``'s reader of the file: maps a multi-line statement's lines to its first."""
    statements: frozenset[int]
    branches: int
    branch_arcs: frozenset[tuple[int, int]]
    lines_first_s: dict[int, float] = field(default_factory=dict)
    arcs_first_s: dict[tuple[int, int], float] = field(default_factory=dict)


class CoverageProbe:
    """``coverage``'s tracer over the code under test, sampled as the campaign goes."""

    def __init__(self, code: CodeUnderTest) -> None:
        try:
            import coverage
        except ImportError:
            raise HiCacheSetupError(
                "--coverage measures with the coverage package, which is not installed; "
                "install the fleet extra: pip install -e '.[fleet]'"
            ) from None
        self.code = code
        folders = (*code.folders, *code.ran_in)
        patterns = [f"{folder}/*" for folder in folders] + [str(path) for path in code.files]
        self.tracer = coverage.Coverage(
            data_file=None, branch=True, include=patterns, config_file=False
        )
        self.tracer.set_option("run:disable_warnings", ["no-data-collected"])  # the 0 s sample
        self.files: dict[str, FileCoverage] = {}
        self.core = ""
        self.sampled_s = 0.0

    def start(self) -> None:
        self.tracer.start()
        collector: Any = getattr(self.tracer, "_collector", None)  # which tracer, for the page
        self.core = str(collector.tracer_name()) if hasattr(collector, "tracer_name") else ""
        for path in self.code.get_files():
            self._file(str(path))

    def stop(self) -> None:
        self.tracer.stop()

    def on_case(self, at_s: float) -> None:
        """A case finished: sample when the last sample is older than a tenth of the time so
        far (at least 0.1 s, at most 1 s), so a short run's curve has its early steps too."""
        if at_s - self.sampled_s >= min(SAMPLE_EVERY_S_MAX, max(0.1, at_s / 10)):
            self.sample(at_s)

    def sample(self, at_s: float) -> dict[str, int]:
        """Take what ran since the last sample; the covered counts for the timeline."""
        data = self.tracer.get_data()
        self.sampled_s = at_s = round(at_s, 2)
        for filename in data.measured_files():
            known = self._file(filename)
            if known is None:
                continue
            for line in known.reporter.translate_lines(data.lines(filename) or ()):
                if line in known.statements:
                    known.lines_first_s.setdefault(line, at_s)
            for arc in known.reporter.translate_arcs(data.arcs(filename) or ()):
                if arc in known.branch_arcs:
                    known.arcs_first_s.setdefault(arc, at_s)
        return self.get_counts()

    def get_counts(self) -> dict[str, int]:
        return {
            "lines": sum(len(f.lines_first_s) for f in self.files.values()),
            "branches": sum(len(f.arcs_first_s) for f in self.files.values()),
        }

    def _file(self, filename: str) -> FileCoverage | None:
        name = self.code.get_name(filename)
        if name not in self.files:
            try:
                self.files[name] = _analyze(self.tracer, filename)
            except Exception:
                return None
        return self.files[name]

    def as_json(self) -> dict[str, Any]:
        return {
            "core": self.core,
            "files": {
                name: {
                    "statements": len(f.statements),
                    "branches": f.branches,
                    "lines": {str(line): t for line, t in sorted(f.lines_first_s.items())},
                    "arcs": {f"{a}>{b}": t for (a, b), t in sorted(f.arcs_first_s.items())},
                }
                for name, f in sorted(self.files.items())
            },
        }


def _analyze(tracer: Any, filename: str) -> FileCoverage:
    """The file's statements and branch arcs, as ``coverage``'s report would count them."""
    from coverage.python import PythonFileReporter

    reporter = PythonFileReporter(filename, tracer)
    exits = reporter.exit_counts()
    branch_lines = {line for line, count in exits.items() if count > 1}
    arcs = frozenset(arc for arc in reporter.arcs() if arc[0] in branch_lines)
    statements = frozenset(reporter.lines())
    return FileCoverage(
        reporter=reporter,
        statements=statements,
        branches=sum(exits[line] for line in branch_lines),
        branch_arcs=arcs,
        lines_first_s=dict.fromkeys(sorted(statements - _function_body_lines(filename)), 0.0),
    )


def _function_body_lines(filename: str) -> set[int]:
    """The lines inside function bodies: every other statement ran when the module was
    imported, before the tracer started, so it counts as covered from the start."""
    tree = ast.parse(Path(filename).read_text(), filename)
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            body = node.body if isinstance(node.body, list) else [node.body]
            lines.update(range(body[0].lineno, (node.end_lineno or body[0].lineno) + 1))
    return lines


@contextmanager
def measure_coverage(implementation: object, enabled: bool) -> Iterator[CoverageProbe | None]:
    """A started probe over ``implementation``'s code for the block (None when not ``enabled``)."""
    if not enabled:
        yield None
        return
    probe = CoverageProbe(get_code_under_test(implementation))
    probe.start()
    try:
        yield probe
    finally:
        probe.stop()
