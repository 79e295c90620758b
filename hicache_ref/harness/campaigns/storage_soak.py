"""A real-thread soak of the storage tier: ranks, faults, resets, a detach, and what was lost.

``run_soak(SoakConfig)`` builds ``ranks`` tiers on the thread executor (the production one)
over one shared L3 (a ``MemoryStore`` or one directory), each behind a seeded fault wrapper, and
drives them through ``StorageTree`` (the tree's half) for ``seconds``: chains of pages are backed
up and prefetched back, prefetches are terminated by a timeout policy, every few seconds every
rank is reset with work in flight, and at the end every rank is detached. The first part of the
run has faults off: its rate is the same-run baseline.

Every page a prefetch brings back is compared with the bytes the soak's own content function
wrote for that chain and rank; at the end every host page must be free again. The report counts
leaked pages, double frees, threads alive after detach, pages read back (and how many differed),
collective violations and operations per second.
"""

from __future__ import annotations

import hashlib
import random
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache_ref.controller.storage import RankGroup, StorageTier, detach_ranks, reset_ranks
from hicache_ref.controller.storage_facade import StorageFacade
from hicache_ref.device import SimDevice
from hicache_ref.errors import DoubleFreeError, ForeignSlotError, HiCacheInputError
from hicache_ref.harness.driver.storage_tree import EventFn, InsertFn, StorageTree, StorageTreeRank
from hicache_ref.pools import HostKVCache, MHATokenToKVPool, make_host_pool
from hicache_ref.storage.backend import HiCacheStorage, HiCacheStorageConfig
from hicache_ref.storage.factory import StorageBackendFactory
from hicache_ref.storage.fault_injection import FaultInjectingStorage
from hicache_ref.storage.file_backend import FileStorage
from hicache_ref.storage.memory_backend import MemoryStorage, MemoryStore
from hicache_ref.storage.operations import PrefetchOperation
from hicache_ref.storage.protocols import StorageHostPool

SOAK_BACKENDS = ("memory", "file")
FAULT_RATES: Mapping[str, float] = {
    "fail_rate": 0.02,
    "miss_rate": 0.02,
    "short_read_rate": 0.02,
    "drop_rate": 0.01,
    "raise_rate": 0.005,
    "delay_rate": 0.05,
}
DELAY_S_MAX = 0.002
BASELINE_SHARE = 0.2
"""Share of the run with faults off (the same-run baseline)."""


@dataclass(frozen=True)
class SoakConfig:
    seconds: float = 180.0
    ranks: int = 4
    backend: str = "memory"
    seed: int = 0
    page_size: int = 4
    host_tokens: int = 1024
    batch_pages: int = 2
    chains: int = 24
    reset_every_s: float = 5.0
    faults: bool = True


@dataclass
class SoakReport:
    seconds: float
    ranks: int
    backend: str
    backups: int = 0
    prefetches: int = 0
    pages_read_back: int = 0
    pages_mismatched: int = 0
    leaked_pages: int = 0
    double_frees: int = 0
    threads_alive_after_detach: int = 0
    resets: int = 0
    violations: list[str] = field(default_factory=list)
    thread_errors: list[str] = field(default_factory=list)
    faults_injected: int = 0
    ops_per_s_faults: float = 0.0
    ops_per_s_baseline: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def clean(self) -> bool:
        return not (
            self.pages_mismatched
            or self.leaked_pages
            or self.double_frees
            or self.threads_alive_after_detach
            or self.violations
            or self.thread_errors
        )


class CountingPool:
    """A host pool whose refused frees are counted (a double free must never happen)."""

    def __init__(self, pool: HostKVCache, report: SoakReport) -> None:
        self.pool, self.report = pool, report

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def free(self, indices: torch.Tensor) -> int:
        try:
            return self.pool.free(indices)
        except (DoubleFreeError, ForeignSlotError) as exc:
            self.report.double_frees += 1
            self.report.violations.append(str(exc))
            return 0


