"""Fault injection: chosen or seeded page faults, the same for the same seed in any order."""

from __future__ import annotations

import pytest
import torch

from hicache_ref.errors import HiCacheInputError
from hicache_ref.storage.fault_injection import (
    FaultInjectingStorage,
    InjectedBackendError,
    InjectedFault,
)
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
        "FaultInjectingStorage(inner, seed=3, rank=0, get_fail_pages=['x', 2], "
        "set_fail_pages=[], fail_rate=0.1, delay_s_max=0.0)"
    )
    rebuilt = eval(
        store.replay_line(),
        {"FaultInjectingStorage": FaultInjectingStorage, "inner": MemoryStorage()},
    )
    assert rebuilt.replay_line() == store.replay_line()


@pytest.mark.parametrize("kwargs", [{"fail_rate": 1.5}, {"drop_rate": -0.1}])
def test_rates_outside_zero_one_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(HiCacheInputError, match="must lie in \\[0, 1\\]"):
        FaultInjectingStorage(MemoryStorage(), seed=0, **kwargs)  # type: ignore[arg-type]


def test_page_choices_must_be_keys_or_ordinals() -> None:
    with pytest.raises(HiCacheInputError, match="page keys \\(str\\) or page ordinals"):
        FaultInjectingStorage(MemoryStorage(), seed=0, get_fail_pages=[-1])


def test_a_miss_ends_the_hit_run_at_a_page_that_is_stored() -> None:
    store = stocked(seed=5, miss_rate=0.5)
    run = store.batch_exists(KEYS)
    assert run < len(KEYS) and store.inner.batch_exists(KEYS) == len(KEYS)
    assert store.faults[-1].kind == "exists_miss" and store.faults[-1].key == KEYS[run]


def test_a_short_read_reports_the_page_unreadable_after_touching_the_target() -> None:
    store = stocked(seed=0, short_read_rate=1.0)
    target = torch.full((4,), -1.0)
    assert store.batch_get(["k3"], [target]) == [None]
    assert store.fault_counts["short_read"] == 1
    assert not torch.equal(target, torch.full((4,), -1.0))  # the target was partly written


def test_raise_makes_the_backend_fail_loudly_and_delays_only_slow_it() -> None:
    store = stocked(seed=0, raise_rate=1.0)
    with pytest.raises(InjectedBackendError, match="injected: the storage backend failed"):
        store.batch_get(["k0"], [torch.zeros(4)])
    slow = stocked(seed=0, delay_rate=1.0, delay_s_max=0.001)
    assert slow.batch_exists(KEYS[:3]) == 3 and slow.fault_counts["delay"] == 3


def test_ranks_with_one_seed_draw_different_faults() -> None:
    rank0 = set(failed_gets(stocked(seed=7, fail_rate=0.3, rank=0), KEYS))
    rank1 = set(failed_gets(stocked(seed=7, fail_rate=0.3, rank=1), KEYS))
    assert rank0 != rank1
    assert rank1 == set(failed_gets(stocked(seed=7, fail_rate=0.3, rank=1), KEYS))


def test_a_dropped_page_is_remembered_as_lost() -> None:
    store = FaultInjectingStorage(MemoryStorage(), seed=1, drop_rate=1.0)
    store.set("a", pages(1)[0])
    assert store.dropped_keys == {"a"}


def test_an_armed_fault_hits_the_next_pages_once() -> None:
    store = stocked(seed=0)
    store.arm("get_fail", pages=2)
    assert failed_gets(store, KEYS[:4]) == ["k0", "k1"]
    assert failed_gets(store, KEYS[:4]) == []
    store.arm("exists_miss")
    assert store.batch_exists(KEYS[:4]) == 0 and store.batch_exists(KEYS[:4]) == 4
    with pytest.raises(HiCacheInputError, match="cannot arm fault 'delay'"):
        store.arm("delay")
