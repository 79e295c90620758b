"""What a CP world's ranks are told and what they report: the records the launcher and each
rank's campaign share.

``WorldSpec`` (pickled to every child: implementation, processes, backend, budget, a trace to
replay) -> each rank runs -> ``RankReport`` (its counts and its ``Failure``s, written as JSON
into the parent's folder).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache_ref.distributed.group import Backend

__all__ = ["Failure", "RankReport", "WorldSpec"]


@dataclass(frozen=True)
class WorldSpec:
    """Everything a rank needs to run its part (pickled to every child)."""

    impl: str
    processes: int
    backend: Backend
    seed: int = 0
    seconds: float = 30.0
    out_dir: str = "fuzz/out"
    steps_per_case: int = 80
    cases_max: int = 0  # 0: as many as fit in ``seconds``
    keep_going: bool = False
    progress: bool = False
    trace: str = ""  # replay this trace instead of running a campaign
    source: str = ""  # the implementation's source tree (sglang / seed)
    collective_timeout_s: float = 60.0
    deadline_s: float = 0.0  # 0: seconds + 2 collective timeouts + start-up slack


@dataclass
class Failure:
    signature: str
    message: str
    trace: str
    case: int
    config: str


@dataclass
class RankReport:
    """What one rank did (rank 0's counts are the campaign's)."""

    rank: int
    cases: int = 0
    steps: int = 0
    skipped: int = 0
    left_out: int = 0
    rules: dict[str, int] = field(default_factory=dict)
    checks_by_id: dict[str, int] = field(default_factory=dict)
    configs: dict[str, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    error: str = ""  # the rank could not take part (a collective timed out, setup failed)
    seconds: float = 0.0

    def absorb(self, rules: Counter[str], checks: Counter[str], config: str) -> None:
        self.rules = dict(Counter(self.rules) + rules)
        self.checks_by_id = dict(Counter(self.checks_by_id) + checks)
        self.configs[config] = self.configs.get(config, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> RankReport:
        failures = [Failure(**f) for f in data.pop("failures", [])]
        return RankReport(**data, failures=failures)
