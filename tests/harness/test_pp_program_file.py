"""A PP gate program on disk: the storage threads' points, the draft sidecar and the Mamba state
pool travel with it, and a file written before they were drawn reads as a program without them."""

from __future__ import annotations

import json
from pathlib import Path

from hicache_ref.harness.campaigns.pp_gate import PpOp, PpProgram
from hicache_ref.harness.campaigns.pp_program_file import (
    PpProgramHeader,
    read_program_file,
    write_program_file,
)

HEADER = PpProgramHeader(implementation="sglang", seed=3, invariant="INV-38")
OPS = (PpOp("back_up", 1), PpOp("fetch", 0), PpOp("io", 2), PpOp("release", 0))


def test_a_program_with_the_storage_threads_points_round_trips(tmp_path: Path) -> None:
    program = PpProgram(
        False, "memory", True, OPS, storage_points=True, page_points=True, sidecar=True
    )
    path = write_program_file(tmp_path, HEADER, program)
    header, read = read_program_file(str(path))
    assert (header, read) == (HEADER, program)
    assert "storage_points=True page_points=True sidecar=True: back_up(1)" in read.describe()


def test_a_mamba_program_round_trips_and_an_older_file_reads_without_it(tmp_path: Path) -> None:
    program = PpProgram(False, "file", True, OPS, mamba=True)
    path = write_program_file(tmp_path, HEADER, program)
    _, read = read_program_file(str(path))
    assert read == program and "points=True mamba=True: back_up(1)" in read.describe()
    # a file written before Mamba PP worlds were drawn has no mamba field: not a Mamba world
    header_line, program_line = path.read_text().splitlines()
    record = json.loads(program_line)
    record.pop("mamba")
    path.write_text(f"{header_line}\n{json.dumps(record)}\n")
    assert not read_program_file(str(path))[1].mamba


def test_a_program_written_before_storage_points_reads_without_them(tmp_path: Path) -> None:
    # the program line of an older file: faults, backend, points and ops only
    path = write_program_file(tmp_path, HEADER, PpProgram(False, "file", True, OPS))
    header_line, program_line = path.read_text().splitlines()
    record = json.loads(program_line)
    for key in ("storage_points", "page_points", "sidecar"):
        record.pop(key)
    path.write_text(f"{header_line}\n{json.dumps(record)}\n")
    _, read = read_program_file(str(path))
    assert not (read.storage_points or read.page_points or read.sidecar) and read.points
    assert read.describe() == "faults=False backend=file points=True: " + " ".join(
        op.describe() for op in OPS
    )
