"""The report's failures: one card per new failure, with its minimal failing program.

A card names the invariant (with its title), the error, which worker found it when, how many
more like it came after, the line that replays it (one line, never wrapped inside a word: it
scrolls, and a button copies it whole) and the program that fails: the configuration, then the
steps of the minimized trace, numbered, as ``rule(arg=value, ...)``. The campaign records the
program in the failure's record (``campaign_failures``); a report from before that reads the
trace file itself when it is still where the record says.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from hicache_ref.campaign.report import CampaignReport
from hicache_ref.invariant_titles import get_invariant_label

PROGRAM_STEPS_SHOWN = 60
"""A longer program (ddmin was cut short) shows its first and last steps around a gap."""


def get_failure_anchor(invariant: str) -> str:
    return f"failure-{invariant}"


def get_program(failure: dict[str, Any]) -> tuple[str, list[str]]:
    """The failing program's configuration and steps (from the record, else its trace file)."""
    if "program" in failure:
        return str(failure.get("config", "")), [str(step) for step in failure["program"]]
    path = Path(str(failure.get("trace") or ""))
    if not failure.get("trace") or not path.is_file():
        return "", []
    from hicache_ref.harness.steps.trace import Trace

    try:
        trace = Trace.read(path)
    except Exception:
        return "", []
    return trace.header.config.describe(), [step.render() for step in trace.steps]


def render_failures(merged: CampaignReport) -> str:
    if not merged.failures:
        known = sum(merged.known_hits.values())
        more = f" ({known} failure(s) explained by known findings)" if known else ""
        return f'<section id="failures"><h2>Failures</h2><p class="quiet">None new{more}.</p></section>'
    cards = [_card(failure, merged.repeats[failure["invariant"]]) for failure in merged.failures]
    return '<section id="failures"><h2>Failures</h2>' + "".join(cards) + "</section>"


def _card(failure: dict[str, Any], repeats: int) -> str:
    invariant = str(failure["invariant"])
    worker = failure.get("worker")
    where = f"worker {worker} ({failure.get('shard', '1/1')}), " if worker is not None else ""
    again = f", {repeats} more like it" if repeats else ""
    facts = f"{where}seed {failure['seed']}, found at {failure.get('found_at_s', '-')} s{again}"
    replay = str(failure.get("replay", ""))
    return (
        f'<article class="failure" id="{_e(get_failure_anchor(invariant))}">'
        f"<h3>{_e(get_invariant_label(invariant))}</h3>"
        f'<p class="error">{_e(failure["error"])}</p><p class="quiet">{_e(facts)}</p>'
        '<div class="replay"><span class="label">replay</span>'
        f"<pre>{_e(replay)}</pre>"
        '<button type="button" onclick="copyReplay(this)">copy</button></div>'
        + _program(failure)
        + "</article>"
    )


def _program(failure: dict[str, Any]) -> str:
    config, steps = get_program(failure)
    if not steps:
        return '<p class="quiet">No program: it failed outside a step (the seed reruns it).</p>'
    shown = list(enumerate(steps, 1))
    if len(shown) > PROGRAM_STEPS_SHOWN:
        half = PROGRAM_STEPS_SHOWN // 2
        shown = [*shown[:half], (0, f"... {len(steps) - 2 * half} steps ..."), *shown[-half:]]
    lines = "".join(
        f'<li value="{number}"><code>{_e(text)}</code></li>'
        if number
        else f'<li class="gap">{_e(text)}</li>'
        for number, text in shown
    )
    return (
        f'<div class="program"><div class="label">minimal failing program, '
        f"{len(steps)} step(s); the failure follows the last</div>"
        f'<div class="config">{_e(config)}</div><ol>{lines}</ol></div>'
    )


def _e(text: object) -> str:
    return html.escape(str(text))
