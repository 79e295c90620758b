"""A failure database every worker and runner shares: Hypothesis' own example databases.

``--database`` takes one of

- a folder (``fuzz/db``, or ``dir:PATH``): ``DirectoryBasedExampleDatabase``, for one host;
- ``redis://host:port[/db]`` (or ``rediss://``): ``hypothesis.extra.redis.RedisExampleDatabase``,
  for a fleet (needs the ``redis`` package: the ``fleet`` extra);
- ``local+redis://host:port``, or ``PATH+redis://...``: the split recommended for developers,
  ``MultiplexedDatabase(local, ReadOnlyDatabase(shared))``: read what the fleet found, write
  only to the local folder (``local`` is ``.hypothesis/examples``).

Hypothesis saves every failing case under the machine's key (its class name: implementation
and a digest of its source tree, ``get_source_key``), and the first round of every campaign
replays what the database holds for that key before drawing anything new. The JSONL traces of
failures go to the same store under ``TRACE_KEY``, one value per trace text: two runners never
overwrite each other's, and ``hicache-fuzz traces --database URL`` writes them out.

A ``DatabaseSpec`` is the URL (it crosses into worker processes); each process opens its own
``CampaignDatabase``. A database that cannot be reached is one ``HiCacheSetupError`` line,
before the campaign and whenever the connection is lost during it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

from hicache_ref.errors import HiCacheInputError, HiCacheSetupError
from hicache_ref.harness.adapters.sglang_tree import CONTROLLER_RELPATH
from hicache_ref.harness.steps.trace import Trace

TRACE_KEY = b"hicache-fuzz:traces"
LOCAL_DIR_DEFAULT = Path(".hypothesis/examples")
SOURCE_KEY_CHARS = 12
_REDIS = re.compile(r"^rediss?://")
_SPLIT = re.compile(r"^(?P<local>.*?)\+(?P<shared>rediss?://.*)$")
_PASSWORD = re.compile(r"(rediss?://[^:/@]*:)[^@]*@")


def get_source_key(implementation: Any) -> str:
    """A digest of the implementation's source tree (its controller file and path), or "" when
    its code is this package's: two sglang trees gated under one name keep their examples apart
    (Hypothesis drops a saved example that no longer fails)."""
    tree = getattr(implementation, "source_tree", "") or ""
    if not tree:
        return ""
    digest = hashlib.sha256(str(tree).encode())
    controller = Path(tree) / CONTROLLER_RELPATH
    if controller.is_file():
        digest.update(controller.read_bytes())
    return digest.hexdigest()[:SOURCE_KEY_CHARS]


@dataclass(frozen=True)
class DatabaseSpec:
    """``--database URL``: checked for its form, opened in each process that uses it."""

    url: str

    @property
    def label(self) -> str:
        """The URL with any password left out (it is printed and written to reports)."""
        return _PASSWORD.sub(r"\1***@", self.url)

    def open(self) -> CampaignDatabase:
        return CampaignDatabase(_open_examples(self.url), self.label)


def parse_database(text: str) -> DatabaseSpec:
    """The form of ``--database``; reaching it is ``check_database``'s job."""
    if not text.strip():
        raise HiCacheInputError("--database is empty; pass a folder or redis://host:port")
    if "://" in text and not _REDIS.match(text) and _SPLIT.match(text) is None:
        raise HiCacheInputError(
            f"--database {text}: unknown scheme; legal: a folder, redis://host:port, "
            "rediss://host:port, local+redis://host:port"
        )
    return DatabaseSpec(text.strip())


def check_database(spec: DatabaseSpec) -> DatabaseSpec:
    """Open the database and touch it once, so a wrong URL fails before any work."""
    database = spec.open()
    list(database.examples.fetch(TRACE_KEY + b":probe"))
    return spec


class CampaignDatabase:
    """One process's view of the shared database: examples for Hypothesis, traces for people."""

    def __init__(self, examples: ExampleDatabase, label: str) -> None:
        self.examples = examples
        self.label = label

    def save_trace(self, trace: Trace) -> None:
        """Keep a failure's JSONL trace (its text is the value: equal traces are one entry)."""
        self.examples.save(TRACE_KEY, trace.to_jsonl().encode())

    def load_traces(self, implementation: str | None = None) -> list[Trace]:
        """Every stored trace (of ``implementation``), in a stable order."""
        traces = [Trace.from_jsonl(value.decode()) for value in self.examples.fetch(TRACE_KEY)]
        chosen = [t for t in traces if implementation in (None, t.header.implementation)]
        return sorted(chosen, key=lambda trace: trace.to_jsonl())


def _open_examples(url: str) -> ExampleDatabase:
    split = _SPLIT.match(url)
    if split is not None:
        local_text = split.group("local")
        local = LOCAL_DIR_DEFAULT if local_text in ("", "local") else Path(local_text)
        shared = ReadOnlyDatabase(_open_redis(split.group("shared")))
        return MultiplexedDatabase(_open_folder(local, url), shared)
    if _REDIS.match(url):
        return _open_redis(url)
    return _open_folder(Path(url.removeprefix("dir:")), url)


def _open_folder(path: Path, url: str) -> ExampleDatabase:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".hicache-fuzz-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise HiCacheInputError(
            f"--database {url}: cannot write folder {path} ({why}); pass a writable folder"
        ) from None
    return DirectoryBasedExampleDatabase(str(path))


def _open_redis(url: str) -> ExampleDatabase:
    try:
        from hypothesis.extra.redis import RedisExampleDatabase
        from redis import Redis
        from redis.exceptions import RedisError
    except ImportError:
        raise HiCacheSetupError(
            f"--database {url} needs the redis package; install the fleet extra: "
            "pip install -e '.[fleet]'"
        ) from None
    label = _PASSWORD.sub(r"\1***@", url)
    try:
        client = Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
        client.ping()
    except (RedisError, ValueError) as exc:
        raise HiCacheSetupError(
            f"--database {label}: cannot reach redis ({_first_line(exc)}); start redis-server "
            "there or fix the URL"
        ) from None
    return _GuardedDatabase(RedisExampleDatabase(client), label, RedisError)


class _GuardedDatabase(ExampleDatabase):
    """A database whose connection errors are one setup line, never a "found bug": Hypothesis
    calls the database between test cases, so a lost server would otherwise end a round."""

    def __init__(
        self, inner: ExampleDatabase, label: str, errors: type[BaseException] | None
    ) -> None:
        super().__init__()
        self.inner = inner
        self.label = label
        self.errors: tuple[type[BaseException], ...] = (errors,) if errors else ()

    def __repr__(self) -> str:
        return f"_GuardedDatabase({self.inner!r})"

    def fetch(self, key: bytes) -> Iterable[bytes]:
        values: list[bytes] = self._guard(lambda: list(self.inner.fetch(key)))
        return values

    def save(self, key: bytes, value: bytes) -> None:
        self._guard(lambda: self.inner.save(key, value))

    def delete(self, key: bytes, value: bytes) -> None:
        self._guard(lambda: self.inner.delete(key, value))

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self._guard(lambda: self.inner.move(src, dest, value))

    def _guard(self, call: Any) -> Any:
        try:
            return call()
        except self.errors as exc:
            raise HiCacheSetupError(
                f"--database {self.label}: lost the connection ({_first_line(exc)}); check "
                "the server and run again"
            ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
