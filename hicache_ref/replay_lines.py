"""The command lines hicache-fuzz prints for a person to paste: each one runs as printed.

A bare ``hicache-fuzz replay ...`` is ``command not found`` in a shell where the venv is not
activated, so the printed command names this interpreter's console script by its absolute path
(``.venv/bin/hicache-fuzz`` beside ``sys.executable``) or, where no script is installed there
(a ``--user`` install, a source checkout on ``PYTHONPATH``), ``python -m hicache_ref.cli`` with
the absolute interpreter. Paths are absolute too, so the line works from any folder, and the
line starts with the environment the run needed that a fresh shell lacks
(``get_line_environment``): ``PYTHONPATH`` with the folder an outside package
(``--impl pkg.module:factory``) or this checkout was imported from, and the mutants folder when
``HICACHE_MUTANTS_DIR`` moved it. A tree the run read travels as ``--sglang-src`` (a rerun) or
in the trace's header (a replay).
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
from pathlib import Path

PROG = "hicache-fuzz"
MUTANTS_DIR_ENV = "HICACHE_MUTANTS_DIR"


def get_cli_command() -> str:
    """How to start this hicache-fuzz from any shell, quoted for it."""
    script = Path(sys.executable).parent / PROG
    if script.is_file() and os.access(script, os.X_OK):
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m hicache_ref.cli"


@functools.lru_cache(maxsize=32)
def _found_by_a_fresh_shell(top: str) -> bool:
    """Whether this interpreter, started from another folder without ``PYTHONPATH``, finds the
    top-level module ``top`` (an installed package, an editable install: yes; a folder put on
    ``sys.path`` by this process or its ``PYTHONPATH``: no). Asked once per name."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    code = "import importlib.util, sys; print(importlib.util.find_spec(sys.argv[1]) is not None)"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, top],
            env=env,
            cwd=Path(sys.executable).anchor,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.stdout.strip() == "True"


def get_import_root(module_name: str) -> Path | None:
    """The folder ``module_name``'s top-level package was imported from, when a fresh shell's
    interpreter would not find it there by itself (None: it would, or it is not imported)."""
    top_name = module_name.split(".")[0]
    top = sys.modules.get(top_name)
    file = getattr(top, "__file__", None)
    if not file or _found_by_a_fresh_shell(top_name):
        return None
    path = Path(file).resolve()
    return path.parent.parent if path.name == "__init__.py" else path.parent


def get_line_environment(implementations: tuple[str, ...] = ()) -> dict[str, str]:
    """The variables a pasted line needs: ``PYTHONPATH`` for this package and any outside
    ``pkg.module:factory`` implementation imported from a folder the interpreter does not
    search by itself, and ``HICACHE_MUTANTS_DIR`` when it is set."""
    roots: list[str] = []
    for module in ("hicache_ref", *(name.split(":")[0] for name in implementations if ":" in name)):
        if module.startswith("mutant") or module.startswith("unguarded"):
            continue
        root = get_import_root(module)
        if root is not None and str(root) not in roots:
            roots.append(str(root))
    environment = {"PYTHONPATH": os.pathsep.join(roots)} if roots else {}
    mutants = os.environ.get(MUTANTS_DIR_ENV)
    if mutants:
        environment[MUTANTS_DIR_ENV] = str(Path(mutants).resolve())
    return environment


def _prefix(implementations: tuple[str, ...]) -> str:
    environment = get_line_environment(implementations)
    return "".join(f"{key}={shlex.quote(value)} " for key, value in environment.items())


def get_replay_line(trace: Path | str, implementation: str = "") -> str:
    """``[ENV=...] <hicache-fuzz> replay <absolute trace path>`` (``implementation``: the one
    the trace names, whose package the line must be able to import)."""
    path = shlex.quote(str(Path(trace).absolute()))
    return f"{_prefix((implementation,))}{get_cli_command()} replay {path}"


def get_rerun_line(
    implementation: str, profile: str, seed: int, device: str, source: str = ""
) -> str:
    """The campaign of one round, for a failure that left no trace (it failed outside a step)."""
    where = "" if device == "sim" else f" --device {device}"
    tree = f" --sglang-src {shlex.quote(source)}" if source else ""
    return (
        f"{_prefix((implementation,))}{get_cli_command()} run --impl {shlex.quote(implementation)}"
        f"{tree} --profile {profile} --seed {seed} --workers 1{where}"
    )


def get_vector_line(
    implementation: str, vector_id: str, suite: Path | str, source: str = ""
) -> str:
    """``hicache-fuzz vectors replay`` of one vector: the suite first, then ``--only`` (which
    takes every word after it)."""
    tree = f" --sglang-src {shlex.quote(source)}" if source else ""
    return (
        f"{_prefix((implementation,))}{get_cli_command()} vectors replay "
        f"{shlex.quote(str(Path(suite).absolute()))} --impl {shlex.quote(implementation)}{tree} "
        f"--only {shlex.quote(vector_id)}"
    )
