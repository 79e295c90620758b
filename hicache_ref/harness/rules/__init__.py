"""The machine's rules: one module per family, each rule on one screen of it.

In the order a step meets them:

- ``record``: what a rule is (``RuleRecord``: family, ``why_not``, ``candidates``, ``pins``,
  ``process``, ``draw`` and its ``Param``s, the oracle translation, the session's flags, and
  what traces and vectors read of it: argument types, ``Completion``, walk weight) and what it
  sees of its case (``StepContext``, a narrow Protocol ``Session`` satisfies);
- the families, in flow order, each holding for every rule its precondition, its verb (what the
  radix cache and the scheduler do around the controller), its oracle translation and its
  record: ``forward`` (prefill, forward_layer, store_layer, layer_end) -> ``write`` (write,
  start_writing, reserve, submit_layer, drain_write, cancel) -> ``load`` (load,
  start_loading, forward_read, forward_read_batch, drain_load, drain_acks) -> ``evict``
  (evict_device, drop, evict_host) -> ``streams`` (advance, advance_to_record, synchronize)
  -> ``misuse`` (the probes, scribble_free_host) -> ``reset`` (reset, reset_in_flight, noop)
  -> ``storage`` (the L3 verbs of ``driver/storage_driver.py``) -> ``schedule`` (a grant of a
  parked storage thread, with its outcome);
- ``table``: ``RULES``, every record by name, from the families' ``RECORDS``.

Rule names and argument names are a stable format: traces in ``fuzz/corpus`` name them, and
``step_types.RuleName`` must name exactly these rules (``tests/harness/test_rules.py``).
"""

from hicache_ref.harness.rules.record import MULTI_CONSUMER, RESET_DRAINS, STREAMS, RuleRecord
from hicache_ref.harness.rules.table import RULES, rule_families, step_argument_types

__all__ = [
    "MULTI_CONSUMER",
    "RESET_DRAINS",
    "RULES",
    "STREAMS",
    "RuleRecord",
    "rule_families",
    "step_argument_types",
]
