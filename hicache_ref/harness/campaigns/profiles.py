"""Hypothesis settings profiles: ``ci`` (bounded gate), ``dev`` and ``campaign`` (long runs).

A campaign names its profile (``hicache-fuzz run --profile``) and passes it down: the settings
(``make_settings(profile)``) and whether the pure oracle steps in lockstep
(``lockstep_enabled(profile)``, handed to the machine) both follow it. A pytest run, which has
no command line of its own here, selects one with ``HICACHE_PROFILE=ci|dev|campaign``;
``HICACHE_LOCKSTEP=0|1`` forces the oracle off or on for either.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import ExampleDatabase

PROFILE_ENV = "HICACHE_PROFILE"

PROFILES: dict[str, dict[str, object]] = {
    "ci": {"max_examples": 60, "stateful_step_count": 40, "derandomize": True},
    "dev": {"max_examples": 200, "stateful_step_count": 60},
    "campaign": {"max_examples": 5000, "stateful_step_count": 120},
}


PROFILE_HELP: dict[str, str] = {
    "ci": "bounded cases (60 of 40 steps, derandomized), the pure oracle in lockstep",
    "dev": "more and longer cases (200 of 60 steps), the pure oracle in lockstep",
    "campaign": "long cases (120 steps), no lockstep oracle: the most steps/s",
}
"""What each profile does, as ``--help`` says it."""


def get_profile_help(default: str = "ci") -> str:
    """``--profile``'s help: every profile and what it does."""
    said = "; ".join(f"{name}: {PROFILE_HELP[name]}" for name in PROFILES)
    return f"Hypothesis settings profile. {said} (default {default})"


def make_settings(
    profile: str | None = None,
    *,
    shrink: bool = True,
    database: ExampleDatabase | None = None,
    reuse: bool = True,
    **overrides: object,
) -> settings:
    """The profile's settings; with ``database`` Hypothesis saves every failing case there, and
    with ``reuse`` it first replays what the database holds for this machine."""
    name = profile or os.environ.get(PROFILE_ENV, "ci")
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; legal: {', '.join(PROFILES)}")
    values: dict[str, object] = dict(PROFILES[name])
    values.update(overrides)
    return settings(
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
        phases=[Phase.explicit, *([Phase.reuse] if reuse else []), Phase.generate, Phase.target]
        + ([Phase.shrink] if shrink else []),
        print_blob=False,
        report_multiple_bugs=False,
        database=database,
        **values,  # type: ignore[arg-type]
    )


LOCKSTEP_ENV = "HICACHE_LOCKSTEP"
LOCKSTEP_BY_PROFILE: dict[str, bool] = {"ci": True, "dev": True, "campaign": False}
"""Whether ``harness/lockstep.attach_lockstep`` follows cases under each profile (the oracle
costs steps/s; a campaign wants throughput). ``HICACHE_LOCKSTEP=0|1`` overrides."""


def lockstep_enabled(profile: str | None = None) -> bool:
    """Whether the oracle steps in lockstep with the harness under ``profile``."""
    forced = os.environ.get(LOCKSTEP_ENV)
    if forced is not None:
        return forced not in ("", "0", "false", "off")
    name = profile or os.environ.get(PROFILE_ENV, "ci")
    return LOCKSTEP_BY_PROFILE.get(name, False)
