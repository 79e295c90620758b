"""hicache_ref: a checked reference implementation of SGLang's HiCache controller.

Packages, in the order data flows through them (under every one, ``errors``: the failure
channels, and ``ids``: the distinct id types):
- ``device``: the seam (CUDA or simulated streams and events);
- ``pools``: device KV pools, host pools and their layouts, allocators, the CP layout;
- ``controller``: ``HiCacheController`` (write -> ack -> evict -> load -> ack; CP; draft; storage);
- ``storage``: the L3 tier (backends, fault injection);
- ``invariants``: pydantic records and one checker per invariant id in ``specs/invariants.md``
  (``invariant_titles``: every id's title, generated from ``specs/``);
- ``oracle``: a pure model of what a correct controller must do;
- ``formal``: CrossHair contracts and a bounded model checker over the oracle;
- ``harness``: adapters, Hypothesis state machines, traces and replay; ``campaign``: campaigns;
  ``distributed``: CP ranks as processes, one step broadcast and compared across them;
- ``vectors``: recorded stories every implementation must answer alike (the test suite);
- ``fleet``: workers, shards, a shared failure database, merged and HTML reports; ``cli``,
  and ``replay_lines``: the command lines it prints, each runnable as pasted.
"""

__version__ = "0.1.0"
