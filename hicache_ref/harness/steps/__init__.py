"""What a step is, how it is applied, and how a program of steps is kept and replayed.

In the order a step goes through them:

- ``rule_record.RuleRecord``: everything one rule is (family, ``why_not``, ``process``,
  ``draw`` and its ``Param``s, the oracle translation, the CP-process schedule's weight, the
  session's flags); ``rules``, ``storage_rules`` and ``schedule_rules`` (a parked storage
  thread granted with a drawn backend outcome): every atomic record, defined once;
- ``programs`` and ``storage_programs``: compound stories yielding atomic steps, shared by
  the Hypothesis machine and the CP-process schedule;
- ``session.Session``: applies a step (pins, preconditions, the rule, then every check of its
  phase) and returns an ``outcome.Outcome`` (the trace's text and typed facts);
- ``trace``: versioned JSONL traces (a header, then one step per line);
- ``replay``: a trace applied again without Hypothesis, and ddmin over its steps.
"""
