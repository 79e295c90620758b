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

One root cause can fire more than one check, depending on the schedule; ``also`` lists the
other ``(invariant, message_pattern)`` pairs that count as the same finding.

A finding of some upstream releases only names them in ``releases`` (``"0.5.10..0.5.18"``, both
ends included, post releases too): it then matches only a failure of a tree whose release (its
``sglang/_version.py``, the campaign's ``release``) lies in that range. A tree of another
release, or of no known release (a checkout), is reported, not baselined: the same symptom
outside the releases read to have the bug is a new failure.

A failure that matches no selected entry is new: the gate prints its replay line and exits 1.
``--known all`` selects every entry whose ``implementations`` cover the implementation under
test; ``--known ID ...`` selects entries by id, and an unknown id is a usage error.

The table holds the written-up findings whose failures a campaign reproduces; an entry looks
like::

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.sglang_releases import (
    VERSION_RE,
    VersionKey,
    check_version,
    compute_version_key,
)

ALL = "all"


@dataclass(frozen=True)
class KnownFinding:
    """One understood failure: which implementations have it and how to recognise it."""

    id: str
    implementations: tuple[str, ...]
    invariant: str
    message_pattern: str
    summary: str
    also: tuple[tuple[str, str], ...] = ()
    """Other ``(invariant, message_pattern)`` pairs the same root cause shows up as (which check
    fires first depends on the schedule)."""
    releases: str = ""
    """``LO..HI``: the upstream releases read to have it (empty: every release)."""

    def __post_init__(self) -> None:
        # Verify the entry can match something and its pattern compiles (a typo fails at import)
        if not self.id or self.id == ALL:
            raise HiCacheInputError(f"a known finding needs an id other than {ALL!r}")
        if not self.implementations:
            raise HiCacheInputError(f"known finding {self.id}: name at least one implementation")
        for pattern in (self.message_pattern, *(p for _, p in self.also)):
            re.compile(pattern)
        if self.releases:
            self.release_range()  # a malformed range fails at import

    def release_range(self) -> tuple[VersionKey, VersionKey]:
        low, sep, high = self.releases.partition("..")
        if not sep:
            raise HiCacheInputError(
                f"known finding {self.id}: releases {self.releases!r} is not LO..HI"
            )
        return (
            compute_version_key(check_version(low, f"{self.id} releases")),
            compute_version_key(check_version(high, f"{self.id} releases")),
        )

    def covers_release(self, release: str | None) -> bool:
        """Whether a failure of ``release`` can be this finding (unscoped: every release)."""
        if not self.releases:
            return True
        if not release or VERSION_RE.match(release) is None:
            return False  # a tree of no known release is reported, never baselined
        low, high = self.release_range()
        return low <= compute_version_key(release) <= high

    def covers(self, implementation: str) -> bool:
        """Whether this finding applies to ``implementation`` (a name or a ``name:`` prefix)."""
        return any(
            implementation == name or implementation.startswith(f"{name}:")
            for name in self.implementations
        )

    def matches(
        self, implementation: str, invariant: str, message: str, release: str | None = None
    ) -> bool:
        """Whether a failure of ``implementation`` (of upstream ``release``) is this finding
        (see the module docstring)."""
        if not self.covers(implementation) or not self.covers_release(release):
            return False
        return any(
            invariant == inv_id and re.search(pattern, message) is not None
            for inv_id, pattern in ((self.invariant, self.message_pattern), *self.also)
        )


_SEED_AND_UPSTREAM: tuple[KnownFinding, ...] = (
    KnownFinding(
        id="F1",
        implementations=("seed",),
        invariant="INV-09",
        message_pattern=r"write ack drained: host copy of node \d+ draft layer \d+ \S+ rank \d+: "
        r"row \d+ holds an untouched \(zero\) row",
        summary="draft pools given to the constructor are never backed up (has_draft unset)",
    ),
    KnownFinding(
        id="F2",
        implementations=("seed",),
        invariant="INV-09",
        message_pattern=r"load ack drained: device copy of node \d+ draft layer \d+ ",
        summary="a load ack finishes before the draft layers beyond the target's have landed",
    ),
    KnownFinding(
        id="F3",
        implementations=("seed",),
        invariant="IndexError",
        message_pattern=r"list index out of range",
        summary="draft layers at or beyond the target layer count have no load event to wait on",
    ),
    KnownFinding(
        id="F4",
        implementations=("seed",),
        invariant="INV-14",
        message_pattern=r"ack_write_queue( drain)?: rank \d+ (has \d+ ack rows but|ack row \d+ carries)",
        summary="a zero-owned CP rank acks after the target layers, the owners after the draft "
        "layers (hinges on the re-indentation at flat line 1249)",
    ),
    KnownFinding(
        id="F7",
        implementations=("seed",),
        invariant="INV-09",
        message_pattern=r"write ack drained: host copy of node \d+ draft layer \d+ \S+ rank \d+: "
        r"row \d+ holds node-content",
        summary="the per-layer draft D2H pairs draft host rows with the target's permutation",
    ),
    KnownFinding(
        id="F8",
        implementations=("seed", "sglang"),
        invariant="INV-18",
        message_pattern=r"reset\(\) left producer_index=",
        summary="reset() never resets the layer counter (0.5.10, 0.5.23 and the seed); harmless "
        "when the tree resets at idle",
    ),
    KnownFinding(
        id="F9",
        implementations=("seed",),
        invariant="INV-07",
        message_pattern=r"free host slots .*holds node-content .*expected the harness's scribble "
        r"into a free host slot",
        summary="a cancel that finds no pending state (its ack is queued) does not drain the "
        "write stream, so the rollback frees host slots a D2H still writes (reached through "
        "F20's state: hinges on flat line 1249)",
    ),
    KnownFinding(
        id="F20",
        implementations=("seed",),
        invariant="INV-02",
        message_pattern=r"two undrained write acks|write ack for node_id \d+, which has no backup "
        r"in flight",
        summary="catch-up on a zero-owned rank with a deeper draft re-registers a finished write "
        "state and acks twice (hinges on flat line 1249)",
        also=(
            # the second ack outlives every drain when the forward finishes at quiescence
            ("INV-16", r"ack_write_queue still holds \d+ ack\(s\) \[\[\d+\]\] at quiescence"),
            # the fresh state outlives the node's backup when nothing ever completes it
            (
                "INV-15",
                r"per-layer write states still pending for node ids \[[\d, ]+\], whose "
                r"backup is not in flight",
            ),
        ),
    ),
)

_UPSTREAM_RELEASES: tuple[KnownFinding, ...] = (
    KnownFinding(
        id="F21",
        implementations=("sglang",),
        invariant="INV-09",
        message_pattern=r"load ack drained: device copy of node \d+ draft layer \d+ ",
        summary="a draft deeper than the target is loaded only for the target's layer count: "
        "set_draft_kv_pool's copies ride inside the target's layer loop (0.5.11 - 0.5.18), and a "
        "packed MTP draft of depth d loads at transfer layer d (0.5.19 - 0.5.21; 0.5.22 loads "
        "every depth by the last target layer)",
        also=(
            # a read of the never-loaded draft tail (after the target's last layer event)
            ("INV-11", r"forward read of node \d+ draft layer \d+ "),
            # the lockstep oracle still holds the tail copy it expected, so it misplaces the
            # next load's copies of that channel
            (
                "INV-11",
                r"lockstep at step \d+ .*forward read of channel \d+ of node \d+ ran before "
                r"that layer's H2D landed",
            ),
        ),
        releases="0.5.11..0.5.21",
    ),
    KnownFinding(
        id="F22",
        implementations=("sglang", "seed"),  # the fork keeps 0.5.10's storage threads
        invariant="INV-25",
        message_pattern=r"upstream's backup_thread_func died of ",
        summary="the backup thread has no exception handler (0.5.10 - 0.5.21): one backend "
        "exception kills it, so that backup and every later one are never acked and their host "
        "locks leak (sglang#38427; 0.5.22 catches it in _page_backup_or_log)",
        releases="0.5.10..0.5.21",
    ),
    KnownFinding(
        id="F23",
        implementations=("sglang", "seed"),  # the fork keeps 0.5.10's storage threads
        invariant="INV-24",
        message_pattern=r"after detach: \d+ storage threads alive",
        summary="reset() never joins the prefetch IO thread (0.5.10 - 0.5.18): the old one "
        "sleeps through the stop and outlives the next detach (sglang#36882's class)",
        also=(
            # the old IO thread parked inside its body at the reset (schedule points: at a
            # backend call or, under lock points, at its operation's lock) finishes that body,
            # on the old epoch's operation, after reset() returned
            (
                "INV-24",
                r"io step of prefetch '[^']*' from epoch \d+ after the harness moved",
            ),
            # ... and, parked at a backend call, takes its next point in the new epoch
            (
                "INV-35",
                r"storage thread \S+ \(prefetch_io_aux_func\) of epoch \d+ ran again in epoch",
            ),
        ),
        releases="0.5.10..0.5.18",
    ),
    KnownFinding(
        id="F25",
        implementations=("sglang", "seed"),  # the fork keeps 0.5.10's storage threads
        invariant="INV-24",
        message_pattern=r"after reset: queues \{[^}]*\}, prefetch_tokens_occupied=\d+",
        summary="reset() keeps prefetch_tokens_occupied and host_mem_release_queue "
        "(0.5.10 - 0.5.13.post1): a prefetch ongoing at reset stays counted against the rate limit "
        "and its queued releases free pages of the next epoch (sglang#26009; 0.5.14 fixed it)",
        releases="0.5.10..0.5.13.post1",  # 0.5.13.post1's reset() is 0.5.13's (read, replayed)
    ),
    KnownFinding(
        id="F26",
        implementations=("sglang", "seed"),  # the fork keeps 0.5.10's storage threads
        invariant="INV-25",
        message_pattern=r"upstream's prefetch_(thread|io_aux)_func died of ",
        summary="the prefetch hit-query and IO threads have no exception handler (0.5.10 - "
        "0.5.21): one backend exception in batch_exists or batch_get kills the thread, so no "
        "later prefetch of that rank is queried or fetched (sglang#27501's class; 0.5.22 "
        "catches it)",
        releases="0.5.10..0.5.21",
    ),
    KnownFinding(
        id="F27",
        implementations=("sglang",),
        invariant="INV-37",
        message_pattern=r"published progress counts \d+ page\(s\) but only \d+ hold the "
        r"draft sidecar's bytes",
        summary="the draft releases read a batch's draft pages best-effort (0.5.11 - 0.5.18): "
        "a draft page that is missing, short or raises is skipped and the batch's KV pages "
        "are counted, so the node's draft layers hold whatever the bounce slot held "
        "(sglang#30393's class; 0.5.19 moves drafts to an all-or-nothing sidecar)",
        releases="0.5.11..0.5.18",
    ),
    KnownFinding(
        id="F28",
        implementations=("sglang",),
        invariant="INV-29",
        message_pattern=r"with a trailing window, the longest prefix restorable on every rank",
        summary="0.5.19 - 0.5.22 agree on an SWA window's hit as the MIN of each rank's longest "
        "restorable prefix, which may be a prefix some rank cannot restore (its trailing window "
        "is not in its L3): the window read fails there and the whole prefetch is discarded "
        "(0.5.23 reduces one restorable flag per prefix length)",
        releases="0.5.19..0.5.22",
    ),
    KnownFinding(
        id="F24",
        implementations=("sglang", "seed"),  # the fork runs its tree's HiCacheFile
        invariant="INV-28",
        message_pattern=r"rank \d+'s clear\(\) removed \d+ pages of other ranks",
        summary="upstream's HiCacheFile.clear() removes every file of its directory: one "
        "rank's clear endpoint wipes every other rank's and model's pages (sglang#32693's class)",
        releases="0.5.10..0.5.23",  # the same loop over the directory in every release read
    ),
)

KNOWN_FINDINGS: Mapping[str, KnownFinding] = MappingProxyType(
    {f.id: f for f in (*_SEED_AND_UPSTREAM, *_UPSTREAM_RELEASES)}
)
"""Every known finding by id, from specs/upstream_findings.md (the F-entries whose failures the
gate has reproduced). Read-only: a new finding is an entry above; a test passes its own table."""


def get_known_findings(
    ids: Iterable[str], implementation: str, table: Mapping[str, KnownFinding] | None = None
) -> tuple[KnownFinding, ...]:
    """The entries of ``table`` (default ``KNOWN_FINDINGS``) that ``--known ids`` selects;
    ``all`` means every entry covering the implementation."""
    findings = KNOWN_FINDINGS if table is None else table
    selected: list[KnownFinding] = []
    for finding_id in ids:
        if finding_id == ALL:
            selected += [f for f in findings.values() if f.covers(implementation)]
            continue
        if finding_id not in findings:
            legal = ", ".join(sorted(findings)) or "none registered"
            raise HiCacheInputError(
                f"unknown known-finding id {finding_id!r}; known ids: {legal} (or 'all')"
            )
        selected.append(findings[finding_id])
    return tuple(dict.fromkeys(selected))


def match_known_finding(
    findings: Sequence[KnownFinding],
    implementation: str,
    invariant: str,
    message: str,
    release: str | None = None,
) -> KnownFinding | None:
    """The first of ``findings`` that explains this failure, or None when it is new."""
    for finding in findings:
        if finding.matches(implementation, invariant, message, release):
            return finding
    return None
