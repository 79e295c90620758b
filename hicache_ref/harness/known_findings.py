"""Known findings: failures a gate expects, so it can keep going and report only new ones.

A ``KnownFinding`` names a deviation that is already understood (usually one of the ``F<n>``
entries of ``specs/upstream_findings.md``) for the implementations that have it. ``hicache-fuzz
gate --known F20 F21`` (or ``--known all``) makes those failures a baseline: the campaign counts
them, keeps going, and fails only on a failure that no selected entry explains.

How a failure is matched. A failure matches a known finding when all three hold:

1. *the implementation*: the name of the implementation under test equals one of the entry's
   ``implementations``, or starts with one of them followed by ``:`` (so ``"sglang"`` covers
   ``sglang`` and ``sglang:<variant>``, ``"mutant"`` covers every ``mutant:<name>``);
2. *the invariant*: the failure's invariant id (``INV-xx`` of an ``InvariantViolation``; for any
   other exception, its type name, such as ``HiCacheInputError``) equals the entry's
   ``invariant``;
3. *the message*: the entry's ``message_pattern``, a Python regular expression, is found
   (``re.search``) anywhere in the failure's full message (``str(exc)``, all lines).

A failure that matches no selected entry is new: the gate prints its replay line and exits 1.
``--known all`` selects every entry whose ``implementations`` cover the implementation under
test; ``--known ID ...`` selects entries by id, and an unknown id is a usage error.

The table below starts empty; an entry looks like::

    KnownFinding(
        id="F5",
        implementations=("sglang", "seed"),
        invariant="INV-02",
        message_pattern=r"two undrained write acks",
        summary="the duplicate-write gate ignores pending per-layer writes",
    )
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hicache_ref.errors import HiCacheInputError

ALL = "all"


@dataclass(frozen=True)
class KnownFinding:
    """One understood failure: which implementations have it and how to recognise it."""

    id: str
    implementations: tuple[str, ...]
    invariant: str
    message_pattern: str
    summary: str

    def __post_init__(self) -> None:
        # Verify the entry can match something and its pattern compiles (a typo fails at import)
        if not self.id or self.id == ALL:
            raise HiCacheInputError(f"a known finding needs an id other than {ALL!r}")
        if not self.implementations:
            raise HiCacheInputError(f"known finding {self.id}: name at least one implementation")
        re.compile(self.message_pattern)

    def covers(self, implementation: str) -> bool:
        """Whether this finding applies to ``implementation`` (a name or a ``name:`` prefix)."""
        return any(
            implementation == name or implementation.startswith(f"{name}:")
            for name in self.implementations
        )

    def matches(self, implementation: str, invariant: str, message: str) -> bool:
        """Whether a failure of ``implementation`` is this finding (see the module docstring)."""
        return (
            self.covers(implementation)
            and invariant == self.invariant
            and re.search(self.message_pattern, message) is not None
        )


KNOWN_FINDINGS: dict[str, KnownFinding] = {}
"""Every known finding by id. Filled from specs/upstream_findings.md; tests register their own."""


def register_known_finding(finding: KnownFinding) -> KnownFinding:
    """Add ``finding`` to the table; an id that is taken already is refused."""
    if finding.id in KNOWN_FINDINGS:
        raise HiCacheInputError(f"known finding id {finding.id!r} is registered already")
    KNOWN_FINDINGS[finding.id] = finding
    return finding


def get_known_findings(ids: Iterable[str], implementation: str) -> tuple[KnownFinding, ...]:
    """The entries ``--known ids`` selects; ``all`` means every entry covering the implementation."""
    selected: list[KnownFinding] = []
    for finding_id in ids:
        if finding_id == ALL:
            selected += [f for f in KNOWN_FINDINGS.values() if f.covers(implementation)]
            continue
        if finding_id not in KNOWN_FINDINGS:
            legal = ", ".join(sorted(KNOWN_FINDINGS)) or "none registered"
            raise HiCacheInputError(
                f"unknown known-finding id {finding_id!r}; known ids: {legal} (or 'all')"
            )
        selected.append(KNOWN_FINDINGS[finding_id])
    return tuple(dict.fromkeys(selected))


def match_known_finding(
    findings: Sequence[KnownFinding], implementation: str, invariant: str, message: str
) -> KnownFinding | None:
    """The first of ``findings`` that explains this failure, or None when it is new."""
    for finding in findings:
        if finding.matches(implementation, invariant, message):
            return finding
    return None
