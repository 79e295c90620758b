"""One verdict for every rank: the first failing rank's error, else the first divergence.

A rank never leaves the agreement round on an exception: it catches it as a ``RankError``
(signature: the invariant id or the exception type; one line of text) and sends it in the
round's gather with its digest. Every rank then computes the same ``Verdict`` from the same
gathered list, so they fail together with the same one-line message, and rank 0 writes the one
trace whose replay line they all print. ``raise_verdict`` turns it back into an exception: an
``InvariantViolation`` when an invariant broke (the campaign and ``replay`` read its id), else a
``RankFailure`` that carries the original exception type as its signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from hicache_ref.distributed.compare import RankDigest, find_divergence
from hicache_ref.errors import InvariantViolation

MESSAGE_CHARS_MAX = 400


@dataclass(frozen=True)
class RankError:
    """An exception one rank raised, as plain data that survives a gather."""

    rank: int
    signature: str  # "INV-xx", or the exception's type name
    detail: str  # one line

    @staticmethod
    def of(rank: int, exc: BaseException) -> RankError:
        inv = getattr(exc, "inv_id", None)
        if isinstance(exc, InvariantViolation):
            return RankError(rank, exc.inv_id, _one_line(exc.detail))
        signature = inv if isinstance(inv, str) else type(exc).__name__
        return RankError(rank, signature, _one_line(f"{type(exc).__name__}: {exc}"))


@dataclass(frozen=True)
class Verdict:
    """Why the case failed, identically on every rank."""

    signature: str
    message: str

    @property
    def line(self) -> str:
        """The one line every rank prints (the exception's text)."""
        return str(self.as_exception())

    def as_exception(self) -> BaseException:
        if self.signature.startswith("INV-"):
            detail = self.message.removeprefix(f"{self.signature} violated: ")
            return InvariantViolation(self.signature, detail)
        return RankFailure(self.signature, self.message)


class RankFailure(RuntimeError):
    """A CP rank raised something other than an invariant violation (a harness or setup bug,
    or a crash of the implementation); ``inv_id`` is that exception's type name."""

    def __init__(self, signature: str, message: str) -> None:
        self.inv_id = signature
        super().__init__(message)


def decide(
    where: str, errors: Sequence[RankError | None], digests: Sequence[RankDigest | None]
) -> Verdict | None:
    """The verdict of one agreement round after ``where`` (a step, or quiescence)."""
    failed = [e for e in errors if e is not None]
    n = len(errors)
    if failed:
        first = min(failed, key=lambda e: e.rank)
        others = [e.rank for e in failed if e.rank != first.rank]
        also = f" (ranks {others} failed too)" if others else ""
        text = f"rank {first.rank} of {n} at {where}: {first.detail}{also}"
        return Verdict(first.signature, _one_line(text))
    present = [d for d in digests if d is not None]
    if len(present) < n:
        return Verdict("RankFailure", f"at {where}: a rank sent no state (a harness bug)")
    found = find_divergence(present)
    if found is None:
        return None
    inv_id, detail = found
    return Verdict(inv_id, _one_line(f"CP ranks diverge at {where}: {detail}"))


def raise_verdict(verdict: Verdict) -> NoReturn:
    raise verdict.as_exception()


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= MESSAGE_CHARS_MAX else flat[: MESSAGE_CHARS_MAX - 3] + "..."
