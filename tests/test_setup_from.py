"""An air-gapped runner: ``hicache-fuzz setup --from`` a wheel file or an unpacked tree, with no
package index, serves the gate, the corpus traces the CUDA tests replay, and ``cuda_detect.py``.

Every test here runs with an empty cache of its own and pip pointed at nothing
(``PIP_NO_INDEX=1``): a fetch would fail, so whatever works, worked from the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hicache_ref.cli import main
from hicache_ref.harness.adapters.sglang_tree import (
    CONTROLLER_RELPATH,
    ReleaseUnavailable,
    fetch_wheel_tree,
    wheel_tree_path,
)
from hicache_ref.harness.steps.replay import replay
from hicache_ref.harness.steps.trace import Trace

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_FILE_TRACES = ("complete_before_hit", "keys_without_rank")  # storage_backend upstream_file
MINIMAL_0523 = (
    "sglang/__init__.py",
    "sglang/_version.py",
    "sglang/srt/environ.py",
    str(CONTROLLER_RELPATH),
)


def make_wheel(tree: Path, into: Path) -> Path:
    """``sglang-<release>-py3-none-any.whl`` of ``tree``'s ``sglang/`` (what pip download gets)."""
    release = tree.name.removeprefix("sglang-")
    wheel = into / f"sglang-{release}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for path in sorted((tree / "sglang").rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(tree))
    return wheel


def make_minimal_0523(source: Path, into: Path) -> Path:
    """The files of 0.5.23 the upstream file backend reads (its mem_cache, the controller)."""
    for relpath in MINIMAL_0523:
        (into / relpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / relpath, into / relpath)
    shutil.copytree(source / "sglang/srt/mem_cache", into / "sglang/srt/mem_cache")
    return into


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache and no package index; returns the machine's own 0.5.10 tree, read first
    (the wheels and trees below are made from it)."""
    machine_tree = fetch_wheel_tree()
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("HICACHE_SGLANG_SRC", raising=False)
    return machine_tree


def test_setup_from_a_wheel_serves_the_gate_with_no_network(
    offline: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = make_wheel(offline, tmp_path)
    assert main(["setup", "--from", str(wheel)]) == 0
    assert (wheel_tree_path("0.5.10") / CONTROLLER_RELPATH).is_file()
    assert "sglang 0.5.10: " in capsys.readouterr().out
    argv = ["gate", "--impl", "sglang", "--budget", "2", "--workers", "1", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("gate: passed")


@pytest.fixture
def release_0523() -> Path:
    """The machine's 0.5.23 tree (from its cache; online, fetched), read before going offline."""
    return fetch_wheel_tree("0.5.23")


def test_setup_from_a_tree_serves_the_upstream_file_traces_the_cuda_tests_replay(
    release_0523: Path, offline: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the two corpus traces over 0.5.23's HiCacheFile: they read the cache, never pip
    tree = make_minimal_0523(release_0523, tmp_path / "mini")
    assert main(["setup", "--from", str(tree)]) == 0
    assert "sglang 0.5.23: " in capsys.readouterr().out
    for name in UPSTREAM_FILE_TRACES:
        trace = Trace.read(ROOT / "fuzz" / "corpus" / "mutants" / f"{name}.jsonl")
        assert trace.header.config.storage_backend == "upstream_file"
        assert replay(trace).failed  # on its mutant: caught
        assert not replay(trace, implementation="reference").failed


def test_cuda_detect_reads_its_tree_from_the_cache(offline: Path, tmp_path: Path) -> None:
    assert main(["setup", "--from", str(offline)]) == 0
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cuda_detect.py"), "--pack-tree", str(tmp_path / "packed")],
        capture_output=True, text=True, timeout=300, env=os.environ.copy(), cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "packed" / "sglang-0.5.10" / CONTROLLER_RELPATH).is_file()


def test_a_release_the_cache_lacks_names_the_command_that_fills_it(
    offline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ReleaseUnavailable) as missing:
        fetch_wheel_tree("0.5.22")
    assert missing.value.fill == "hicache-fuzz setup --from sglang-0.5.22-py3-none-any.whl"
    argv = ["gate", "--impl", "sglang", "--sglang-version", "0.5.22", "--budget", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hicache-fuzz setup --from sglang-0.5.22" in err


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("not-a-wheel.zip", "not an sglang wheel"),
        ("sglang-0.5.10-py3-none-any.whl", "is not a readable wheel"),
    ],
)
def test_a_bad_file_is_one_line(
    offline: Path, tmp_path: Path, name: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / name
    bad.write_text("not a zip")
    assert main(["setup", "--from", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err
