"""Fleets: every core of a runner, many runners, one failure database, one report.

In the order a fleet's campaign flows through them:

- ``shards``: ``--shard I/N`` and each worker's ``SeedLane``: runner I of N owns the seeds
  ``base + I - 1`` modulo N, its workers interleave inside them (disjoint, no gaps);
- ``database``: ``--database URL``, Hypothesis' example databases (a folder, Redis, or the
  local + read-only-shared split); every campaign's first round replays what any saved, and
  failure traces are stored there too, one entry per trace text;
- ``workers``: ``--workers N`` processes (spawned), one campaign each on its lane, no traffic
  while they fuzz but a progress snapshot a second; Ctrl-C ends them all with a report;
- ``progress``: a bar on a terminal, a line every 30 s in a log;
- ``merge``: the workers' reports as one (coverage and behaviours: their union) and reports read back from JSON;
- ``svg_charts`` and ``plots``: the timelines as inline SVG charts;
- ``report_failures``, ``report_tables``, ``report_style`` and ``report``: ``hicache-fuzz report
  RUN.json... -o report.html``, one static page;
- ``live_report``: ``--report-live``, that page rewritten while the campaign runs;
- ``commands``: the fleet's command-line options and the ``report`` and ``traces`` subcommands.
"""
