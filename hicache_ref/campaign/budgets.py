"""A campaign's case budget, beside its time budget: ``--max-cases N`` for ``run``, ``gate`` and
``mutants``.

A time budget (``--budget``) measures the host as much as the implementation: on a busy host
the same seed runs fewer cases, so a planted bug caught at case 300 when idle survives a gate
that ran 219. A case budget ends the campaign after N cases (each worker's), whichever of the
two comes first, so a fixed seed and profile run the same cases on a busy host as on an idle
one (only slower). In the order a command uses them:

- ``add_cases_argument``: the ``--max-cases`` option, ``parse_case_count`` its type (a bad
  count is one line naming the rule and the fix);
- ``check_cases_max``: the same rule for a caller that did not come through argparse;
- ``split_cases``: a gate on a tree with ``storage:pp`` splits the cases as it splits the time
  (``pp_share.PP_GATE_SHARE``): the state machine's part and the PP gate's.
"""

from __future__ import annotations

import argparse

from hicache_ref.errors import HiCacheInputError

CASES_FLAG = "--max-cases"


def parse_case_count(text: str) -> int:
    """``--max-cases N``: a positive whole number of cases."""
    try:
        cases = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of cases; give a whole number such as 400"
        ) from None
    if cases < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not positive; give 1 or more cases, or drop {CASES_FLAG} to run "
            "until --budget"
        )
    return cases


def check_cases_max(flag: str, cases_max: int | None) -> None:
    """A case budget given as a value (not parsed from a command line): None or positive."""
    if cases_max is not None and cases_max < 1:
        raise HiCacheInputError(
            f"{flag} {cases_max} is not positive; give 1 or more cases, or None for time alone"
        )


RUN_CASES_HELP = (
    "stop after N cases per worker, or at --budget, whichever comes first: a fixed "
    "--seed and --profile then run the same cases however busy the host is (a gate on a "
    "tree with storage:pp gives the PP gate its share of them, as of the time)"
)


def add_cases_argument(parser: argparse.ArgumentParser, help_text: str = RUN_CASES_HELP) -> None:
    """``--max-cases N`` (``run`` and ``gate``; ``mutants`` with its own help)."""
    parser.add_argument(
        CASES_FLAG,
        dest="max_cases",
        type=parse_case_count,
        default=None,
        metavar="N",
        help=help_text,
    )


def split_cases(cases_max: int | None, share: float) -> tuple[int | None, int | None]:
    """(the state machine's cases, the PP gate's) of ``cases_max`` when ``share`` goes to the
    PP gate; each part at least one case (None: no case budget)."""
    assert 0.0 <= share < 1.0, f"a share is in [0, 1), got {share}"
    check_cases_max(CASES_FLAG, cases_max)
    if cases_max is None:
        return None, None
    if not share:
        return cases_max, None
    pp = max(1, round(cases_max * share))
    return max(1, cases_max - pp), pp
