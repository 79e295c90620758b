"""The report's page in a real browser: headless Chromium (Debian's ``chromium`` package).

The page of a real two-shard campaign (``conftest.two_shards``) is loaded by Chromium; what it
laid out is read back from the DOM it dumps, with a probe script appended to a copy of the page
that measures the layout: the coverage chart is drawn at a readable size with its curves, every
rule has a visible row (a click on a heading sorts them), each failure shows its program and its
replay line on one line (never wrapped inside a word). A screenshot is taken too (look at it: ``HICACHE_REPORT_SHOT=DIR``
keeps it). CI installs chromium (``.ci/run``, which sets ``HICACHE_CI``) and fails here without
it; a developer machine without it skips, saying how to install it.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hicache_ref.fleet.merge import merge_reports, read_reports
from hicache_ref.fleet.report import write_report
from hicache_ref.fleet.report_failures import get_program

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
)  # fmt: skip
BROWSER_TIMEOUT_S = 90
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAYOUT_PROBE = """<script>
window.addEventListener("load", () => {
  const box = (el) => el.getBoundingClientRect();
  const coverage = document.querySelector('svg[aria-label^="coverage"]');
  const replays = [...document.querySelectorAll(".replay pre")].map((pre) => {
    const style = getComputedStyle(pre);
    return {lines: Math.round(box(pre).height / parseFloat(style.lineHeight || "16")),
            whiteSpace: style.whiteSpace};
  });
  const rules = [...document.querySelectorAll("tr[id^=rule-]")]
    .filter((row) => box(row).height > 0).map((row) => row.id.slice(5));
  document.querySelector("#rules thead th").click();  // sort the rules by name, Z first
  const sortedFirst = document.querySelector("#rules tbody tr").id.slice(5);
  const probe = document.createElement("pre");
  probe.id = "layout-probe";
  probe.textContent = JSON.stringify({
    coverageWidth: coverage ? box(coverage).width : 0,
    coverageCurves: coverage ? coverage.querySelectorAll("polyline").length : 0,
    replays, rules, sortedFirst,
  });
  document.body.appendChild(probe);
});
</script>"""


@pytest.fixture
def chromium() -> str:
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is not None:
        return found
    reason = "no chromium on PATH: apt-get install -y chromium (.ci/run installs it)"
    if os.environ.get("HICACHE_CI") or os.environ.get("CI"):
        pytest.fail(f"CI must render the report in a browser; {reason}")
    pytest.skip(reason)


def run_browser(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile.mkdir()
    command = [browser, *FLAGS, f"--user-data-dir={profile}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}"
    return done


def test_chromium_shows_coverage_rules_and_each_failing_program(
    two_shards: list[Path], chromium: str, tmp_path: Path
) -> None:
    page = tmp_path / "report.html"
    write_report(two_shards, page)
    merged = merge_reports(read_reports(two_shards))
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("</body>", LAYOUT_PROBE + "</body>"))
    # Chromium loads the page, runs the probe, and dumps the document it laid out
    dom = run_browser(chromium, tmp_path / "profile-dom", "--window-size=1360,900",
                      "--dump-dom", probed.as_uri()).stdout  # fmt: skip
    found = re.search(r'<pre id="layout-probe">(.*?)</pre>', dom, re.DOTALL)
    assert found is not None, "the page's layout probe did not run"
    layout = json.loads(html.unescape(found.group(1)))
    # the coverage chart: drawn wide enough to read, with its line and branch curves
    assert layout["coverageWidth"] > 400
    assert layout["coverageCurves"] >= 2
    # every rule applied has a visible row
    assert sorted(layout["rules"]) == sorted(merged.rules)
    assert layout["sortedFirst"] == max(merged.rules)  # a click on a heading sorts the rows
    # each failure: its replay line on one line, its program step by step
    assert len(layout["replays"]) == len(merged.failures)
    assert all(r == {"lines": 1, "whiteSpace": "pre"} for r in layout["replays"])
    for failure in merged.failures:
        assert html.escape(failure["replay"], quote=False) in dom
        for step in get_program(failure)[1]:
            assert f"<code>{html.escape(step, quote=False)}</code>" in dom
    # and a screenshot of the whole page
    shot = tmp_path / "report.png"
    run_browser(chromium, tmp_path / "profile-shot", "--window-size=1360,2400",
                f"--screenshot={shot}", page.as_uri())  # fmt: skip
    assert shot.read_bytes().startswith(PNG_MAGIC)
    keep = os.environ.get("HICACHE_REPORT_SHOT")
    if keep:
        shutil.copy(shot, Path(keep) / "report.png")
