"""Before each step, the ranks agree on what the lockstep tree decides over all ranks at once.

``plan_step`` is this rank's view, read without side effects: whether the step is enabled here
(``Session.is_enabled``: a forward read's pending count or an in-flight copy are rank-local),
how many leading acks of each queue completed (the drain takes MIN over ranks, as SGLang's
``writing_check`` all-reduces it), and whether a CP reservation would fit this rank's host
pools (each rank holds only its owned pages, so one rank can be full while another is not; the
tree's all-or-nothing reservation is a collective decision). ``agree`` turns every rank's plan
into one decision, the same on every rank: apply the step, or leave it out on every rank (a
step only some ranks enable is no step of the CP world; it is not recorded, so a replay skips
it the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache_ref.distributed.rank_session import RankSession
from hicache_ref.harness.rules import RULES
from hicache_ref.harness.steps.trace import Step


@dataclass(frozen=True)
class StepPlan:
    """One rank's view of the next step."""

    enabled: bool
    ready: tuple[int, int]  # completed leading (write acks, load acks)
    fits: bool  # a reservation the step makes fits this rank's host pools (True: none made)


@dataclass(frozen=True)
class Agreement:
    """What every rank does with the step."""

    apply: bool
    ready: tuple[tuple[int, int], ...]
    why: str = ""  # when left out: which ranks disagreed on what


def plan_step(rank_session: RankSession, step: Step) -> StepPlan:
    session = rank_session.session
    record = RULES[step.rule]
    if bool(step.args.get("early_reserve", False)):
        raise ValueError(
            "prefill(early_reserve=True) cannot be agreed across processes (the reservation "
            "would be decided inside the step); record it as prefill then reserve"
        )
    enabled = session.is_enabled(step)
    fits = not enabled or not record.reserves or _reservation_fits(rank_session, step)
    return StepPlan(enabled, rank_session.drains.local(), fits)


def _reservation_fits(rank_session: RankSession, step: Step) -> bool:
    """Whether this rank's host (and draft host) pool has a slot per owned position of the
    node's padded span: the harness's own layout and pools, never the implementation's."""
    session = rank_session.session
    node = session.tree.node(int(step.args.get("node", -1)))
    rank = session.world.ranks[0]
    if node is None or node.value is None or rank.cp_layout is None:
        return True
    page = session.config.page_size
    pages = torch.div(node.value[::page], page, rounding_mode="floor")
    padded = (pages[:, None] * page + torch.arange(page)).reshape(-1)
    needed = int(rank.cp_layout.owned_by_this_rank(padded).sum())
    if needed > rank.host_pool.free_slot_count():
        return False
    draft = rank.draft_host_pool
    return draft is None or needed <= draft.free_slot_count()


def agree(plans: Sequence[StepPlan]) -> Agreement:
    """One decision from every rank's plan (each rank computes the same one)."""
    ready = tuple(plan.ready for plan in plans)
    enabled = [plan.enabled for plan in plans]
    if any(enabled) and not all(enabled):
        return Agreement(False, ready, f"enabled on ranks {_ranks(enabled)} only")
    fits = [plan.fits for plan in plans]
    if any(fits) and not all(fits):
        return Agreement(False, ready, f"the reservation fits on ranks {_ranks(fits)} only")
    return Agreement(True, ready)


def _ranks(flags: Sequence[bool]) -> list[int]:
    return [rank for rank, flag in enumerate(flags) if flag]
