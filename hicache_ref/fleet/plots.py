"""The report's plots: matplotlib figures (Agg, no display) as base64 PNGs for one static page.

Over the campaign's time, from each worker's timeline (``CampaignReport.timeline``): steps and
cases (one thin line per worker, their sum thick, each new failure a marked vertical line),
distinct configurations and invariant ids covered (the union over workers, from the times each
was first seen), the rule families' shares as the steps accumulated; and, over the whole
campaign, invariant checks by id (every id with its title, the unchecked ones in red).
"""

from __future__ import annotations

import base64
import io
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

from hicache_ref.campaign.report import RULE_FAMILIES, CampaignReport
from hicache_ref.errors import HiCacheSetupError
from hicache_ref.fleet.merge import get_leaves
from hicache_ref.invariant_titles import INVARIANT_TITLES, get_invariant_label

WIDTH_IN, HEIGHT_IN, DPI = 6.4, 3.2, 110
FAILURE_COLOR = "#c0392b"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise HiCacheSetupError(
            "hicache-fuzz report draws its plots with matplotlib, which is not installed; "
            "install the fleet extra: pip install -e '.[fleet]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def render_plots(merged: CampaignReport) -> dict[str, str]:
    """Every plot of the page, by name, as a base64 PNG."""
    plt = _pyplot()
    leaves = get_leaves(merged)
    plots = {
        "steps": _over_time(plt, leaves, merged, "steps", "protocol steps"),
        "cases": _over_time(plt, leaves, merged, "cases", "cases"),
        "configs": _first_seen(
            plt, merged.config_first_s, merged.seconds, "distinct configurations"
        ),
        "invariants": _first_seen(
            plt, merged.checks_first_s, merged.seconds, "invariant ids checked",
            ceiling=len(INVARIANT_TITLES),
        ),
        "families": _families(plt, leaves),
        "checks": _checks(plt, merged),
    }  # fmt: skip
    return plots


def get_summed_timeline(
    leaves: list[CampaignReport], value: Callable[[dict[str, Any]], int]
) -> tuple[list[float], list[int]]:
    """The fleet's cumulative ``value`` at every time a worker sampled it (a worker holds its
    last sample until its next one; workers are taken to have started together)."""
    series = [
        ([p["t"] for p in leaf.timeline], [value(p) for p in leaf.timeline]) for leaf in leaves
    ]
    grid = sorted({t for times, _ in series for t in times})
    totals = []
    for t in grid:
        total = 0
        for times, values in series:
            index = bisect_right(times, t) - 1
            total += values[index] if index >= 0 else 0
        totals.append(total)
    return grid, totals


def _figure(plt: Any, title: str, xlabel: str = "seconds since the start") -> tuple[Any, Any]:
    figure, axes = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    axes.set_title(title, fontsize=11)
    axes.set_xlabel(xlabel)
    axes.grid(alpha=0.3)
    return figure, axes


def _png(plt: Any, figure: Any) -> str:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _over_time(
    plt: Any, leaves: list[CampaignReport], merged: CampaignReport, key: str, what: str
) -> str:
    figure, axes = _figure(plt, f"{what} over time")
    if len(leaves) > 1:
        for leaf in leaves:
            times = [p["t"] for p in leaf.timeline]
            axes.plot(times, [p[key] for p in leaf.timeline], lw=0.8, alpha=0.6,
                      label=f"worker {leaf.worker} ({leaf.shard})")  # fmt: skip
    grid, totals = get_summed_timeline(leaves, lambda point: int(point[key]))
    axes.plot(grid, totals, lw=2.2, color="black", label="all workers")
    top = max(totals, default=0) or 1
    for failure in merged.failures:
        at_s = float(failure.get("found_at_s") or 0.0)
        axes.axvline(at_s, color=FAILURE_COLOR, ls="--", lw=1.2)
        axes.annotate(f" {failure['invariant']}", (at_s, top * 0.98), color=FAILURE_COLOR,
                      fontsize=8, rotation=90, ha="right", va="top")  # fmt: skip
    axes.set_ylabel(what)
    axes.set_ylim(0, top * 1.05)
    axes.legend(fontsize=7, loc="lower right")
    return _png(plt, figure)


def _first_seen(
    plt: Any, first_s: dict[str, float], seconds: float, what: str, ceiling: int | None = None
) -> str:
    figure, axes = _figure(plt, f"{what} over time")
    times = sorted(first_s.values())
    xs = [0.0, *times, max(seconds, times[-1] if times else 0.0)]
    ys = [0, *range(1, len(times) + 1), len(times)]
    axes.step(xs, ys, where="post", lw=2.0, color="#2471a3")
    if ceiling is not None:
        axes.axhline(ceiling, color="grey", ls=":", lw=1.0)
        axes.set_ylim(0, ceiling + 2)
        axes.annotate(f"{ceiling} ids in the spec", (xs[-1], ceiling), fontsize=8,
                      va="bottom", ha="right", color="grey")  # fmt: skip
    axes.yaxis.get_major_locator().set_params(integer=True)
    axes.set_ylabel(what)
    return _png(plt, figure)


def _families(plt: Any, leaves: list[CampaignReport]) -> str:
    """Each rule family's share of the steps applied so far, as the campaign went on."""
    figure, axes = _figure(plt, "rule families: share of applied steps so far")
    names = list(RULE_FAMILIES)
    sums: dict[str, list[int]] = {}
    grid: list[float] = []
    for name in names:
        grid, sums[name] = get_summed_timeline(leaves, _family_steps(name))
    totals = [sum(sums[name][i] for name in names) or 1 for i in range(len(grid))]
    shares = [[sums[name][i] / totals[i] for i in range(len(grid))] for name in names]
    axes.stackplot(grid, shares, labels=names, alpha=0.85)
    axes.set_ylim(0, 1)
    axes.set_ylabel("share")
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _png(plt, figure)


def _family_steps(name: str) -> Callable[[dict[str, Any]], int]:
    def steps(point: dict[str, Any]) -> int:
        return int(point.get("families", {}).get(name, 0))

    return steps


def _checks(plt: Any, merged: CampaignReport) -> str:
    """Checks by invariant id, every id of the spec with its title (unchecked ones' labels in
    red)."""
    ids = sorted(set(INVARIANT_TITLES) | set(merged.checks_by_id))
    counts = [merged.checks_by_id.get(inv_id, 0) for inv_id in ids]
    height = max(HEIGHT_IN, 0.26 * len(ids) + 1.0)
    figure, axes = plt.subplots(figsize=(WIDTH_IN, height), dpi=DPI)
    axes.set_title("invariant checks by id (whole campaign)", fontsize=11)
    colors = ["#2471a3" if count else FAILURE_COLOR for count in counts]
    axes.barh([get_invariant_label(inv_id) for inv_id in ids], counts, color=colors)
    axes.invert_yaxis()
    for label, count in zip(axes.get_yticklabels(), counts, strict=True):
        if not count:
            label.set_color(FAILURE_COLOR)  # never checked: its bar has no length to colour
    axes.set_xscale("symlog")
    axes.set_xlabel("checks (log scale)")
    axes.tick_params(axis="y", labelsize=8)
    axes.grid(alpha=0.3, axis="x")
    return _png(plt, figure)
