"""``oracle.geometry.compute_drainable_prefix`` that counts completed acks past a gap."""

from __future__ import annotations


def compute_drainable_prefix_planted(complete: tuple[bool, ...]) -> int:
    """Length of the leading run of completed acks (planted bug: counts every completed ack).

    post: 0 <= __return__ <= len(complete)
    post: all(complete[:__return__])
    """
    return sum(1 for done in complete if done)
