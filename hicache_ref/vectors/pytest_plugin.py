"""A pytest plugin: check an implementation from inside another project's own test run.

``pip install hicache_ref`` registers it (the ``pytest11`` entry point); it does nothing until
asked. ``pytest --hicache-impl pkg.module:factory`` (or an entry-point name of the
``hicache_ref.implementations`` group) then adds, to whatever the run collects:

- one item per vector of the shipped suite (``--hicache-vectors all|stories|N``: every vector,
  the hand-written stories only, or the first N), named ``hicache-vectors::<vector id>``; a
  vector the implementation cannot run is skipped with the reason;
- one bounded gate campaign, ``hicache-gate::<impl>`` (``--hicache-gate-seconds``, 0 for
  none; ``--hicache-known`` baselines written-up findings as ``hicache-fuzz gate --known``).

A failing item's report is the divergence and the one line that replays it outside pytest
(``hicache-fuzz vectors replay SUITE --impl ... --only <id>``, or ``hicache-fuzz replay
<trace>``), runnable as printed from any folder (``replay_lines.py``).
A contract break (a missing hook or method) stops the run before any test, as a usage error.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

IMPL_OPTION = "--hicache-impl"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hicache_ref", "check an implementation against hicache_ref")
    group.addoption(
        IMPL_OPTION,
        default=None,
        metavar="SPEC",
        help="the implementation to check: pkg.module:factory, an entry point name of "
        "hicache_ref.implementations, or a built-in name (reference, sglang, seed)",
    )
    group.addoption(
        "--hicache-suite",
        default=None,
        metavar="FILE",
        help="a vector suite (default: the one hicache_ref ships)",
    )
    group.addoption(
        "--hicache-vectors",
        default="all",
        metavar="all|stories|N",
        help="which vectors become items (default all)",
    )
    group.addoption(
        "--hicache-gate-seconds",
        type=float,
        default=20.0,
        metavar="S",
        help="budget of the gate campaign item (0: no gate item; default 20)",
    )
    group.addoption(
        "--hicache-out",
        default=None,
        metavar="DIR",
        help="where the gate writes failing traces (default: a new temporary folder)",
    )
    group.addoption(
        "--hicache-known",
        nargs="*",
        default=[],
        metavar="ID",
        help="known-finding ids the gate counts instead of failing on (or 'all')",
    )


def _tree_of(spec: str) -> str:
    """The sglang tree a ``sglang``/``seed`` run of this session read (``HICACHE_SGLANG_SRC``,
    the pytest side's input), for a replay line that must name it; else empty."""
    import os

    from hicache_ref.harness.adapters.sglang_tree import SRC_ENV

    return os.environ.get(SRC_ENV, "") if spec in ("sglang", "seed") else ""


class HiCacheFailure(Exception):
    """A vector or the gate failed; the message is the report, replay line included."""


def _implementation(config: pytest.Config) -> Any:
    from hicache_ref.errors import HiCacheInputError
    from hicache_ref.harness.adapters.registry import checked_implementation

    spec = config.getoption(IMPL_OPTION)
    try:
        return checked_implementation(spec)
    except HiCacheInputError as exc:  # a contract break: one line, before any test runs
        raise pytest.UsageError(f"{IMPL_OPTION} {spec}: {' '.join(str(exc).split())}") from None


def _vectors(config: pytest.Config) -> tuple[Path, list[Any]]:
    from hicache_ref.errors import HiCacheInputError
    from hicache_ref.vectors.suite import read_suite, shipped_suite_path

    given = config.getoption("--hicache-suite")
    path = Path(given) if given else shipped_suite_path()
    try:
        _, vectors = read_suite(path)
    except HiCacheInputError as exc:
        raise pytest.UsageError(f"--hicache-suite: {' '.join(str(exc).split())}") from None
    which = str(config.getoption("--hicache-vectors"))
    if which == "stories":
        return path, [v for v in vectors if v.kind == "story"]
    if which.isdigit():
        return path, vectors[: int(which)]
    if which != "all":
        raise pytest.UsageError(f"--hicache-vectors {which!r}: give all, stories or a count")
    return path, vectors


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    spec = config.getoption(IMPL_OPTION)
    if not spec:
        return
    implementation = _implementation(config)
    path, vectors = _vectors(config)
    for vector in vectors:
        items.append(
            VectorItem.from_parent(
                session,
                name=f"hicache-vectors::{vector.id}",
                vector=vector,
                spec=spec,
                implementation=implementation,
                suite=path,
            )
        )
    seconds = float(config.getoption("--hicache-gate-seconds"))
    if seconds > 0:
        items.append(
            GateItem.from_parent(session, name=f"hicache-gate::{spec}", spec=spec, seconds=seconds)
        )


class VectorItem(pytest.Item):
    """One vector replayed on the implementation under test."""

    def __init__(
        self, *, vector: Any, spec: str, implementation: Any, suite: Path, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.vector, self.spec, self.implementation, self.suite = (
            vector,
            spec,
            implementation,
            suite,
        )

    def runtest(self) -> None:
        from hicache_ref.vectors.replay import replay_vector

        result = replay_vector(self.vector, self.implementation, self.spec)
        if result.status == "skip":
            pytest.skip(result.reason)
        if result.status == "fail":
            from hicache_ref.replay_lines import get_vector_line

            line = get_vector_line(self.spec, self.vector.id, self.suite, _tree_of(self.spec))
            raise HiCacheFailure(f"{result.render()}\n  replay: {line}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, HiCacheFailure):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.suite, 0, f"hicache vector {self.vector.id}: {self.vector.title}"


class GateItem(pytest.Item):
    """A bounded gate campaign: fails on the first failure no selected known finding explains."""

    def __init__(self, *, spec: str, seconds: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.spec, self.seconds = spec, seconds

    def runtest(self) -> None:
        from hicache_ref.campaign.run import run_campaign
        from hicache_ref.harness.campaigns.known_findings import get_known_findings

        known = get_known_findings(self.config.getoption("--hicache-known"), self.spec)
        given = self.config.getoption("--hicache-out")
        out = Path(given) if given else Path(tempfile.mkdtemp(prefix="hicache-gate-"))
        report = run_campaign(
            self.spec,
            seconds=self.seconds,
            profile="ci",
            seed=0,
            out_dir=out,
            progress=False,
            known=known,
        )
        if report.failures:
            raise HiCacheFailure("\n".join(self._lines(report.failures)))

    def _lines(self, failures: list[dict[str, str]]) -> Iterator[str]:
        for failure in failures:
            yield f"gate: NEW {failure['invariant']} (seed {failure['seed']}): {failure['error']}"
            yield f"  replay: {failure['replay']}"  # the trace's, or the round's when none

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, HiCacheFailure):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int, str]:
        return "hicache-gate", 0, f"hicache gate campaign of {self.spec} ({self.seconds:g}s)"
