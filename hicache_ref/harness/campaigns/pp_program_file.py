"""A PP gate failure on disk: the shrunk program that replays it without Hypothesis.

A PP world is not driven by the state machine, so its failure has no trace of rule steps; what
replays it is the program ``pp_gate.run_program`` ran. The file is two JSON lines, like a trace:

- the header (``PpProgramHeader``): ``version`` (``hicache-pp-program/1``, which the trace reader
  refuses by name, so ``hicache-fuzz replay`` can dispatch on it), the implementation, the tree it
  read, the seed of the world's config, and what failed;
- the program (``PpProgramRecord``): its faults, backend, schedule points (the command
  threads'; ``storage_points``, ``page_points``: the storage threads' too), ``sidecar`` (a draft
  pool riding on the KV's slots), ``swa_window`` (an independent SWA side pool's window),
  ``mamba`` (a Mamba state pool) and ops; the last five are absent in a file written before they
  were drawn.

In the order a failure flows through them: ``write_program_file`` (the PP gate, under ``--out``),
``is_program_file`` (``replay`` peeks at the first line), ``read_program_file`` (every problem one
``HiCacheInputError`` line naming the file, the line and the fix).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.campaigns.pp_gate import VERBS, PpOp, PpProgram

PP_PROGRAM_VERSION: Final = "hicache-pp-program/1"
BACKENDS = ("memory", "file")
PICK_MAX = 1 << 20
"""A pick is read modulo what it picks from; a larger one is no program the gate drew."""


class PpProgramHeader(BaseModel):
    """Where a PP program ran and what it found."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal["hicache-pp-program/1"] = PP_PROGRAM_VERSION
    implementation: str
    source: str = ""
    """The sglang tree the implementation read (the replay reads it again)."""
    seed: int = Field(ge=0)
    """The PP world's config seed (``run_program``'s ``seed``)."""
    invariant: str = ""
    error: str = ""
    flaky: bool = False
    """The shrunk program's failure did not repeat when the gate ran it again (thread timing)."""


class PpOpRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    verb: str
    pick: int = Field(ge=0, le=PICK_MAX)

    @field_validator("verb")
    @classmethod
    def _is_a_verb(cls, verb: str) -> str:
        if verb not in VERBS:
            raise ValueError(f"{verb!r} is not a PP program verb")
        return verb


class PpProgramRecord(BaseModel):
    """``pp_gate.PpProgram`` as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    faults: bool
    backend: str
    points: bool
    ops: list[PpOpRecord] = Field(min_length=1)
    storage_points: bool = False
    page_points: bool = False
    sidecar: bool = False
    swa_window: int = Field(default=0, ge=0, le=3)
    mamba: bool = False

    @field_validator("backend")
    @classmethod
    def _is_a_backend(cls, backend: str) -> str:
        if backend not in BACKENDS:
            raise ValueError(f"{backend!r} is not a PP world's backend ({', '.join(BACKENDS)})")
        return backend

    def to_program(self) -> PpProgram:
        ops = tuple(PpOp(op.verb, op.pick) for op in self.ops)
        return PpProgram(
            self.faults,
            self.backend,
            self.points,
            ops,
            self.storage_points,
            self.page_points,
            self.sidecar,
            self.swa_window,
            self.mamba,
        )

    @staticmethod
    def of(program: PpProgram) -> PpProgramRecord:
        ops = [PpOpRecord(verb=op.verb, pick=op.pick) for op in program.ops]
        return PpProgramRecord(
            faults=program.faults,
            backend=program.backend,
            points=program.points,
            ops=ops,
            storage_points=program.storage_points,
            page_points=program.page_points,
            sidecar=program.sidecar,
            swa_window=program.swa_window,
            mamba=program.mamba,
        )


def get_program_stem(header: PpProgramHeader, program: PpProgram) -> str:
    """``pp-failure-<impl>-seed<seed>-<digest>``: a name no other program takes."""
    digest = hashlib.sha256(f"{header.source}\n{program.describe()}".encode()).hexdigest()[:10]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in header.implementation)
    return f"pp-failure-{name}-seed{header.seed}-{digest}"


def write_program_file(out_dir: Path, header: PpProgramHeader, program: PpProgram) -> Path:
    """Write the header and program lines under ``out_dir``; returns the file's absolute path."""
    path = (out_dir / f"{get_program_stem(header, program)}.jsonl").absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [header.model_dump_json(), PpProgramRecord.of(program).model_dump_json()]
    path.write_text("\n".join(lines) + "\n")
    return path


def is_program_file(path_text: str) -> bool:
    """Whether the file's first line is a PP program header (any other file: a trace's turn)."""
    try:
        with Path(path_text).open() as file:
            first = file.readline()
        record = json.loads(first)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(record, dict) and record.get("version") == PP_PROGRAM_VERSION


def read_program_file(path_text: str) -> tuple[PpProgramHeader, PpProgram]:
    """The header and program of a file ``write_program_file`` wrote; anything else is one
    ``HiCacheInputError`` line naming the file, the line and the fix."""
    try:
        text = Path(path_text).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise HiCacheInputError(f"PP program {path_text} cannot be read ({exc})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if len(lines) != 2:
        raise HiCacheInputError(
            f"PP program {path_text} has {len(lines)} line(s), not 2: a PP program file is a "
            "header line, then the program line (the PP gate writes it under --out)"
        )
    (header_no, header_line), (program_no, program_line) = lines
    header = _parse(path_text, header_no, header_line, PpProgramHeader, HEADER_HINT)
    record = _parse(path_text, program_no, program_line, PpProgramRecord, PROGRAM_HINT)
    return header, record.to_program()


HEADER_HINT = "header", "a header holds version, implementation, source and seed"
PROGRAM_HINT = (
    "program",
    "a program holds faults, backend, points, ops and optionally storage_points, "
    "page_points, sidecar, swa_window and mamba; verbs: " + ", ".join(VERBS),
)


def _parse(path_text: str, line_no: int, line: str, model: Any, hint: tuple[str, str]) -> Any:
    try:
        return model.model_validate_json(line)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the line"
        raise HiCacheInputError(
            f"PP program {path_text} line {line_no} is not a valid {hint[0]} ({where}: "
            f"{error['msg']}); {hint[1]}"
        ) from None
