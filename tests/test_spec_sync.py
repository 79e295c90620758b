"""The spec, the code and the tests cite the same invariants (specs/invariants.md).

Each invariant is a level-3 heading ``### INV-07 — title``. The spec names it, code under
``hicache_ref/`` enforces it, a test under ``tests/`` shows it firing — and each of them cites
the id, so these tests can hold the three together:

- the spec's ids are exactly ``specs/invariant_ids.txt``, in order, each with its sections;
- every id is cited by the code (outside the checker package too, unless a session phase hands
  its checker evidence) and by a test;
- every id has one registered checker (``invariants/checker.py``), whose phases hand it evidence
  it declares;
- every id cited anywhere in the code, tests, fuzz mutants or specs exists in the spec;
- every backticked path the spec names exists and cites the id, and every named test exists.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "invariants.md"
IDS_FILE = ROOT / "specs" / "invariant_ids.txt"

HEADING = re.compile(r"^### (INV-\d\d) — (\S.*)$", re.MULTILINE)
CITED_ID = re.compile(r"INV-\d\d")
SPEC_REF = re.compile(r"`((?:hicache_ref|tests|fuzz|benchmarks)/[^`\s:]+)(?:::(\w+))?`")
PLANNED = re.compile(r"((?:hicache_ref|tests|fuzz)/[\w/.-]+)\s+\(planned\)")
SECTIONS = ("**Statement.**", "**Why.**", "**Enforced.**", "**Shown by.**")
CHECKER_PACKAGE = ROOT / "hicache_ref" / "invariants"


@dataclass(frozen=True)
class SpecEntry:
    inv_id: str
    title: str
    body: str


def read_spec() -> list[SpecEntry]:
    """The spec's invariant entries in order: id, title and the text up to the next heading."""
    text = SPEC.read_text()
    matches = list(HEADING.finditer(text))
    entries = []
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        entries.append(SpecEntry(match.group(1), match.group(2), text[match.end() : end]))
    return entries


def read_spec_ids() -> list[str]:
    return [entry.inv_id for entry in read_spec()]


def iter_files(folder: str, suffixes: tuple[str, ...] = (".py",)) -> Iterator[Path]:
    base = ROOT / folder
    if not base.exists():
        return
    for path in sorted(base.rglob("*")):
        if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts:
            yield path


def cited_ids(paths: Iterator[Path]) -> dict[str, list[Path]]:
    """Which files cite each ``INV-xx``."""
    found: dict[str, list[Path]] = {}
    for path in paths:
        for inv_id in set(CITED_ID.findall(path.read_text(errors="replace"))):
            found.setdefault(inv_id, []).append(path)
    return found


# --- the spec itself ---------------------------------------------------------------------------


def test_spec_ids_are_the_fixed_id_list_in_order() -> None:
    fixed = [line.split()[0] for line in IDS_FILE.read_text().splitlines() if line.strip()]
    assert read_spec_ids() == fixed


def test_every_spec_entry_has_all_four_sections() -> None:
    missing = {
        entry.inv_id: [s for s in SECTIONS if s not in entry.body]
        for entry in read_spec()
        if not all(s in entry.body for s in SECTIONS)
    }
    assert not missing, f"spec entries missing sections: {missing}"


def test_every_spec_entry_names_a_test_and_a_mutant() -> None:
    lacking = [
        entry.inv_id
        for entry in read_spec()
        if "- test: `tests/" not in entry.body or "- mutant: " not in entry.body
    ]
    assert not lacking, f"spec entries without a test or a mutant line: {lacking}"


# --- the spec's references are real ------------------------------------------------------------


def test_every_path_the_spec_names_exists_and_cites_its_invariant() -> None:
    problems = []
    for entry in read_spec():
        for match in SPEC_REF.finditer(entry.body):
            path, test_name = ROOT / match.group(1), match.group(2)
            files = list(path.rglob("*.py")) if path.is_dir() else [path]
            if not path.exists():
                problems.append(f"{entry.inv_id}: {match.group(1)} does not exist")
                continue
            if not any(entry.inv_id in f.read_text(errors="replace") for f in files):
                problems.append(f"{entry.inv_id}: {match.group(1)} does not cite {entry.inv_id}")
            if test_name and f"def {test_name}(" not in path.read_text():
                problems.append(f"{entry.inv_id}: {match.group(1)} has no {test_name}")
    assert not problems, "\n".join(problems)


def test_planned_entries_are_still_missing() -> None:
    # once a planned mutant or module lands, the spec must name it for real (in backticks)
    landed = [
        f"{entry.inv_id}: {match.group(1)}"
        for entry in read_spec()
        for match in PLANNED.finditer(entry.body)
        if (ROOT / match.group(1)).exists()
    ]
    assert not landed, f"planned entries that now exist; drop '(planned)': {landed}"


# --- code and tests cite every invariant --------------------------------------------------------


