"""Implementations by name, through one resolver (``get_implementation``), in this order:

1. ``sglang`` and ``seed`` (adapters/sglang.py: a controller file read from a source tree);
2. ``mutant:<name>`` (fuzz/mutants/<name>.py), ``unguarded:<entry>`` (a mutant's name or an
   outside ``pkg.module:factory`` with the ``guards`` capability off, built from the name alone,
   so any process rebuilds it) and the built-in table ``BUILT_IN`` (``reference``);
3. names an installed package registers in the ``hicache_ref.implementations`` entry-point
   group (``[project.entry-points."hicache_ref.implementations"] my_impl = "pkg.mod:factory"``);
4. ``pkg.module:factory``: imported from the path, ``factory`` a class or function returning an
   implementation (or an implementation object itself).

Whatever the source, the result goes through ``contract.adopt`` (its required hooks checked,
its optional ones read once); ``checked_implementation`` also runs the contract's preflight
(``contract.check_contract``), once per name in a process (a bounded memo). Nothing registers a
name at run time: a new implementation is a row of ``BUILT_IN`` (inside this project), an entry
point or a ``pkg.module:factory`` (outside it). A trace header names its
implementation (the name as given: a ``pkg.module:factory`` too) and, for sglang trees, the
tree, so a replay rebuilds the same one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hicache_ref.errors import UnknownOptionError
from hicache_ref.harness.adapters.contract import (
    ContractError,
    ImplementationBase,
    adopt,
    check_contract,
)
from hicache_ref.harness.adapters.mutant import UNGUARDED_PREFIX, unguarded, without_guards
from hicache_ref.harness.adapters.reference import ReferenceImplementation

MUTANTS_DIR_ENV = "HICACHE_MUTANTS_DIR"
ENTRY_POINT_GROUP = "hicache_ref.implementations"
_SPEC = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*):([A-Za-z_][\w]*)$")
CHECKED_NAMES_MAX = 64
"""Implementations ``checked_implementation`` remembers (a process gates a handful)."""


def _sglang(source: str = "") -> ImplementationBase:
    from hicache_ref.harness.adapters.sglang import SglangImplementation

    return SglangImplementation(_source_tree(source))


def _seed(source: str = "") -> ImplementationBase:
    from hicache_ref.harness.adapters.sglang import SeedImplementation

    return SeedImplementation(_source_tree(source))


def _source_tree(source: str) -> Path | None:
    """The tree the caller chose (``--sglang-src``, a release, a trace's recorded tree), checked;
    None lets the implementation pick its default (``sglang_tree.resolve_tree``)."""
    from hicache_ref.harness.adapters.sglang_tree import check_tree

    return check_tree(Path(source)) if source else None


_SOURCED: dict[str, Callable[[str], ImplementationBase]] = {
    "sglang": _sglang,  # upstream's controller from the given tree (default: 0.5.10 wheel)
    "seed": _seed,  # the CP/draft fork: the given tree, or one built from HICACHE_SEED_FILE
}
"""Implementations whose code lives in a source tree (a trace header records it)."""

BUILT_IN: Mapping[str, Callable[[], object]] = MappingProxyType(
    {
        "reference": ReferenceImplementation,
    }
)
"""Implementations of this project known by a plain name (read-only: a new one is a row here)."""


def mutants_dir() -> Path:
    env = os.environ.get(MUTANTS_DIR_ENV)
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in [Path.cwd(), *here.parents]:
        candidate = parent / "fuzz" / "mutants"
        if candidate.is_dir():
            return candidate
    return Path("fuzz/mutants")


def load_mutant_module(name: str) -> Any:
    path = mutants_dir() / f"{name}.py"
    if not path.is_file():
        known = ", ".join(sorted(list_mutants())) or "none found"
        raise UnknownOptionError(f"no mutant {name!r} at {path}; known mutants: {known}")
    spec = importlib.util.spec_from_file_location(f"hicache_mutant_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def list_mutants() -> list[str]:
    directory = mutants_dir()
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.py") if not p.stem.startswith("_"))


def get_implementation(name: str, source: str = "") -> ImplementationBase:
    """The implementation called ``name``; ``source`` is the sglang tree a ``sglang`` or
    ``seed`` implementation reads (``--sglang-src``, a release's tree, a trace's recorded tree;
    empty: ``HICACHE_SGLANG_SRC``, else the default tree)."""
    if name in _SOURCED:
        return _SOURCED[name](source)
    if name.startswith("mutant:"):
        module = load_mutant_module(name.split(":", 1)[1])
        return adopt(module.implementation(), name)
    if name.startswith(UNGUARDED_PREFIX):
        return adopt(_unguarded(name.removeprefix(UNGUARDED_PREFIX)), name)
    factory = BUILT_IN.get(name)
    if factory is not None:
        return adopt(factory(), name)
    entry = _entry_points().get(name)
    if entry is not None:
        return adopt(_call_factory(_load_entry_point(name, entry), name), name)
    if _SPEC.match(name):
        return adopt(_call_factory(_import_spec(name), name), name)
    raise UnknownOptionError(
        f"unknown implementation {name!r}; legal: {', '.join(sorted(known_names()))}, "
        "mutant:<name>, or pkg.module:factory (an importable factory)"
    )


def _unguarded(entry: str) -> object:
    """Catalogue entry ``entry`` with ``guards`` off: an outside ``pkg.module:factory`` (it has a
    colon) wrapped, a mutant of ``fuzz/mutants`` rebuilt without them."""
    if ":" in entry:
        return unguarded(get_implementation(entry))
    return without_guards(load_mutant_module(entry).implementation())


@functools.lru_cache(maxsize=CHECKED_NAMES_MAX)
def checked_implementation(name: str, source: str = "") -> ImplementationBase:
    """``get_implementation``, after the contract's preflight (once per name and source; a
    contract break raises every time)."""
    implementation = get_implementation(name, source)
    check_contract(implementation)
    return implementation


def known_names() -> list[str]:
    """Names ``get_implementation`` knows without a path: built in and entry points."""
    return sorted({*BUILT_IN, *_SOURCED, *_entry_points()})


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_entry_point(name: str, entry: importlib.metadata.EntryPoint) -> object:
    try:
        return entry.load()
    except Exception as exc:
        raise ContractError(
            f"implementation {name!r} (entry point {entry.value!r} of group "
            f"{ENTRY_POINT_GROUP!r}) cannot be loaded ({type(exc).__name__}: {exc}); fix or "
            "reinstall the package that registers it"
        ) from None


def _import_spec(spec: str) -> object:
    module_name, attribute = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ContractError(
            f"--impl {spec}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            "install its package or put its folder on PYTHONPATH"
        ) from None
    if not hasattr(module, attribute):
        raise ContractError(
            f"--impl {spec}: module {module_name!r} has no {attribute!r}; name a class or "
            "function that returns an implementation (pkg.module:factory)"
        )
    return getattr(module, attribute)


def _call_factory(found: object, origin: str) -> object:
    """A factory's implementation: a class or function is called, an implementation kept."""
    if isinstance(found, type) or (callable(found) and not hasattr(found, "build_controller")):
        try:
            return found()
        except Exception as exc:
            raise ContractError(
                f"implementation {origin!r}: its factory raised {type(exc).__name__}: {exc} "
                "(a factory takes no arguments and returns an implementation)"
            ) from None
    return found