def page_bytes(rank: int, tokens: tuple[int, ...], numel: int) -> torch.Tensor:
    """The soak's content function: the flat page of the page ending ``tokens`` on ``rank``."""
    digest = hashlib.sha256(repr((rank, tokens)).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.rand(numel, generator=generator)


@dataclass
class Soak:
    config: SoakConfig
    report: SoakReport
    group: RankGroup
    tiers: list[StorageTier]
    pools: list[HostKVCache]
    tree: StorageTree
    chains: list[tuple[int, ...]]
    rng: random.Random
    names: list[str]
    faulty: list[FaultInjectingStorage] = field(default_factory=list)
    sources: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    next_rid: int = 0

    # -- the tree's callbacks ----------------------------------------------------------------------
    def verify_insert(self, rank: int, host: torch.Tensor, tokens: tuple[int, ...]) -> int:
        """Compare each fetched page with the content function; all of it goes back (matched)."""
        page = self.config.page_size
        pool = self.pools[rank]
        numel = pool.get_dummy_flat_data_page().numel()
        for i in range(host.numel() // page):
            want = page_bytes(rank, tokens[: (i + 1) * page], numel)
            got = pool.get_data_page(int(host[i * page]), True)
            self.report.pages_read_back += 1
            if not torch.equal(got, want):
                self.report.pages_mismatched += 1
        return int(host.numel())

    def insert_callback(self, rank: int) -> InsertFn:
        def on_insert(rid: str, operation: PrefetchOperation, host: torch.Tensor) -> int:
            tokens = tuple(int(t) for t in operation.token_ids[: host.numel()])  # type: ignore[arg-type]
            return self.verify_insert(rank, host, tokens)

        return on_insert

    def event_callback(self, rank: int) -> EventFn:
        return lambda kind, data: self.on_event(rank, kind, data)

    def on_event(self, rank: int, kind: str, data: dict[str, Any]) -> None:
        if kind == "backup_ack" and data["node"] is not None:
            source = self.sources.pop((rank, int(data["operation"].id)), None)
            if source is not None:
                self.tree.ranks[rank].host_pool.free(source)

    # -- the workload ------------------------------------------------------------------------------
    def back_up(self, chain: tuple[int, ...]) -> bool:
        page = self.config.page_size
        hosts = [pool.alloc(len(chain)) for pool in self.pools]
        if any(h is None for h in hosts):
            for pool, host in zip(self.pools, hosts, strict=True):
                if host is not None:
                    pool.free(host)
            return False
        for rank, (tree_rank, host) in enumerate(zip(self.tree.ranks, hosts, strict=True)):
            assert host is not None
            numel = self.pools[rank].get_dummy_flat_data_page().numel()
            for i in range(len(chain) // page):
                data = page_bytes(rank, chain[: (i + 1) * page], numel)
                self.pools[rank].set_from_flat_data_page(int(host[i * page]), data)
            op_id = tree_rank.write_backup_storage(("backup", self.next_rid), host, list(chain))
            self.sources[(rank, op_id)] = host
        self.next_rid += 1
        self.report.backups += 1
        return True

    def prefetch(self, chain: tuple[int, ...]) -> None:
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        started = [
            tree_rank.prefetch_from_storage(rid, "root", list(chain))
            for tree_rank in self.tree.ranks
        ]
        if all(op is not None for op in started):
            self.report.prefetches += 1

    def poll_prefetches(self) -> None:
        rids = sorted(set.intersection(*(set(r.ongoing_prefetch) for r in self.tree.ranks)))
        for rid in rids:
            for tree_rank in self.tree.ranks:
                tree_rank.check_prefetch_progress(rid)

    def reset(self) -> None:
        reset_ranks(self.tiers, self.group)
        self.tree.reset()
        for pool in self.pools:
            pool.clear()
        self.sources.clear()
        self.report.resets += 1

    def iterate(self) -> None:
        chain = self.rng.choice(self.chains)
        if self.rng.random() < 0.4:
            self.back_up(chain)
        else:
            self.prefetch(chain)
        self.tree.drain_storage_control_queues()
        self.poll_prefetches()

    def settle(self, timeout_s: float = 30.0) -> None:
        """Drain until nothing moves (threads finish their queued work meanwhile)."""
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while quiet < 20 and time.monotonic() < deadline:
            taken = self.tree.drain_storage_control_queues()
            busy = any(t.enable_storage and t.has_any_work() for t in self.tiers)
            quiet = 0 if (taken or busy) else quiet + 1
            time.sleep(0.001)

    def finish(self) -> None:
        """Detach every rank (terminates what runs), drain, and count what was not given back."""
        for tree_rank in self.tree.ranks:
            for rid in list(tree_rank.ongoing_prefetch):
                tree_rank.terminate(rid)
        self.settle()
        detach_ranks(self.tiers, self.group)
        self.settle()
        self.report.threads_alive_after_detach = sum(len(t.alive_threads()) for t in self.tiers)
        for tier in self.tiers:
            self.report.thread_errors.extend(repr(e) for e in tier.thread_errors)
        self.report.violations.extend(str(v) for v in self.group.violations)
        self.report.leaked_pages = sum(
            (pool.size - pool.available_size()) // self.config.page_size for pool in self.pools
        )
        self.report.faults_injected = sum(sum(f.fault_counts.values()) for f in self.faulty)
        for name in self.names:
            StorageBackendFactory.unregister_backend(name)


def _make_chains(config: SoakConfig, rng: random.Random) -> list[tuple[int, ...]]:
    """Chains of 1-6 pages that share prefixes (a chain often extends an earlier one)."""
    page = config.page_size
    chains: list[tuple[int, ...]] = []
    for _ in range(config.chains):
        base = rng.choice(chains) if chains and rng.random() < 0.6 else ()
        extra = tuple(rng.randrange(0, 64) for _ in range(page * rng.randint(1, 3)))
        chains.append((base + extra)[: 6 * page])
    return chains


def build_soak(config: SoakConfig, root: Path) -> Soak:
    if config.backend not in SOAK_BACKENDS:
        raise HiCacheInputError(
            f"unknown soak backend {config.backend!r}; legal values: {', '.join(SOAK_BACKENDS)}"
        )
    report = SoakReport(config.seconds, config.ranks, config.backend)
    group = RankGroup(config.ranks, timeout_s=10.0)
    store = MemoryStore()
    rng = random.Random(config.seed)
    pools = [
        make_host_pool(
            MHATokenToKVPool(64, config.page_size, torch.float32, 2, 4, 2, SimDevice()),
            layout="layer_first",
            size_tokens=config.host_tokens,
        )
        for _ in range(config.ranks)
    ]
    tiers: list[StorageTier] = []
    names: list[str] = []
    soak = Soak(
        config, report, group, tiers, pools, StorageTree([]), _make_chains(config, rng), rng, names
    )
    for rank, pool in enumerate(pools):
        name = f"soak-{id(soak)}-r{rank}"

        def build(
            cfg: HiCacheStorageConfig,
            host: StorageHostPool | None,
            extra: Mapping[str, object],
            rank: int = rank,
        ) -> HiCacheStorage:
            inner: HiCacheStorage = (
                MemoryStorage(cfg, store) if config.backend == "memory" else FileStorage(root, cfg)
            )
            faulty = FaultInjectingStorage(
                inner, seed=config.seed, rank=rank, delay_s_max=DELAY_S_MAX
            )
            soak.faulty.append(faulty)  # rates set by _set_faults
            return faulty

        StorageBackendFactory.register_backend(name, build)
        names.append(name)
        tier = StorageTier(pool, object(), config.page_size, collectives=group.view(rank))
        tier.attach_storage_backend(name, prefetch_threshold=config.page_size)
        tier.storage_batch_size = config.batch_pages
        tiers.append(tier)
        facade = StorageFacade()
        facade.storage = tier
        soak.tree.ranks.append(
            StorageTreeRank(
                facade,
                CountingPool(pool, report),
                config.page_size,
                on_insert=soak.insert_callback(rank),
                on_event=soak.event_callback(rank),
                policy="timeout",
                timeout_steps=8,
            )
        )
    return soak


def _set_faults(soak: Soak, on: bool) -> None:
    for faulty in soak.faulty:
        faulty.rates = (
            dict(FAULT_RATES) if on and soak.config.faults else dict.fromkeys(FAULT_RATES, 0.0)
        )


def run_soak(config: SoakConfig) -> SoakReport:
    """Run the soak for ``config.seconds``; the report says what, if anything, went wrong."""
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as tmp:
        soak = build_soak(config, Path(tmp))
        report = soak.report
        start = time.monotonic()
        baseline_end = start + config.seconds * BASELINE_SHARE
        end = start + config.seconds
        next_reset = baseline_end + config.reset_every_s
        counts = {"baseline": 0, "faults": 0}
        _set_faults(soak, on=False)
        faults_on = False
        try:
            while (now := time.monotonic()) < end:
                if not faults_on and now >= baseline_end:
                    _set_faults(soak, on=True)
                    faults_on = True
                if faults_on and now >= next_reset:
                    soak.reset()
                    next_reset = now + config.reset_every_s
                soak.iterate()
                counts["faults" if faults_on else "baseline"] += 1
        finally:
            soak.finish()
        elapsed_baseline = max(1e-9, baseline_end - start)
        elapsed_faults = max(1e-9, end - baseline_end)
        report.ops_per_s_baseline = counts["baseline"] / elapsed_baseline
        report.ops_per_s_faults = counts["faults"] / elapsed_faults
        return report
