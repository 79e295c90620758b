"""Formal checks of the oracle: bounded model checking and CrossHair contracts.

- ``bounded.explore(config, max_depth)``: breadth-first over every enabled op, symmetry-reduced
  (``canonical``), every invariant in every reachable state; returns the shortest violating
  trace as an op tuple that replays with ``oracle.run_ops``. CLI: ``python -m
  hicache_ref.formal.bounded --nodes 2 --layers 2 --pages 2 --cp 2 --draft 1 --max-depth 9``.
- ``bounded_storage.explore_storage(config, max_depth, preemptions=k)``: the same over the
  storage oracle (``oracle/storage``): every interleaving of the storage threads' schedule
  points, the tree and the faults, under a CHESS preemption bound. CLI: ``python -m
  hicache_ref.formal.bounded_storage --ranks 2 --ops 2 --pages 2 --max-depth 80 --preemptions 1``.
- ``explore_impl.explore(implementation, name, world)``: the same kind of enumeration run
  against an implementation (the reference, a mutant, upstream 0.5.23) through the schedule
  points: every interleaving of a small world a fresh harness run, within a fault budget and a
  preemption bound; the shortest violating run is a JSONL trace ``hicache-fuzz replay`` runs.
  CLI: ``python -m hicache_ref.formal.explore_impl --impl sglang --world fetch``.
- CrossHair checks the ``pre:``/``post:`` contracts of the oracle's pure functions and of
  ``pools/page_math.py`` (``.ci/crosshair.sh``, ``tests/formal/test_crosshair.py``), and
  ``optimized``: faster page helpers that must behave exactly like ``page_math`` (CrossHair's
  diffbehavior).

Import from the submodules (``hicache_ref.formal.bounded``); this package imports nothing so
``python -m hicache_ref.formal.bounded`` runs without a double import.
"""
