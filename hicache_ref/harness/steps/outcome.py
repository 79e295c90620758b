"""What one applied step did, as a value: the trace's text and the facts the checks read.

A tree verb returns an ``Outcome``; the session, the lockstep oracle and the cross-rank
comparison read its fields (``refused``, ``reservation``, ``agreed``) and never its text, which
is only what a trace and a replay print. ``SKIPPED`` is the outcome of a step whose rule was not
enabled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
