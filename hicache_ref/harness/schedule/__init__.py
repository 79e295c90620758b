"""Schedule points: storage threads that park wherever another thread's action can matter.

In the order a grant flows:

- ``points``: the point kinds (``wait``, the backend calls, ``return``, ``all_reduce``, ``put``,
  ``lock``, ``event``) and the outcomes of a backend call (``ok``, ``hole``, ``gone``,
  ``raise``, ``short``, ``defer``): ``Point``, ``Grant``, ``schedule_point``;
- ``gate``: ``GatedThread`` and ``StepGate`` (where threads park, who the harness grants,
  ``grants`` as the harness's record);
- ``outcomes``: a backend point's outcome applied through the world's fault layer, and a
  deferred call's return point;
- ``reference``: the reference tier's face (``GatedExecutor``: its four threads on the gate);
- ``pct``: the ``campaign`` profile's PCT-style bias over which thread runs next.

Upstream's face is ``harness/adapters/sglang_gate.py`` (served queues) with
``sglang_storage.UpstreamTier``; the rules that draw grants are
``harness/rules/schedule.py``.
"""
