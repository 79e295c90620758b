"""Implementations under test, behind one seam (``base.Implementation``).

The seam, and how an implementation is found:

- ``base``: ``Implementation`` (capabilities, ``build``), ``ControllerLike``, the per-rank
  snapshot the checks read; ``contract``: the hooks an adapter must and may define;
- ``registry``: implementations by name (``reference``, mutants, ``sglang``, ``seed``);
- ``reference``: this project's controller (``reference_windows``: its side pool's L3 window
  named as the tree names it; ``reference_beliefs``: in buffer mode, the tree's existence
  beliefs it holds, handed to the tree half); ``mutant``: it with one seeded bug from ``fuzz/mutants/``; ``unfenced``: fences that do not fence (the stream-order mutants).

The gate on upstream's own code, in the order a gate uses the modules:

1. ``sglang_releases`` / ``sglang_tree``: which release, and its unpacked tree;
2. ``sglang_stubs``: the tree as the ``sglang`` package, the controller's other imports stubbed
   (``sglang_hashes``: the tree's page-key hash functions without its kernels);
3. ``sglang``: ``SglangImplementation``, the controller file executed once per world;
   ``sglang_shapes``: the shims per release shape; ``sglang_group``: 0.5.19+'s hybrid
   controller over a ``HostPoolGroup``, and ``sglang_sides``: the tree half of its independent
   side pool, as upstream's hybrid radix cache drives it;
4. in a storage world, ``sglang_storage``: upstream's controller subclassed for the storage
   driver (``storage_controller_class``, ``UpstreamTier``), whose threads park at the thread
   gate (``sglang_gate``: served queues, gated threads, ``StepGate``) under the storage world's
   process group, attach and backend factory (``sglang_world``); ``upstream_storage``:
   upstream's own file backend behind this project's interface; in a ``buffer_only`` world,
   ``sglang_buffer``: the tree's storage existence beliefs, upstream's own class; in a PP world,
   ``sglang_verdict``: the timeout stop policy's PP-rank-0 verdict, the radix cache's own
   methods run per PP rank over the rank's clock.
"""

from hicache_ref.harness.adapters.base import (
    CAPABILITIES,
    BuildRequest,
    ControllerLike,
    Implementation,
    supports,
    unsupported_reasons,
)
from hicache_ref.harness.adapters.reference import ReferenceImplementation

__all__ = [
    "CAPABILITIES",
    "BuildRequest",
    "ControllerLike",
    "Implementation",
    "ReferenceImplementation",
    "supports",
    "unsupported_reasons",
]
