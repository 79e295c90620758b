"""Implementations by name: ``reference``, ``sglang`` and ``seed`` (adapters/sglang.py),
``mutant:<name>`` (fuzz/mutants/<name>.py), and any registered adapter. A trace header names
its implementation (and, for sglang trees, the tree), so a replay rebuilds the same one.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache_ref.errors import UnknownOptionError
from hicache_ref.harness.adapters.base import Implementation
from hicache_ref.harness.adapters.reference import ReferenceImplementation

MUTANTS_DIR_ENV = "HICACHE_MUTANTS_DIR"


def _sglang(source: str = "") -> Implementation:
    from hicache_ref.harness.adapters.sglang import SglangImplementation

    return SglangImplementation(_source_tree(source))


def _seed(source: str = "") -> Implementation:
    from hicache_ref.harness.adapters.sglang import SeedImplementation

    return SeedImplementation(_source_tree(source))


def _source_tree(source: str) -> Path | None:
    """A trace's recorded tree, unless ``--sglang-src`` / ``HICACHE_SGLANG_SRC`` names one."""
    from hicache_ref.harness.adapters.sglang_tree import SRC_ENV, check_tree

    if not source or os.environ.get(SRC_ENV):
        return None
    return check_tree(Path(source))


_SOURCED: dict[str, Callable[[str], Implementation]] = {
    "sglang": _sglang,  # upstream's controller from HICACHE_SGLANG_SRC (default: 0.5.10 wheel)
    "seed": _seed,  # the CP/draft fork: HICACHE_SGLANG_SRC or HICACHE_SEED_FILE
}
"""Implementations whose code lives in a source tree (a trace header records it)."""

_FACTORIES: dict[str, Callable[[], Implementation]] = {
    "reference": ReferenceImplementation,
}


def register_implementation(name: str, factory: Callable[[], Implementation]) -> None:
    _FACTORIES[name] = factory


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


def get_implementation(name: str, source: str = "") -> Implementation:
    """The implementation called ``name``; ``source`` is a trace's recorded source tree."""
    if name in _SOURCED:
        return _SOURCED[name](source)
    if name.startswith("mutant:"):
        module = load_mutant_module(name.split(":", 1)[1])
        impl: Implementation = module.implementation()
        return impl
    factory = _FACTORIES.get(name)
    if factory is None:
        legal = ", ".join(sorted([*_FACTORIES, *_SOURCED])) + ", mutant:<name>"
        raise UnknownOptionError(f"unknown implementation {name!r}; legal: {legal}")
    return factory()
