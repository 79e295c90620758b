"""What runs the machines, and what a gate knows beforehand.

- ``machine.HiCacheMachine``: the Hypothesis state machine (a case's swarm, then one rule per
  compound program and per drawn atomic record, drawn by the machine's single ``step`` rule),
  ``machine_for`` binding it to an implementation and a sink;
  ``side_draws``: the side of a drawn world past its pools' kinds (side pools, stored
  windows, storage sidecars, buffer mode); ``profiles``: its settings (ci, dev, campaign);
- ``literal_pool``: Hypothesis' pool of local literals, pinned (empty) while a campaign's
  rounds or the PP gate search, so a seed draws the same programs in any process;
- ``known_findings``: the findings written up per implementation, which a gate baselines;
- ``storage_soak``: the storage tier on real threads for minutes, faults on;
- ``pp_gate``: Hypothesis programs of the PP tree half's steps on 0.5.23's PP worlds (INV-38);
  ``pp_program_file``: a failing program on disk (``hicache-pp-program/1``), replayed without
  Hypothesis.

The campaign runner itself, the mutant catalogue and the release matrix (which run campaigns)
are ``hicache_ref.campaign``; workers, shards and the failure database are ``hicache_ref.fleet``.
"""
