"""The pure oracle beside the harness, in both directions.

- ``oracle.attach_lockstep`` -> ``oracle.LockstepOracle``: after every applied step, the rule's
  oracle ops (its record's translation) and what the device executed are fed to the oracle;
- ``compare``: the oracle's state against the implementation's (ack rows, lifecycles, producer
  slots, pages; content at quiescence), a divergence named by the id of what diverged;
- ``from_oracle``: an oracle op trace (the bounded model checker's) as harness steps.
"""
