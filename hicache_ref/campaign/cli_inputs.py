"""The CLI's inputs, checked before any work starts: each bad one is one ``HiCacheInputError``.

``hicache-fuzz`` turns a ``HiCacheInputError`` (and so a ``HiCacheSetupError``) into one line on
stderr and exit status 2; everything else that goes wrong is a bug and keeps its traceback. The
checks here name the argument, what is wrong with it and the fix: durations (``--budget``, one
name for the time budget of every subcommand; ``--seconds`` is its hidden old spelling), output
folders and files (``--out``, ``--json``, ``-o``: each opened for writing before any work),
``--sglang-src`` and trace files (missing, not JSON, a bad header, a wrong version, a step with
an unknown rule or an argument of the wrong type).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from hicache_ref.device.perturb import Perturbation
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.adapters.sglang_tree import CONTROLLER_RELPATH, check_tree
from hicache_ref.harness.campaigns.pp_program_file import PP_PROGRAM_VERSION
from hicache_ref.harness.rules import STREAMS, step_argument_types
from hicache_ref.harness.step_types import RuleName
from hicache_ref.harness.steps.trace import TRACE_VERSION, Step, Trace, TraceHeader

SGLANG_CONTROLLER = CONTROLLER_RELPATH
LEGAL_RULES: tuple[str, ...] = get_args(RuleName)
_DURATION = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*(s|m|h)?\s*$")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0}


class UsageError(HiCacheInputError):
    """A command line argparse refused; the message ends with where the help is."""


# -- durations -------------------------------------------------------------------------------
def parse_duration(text: str) -> float:
    """``120``, ``120s``, ``2m``, ``1.5m`` or ``1h`` as seconds; it must be positive."""
    found = _DURATION.match(text)
    if found is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; write seconds or a unit: 120, 120s, 2m, 1.5m"
        )
    seconds = float(found.group(1)) * _UNIT_SECONDS[found.group(2) or "s"]
    if seconds <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not positive; give a time to run for, such as 60 or 2m"
        )
    return seconds


def check_positive_seconds(flag: str, seconds: float) -> float:
    """For flags parsed elsewhere as plain floats: refuse zero, negative and NaN budgets."""
    if not seconds > 0:
        raise HiCacheInputError(f"{flag} {seconds:g} is not positive; give a time such as 20")
    return seconds


def add_budget_argument(parser: argparse.ArgumentParser, default: str, *, what: str) -> None:
    """``--budget`` (``--seconds``, the old spelling, still parses and is left out of --help)."""
    parser.add_argument(
        "--budget",
        type=parse_duration,
        default=parse_duration(default),
        metavar="TIME",
        help=f"how long to fuzz, {what}: 60, 90s, 2m, 1.5m, 1h (default {default})",
    )
    parser.add_argument(
        "--seconds", type=parse_duration, dest="budget", default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )  # fmt: skip


# -- GPU timing perturbation ---------------------------------------------------------------
_SPINS = re.compile(r"^\s*([0-9.]+)\s*:\s*([0-9_]+)\s*\.\.\s*([0-9_]+)\s*$")


def parse_spins(text: str) -> Perturbation:
    """``P:MIN..MAX``: spin at a site with chance P, for MIN..MAX GPU cycles (log-uniform)."""
    found = _SPINS.match(text)
    if found is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not P:MIN..MAX; write a chance and a cycle range such as "
            "0.5:4096..8388608"
        )
    try:
        return Perturbation(
            probability=float(found.group(1)),
            cycles_min=int(found.group(2)),
            cycles_max=int(found.group(3)),
            paces=True,  # as the default campaign: only the chance and the range change
        )
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise argparse.ArgumentTypeError(f"{text!r}: {reason}") from None


def check_spins_device(flag: str, spins: Perturbation | None, device: str) -> Perturbation | None:
    """Spins perturb a GPU's streams; the simulator schedules every op itself."""
    if spins is not None and device != "cuda":
        raise HiCacheInputError(
            f"{flag} perturbs a GPU's streams; add --device cuda (the simulator decides when "
            "each op runs, so it needs no spins)"
        )
    return spins


# -- where output goes -----------------------------------------------------------------------
def check_out_dir(flag: str, path_text: str) -> Path:
    """``path_text`` as a folder that exists (created if need be) and takes new files."""
    path = Path(path_text)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise HiCacheInputError(
            f"{flag} {path_text}: cannot write files there ({why}); pass a writable folder"
        ) from None
    return path


