"""The checker registry: every invariant id has one checker, named after it, citing it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from hicache_ref.invariants import (
    checks_storage_buffer,
    checks_storage_l3,
    checks_storage_pp,
    checks_storage_prefetch,
    checks_storage_side,
    checks_storage_windows,
    registry,
)
from hicache_ref.invariants.registry import REGISTERED

IDS_FILE = Path(__file__).resolve().parents[2] / "specs" / "invariant_ids.txt"


def read_invariant_ids() -> list[str]:
    return [line.split()[0] for line in IDS_FILE.read_text().splitlines() if line.strip()]


def test_every_harness_invariant_has_one_checker_named_after_it() -> None:
    assert sorted(REGISTERED) == read_invariant_ids()
    for inv_id, checker in REGISTERED.items():
        number = inv_id.removeprefix("INV-")
        assert re.fullmatch(rf"check_inv_{number}_\w+", checker.__name__), checker.__name__


def test_every_checker_cites_the_invariant_it_is_registered_for() -> None:
    # the spec names, the code enforces: a checker's source names the id it checks
    for inv_id, checker in REGISTERED.items():
        assert inv_id in inspect.getsource(checker), f"{checker.__name__} does not cite {inv_id}"


def test_every_check_inv_function_is_registered() -> None:
    modules = [
        registry,
        checks_storage_l3,
        checks_storage_prefetch,
        checks_storage_windows,
        checks_storage_pp,
        checks_storage_side,
        checks_storage_buffer,
    ]
    public = {
        name
        for module in modules
        for name, _ in inspect.getmembers(module)
        if name.startswith("check_inv_")
    }
    assert public == {checker.__name__ for checker in REGISTERED.values()}
