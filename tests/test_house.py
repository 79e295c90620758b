"""The house stays easy to live in: a rule in one module, an invariant in three files, no import
circle, no channel that is not an argument, no room over 600 lines, a short walk for one step,
and every package's docstring a map of its modules.

Each test reads the package's own source (the AST, never a grep of text), so it fails the day a
table of rule names, a table of invariant ids, a circle, a module-level channel or a long file
comes back. Offenders that belong to work in progress elsewhere are named with their owner in
``KNOWN_*``; those lists only shrink: an entry that no longer offends fails the test too, so
whoever fixes it removes it.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from hicache_ref.harness.rules import STREAMS
from hicache_ref.harness.rules.table import FAMILY_MODULES, RULES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hicache_ref"
GENERATED = frozenset({"hicache_ref/invariant_titles.py"})
"""Files a command writes (``python -m hicache_ref.invariant_titles``), not people."""
FILE_LINES_MAX = 600
WRITE_STEP_FILES_MAX = 20

KNOWN_CIRCLES: dict[str, str] = {}
"""Modules still in an import circle, and who is taking them out of it."""
KNOWN_CHANNELS: dict[str, str] = {}
"""Module-level channels still in the package, and who is turning them into arguments."""
LIBRARY_ENVIRONMENT: dict[str, str] = {
    "hicache_ref/distributed/group.py: os.environ write": "NCCL reads NVLS settings only there",
}
"""Environment writes that are no channel: the only interface a library reads, set in a process
the harness starts for it (not a value one part of the package hands another)."""
KNOWN_LONG_FILES: dict[str, str] = {}


def package_files() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path


def relative(path: Path) -> str:
    """A path as the repository names it (a file outside it: its name)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# -- (a) a rule is spelled in its family module and in RuleName ----------------------------------
STORIES = frozenset(
    {
        "hicache_ref/vectors/stories.py",
        "hicache_ref/vectors/stories_regressions.py",
        "hicache_ref/vectors/stories_storage.py",
        "hicache_ref/vectors/storybook.py",
    }
)
"""Vector stories apply rules by name, scene by scene, as tests do: a new rule needs none."""
OTHER_MEANINGS = frozenset({"stream", "queue", "queue_name", "kind", "verb"})
"""Names whose comparison with a word (or a keyword argument so named) means a stream, a queue,
an op's kind or a storage driver's method, not a rule."""


