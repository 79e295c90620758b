"""The command lines hicache-fuzz prints for a person to paste: each one runs as printed.

A bare ``hicache-fuzz replay ...`` is ``command not found`` in a shell where the venv is not
activated, so the printed command names this interpreter's console script by its absolute path
(``.venv/bin/hicache-fuzz`` beside ``sys.executable``) or, where no script is installed there
(a ``--user`` install, a source checkout on ``PYTHONPATH``), ``python -m hicache_ref.cli`` with
the absolute interpreter. Paths are absolute too, so the line works from any folder.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

PROG = "hicache-fuzz"


def get_cli_command() -> str:
    """How to start this hicache-fuzz from any shell, quoted for it."""
    script = Path(sys.executable).parent / PROG
    if script.is_file() and os.access(script, os.X_OK):
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m hicache_ref.cli"


def get_replay_line(trace: Path | str) -> str:
    """``<hicache-fuzz> replay <absolute trace path>``."""
    return f"{get_cli_command()} replay {shlex.quote(str(Path(trace).absolute()))}"


def get_rerun_line(implementation: str, profile: str, seed: int, device: str) -> str:
    """The campaign of one round, for a failure that left no trace (it failed outside a step)."""
    where = "" if device == "sim" else f" --device {device}"
    return (
        f"{get_cli_command()} run --impl {shlex.quote(implementation)} --profile {profile} "
        f"--seed {seed} --workers 1{where}"
    )
