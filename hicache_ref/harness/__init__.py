"""The harness: state machines that drive any implementation of the controller and check it
against the harness's own model, never the implementation's word.

Its map, in the order one case flows through it:

- ``adapters``: the one seam to an implementation (the contract, snapshots; the reference, the
  mutants, upstream SGLang and the seed fork read from a tree, upstream's storage backend);
- ``world``: the simulated world of one case (``HarnessConfig``, pools, allocators, devices,
  the storage world and its recording backends) and the content oracle's bytes;
- ``schedule``: schedule points: storage threads parked at every backend call, collective and
  control-queue put, granted one at a time with a drawn outcome per backend call;
- ``steps``: the rule table (``rules``: one ``RuleRecord`` per trace step, ``programs``: the
  compound stories), ``Session`` (a step's preconditions, the rule, then every check), traces
  and their replay;
- ``driver``: the tree side as verbs (``tree.TreeDriver``: what SGLang's radix cache and
  scheduler do around the controller; ``storage_driver``: the L3 side), and what they check
  as they go (byte checks, the free-slot and store watches, misuse probes);
- ``lockstep``: the pure oracle stepped beside every applied step, and oracle traces
  translated into harness steps;
- ``campaigns``: the Hypothesis machine, its profiles, the mutant catalogue, the known
  findings a gate baselines, the release matrix and the storage soak.

The invariants the checks judge live in ``hicache_ref.invariants`` (one checker per id); the
campaign runner and its report in ``hicache_ref.campaign``.
"""
