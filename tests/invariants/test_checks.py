"""The checker registry: every invariant id has a checker, and every checker cites its id."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from hicache_ref.invariants import checks
from hicache_ref.invariants.checks import CHECKERS_BY_INVARIANT

IDS_FILE = Path(__file__).resolve().parents[2] / "specs" / "invariant_ids.txt"


def read_invariant_ids() -> list[str]:
    return [line.split()[0] for line in IDS_FILE.read_text().splitlines() if line.strip()]


def test_every_invariant_id_has_a_checker() -> None:
    assert sorted(CHECKERS_BY_INVARIANT) == read_invariant_ids()
    assert all(CHECKERS_BY_INVARIANT.values())


def test_every_checker_cites_the_invariant_it_is_registered_for() -> None:
    # the spec names, the code enforces: a checker's source names each id it checks
    for inv_id, checkers in CHECKERS_BY_INVARIANT.items():
        for checker in checkers:
            assert inv_id in inspect.getsource(checker), (
                f"{checker.__name__} does not cite {inv_id}"
            )


def test_every_public_checker_is_registered() -> None:
    registered = {c.__name__ for group in CHECKERS_BY_INVARIANT.values() for c in group}
    public = {name for name in checks.__all__ if re.fullmatch(r"check_\w+", name)}
    assert public == registered
