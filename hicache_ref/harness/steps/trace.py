"""Versioned JSONL traces: a header line (config, implementation, seed) then one line per step.

A trace replays without Hypothesis (``hicache-fuzz replay TRACE``), across Hypothesis versions,
because a step names the rule and its concrete arguments (node *handles*: the k-th node the
trace created), never a position in Hypothesis' choice sequence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hicache_ref.device.perturb import Perturbation
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.step_types import RuleName, StepArg
from hicache_ref.harness.world.config import HarnessConfig

TRACE_VERSION = "hicache-trace/1"


class Step(BaseModel):
    """One rule application with concrete arguments."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: RuleName
    args: dict[str, StepArg] = Field(default_factory=dict)

    def render(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        return f"{self.rule}({inner})"


class TraceHeader(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = TRACE_VERSION
    implementation: str = "reference"
    config: HarnessConfig
    note: str = ""
    source: str = ""
    """Where the implementation's code came from, when it is not this package: the sglang tree
    of ``sglang``/``seed`` (so the printed replay line rebuilds the same controller)."""
    device: Literal["sim", "cuda"] = "sim"
    """The device the case ran on; a replay builds the same (a ``cuda`` trace needs a GPU)."""
    perturbation: Perturbation | None = None
    """On ``cuda``: the spin schedule's parameters (with the config's seed, the same spins)."""
    cp_processes: int = 0
    """0: the CP ranks ran in lockstep in one process; n >= 2: one process per rank
    (``hicache_ref.distributed``), and ``replay`` spawns n processes again."""


class Trace(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    header: TraceHeader
    steps: tuple[Step, ...]

    def to_jsonl(self) -> str:
        lines = [self.header.model_dump_json()]
        lines += [step.model_dump_json() for step in self.steps]
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_jsonl())
        return path

    @staticmethod
    def read(path: Path) -> Trace:
        return Trace.from_jsonl(Path(path).read_text(), where=str(path))

    @staticmethod
    def from_jsonl(text: str, where: str = "<text>") -> Trace:
        """The trace ``to_jsonl`` wrote (``where`` names it in errors)."""
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise HiCacheInputError(f"trace {where} is empty (expected a header line and steps)")
        header_data = json.loads(lines[0])
        version = header_data.get("version")
        if version != TRACE_VERSION:
            raise HiCacheInputError(
                f"trace {where} has version {version!r}; this hicache_ref reads {TRACE_VERSION!r}"
            )
        header = TraceHeader.model_validate(header_data)
        steps = tuple(Step.model_validate_json(line) for line in lines[1:])
        return Trace(header=header, steps=steps)

    def with_steps(self, steps: tuple[Step, ...]) -> Trace:
        return Trace(header=self.header, steps=steps)
