"""A step's vocabulary, below every floor that applies steps: the rule names a trace may hold,
the values its arguments take, and what one applied step did.

``RuleName`` names every machine rule (the trace format: ``steps/trace.py`` writes it, the rule
families under ``rules/`` are these names, one ``RuleRecord`` each); ``StepArg`` is the type of
one argument. A verb (the tree's, the storage driver's, a rule's) returns an ``Outcome``; the
session, the lockstep oracle and the cross-rank comparison read its fields (``refused``,
``reservation``, ``agreed``) and never its text, which is only what a trace and a replay print.
``SKIPPED`` is the outcome of a step whose rule was not enabled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RuleName = Literal[
    "prefill",
    "forward_layer",
    "write",
    "start_writing",
    "load",
    "start_loading",
    "forward_read",
    "advance",
    "synchronize",
    "drain_acks",
    "cancel",
    "evict_device",
    "drop",
    "evict_host",
    "reset",
    "noop",
    "probe_evict_host",
    "probe_evict_device",
    "probe_rewrite",
    "store_layer",
    "layer_end",
    "reserve",
    "submit_layer",
    "drain_write",
    "drain_load",
    "forward_read_batch",
    "scribble_free_host",
    "reset_in_flight",
    "advance_to_record",
    "write_storage",
    "storage_step",
    "prefetch",
    "check_prefetch",
    "terminate_prefetch",
    "drain_prefetch_acks",
    "drain_backup_acks",
    "inject_fault",
    "detach_storage",
    "attach_storage",
    "clear_storage",
    "reset_storage_in_flight",
    "schedule_point",
]
StepArg = int | bool | str
"""One argument's value in a step (a node handle, a count, a flag, a stream's name)."""

Reservation = Literal["", "made", "refused"]


@dataclass(frozen=True)
class Outcome:
    """One step's result: ``text`` for the trace, typed facts for everything downstream."""

    text: str
    refused: bool = False
    """The call was refused (a capacity shortfall or a device full): it must change nothing
    (INV-17)."""
    reservation: Reservation = ""
    """An early CP reservation made inside the step (``prefill(early_reserve=True)``): ``made``
    or ``refused`` (the node's pages stay; the refused reservation must leave nothing)."""
    agreed: str | None = None
    """What every CP rank must report alike (None: the text). Rank-local detail (how many ops an
    advance ran, which host pool was short) is left out."""
    skipped: bool = False

    def __str__(self) -> str:
        return self.text

    @property
    def shared(self) -> str:
        """The part of the outcome every rank agrees on (``agreed``, else the text)."""
        return self.text if self.agreed is None else self.agreed

    def then(self, other: Outcome) -> Outcome:
        """Two verbs of one step in order (``drain_acks``: the write drain, then the load's)."""
        return Outcome(
            f"{self.text}; {other.text}",
            refused=self.refused or other.refused,
            agreed=f"{self.shared}; {other.shared}",
        )


def done(text: str, *, agreed: str | None = None) -> Outcome:
    """A verb that did what it was asked."""
    return Outcome(text, agreed=agreed)


def refused(reason: str, *, agreed: str | None = None) -> Outcome:
    """A verb whose call the implementation (or the tree) refused: nothing may change."""
    return Outcome(f"refused: {reason}", refused=True, agreed=agreed)


SKIPPED = Outcome("skipped", skipped=True)
