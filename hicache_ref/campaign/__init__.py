"""Campaigns: the fuzz runs ``hicache-fuzz run``, ``gate`` and ``mutants`` start, and their report.

In the order a campaign flows through them:

- ``cli_inputs``: every command-line input checked before any work (durations, output folders
  and files, the sglang tree, trace files), each bad one a single ``HiCacheInputError`` line;
- ``budgets``: the case budget (``--max-cases``) beside the time budget, and how a gate splits
  it with the PP gate;
- ``run``: ``run_campaign``, one campaign against one implementation until its time is up (or
  its case budget is spent);
- ``rounds``: its seeded rounds of the state machine, and the ``CampaignSignals`` a fleet (or a
  Ctrl-C, SIGINT or SIGTERM) steers them with;
- ``interrupts``: how SIGINT and SIGTERM end a campaign (exit 130 or 143) with its report and
  no failure the signal itself caused;
- ``failures``: a failing round named, counted against the known findings or recorded, its
  trace kept and ddmin'd under a name no other campaign takes;
- ``behaviours``: rule/outcome pairs and checks by id, first and last seen, and the campaign's
  last new behaviour; ``coverage``: ``--coverage``, line and branch coverage of the
  implementation under test over time (coverage.py's tracer), each line and branch stamped when
  first covered;
- ``report``: ``CampaignReport``, what a campaign exercised and found (the type the fleet's
  progress view, merge and HTML page read);
- ``summary``: the report as the text ``run`` and ``gate`` print, the verdict last;
- ``gate``: the gate's known findings, new failures, JSON verdict and exit status;
- ``catalogue`` and ``cli_mutants``: every seeded mutant against the machines, and its
  subcommand;
- ``pp_share``: the PP gate's share of a gate on a tree with ``storage:pp`` (``gate`` and the
  matrix alike), its failure a new one, and ``replay`` of the program file it writes;
- ``matrix``: every upstream release of a range gated, one table; ``release_coverage``: what a
  release's gate drove, and what the release has that the gate does not drive;
- ``cli_lists``: ``hicache-fuzz list {invariants,known,mutants,rules}``.

The machine these campaigns run, its profiles and the known findings are
``hicache_ref.harness.campaigns``; workers, shards, the failure database and the HTML report
are ``hicache_ref.fleet``. ``from hicache_ref.campaign import run_campaign, CampaignReport``
still works (resolved on first use, so importing the package imports nothing).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CampaignReport", "run_campaign"]


def __getattr__(name: str) -> Any:
    """``run_campaign`` and ``CampaignReport`` for older imports, loaded on first use."""
    if name == "run_campaign":
        from hicache_ref.campaign.run import run_campaign

        return run_campaign
    if name == "CampaignReport":
        from hicache_ref.campaign.report import CampaignReport

        return CampaignReport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
