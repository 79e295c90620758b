"""A shared failure database: what one worker finds, every later worker replays first.

The database is Hypothesis' own (a folder, a real redis-server on loopback, or the developer
split); each story below runs on a server its test started (``conftest.redis_url``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis.extra.redis import RedisExampleDatabase
from redis import Redis

from hicache_ref.campaign.report import CampaignReport
from hicache_ref.campaign.summary import render_summary
from hicache_ref.errors import HiCacheSetupError
from hicache_ref.fleet.database import DatabaseSpec, check_database, parse_database
from hicache_ref.fleet.shards import SeedLane, Shard
from hicache_ref.fleet.workers import WorkerTask, run_worker
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Step, Trace, TraceHeader
from hicache_ref.harness.world.config import HarnessConfig

MUTANT = "mutant:double_free_host_slot"
"""Found by seed 1000 in its second case, and by none of seeds 0-60 in their first cases."""
FINDER_BASE = 999  # worker 1 of 2 on base 999: its first round runs seed 1000
CONTROL_BASES = (0, 2, 4, 6, 8)


def _task(out: Path, lane: SeedLane, database: DatabaseSpec | None, **more: object) -> WorkerTask:
    return WorkerTask(
        MUTANT, lane=lane, seconds=30.0, profile="ci", out_dir=str(out), database=database,
        minimize_replays=0, **more,  # type: ignore[arg-type]
    )  # fmt: skip


def _first_case_passes(out: Path, base: int) -> bool:
    lane = SeedLane(base, Shard(), 0, 2)
    alone = run_worker(_task(out, lane, None, examples_per_round=1, rounds_max=1))
    return not alone.failures


def test_a_failure_one_worker_finds_is_replayed_first_by_another_worker_of_a_later_run(
    redis_url: str, tmp_path: Path
) -> None:
    database = check_database(parse_database(redis_url))
    # run 1, worker 1 of 2 -> finds the mutant's INV-05 and saves it (and its trace) to redis
    finder = run_worker(_task(tmp_path / "run1", SeedLane(FINDER_BASE, Shard(), 1, 2), database))
    assert [f["invariant"] for f in finder.failures] == ["INV-05"] and finder.database
    # a later run's worker 0, whose first case alone passes (no database) ...
    base = next(b for b in CONTROL_BASES if _first_case_passes(tmp_path / "control", b))
    # ... with the database -> the saved failure is its very first case
    later = run_worker(_task(tmp_path / "run2", SeedLane(base, Shard(), 0, 2), database))
    (failure,) = later.failures
    assert failure["invariant"] == "INV-05" and (failure["round"], failure["case"]) == (0, 1)
    assert later.cases == 0  # nothing else ran before it
    # the trace the finder stored replays the failure on any runner
    (stored,) = database.open().load_traces(MUTANT)
    assert replay(stored).signature() == "INV-05"


def _trace(note: str) -> Trace:
    header = TraceHeader(implementation="reference", config=HarnessConfig(), note=note)
    return Trace(header=header, steps=(Step(rule="noop"),))


def test_two_runners_storing_traces_never_overwrite_each_other(redis_url: str) -> None:
    one, other = DatabaseSpec(redis_url).open(), DatabaseSpec(redis_url).open()
    one.save_trace(_trace("runner 1"))
    other.save_trace(_trace("runner 2"))
    other.save_trace(_trace("runner 2"))  # the same trace twice is one entry
    assert [t.header.note for t in one.load_traces("reference")] == ["runner 1", "runner 2"]
    assert one.load_traces("sglang") == []


def test_the_developer_split_reads_the_fleet_and_writes_only_locally(
    redis_url: str, tmp_path: Path
) -> None:
    fleet = RedisExampleDatabase(Redis.from_url(redis_url))
    fleet.save(b"machine", b"found by the fleet")
    split = parse_database(f"{tmp_path / 'local'}+{redis_url}").open()
    # read: the fleet's example; write: the local folder only
    assert list(split.examples.fetch(b"machine")) == [b"found by the fleet"]
    split.examples.save(b"machine", b"found here")
    assert set(fleet.fetch(b"machine")) == {b"found by the fleet"}
    assert set(split.examples.fetch(b"machine")) == {b"found by the fleet", b"found here"}
    assert list((tmp_path / "local").iterdir())


def test_a_folder_is_a_database_for_one_host(tmp_path: Path) -> None:
    first = parse_database(str(tmp_path / "db")).open()
    first.save_trace(_trace("kept"))
    again = parse_database(f"dir:{tmp_path / 'db'}").open()
    assert [t.header.note for t in again.load_traces()] == ["kept"]


def test_a_lost_server_is_one_setup_line_not_a_finding(redis_url: str) -> None:
    database = DatabaseSpec(redis_url).open()
    Redis.from_url(redis_url).shutdown(nosave=True)
    with pytest.raises(HiCacheSetupError, match=r"lost the connection .*check the server"):
        database.examples.save(b"machine", b"x")


def test_a_password_never_reaches_the_report() -> None:
    assert DatabaseSpec("redis://ci:s3cret@redis:6379/0").label == "redis://ci:***@redis:6379/0"
    report = CampaignReport("r", "ci", 0, database="redis://ci:***@h:1")
    assert "s3cret" not in render_summary(report)