def rule_name_literals(path: Path, names: set[str]) -> set[str]:
    """The rule names a module spells as string literals, leaving out the same words meaning
    something else: a stream or a queue (``stream="write"``, ``{"stream": "load"}``,
    ``queue == "load"``, a tuple of streams) and an outcome's text (``done("reset")``)."""
    tree = ast.parse(path.read_text())
    other: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            other.update(id(kw.value) for kw in node.keywords if kw.arg in OTHER_MEANINGS)
            if isinstance(node.func, ast.Name) and node.func.id in ("done", "refused", "Outcome"):
                other.update(id(arg) for arg in node.args)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(side, ast.Name) and side.id in OTHER_MEANINGS for side in sides):
                other.update(id(side) for side in sides)
                other.update(  # verb in ("check_prefetch", "terminate")
                    id(e) for side in sides if isinstance(side, ast.Tuple) for e in side.elts
                )
        elif isinstance(node, ast.Dict):
            other.update(
                id(value)
                for key, value in zip(node.keys, node.values, strict=True)
                if isinstance(key, ast.Constant) and key.value == "stream"
            )
        elif isinstance(node, ast.Tuple) and node.elts:
            if all(isinstance(e, ast.Constant) and e.value in STREAMS for e in node.elts):
                other.update(id(e) for e in node.elts)
    return {
        str(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in other
    }


def knows_the_rules(path: Path) -> bool:
    """Whether a module reads the rule table or applies steps (the modules a rule could be
    listed in): it imports ``harness.rules`` or ``harness.steps``."""
    return any(
        target.startswith(("hicache_ref.harness.rules", "hicache_ref.harness.steps"))
        for target in imported_names(path)
    )


def test_a_rule_is_spelled_only_in_its_family_module_and_in_rule_name() -> None:
    # every module that knows the rule table names a rule through its record (RULES, WRITE.name):
    # adding a rule touches its family module and step_types.RuleName, and nothing else
    home = {
        record.name: relative(Path(str(module.__file__)))
        for module in FAMILY_MODULES
        for record in module.RECORDS
    }
    allowed = {"hicache_ref/harness/step_types.py"}
    spread: dict[str, list[str]] = {}
    for path in package_files():
        where = relative(path)
        if where in STORIES or not knows_the_rules(path):
            continue
        for name in rule_name_literals(path, set(RULES)):
            if where not in allowed | {home[name]}:
                spread.setdefault(name, []).append(where)
    assert not spread, f"rule names spelled outside their family module and RuleName: {spread}"


# -- (b) an invariant is listed in specs/, its checker and its test ------------------------------
ID = re.compile(r"INV-\d\d$")
ID_TABLE_MIN = 3


def id_tables(path: Path) -> list[int]:
    """Lines where a collection literal holds ``ID_TABLE_MIN`` or more invariant ids (a table a
    new invariant would have to join)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            elements = node.elts
        elif isinstance(node, ast.Dict):
            elements = [key for key in node.keys if key is not None]
        else:
            continue
        ids = {
            e.value
            for e in elements
            if isinstance(e, ast.Constant) and isinstance(e.value, str) and ID.match(e.value)
        }
        if len(ids) >= ID_TABLE_MIN:
            lines.append(node.lineno)
    return lines


def test_no_module_lists_invariant_ids_in_a_table() -> None:
    # REGISTERED, the phases and the storage checks derive from each checker's registration
    tables = {
        relative(path): lines
        for path in package_files()
        if relative(path) not in GENERATED and (lines := id_tables(path))
    }
    assert not tables, f"tables of invariant ids (derive them from the registrations): {tables}"


def test_the_id_table_scanner_sees_a_table() -> None:
    # the scanner above is not blind: the generated titles are such a table
    assert id_tables(ROOT / "hicache_ref" / "invariant_titles.py")


# -- (c) no import circle, type-only imports included --------------------------------------------
def imported_names(path: Path) -> set[str]:
    """Every module name a file imports, anywhere in it (under TYPE_CHECKING, inside functions),
    as absolute names; ``from a import b`` yields ``a.b`` and ``a``."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the most specific module each import names:
    ``from hicache_ref.harness.rules import evict`` is the family module, not the package)."""
    modules = {module_name(path): path for path in package_files()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {t for t in imported_names(path) if t in modules}
        # ``from a import b``: keep ``a`` only where ``b`` is not a module of its own
        graph[name] = {
            t
            for t in targets
            if t != name and not any(o.startswith(t + ".") and o in targets for o in targets)
        }
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_package_has_no_import_circle() -> None:
    in_circles = {module for component in circles(import_graph()) for module in component}
    new = sorted(in_circles - set(KNOWN_CIRCLES))
    assert not new, f"modules in an import circle: {new} (one direction, or a Protocol)"
    fixed = sorted(set(KNOWN_CIRCLES) - in_circles)
    assert not fixed, f"no longer in a circle, remove from KNOWN_CIRCLES: {fixed}"


def test_the_circle_finder_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [{"a", "b", "c"}]


# -- (d) no module-level mutable channel, no write to os.environ ---------------------------------
MUTABLE_CALLS = frozenset(
    {
        "dict",
        "list",
        "set",
        "bytearray",
        "defaultdict",
        "OrderedDict",
        "Counter",
        "deque",
        "WeakValueDictionary",
        "WeakKeyDictionary",
        "WeakSet",
        "ContextVar",
    }
)
MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "add",
        "update",
        "setdefault",
        "pop",
        "popitem",
        "remove",
        "discard",
        "clear",
        "set",
        "appendleft",
    }
)
ENVIRON_WRITES = frozenset({"update", "setdefault", "pop", "clear", "popitem"})


def _is_mutable(value: ast.expr) -> bool:
    if isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in MUTABLE_CALLS
    return False


def _module_level_mutables(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        for statement in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
            if isinstance(statement, ast.Assign) and _is_mutable(statement.value):
                names.update(t.id for t in statement.targets if isinstance(t, ast.Name))
            elif (
                isinstance(statement, ast.AnnAssign)
                and statement.value is not None
                and _is_mutable(statement.value)
                and isinstance(statement.target, ast.Name)
            ):
                names.add(statement.target.id)
    return names


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def channels(path: Path) -> set[str]:
    """What counts as a channel that is not an argument, in one module:

    - a module-level name bound to a mutable container (a dict, list or set display or
      comprehension; ``dict()``, ``defaultdict()``, ``Counter()``, ``deque()``, weak
      containers, a ``ContextVar``) that some code of the module mutates (a subscript store or
      delete, an augmented assignment, a mutating method: ``append``, ``add``, ``update``,
      ``setdefault``, ``pop``, ``clear``, ``set``, ...), or that another module imports by its
      UPPER_CASE name and mutates; a table filled once and only read is no channel;
    - any name a function rebinds through ``global``;
    - any write to the process environment (``os.environ[...] = ``, ``del os.environ[...]``,
      ``os.environ.update/setdefault/pop/clear``, ``os.putenv``, ``os.unsetenv``).

    A bounded memo is a ``functools.lru_cache`` function, not a dict of its own."""
    tree = ast.parse(path.read_text())
    mutables = _module_level_mutables(tree)
    owners = {name: relative(path) for name in mutables}
    for statement in tree.body:  # a name imported from a module of the package, mutated here
        if isinstance(statement, ast.ImportFrom) and (statement.module or "").startswith(
            "hicache_ref"
        ):
            source = ROOT / Path(*str(statement.module).split("."))
            file = source.with_suffix(".py") if source.with_suffix(".py").exists() else source
            for alias in statement.names:
                if alias.asname is None and alias.name.isupper():
                    mutables.add(alias.name)
                    owners[alias.name] = relative(file)
    found: set[str] = set()

    def target_name(node: ast.expr) -> str | None:
        while isinstance(node, ast.Subscript | ast.Attribute) and not _is_environ(node):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(node.names)
            owners.update((name, relative(path)) for name in node.names)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and _is_environ(target.value):
                    found.add(f"{relative(path)}: os.environ write")
                elif isinstance(target, ast.Subscript | ast.Attribute) or isinstance(
                    node, ast.AugAssign
                ):
                    name = target_name(target)
                    if name in mutables and (
                        isinstance(target, ast.Subscript) or isinstance(node, ast.AugAssign)
                    ):
                        found.add(name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, method = node.func.value, node.func.attr
            if _is_environ(owner) and method in ENVIRON_WRITES:
                found.add(f"{relative(path)}: os.environ write")
            elif method in ("putenv", "unsetenv") and getattr(owner, "id", "") == "os":
                found.add(f"{relative(path)}: os.environ write")
            elif method in MUTATORS and isinstance(owner, ast.Name) and owner.id in mutables:
                found.add(owner.id)
    return {name if " " in name else f"{owners[name]}: {name}" for name in found}


def test_no_module_level_channel_and_no_environment_write() -> None:
    present = {channel for path in package_files() for channel in channels(path)}
    new = sorted(present - set(KNOWN_CHANNELS) - set(LIBRARY_ENVIRONMENT))
    assert not new, f"module-level channels (pass them as arguments): {new}"
    fixed = sorted(set(KNOWN_CHANNELS) - present)
    assert not fixed, f"no longer a channel, remove from KNOWN_CHANNELS: {fixed}"


def test_the_channel_finder_sees_each_kind(tmp_path: Path) -> None:
    source = tmp_path / "channels.py"
    source.write_text(
        "import os\n"
        "MEMO = {}\nSEEN = []\nTABLE = {'a': 1}\nCURRENT = None\n"
        "def f(k):\n    MEMO[k] = 1\n    SEEN.append(k)\n    return TABLE['a']\n"
        "def g(d):\n    global CURRENT\n    CURRENT = d\n"
        "def h():\n    os.environ['X'] = '1'\n"
    )
    found = channels(source)
    assert found == {f"channels.py: {n}" for n in ("MEMO", "SEEN", "CURRENT", "os.environ write")}


# -- (e) no room over 600 lines ------------------------------------------------------------------
def test_no_file_of_the_package_is_over_600_lines() -> None:
    long = {
        relative(path)
        for path in package_files()
        if len(path.read_text().splitlines()) > FILE_LINES_MAX
    }
    new = sorted(long - set(KNOWN_LONG_FILES))
    assert not new, f"files over {FILE_LINES_MAX} lines (one concept per module): {new}"
    fixed = sorted(set(KNOWN_LONG_FILES) - long)
    assert not fixed, (
        f"no longer over {FILE_LINES_MAX} lines, remove from KNOWN_LONG_FILES: {fixed}"
    )


# -- (g) every package's docstring is its map ----------------------------------------------------
def package_members(init: Path) -> list[str]:
    """A package's modules and subpackages, by name (``__init__`` aside)."""
    folder = init.parent
    modules = [p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
    packages = [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
    return sorted(modules + packages)


def unmapped(init: Path) -> list[str]:
    """The members a package's docstring does not name (as a word: ``tier`` or ``tier.py``, in
    backquotes or not, alone or dotted: ``tier.StorageTier``)."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    return [
        name
        for name in package_members(init)
        if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", doc)
    ]


def test_every_package_docstring_names_each_of_its_modules() -> None:
    # a module added to a package joins the map in its __init__ (in flow order: read by people)
    missing = {
        relative(init): names
        for init in package_files()
        if init.name == "__init__.py" and (names := unmapped(init))
    }
    assert not missing, f"modules missing from their package's docstring map: {missing}"


def test_the_map_reader_sees_a_missing_module(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""``tier``: the tier; ``tier_ports``: its ports."""\n')
    for name in ("tier", "tier_ports", "queues"):
        (package / f"{name}.py").write_text("")
    assert unmapped(package / "__init__.py") == ["queues"]


# -- (f) one write step, from the machine to the checkers, opens at most 20 files ----------------
BESIDE_THE_WALK = ("controller/", "pools/", "device/", "storage/", "oracle/")
"""What a step drives rather than walks through: the implementation under test (the reference's
controller, its pools, its device, its storage tier: an outside implementation replaces them)
and the pure oracle the lockstep observer steps beside it."""


@dataclass
class FilesOpened:
    """The package's files whose code runs while a profile is set (``sys.setprofile``)."""

    files: set[str]

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(str(PACKAGE)):
                self.files.add(relative(Path(name)))


def test_one_write_step_from_the_machine_to_the_checkers_opens_at_most_20_files() -> None:
    """What "followed from the machine to the checkers" counts: the files a person reads to
    follow the harness's side of one step, from ``machine._apply`` through the session, the
    rule's record and family module, the tree driver, the adapter's snapshot, the lockstep
    comparison and the checkers (``invariants/``, their pure rules included). It leaves out what
    the step *drives* (``BESIDE_THE_WALK``): the implementation under test, which an outside
    adapter replaces and whose own walk is the controller's story, and the oracle, a separate
    model stepped beside the harness. Measured when this was written (the reference, lockstep
    on): 20 files walked (13 of ``harness/``, 7 of ``invariants/``) of 43 that ran; the other
    23 are 5 of ``controller/``, 8 of ``pools/``, 1 of ``device/`` and 9 of ``oracle/``."""
    # a reference case with a computed node -> the machine applies write(node) -> every file of
    # the package whose code ran, from the machine's step through the rule, the tree, the
    # session's checks and the lockstep comparison to the checkers (what the step drives, the
    # controller and the oracle, runs beside that walk: BESIDE_THE_WALK)
    from hicache_ref.harness.adapters import ReferenceImplementation
    from hicache_ref.harness.campaigns.machine import machine_for
    from hicache_ref.harness.lockstep.oracle import attach_lockstep
    from hicache_ref.harness.rules.write import WRITE
    from hicache_ref.harness.steps.session import Session
    from hicache_ref.harness.steps.trace import Step
    from hicache_ref.harness.world.config import HarnessConfig

    machine = machine_for(ReferenceImplementation(), "reference")()
    machine.session = Session(HarnessConfig(), machine.implementation, "reference")
    attach_lockstep(machine.session)
    machine._apply(Step(rule="prefill", args={"tokens": 4}))
    while machine.s.tree.batch:
        machine._apply(Step(rule="forward_layer"))
    node = machine.s.candidates(WRITE.name)[0]
    opened = FilesOpened(set())
    sys.setprofile(opened)
    try:
        machine._apply(Step(rule=WRITE.name, args={"node": node}))
    finally:
        sys.setprofile(None)
    walked = {
        f for f in opened.files if not f.removeprefix("hicache_ref/").startswith(BESIDE_THE_WALK)
    }
    assert "hicache_ref/harness/rules/write.py" in walked
    assert "hicache_ref/invariants/registry.py" in walked  # it reached the checkers
    assert "hicache_ref/controller/cache_controller.py" in opened.files  # and drove the controller
    beside = sorted(opened.files - walked)
    assert len(walked) <= WRITE_STEP_FILES_MAX, (sorted(walked), f"and beside it: {beside}")
