"""What a step is, how it is applied, and how a program of steps is kept and replayed.

In the order a step goes through them (the rules themselves, one ``RuleRecord`` each, are the
family modules of ``harness/rules/``):

- ``programs`` and ``storage_programs``: compound stories yielding atomic steps, shared by
  the Hypothesis machine, the CP-process schedule and the vector walks;
- ``session.Session``: applies a step (pins, preconditions, the rule, then every check of its
  phase) and returns an ``Outcome`` (``harness/step_types.py``: the trace's text and typed
  facts);
- ``trace``: versioned JSONL traces (a header, then one step per line; ``RuleName`` names every
  rule);
- ``replay``: a trace applied again without Hypothesis, and ddmin over its steps.
"""
