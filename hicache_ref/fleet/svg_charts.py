"""Charts as inline SVG: crisp at any zoom, a few kilobytes, drawn in milliseconds.

The report's page is one file rewritten every few seconds while a campaign runs
(``live_report.py``), so its charts are plain SVG text written here rather than images:
``line_chart`` (series over time, stepped or straight, a ceiling, marked moments such as a
failure, optionally a logarithmic time axis so the first seconds do not vanish into the
left edge) and ``stacked_area`` (shares that sum to one). Each returns one ``<figure>``
whose legend is HTML below the plot, and every series carries a ``<title>`` the browser
shows on hover.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

WIDTH, HEIGHT = 640, 270
LEFT, RIGHT, TOP, BOTTOM = 58, 16, 14, 40
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")  # fmt: skip
INK, GRID, MUTED = "#1f2933", "#e4e7eb", "#7b8794"


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str
    width: float = 2.0
    dashed: bool = False
    step: bool = False
    """Hold each value until the next point (counts of first sightings), else straight lines."""


@dataclass(frozen=True)
class Marker:
    """A moment on the time axis (a failure found), drawn as a labelled vertical line."""

    x: float
    label: str
    color: str = "#c0392b"


def get_nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top`` (1, 2, 2.5 or 5 times a power of ten)."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def get_log_ticks(top: float) -> list[float]:
    """0, then 1-2-5 steps up to ``top`` (seconds on a logarithmic axis)."""
    ticks, power = [0.0], 0.1
    while power <= top * 1.0001:
        ticks += [t for t in (power, 2 * power, 5 * power) if t <= top * 1.0001]
        power *= 10
    return [t for t in ticks if t == 0 or t >= 0.1]


def _format(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:,.0f}k"
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:.1f}".rstrip("0").rstrip(".") if value >= 1 else f"{value:g}"


class _Frame:
    """The plot area: data coordinates to SVG pixels."""

    def __init__(self, x_max: float, y_max: float, log_x: bool) -> None:
        self.x_max, self.y_max, self.log_x = max(x_max, 1e-9), max(y_max, 1e-9), log_x
        self.width, self.height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
        ticks = get_log_ticks(x_max) if log_x else get_nice_ticks(x_max, 6)
        self.x_ticks = [t for t in ticks if t <= self.x_max * 1.0001]

    def x(self, value: float) -> float:
        scale: Callable[[float], float] = (
            (lambda v: math.log10(1 + 10 * v)) if self.log_x else float
        )
        return LEFT + self.width * scale(max(value, 0.0)) / scale(self.x_max)

    def y(self, value: float) -> float:
        return TOP + self.height * (1 - value / self.y_max)


def line_chart(
    title: str,
    series: Sequence[Series],
    *,
    y_label: str,
    x_label: str = "seconds since the start",
    markers: Sequence[Marker] = (),
    ceiling: tuple[float, str] | None = None,
    log_x: bool = False,
    percent: bool = False,
    note: str = "",
) -> str:
    """Series over time in one figure (``percent``: values are 0..100)."""
    x_max = max((max(s.xs, default=0.0) for s in series), default=0.0)
    y_top = max((max(s.ys, default=0.0) for s in series), default=0.0)
    if ceiling is not None:
        y_top = max(y_top, ceiling[0])
    y_ticks = [0.0, 25.0, 50.0, 75.0, 100.0] if percent else get_nice_ticks(y_top * 1.05 or 1)
    frame = _Frame(x_max or 1.0, y_ticks[-1], log_x)
    parts = _axes(frame, y_ticks, x_label, y_label, percent)
    if ceiling is not None:
        y = frame.y(ceiling[0])
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="{MUTED}" stroke-dasharray="2 3"/>'
                     f'<text x="{WIDTH - RIGHT - 4}" y="{y - 4:.1f}" text-anchor="end" '
                     f'class="faint">{_e(ceiling[1])}</text>')  # fmt: skip
    for s in series:
        parts.append(_path(frame, s))
    for index, marker in enumerate(markers):
        x, label_y = frame.x(marker.x), TOP + 12 + 13 * (index % 4)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + frame.height}" '
                     f'stroke="{marker.color}" stroke-dasharray="5 3"><title>{_e(marker.label)}'
                     f'</title></line><text x="{x + 3:.1f}" y="{label_y}" fill="{marker.color}" '
                     f'class="mark">{_e(marker.label)}</text>')  # fmt: skip
    legend = [(s.label, s.color, s.dashed) for s in series if s.label]
    return _figure(title, parts, legend, note)


def stacked_area(
    title: str,
    xs: Sequence[float],
    layers: Sequence[tuple[str, Sequence[float]]],
    *,
    y_label: str,
    x_label: str = "seconds since the start",
    note: str = "",
) -> str:
    """Layers that sum to at most 1 at each x, stacked bottom to top, as percentages."""
    frame = _Frame(max(xs, default=0.0) or 1.0, 100.0, log_x=False)
    parts = _axes(frame, [0.0, 25.0, 50.0, 75.0, 100.0], x_label, y_label, percent=True)
    base = [0.0] * len(xs)
    legend = []
    for index, (label, shares) in enumerate(layers):
        color = PALETTE[index % len(PALETTE)]
        top = [b + 100 * s for b, s in zip(base, shares, strict=True)]
        upper = [f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in zip(xs, top, strict=True)]
        lower = [f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in zip(xs, base, strict=True)]
        points = " ".join(upper + lower[::-1])
        mean = sum(shares) / len(shares) if shares else 0.0
        parts.append(f'<polygon points="{points}" fill="{color}" fill-opacity="0.85">'
                     f"<title>{_e(label)}: {mean:.0%} on average</title></polygon>")  # fmt: skip
        legend.append((label, color, False))
        base = top
    return _figure(title, parts, legend, note)


def _axes(frame: _Frame, y_ticks: list[float], x_label: str, y_label: str,
          percent: bool) -> list[str]:  # fmt: skip
    parts = []
    for tick in y_ticks:
        y = frame.y(tick)
        text = f"{tick:g}%" if percent else _format(tick)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="{GRID}"/><text x="{LEFT - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end">{text}</text>')  # fmt: skip
    bottom = TOP + frame.height
    for tick in frame.x_ticks:
        x = frame.x(tick)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" '
                     f'stroke="{MUTED}"/><text x="{x:.1f}" y="{bottom + 16}" '
                     f'text-anchor="middle">{_format(tick)}</text>')  # fmt: skip
    parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{bottom}" y2="{bottom}" '
                 f'stroke="{MUTED}"/>'
                 f'<text x="{LEFT + frame.width / 2:.0f}" y="{HEIGHT - 6}" text-anchor="middle" '
                 f'class="faint">{_e(x_label)}</text>'
                 f'<text x="14" y="{TOP + frame.height / 2:.0f}" text-anchor="middle" '
                 f'class="faint" transform="rotate(-90 14 {TOP + frame.height / 2:.0f})">'
                 f"{_e(y_label)}</text>")  # fmt: skip
    return parts


def _path(frame: _Frame, series: Series) -> str:
    points: list[tuple[float, float]] = []
    for i, (x, y) in enumerate(zip(series.xs, series.ys, strict=True)):
        if series.step and i:
            points.append((x, series.ys[i - 1]))
        points.append((x, y))
    if not points:
        return ""
    coords = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in points)
    dash = ' stroke-dasharray="6 3"' if series.dashed else ""
    last = _format(round(series.ys[-1], 1))
    return (f'<polyline points="{coords}" fill="none" stroke="{series.color}" '
            f'stroke-width="{series.width}" stroke-linejoin="round"{dash}>'
            f"<title>{_e(series.label)}: {last} at the end</title></polyline>")  # fmt: skip


def _figure(title: str, parts: list[str], legend: list[tuple[str, str, bool]], note: str) -> str:
    keys = "".join(
        f'<span><i style="border-color:{color};border-style:{"dashed" if dashed else "solid"}">'
        f"</i>{_e(label)}</span>"
        for label, color, dashed in legend
    )
    caption = f'<p class="note">{_e(note)}</p>' if note else ""
    return (
        f'<figure class="chart"><figcaption>{_e(title)}</figcaption>'
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{_e(title)}">'
        + "".join(parts)
        + f'</svg><div class="legend">{keys}</div>{caption}</figure>'
    )


def _e(text: object) -> str:
    return html.escape(str(text))
