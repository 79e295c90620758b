"""The harness: state machines that drive any implementation of the controller and check it
against the harness's own model, never the implementation's word.

Its map, in the order one case flows through it:

- ``adapters``: the one seam to an implementation (the contract, snapshots; the reference, the
  mutants, upstream SGLang and the seed fork read from a tree, upstream's storage backend);
- ``world``: the simulated world of one case (``HarnessConfig``, pools, allocators, devices,
  the storage world and its recording backends) and the content oracle's bytes;
- ``step_types``: a step's vocabulary, which every floor above reads: the rule names a trace
  admits (``RuleName``), argument values (``StepArg``) and what a verb did (``Outcome``);
- ``driver``: the tree's state (``tree.TreeDriver``: SGLang's radix cache around the
  controller, its ack drains; ``storage_driver``: the L3 side, which extends the tree), and
  what they check as they go (byte checks, the free-slot and store watches);
- ``schedule``: schedule points: storage threads parked at every backend call, collective and
  control-queue put, granted one at a time with a drawn outcome per backend call;
- ``rules``: one module per rule family (forward, write, load, evict, streams, misuse, reset,
  storage, schedule), each rule's precondition, verb, oracle translation and ``RuleRecord``
  together; they see the case through ``rules.record.StepContext``, never the session itself;
- ``steps``: the compound stories (``programs``), ``Session`` (a step's preconditions, the
  rule, then every check), traces and their replay;
- ``lockstep``: the pure oracle stepped beside every applied step, and oracle traces
  translated into harness steps;
- ``campaigns``: the Hypothesis machine, its profiles, the known findings a gate baselines and
  the storage soak.

The invariants the checks judge live in ``hicache_ref.invariants`` (one checker per id); the
campaign runner, its report, the mutant catalogue and the release matrix in
``hicache_ref.campaign``.
"""