def check_output_file(flag: str, path_text: str) -> Path:
    """``path_text`` as a file that can be written once the work is done: it is opened for
    writing now (and removed again if it did not exist), so ``/proc/r.json`` or a read-only
    folder fails before the campaign, not after it."""
    path = Path(path_text)
    if path.is_dir():
        raise HiCacheInputError(f"{flag} {path_text} is a folder; pass a file name inside it")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise HiCacheInputError(
            f"{flag} {path_text}: folder {parent} does not exist; create it or pick another path"
        )
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise HiCacheInputError(
            f"{flag} {path_text} is not writable ({why}); pick a writable path"
        ) from None
    if not existed:
        path.unlink(missing_ok=True)
    return path


# -- the sglang source tree ------------------------------------------------------------------
def check_sglang_src(path_text: str) -> Path:
    """``--sglang-src DIR``: an unpacked sglang tree, checked; the command hands it to the
    adapter as an argument (``get_implementation(name, source)``)."""
    return check_tree(Path(path_text))


TREE_IMPLEMENTATIONS = ("sglang", "seed")
"""The implementations that read an sglang tree (``--sglang-src``, ``--sglang-version``)."""


def get_tree_argument(args: argparse.Namespace) -> str:
    """The sglang tree ``--sglang-src DIR`` or ``--sglang-version X`` names (checked; a release is
    fetched once), handed to the adapter as an argument; empty when neither is given. Either
    flag with an implementation that reads no tree is one line, never a gate of the wrong
    target."""
    given = [flag for flag, value in _tree_flags(args) if value]
    if not given:
        return ""
    if len(given) > 1:
        raise HiCacheInputError("--sglang-src and --sglang-version both name a tree; pass one")
    if args.impl not in TREE_IMPLEMENTATIONS:
        raise HiCacheInputError(
            f"{given[0]} names an sglang tree, but --impl {args.impl} reads none: add --impl "
            "sglang (or --impl seed for the CP/draft fork) to gate that tree"
        )
    if args.sglang_src:
        return str(check_sglang_src(args.sglang_src))
    from hicache_ref.harness.adapters.sglang_releases import fetch_release_tree

    return str(fetch_release_tree(args.sglang_version))


