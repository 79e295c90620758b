"""A real redis-server on loopback for the fleet's database tests (each test its own)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_START_POLLS = 100  # x 0.05 s: a loaded CI machine starts redis-server in well under 5 s


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """``redis://127.0.0.1:<port>`` of a redis-server this test started (and stops)."""
    server = shutil.which("redis-server")
    assert server is not None, (
        "the fleet's database tests need redis-server on PATH: apt-get install -y "
        "redis-server (.ci/run installs it when missing)"
    )
    port = _free_port()
    folder = tmp_path / "redis"
    folder.mkdir()
    options = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(
        [server, *options, "--dir", str(folder), "--logfile", str(folder / "redis.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(REDIS_START_POLLS):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as ping:
                    ping.sendall(b"PING\r\n")
                    if ping.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                time.sleep(0.05)
        else:
            raise AssertionError(f"redis-server did not answer on port {port}; see {folder}")
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


MUTANT = "mutant:skip_load_fence"
SHARD_CASES = "12"
"""Each runner's case budget: at seed 0 the mutant falls at case 4 (shard 1/2) and at cases 3 and
9 (shard 2/2, seed 1), so 12 cases give both runners failures however busy the host is."""
SHARD_WALL_CAP = "300"
"""Seconds: a safety net only (12 cases take ~3 s idle)."""


@pytest.fixture(scope="session")
def two_shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The JSON reports of two runners (``--shard 1/2`` and ``2/2``, one worker each, in this
    process) fuzzing a mutant for a case budget each with coverage on: failures, programs,
    coverage timelines, for the report's tests."""
    from hicache_ref import cli

    folder = tmp_path_factory.mktemp("shards")
    paths = []
    for shard in ("1/2", "2/2"):
        path = folder / f"shard{shard[0]}.json"
        argv = ["run", "--impl", MUTANT, "--keep-going", "--shard", shard]
        argv += ["--budget", SHARD_WALL_CAP, "--max-cases", SHARD_CASES]
        argv += ["--workers", "1", "--no-progress", "--coverage", "--out", str(folder)]
        assert cli.main([*argv, "--json", str(path)]) == 1
        paths.append(path)
    return paths
