"""The pure oracle beside the harness, in both directions.

- ``oracle.attach_lockstep`` -> ``oracle.LockstepOracle``: after every applied step, the rule's
  oracle ops (its record's translation) and what the device executed are fed to the oracle;
- ``compare``: the oracle's state against the implementation's (ack rows, lifecycles, producer
  slots, pages; content at quiescence), a divergence named by the id of what diverged;
- ``from_oracle``: an oracle op trace (the bounded model checker's) as harness steps;
  ``from_storage_oracle``: a storage oracle trace (``bounded_storage``'s) as harness steps under
  schedule points;
- ``storage`` -> ``storage.StorageLockstep``: every storage verb (a tree call, or one storage
  step on every rank with its backend calls) fed to the storage oracle (``oracle/storage``);
  ``storage_follower``: the face (a Protocol) the next three read of it; ``storage_steps``: one
  whole loop body as oracle ops; ``storage_point_steps``: under schedule points, one grant of a
  thread kind to its next point as oracle ops; ``storage_compare``: what it compares;
  ``storage_walk``: seeded storage walks (with or without points) for its tests and benchmark.
"""
