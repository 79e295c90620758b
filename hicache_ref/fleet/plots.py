"""The report's charts: a campaign's timelines shaped into series for ``svg_charts.py``.

Over the campaign's time, from each worker's report: coverage of the implementation under test
(lines and branches, in percent; each worker thin, the union of the workers thick: a line one
worker covered counts once), protocol steps (each worker thin, their sum thick, linearly
interpolated between a worker's samples so workers that sampled at different moments sum
smoothly; each new failure a marked vertical line), the behaviours first seen (rule/outcome
pairs and invariant ids, on a logarithmic time axis: most appear in the first second and a
late one is what matters), distinct configurations, and the rule families' shares of the steps
applied in each slice of time (what the campaign was doing then, not the running average that
settles after a second).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from hicache_ref.campaign.behaviours import CHECK_PREFIX
from hicache_ref.campaign.report import RULE_FAMILIES, CampaignReport
from hicache_ref.fleet.merge import get_leaves
from hicache_ref.fleet.svg_charts import PALETTE, Marker, Series, line_chart, stacked_area
from hicache_ref.invariant_titles import INVARIANT_TITLES

FAMILY_SLICES = 30
MERGED = "#1f2933"
LINES_COLOR, BRANCHES_COLOR = "#4e79a7", "#f28e2b"


def render_charts(merged: CampaignReport) -> dict[str, str]:
    """Every chart of the page, by name, as an SVG ``<figure>``."""
    leaves = get_leaves(merged)
    charts = {
        "coverage": _coverage(merged, leaves),
        "behaviours": _behaviours(merged),
        "steps": _steps(merged, leaves),
        "configs": _configs(merged),
        "families": _families(merged, leaves),
    }
    if not merged.coverage.get("files"):  # not measured: its note goes last, not first
        charts["coverage"] = charts.pop("coverage")
    return charts


def get_summed_timeline(
    leaves: list[CampaignReport], value: Callable[[dict[str, Any]], float]
) -> tuple[list[float], list[float]]:
    """The fleet's cumulative ``value`` at every time a worker sampled it: each worker's
    value between two of its samples is interpolated, after its last one held (workers are
    taken to have started together)."""
    series = [
        ([p["t"] for p in leaf.timeline], [value(p) for p in leaf.timeline]) for leaf in leaves
    ]
    grid = sorted({t for times, _ in series for t in times})
    return grid, [sum(_at(times, values, t) for times, values in series) for t in grid]


def _at(times: Sequence[float], values: Sequence[float], t: float) -> float:
    """A cumulative count at ``t``, straight between the samples around it."""
    index = bisect_right(times, t) - 1
    if index < 0:
        return 0.0
    if index + 1 >= len(times) or times[index + 1] == times[index]:
        return float(values[index])
    share = (t - times[index]) / (times[index + 1] - times[index])
    return values[index] + share * (values[index + 1] - values[index])


def get_coverage_curve(
    coverage: dict[str, Any], kind: str, end_s: float
) -> tuple[list[float], list[float]]:
    """Percent of statements (``kind="lines"``) or branches (``"arcs"``) covered over time."""
    files = coverage.get("files", {})
    total = sum(f["statements" if kind == "lines" else "branches"] for f in files.values())
    if not total:
        return [], []
    counts = Counter(t for f in files.values() for t in f[kind].values())
    xs, ys, covered = [0.0], [0.0], 0
    for t in sorted(counts):
        covered += counts[t]
        xs.append(t)
        ys.append(100.0 * covered / total)
    xs.append(max(end_s, xs[-1]))
    ys.append(ys[-1])
    return xs, ys


def get_coverage_percent(coverage: dict[str, Any], kind: str) -> float | None:
    _, ys = get_coverage_curve(coverage, kind, 0.0)
    return ys[-1] if ys else None


def _coverage(merged: CampaignReport, leaves: list[CampaignReport]) -> str:
    title = "coverage of the implementation under test"
    if not merged.coverage.get("files"):
        return (
            f'<figure class="chart empty"><figcaption>{title}</figcaption><p>Not measured: '
            "run with <code>--coverage</code> to record line and branch coverage of the "
            "implementation under test over time, per worker and merged (it costs steps/s: "
            "<code>benchmarks/RESULTS.md</code>).</p></figure>"
        )
    series = []
    if len(leaves) > 1:
        for leaf in leaves:
            for kind, color, dashed in (
                ("lines", LINES_COLOR, False),
                ("arcs", BRANCHES_COLOR, True),
            ):
                xs, ys = get_coverage_curve(leaf.coverage, kind, leaf.seconds)
                series.append(Series("", xs, ys, color, width=0.9, dashed=dashed, step=True))
    for kind, name, color in (
        ("lines", "lines", LINES_COLOR),
        ("arcs", "branches", BRANCHES_COLOR),
    ):
        xs, ys = get_coverage_curve(merged.coverage, kind, merged.seconds)
        label = f"{name}, all workers" if len(leaves) > 1 else name
        series.append(Series(label, xs, ys, color, width=2.6, step=True))
    files = len(merged.coverage["files"])
    note = f"{files} files; thin lines: each worker" if len(leaves) > 1 else f"{files} files"
    return line_chart(title, series, y_label="% covered", percent=True, note=note)


def _steps(merged: CampaignReport, leaves: list[CampaignReport]) -> str:
    series = []
    if len(leaves) > 1:
        for index, leaf in enumerate(leaves):
            xs = [p["t"] for p in leaf.timeline]
            series.append(Series(f"worker {leaf.worker} ({leaf.shard})", xs,
                                 [p["steps"] for p in leaf.timeline],
                                 PALETTE[index % len(PALETTE)], width=1.2))  # fmt: skip
    grid, totals = get_summed_timeline(leaves, lambda point: float(point["steps"]))
    series.append(Series("all workers" if len(leaves) > 1 else "steps", grid, totals, MERGED, 2.6))
    markers = [
        Marker(float(failure.get("found_at_s") or 0.0), str(failure["invariant"]))
        for failure in merged.failures
    ]
    return line_chart("protocol steps applied", series, y_label="steps", markers=markers)


def _step_counts(times: list[float], end_s: float) -> tuple[list[float], list[float]]:
    """A count of first sightings over time: up by one at each, held to ``end_s``."""
    counts = Counter(times)
    xs, ys, total = [0.0], [0.0], 0
    for t in sorted(counts):
        total += counts[t]
        xs.append(t)
        ys.append(float(total))
    return [*xs, max(end_s, xs[-1])], [*ys, ys[-1]]


def _behaviours(merged: CampaignReport) -> str:
    first = merged.behaviours.first_s
    pairs = [t for key, t in first.items() if not key.startswith(CHECK_PREFIX)]
    checks = [t for key, t in first.items() if key.startswith(CHECK_PREFIX)]
    series = [
        Series("rule/outcome pairs", *_step_counts(pairs, merged.seconds), PALETTE[0], step=True),
        Series("invariant ids checked", *_step_counts(checks, merged.seconds), PALETTE[2],
               step=True),
    ]  # fmt: skip
    ceiling = (float(len(INVARIANT_TITLES)), f"{len(INVARIANT_TITLES)} ids in the spec")
    return line_chart("behaviours first seen", series, y_label="distinct", log_x=True,
                      x_label="seconds since the start (log scale)", ceiling=ceiling)  # fmt: skip


def _configs(merged: CampaignReport) -> str:
    xs, ys = _step_counts(list(merged.config_first_s.values()), merged.seconds)
    series = [Series("distinct configurations", xs, ys, PALETTE[4], step=True)]
    return line_chart("configurations drawn", series, y_label="distinct")


def _families(merged: CampaignReport, leaves: list[CampaignReport]) -> str:
    """Each family's share of the steps applied in each of ``FAMILY_SLICES`` slices of time."""
    end = merged.seconds or max((p["t"] for leaf in leaves for p in leaf.timeline), default=0.0)
    edges = [end * i / FAMILY_SLICES for i in range(FAMILY_SLICES + 1)]
    names = list(RULE_FAMILIES)
    cumulative = {}
    for name in names:
        series = [([p["t"] for p in leaf.timeline],
                   [p.get("families", {}).get(name, 0) for p in leaf.timeline]) for leaf in leaves]  # fmt: skip
        cumulative[name] = [sum(_at(ts, vs, edge) for ts, vs in series) for edge in edges]
    mids, shares = [], {name: [] for name in names}  # type: ignore[var-annotated]
    for i in range(FAMILY_SLICES):
        applied = {name: cumulative[name][i + 1] - cumulative[name][i] for name in names}
        total = sum(applied.values())
        if total <= 0:
            continue
        mids.append((edges[i] + edges[i + 1]) / 2)
        for name in names:
            shares[name].append(applied[name] / total)
    layers = [(name, shares[name]) for name in names if any(shares[name])]
    return stacked_area("rule families: share of the steps in each slice of time", mids,
                        layers, y_label="share of steps")  # fmt: skip
