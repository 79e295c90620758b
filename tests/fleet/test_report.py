"""``hicache-fuzz report``: the page of a real (short) campaign run as two shards.

Two runners (``--shard 1/2`` and ``2/2``) fuzz a mutant for a moment and write their JSON;
the report merges them into one page with the plots embedded as PNGs, every invariant id with
its title, and each failure with the line that replays it.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import pytest

from hicache_ref import cli
from hicache_ref.fleet.merge import merge_reports, read_reports
from hicache_ref.fleet.plots import get_summed_timeline
from hicache_ref.invariant_titles import INVARIANT_TITLES, get_invariant_label

MUTANT = "mutant:skip_load_fence"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("steps", "cases", "configs", "invariants", "families", "checks")


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The JSON reports of the two runners (one worker each, in this process)."""
    folder = tmp_path_factory.mktemp("shards")
    paths = []
    for shard in ("1/2", "2/2"):
        path = folder / f"shard{shard[0]}.json"
        argv = ["run", "--impl", MUTANT, "--keep-going", "--budget", "2", "--shard", shard]
        argv += ["--workers", "1", "--no-progress", "--out", str(folder), "--json", str(path)]
        assert cli.main(argv) == 1
        paths.append(path)
    return paths


def test_the_report_of_two_shards_shows_plots_titles_and_replay_lines(
    two_shards: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page_path = tmp_path / "report.html"
    assert cli.main(["report", *map(str, two_shards), "-o", str(page_path)]) == 0
    assert f"report: {page_path} (2 file(s), 2 worker(s)" in capsys.readouterr().out
    page = page_path.read_text()
    # every plot is an embedded PNG
    images = dict(re.findall(r'<img alt="(\w+)" src="data:image/png;base64,([^"]+)"', page))
    assert set(images) == set(PLOTS)
    assert all(base64.b64decode(png).startswith(PNG_MAGIC) for png in images.values())
    # every invariant id of the spec with its title, and each failure's replay line
    for inv_id, title in INVARIANT_TITLES.items():
        assert f"<td>{inv_id}</td><td>{html.escape(title)}</td>" in page
    merged = merge_reports(read_reports(two_shards))
    assert merged.failures
    for failure in merged.failures:
        assert f"<td>{get_invariant_label(failure['invariant'])}</td>" in page
        assert f"<code>{html.escape(failure['replay'])}</code>" in page
    assert "2 / 2 shards" in page


def test_the_fleet_timeline_sums_each_worker_at_every_sample(two_shards: list[Path]) -> None:
    one, other = read_reports(two_shards)
    grid, totals = get_summed_timeline([one, other], lambda point: int(point["steps"]))
    assert grid == sorted({p["t"] for p in one.timeline} | {p["t"] for p in other.timeline})
    assert totals[-1] == one.steps + other.steps and totals == sorted(totals)
