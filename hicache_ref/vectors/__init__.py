"""Conformance vectors: programs a correct controller must answer alike, in any language.

The map, in the order a vector flows:

- ``models``: the format (``Vector``, ``SuiteHeader``; ``specs/vectors.md`` says what each
  field means) and its digests; ``schema``: the same as standard JSON Schema;
- ``observe``: what a step produced, read from the harness's session and pools (normalized:
  counts, node-relative bytes, owner patterns; never slot numbers or outcome text);
- ``settle``: which steps read stream completion, and when their answer is the same for every
  conforming implementation;
- ``record``: one vector recorded on the reference, step by step, checks and oracle on;
- ``storybook`` (how a scene is written), ``stories``, ``stories_regressions`` (the scenes: at
  least one per invariant id), ``stories_sides`` (an independent side pool's),
  ``stories_storage`` (the L3 tier's), ``stories_side_storage`` (a side pool's window in L3),
  ``stories_buffer`` (buffer mode's staging and beliefs), ``stories_windows`` (inside a storage
  loop body) and
  ``stories_exhaustive`` (the storage checker's shortest breaking interleaving of each window);
  ``walks`` (seeded programs over the rule table and over the oracle's ops), ``coverage``
  (the rules x ids table) and ``generate`` (the suite, in order);
- ``suite``: gzip'd JSON Lines on disk, each line checked on the way in;
- ``replay``: a suite against any implementation, the first divergence named like a
  harness failure;
- ``cli``: ``hicache-fuzz vectors generate | replay | schema``; ``pytest_plugin``: the
  vectors and a bounded gate as test items of another project's pytest run.
"""