def _tree_flags(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    return [
        ("--sglang-src", getattr(args, "sglang_src", None)),
        ("--sglang-version", getattr(args, "sglang_version", None)),
    ]


# -- trace files -----------------------------------------------------------------------------
def read_trace_file(path_text: str) -> Trace:
    """Read a trace, naming the line and the fix for anything that is not a valid trace."""
    path = Path(path_text)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise HiCacheInputError(
            f"trace {path_text} {what}; pass a .jsonl trace a campaign wrote "
            "(hicache-fuzz prints its path after 'hicache-fuzz replay')"
        )
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise HiCacheInputError(
            f"trace {path_text} cannot be read ({exc}); check the file"
        ) from None
    records = _parse_lines(path_text, text)
    _check_header(path_text, *records[0])
    for index, (line_no, record) in enumerate(records[1:]):
        _check_step(path_text, line_no, record, index)
    try:
        return Trace.read(path)
    except ValueError as exc:  # pydantic's ValidationError and json's errors are ValueErrors
        raise HiCacheInputError(f"trace {path_text} is malformed: {_first_line(exc)}") from None


def _parse_lines(path_text: str, text: str) -> list[tuple[int, dict[str, Any]]]:
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise HiCacheInputError(
            f"trace {path_text} is empty; a trace is a header line, then one step per line"
        )
    records: list[tuple[int, dict[str, Any]]] = []
    for line_no, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HiCacheInputError(
                f"trace {path_text} line {line_no} is not JSON ({exc.msg}); a trace is JSONL: "
                "a header object, then one step object per line"
            ) from None
        if not isinstance(record, dict):
            raise HiCacheInputError(
                f"trace {path_text} line {line_no} is a JSON {type(record).__name__}, not an "
                "object; every line of a trace is one JSON object"
            )
        records.append((line_no, record))
    return records


def _check_header(path_text: str, line_no: int, record: dict[str, Any]) -> None:
    version = record.get("version")
    if version == PP_PROGRAM_VERSION:  # the PP gate's program file (campaign/pp_share.py)
        raise HiCacheInputError(
            f"{path_text} is a PP gate program, not a trace: hicache-fuzz replay runs it (the "
            "PP gate shrank it already)"
        )
    if version != TRACE_VERSION:
        raise HiCacheInputError(
            f"trace {path_text} has version {version!r} on line {line_no}; this hicache_ref "
            f"reads {TRACE_VERSION!r}: replay it with the hicache_ref that wrote it, or re-record it"
        )
    try:
        TraceHeader.model_validate(record)
    except ValidationError as exc:
        raise HiCacheInputError(
            f"trace {path_text} line {line_no} is not a valid header ({_first_error(exc)}); "
            "a header holds version, implementation and config"
        ) from None


def _check_step(path_text: str, line_no: int, record: dict[str, Any], index: int) -> None:
    rule = record.get("rule")
    if rule not in LEGAL_RULES:
        raise HiCacheInputError(
            f"trace {path_text} line {line_no} has unknown rule {rule!r}; legal rules: "
            + ", ".join(LEGAL_RULES)
        )
    try:
        Step.model_validate(record)
    except ValidationError as exc:
        raise HiCacheInputError(
            f"trace {path_text} line {line_no} is not a valid step ({_first_error(exc)}); "
            'a step looks like {"rule": "prefill", "args": {"tokens": 1}}'
        ) from None
    for name, value in record.get("args", {}).items():
        problem = get_step_argument_problem(name, value)
        if problem is not None:
            raise HiCacheInputError(
                f"trace {path_text} line {line_no} (step {index}, {rule}): argument "
                f"{name}={value!r} {problem}; fix the step or re-record the trace"
            )


STEP_ARGUMENTS: dict[str, str] = dict(step_argument_types())
"""The type of every step argument the rules read (each record's ``args``): a wrong one is a bad
trace, never a controller failure."""
_HANDLES = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*$")


def get_step_argument_problem(name: str, value: Any) -> str | None:
    """What is wrong with one step argument, or None (names the rules do not read pass)."""
    kind = STEP_ARGUMENTS.get(name)
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return "is not an integer (nodes are handles 0, 1, ...; layers and counts are numbers)"
    if kind == "bool" and not isinstance(value, bool):
        return "is not true or false"
    if kind == "str" and not isinstance(value, str):
        return "is not a string"
    if kind == "stream" and value not in STREAMS:
        return f"is not a stream; legal: {', '.join(STREAMS)}"
    if kind == "handles" and not (isinstance(value, str) and _HANDLES.match(value)):
        return 'is not a comma-separated list of node handles such as "0,2"'
    return None


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "value"
    return f"{where}: {first['msg']}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- a CP world across processes (``run --cp-processes N --backend gloo|nccl``) ---------------
CP_PROCESSES_MAX = 8  # HarnessConfig.cp_size's bound


def check_cp_processes(flag: str, processes: int) -> int:
    """One process per CP rank: at least two (one is the lockstep world), at most cp_size's 8."""
    if not 2 <= processes <= CP_PROCESSES_MAX:
        raise HiCacheInputError(
            f"{flag} {processes}: a CP world across processes needs 2 to {CP_PROCESSES_MAX} "
            "ranks (one rank is the ordinary single-process campaign: leave the flag out)"
        )
    return processes


def check_cp_backend(flag: str, backend: str, processes: int) -> str:
    """``gloo`` runs anywhere (CPU); ``nccl`` needs one CUDA GPU per rank."""
    if backend not in ("gloo", "nccl"):
        raise HiCacheInputError(f"{flag} {backend!r} is unknown; legal: gloo, nccl")
    if backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < processes:
            raise HiCacheInputError(
                f"{flag} nccl needs one CUDA GPU per rank: {processes} ranks but {gpus} GPU(s) "
                "visible; use --backend gloo on this machine"
            )
    return backend


def check_cp_implementation(flag: str, name: str, capabilities: frozenset[str]) -> str:
    """The implementation must do CP shared KV for its ranks to be spread over processes."""
    if "cp" not in capabilities:
        raise HiCacheInputError(
            f"{flag}: implementation {name!r} lacks the 'cp' capability (CP shared KV), so "
            "its ranks cannot be spread over processes; pick one with CP, e.g. reference or seed"
        )
    return name