def test_every_invariant_is_cited_by_code_and_by_a_test() -> None:
    code = cited_ids(iter_files("hicache_ref"))
    tests = cited_ids(iter_files("tests"))
    uncited_code = [i for i in read_spec_ids() if i not in code]
    uncited_tests = [i for i in read_spec_ids() if i not in tests]
    assert not uncited_code, f"ids no module under hicache_ref/ cites: {uncited_code}"
    assert not uncited_tests, f"ids no test under tests/ cites: {uncited_tests}"


def test_every_invariant_is_enforced_outside_the_checker_package() -> None:
    # the checkers cite every id by construction; the implementation (controller, pools,
    # oracle, harness, storage) must also say where it enforces each one, or the session hands
    # the checker its evidence in a phase (its registration says which: no file to cite it)
    from hicache_ref.invariants.registry import CHECKERS

    enforcing = cited_ids(p for p in iter_files("hicache_ref") if CHECKER_PACKAGE not in p.parents)
    enforcing |= {c.inv_id: [] for c in CHECKERS if c.phases}
    unenforced = [i for i in read_spec_ids() if i not in enforcing]
    assert not unenforced, (
        f"ids cited only by hicache_ref/invariants/, by no implementation module: {unenforced}"
    )


def test_every_cited_invariant_exists_in_the_spec() -> None:
    known = set(read_spec_ids())
    places = [
        *iter_files("hicache_ref"),
        *iter_files("tests"),
        *iter_files("fuzz"),
        *iter_files("specs", (".md", ".txt")),
    ]
    unknown = {
        inv_id: sorted(str(p.relative_to(ROOT)) for p in paths)
        for inv_id, paths in cited_ids(iter(places)).items()
        if inv_id not in known
    }
    assert not unknown, f"ids cited but not in specs/invariants.md: {unknown}"


# --- every invariant is checked by a call, not only cited -----------------------------------------
HARNESS_CALLERS = ("hicache_ref/harness", "hicache_ref/distributed")


def _ids_handed_to_the_runner() -> set[str]:
    """Ids some harness module hands evidence for: calls naming the id (``<runner>.run("INV-NN",
    ...)``, or a byte check made ``check_rows(rows, expected, "INV-11", ...)``), and the
    session's phase tuples (``STEP_IDS`` ...) of the registry. (That each one really runs in a
    campaign is ``tests/harness/test_checks_reached.py``.)"""
    import ast

    from hicache_ref.invariants import registry

    found = {
        *registry.STEP_IDS,
        *registry.REFUSAL_IDS,
        *registry.RESET_IDS,
        *registry.QUIESCENCE_IDS,
        *registry.STORAGE_IDS,
    }
    for folder in HARNESS_CALLERS:
        for path in iter_files(folder):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and CITED_ID.fullmatch(str(arg.value)):
                        found.add(str(arg.value))
    return found


def test_every_invariant_has_one_registered_checker_that_the_harness_calls() -> None:
    from hicache_ref.invariants.registry import REGISTERED

    spec = read_spec()
    registered = set(REGISTERED)
    assert registered <= {e.inv_id for e in spec}
    missing = [e.inv_id for e in spec if e.inv_id not in registered]
    assert not missing, f"spec ids with no registered checker: {missing}"
    uncalled = sorted(registered - _ids_handed_to_the_runner())
    assert not uncalled, f"registered checkers no harness module hands evidence to: {uncalled}"
    unnamed = [
        e.inv_id
        for e in spec
        if e.inv_id in registered and REGISTERED[e.inv_id].__name__ not in e.body
    ]
    assert not unnamed, (
        f"spec entries whose Enforced section does not name their checker: {unnamed}"
    )


def test_every_phase_hands_its_checkers_evidence_they_declare() -> None:
    # the registrations are the one table: a checker in a state-view phase judges a StateView, the
    # refusal phase a Refusal, the storage phase a StorageSnapshot
    from hicache_ref.invariants.evidence import Refusal, StateView
    from hicache_ref.invariants.registry import CHECKERS
    from hicache_ref.invariants.storage_snapshot import StorageSnapshot

    kinds: dict[str, type] = {"step": StateView, "reset": StateView, "quiescence": StateView}
    kinds |= {"refusal": Refusal, "storage": StorageSnapshot}
    wrong = [
        f"{c.inv_id} ({phase})"
        for c in CHECKERS
        for phase in c.phases
        if kinds[phase] not in c.evidence
    ]
    assert not wrong, f"checkers whose phase hands them evidence they do not declare: {wrong}"
    assert [c.inv_id for c in CHECKERS] == sorted(read_spec_ids())


def test_a_second_checker_for_one_id_is_refused() -> None:
    import pytest

    from hicache_ref.invariants.checker import collect, registered

    def judge(evidence: object) -> None:
        return None

    first, second = registered("INV-05")(judge), registered("INV-05")(judge)
    with pytest.raises(ValueError, match="INV-05 has two checkers"):
        collect([{"a": first, "b": second}])
    with pytest.raises(ValueError, match="unknown phase"):
        registered("INV-05", stepp=1)
