"""Fault injection: chosen or seeded page faults, the same for the same seed in any order."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.fault_injection import FaultInjectingStorage, InjectedFault
from hicache_ref.storage.memory_backend import MemoryStorage

KEYS = [f"k{i}" for i in range(40)]


def pages(n: int) -> list[torch.Tensor]:
    return [torch.full((4,), float(i)) for i in range(n)]


def stocked(**kwargs: object) -> FaultInjectingStorage:
    inner = MemoryStorage()
    inner.batch_set(KEYS, pages(len(KEYS)))
    return FaultInjectingStorage(inner, **kwargs)  # type: ignore[arg-type]


def failed_gets(store: FaultInjectingStorage, keys: list[str]) -> list[str]:
    got = store.batch_get(keys, [torch.zeros(4) for _ in keys])
    return [key for key, page in zip(keys, got, strict=True) if page is None]


def test_get_fail_by_key_reads_none_but_the_page_still_exists() -> None:
    store = stocked(seed=0, get_fail_pages=["k2"])
    assert failed_gets(store, KEYS[:4]) == ["k2"]
    assert store.exists("k2") and store.batch_exists(KEYS[:4]) == 4


def test_get_fail_by_ordinal_counts_page_gets_from_zero() -> None:
    store = stocked(seed=0, get_fail_pages=[1, 5])
    assert failed_gets(store, KEYS[:3]) == ["k1"]
    assert failed_gets(store, KEYS[:3]) == ["k2"]  # ordinals 3, 4, 5


def test_same_seed_same_faults_in_any_order() -> None:
    a = stocked(seed=7, fail_rate=0.3)
    b = stocked(seed=7, fail_rate=0.3)
    forward = set(failed_gets(a, KEYS))
    backward = set(failed_gets(b, list(reversed(KEYS))))
    assert forward == backward and 0 < len(forward) < len(KEYS)
    assert set(failed_gets(stocked(seed=8, fail_rate=0.3), KEYS)) != forward


def test_set_fail_stops_the_batch_and_keeps_earlier_pages() -> None:
    store = FaultInjectingStorage(MemoryStorage(), seed=0, set_fail_pages=["b"])
    assert not store.batch_set(["a", "b", "c"], pages(3))
    assert store.batch_exists(["a", "b", "c"]) == 1
    assert not store.exists("c")
    assert store.faults == [InjectedFault("set_fail", "b", 1)]


def test_dropped_set_reports_success_but_stores_nothing() -> None:
    store = FaultInjectingStorage(MemoryStorage(), seed=1, drop_rate=1.0)
    assert store.batch_set(["a", "b"], pages(2))
    assert store.batch_exists(["a", "b"]) == 0
    assert store.fault_counts["set_drop"] == 2


def test_fault_plan_prints_as_one_replayable_line() -> None:
    store = FaultInjectingStorage(MemoryStorage(), seed=3, get_fail_pages=["x", 2], fail_rate=0.1)
    assert store.replay_line() == (
        "FaultInjectingStorage(inner, seed=3, fail_rate=0.1, get_fail_pages=['x', 2], "
        "set_fail_pages=[], drop_rate=0.0)"
    )


@pytest.mark.parametrize("kwargs", [{"fail_rate": 1.5}, {"drop_rate": -0.1}])
def test_rates_outside_zero_one_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(HiCacheInputError, match="must lie in \\[0, 1\\]"):
        FaultInjectingStorage(MemoryStorage(), seed=0, **kwargs)  # type: ignore[arg-type]


def test_page_choices_must_be_keys_or_ordinals() -> None:
    with pytest.raises(HiCacheInputError, match="page keys \\(str\\) or page ordinals"):
        FaultInjectingStorage(MemoryStorage(), seed=0, get_fail_pages=[-1])
