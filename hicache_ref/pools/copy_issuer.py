"""A native issuing thread for the copy engine: the caller pays two stream operations, not the
runtime's ~0.46 us per copy.

``cudaMemcpyBatchAsync`` costs the calling thread ~6 us plus ~0.46 us per copy (measured on an
H200, CUDA 13.0, ``benchmarks/copy_issue.py``): a layer of 512 page copies is ~240 us on the
scheduler's thread. ``CopyIssuer`` moves that call to a thread written in C (``copy_issuer.c``,
compiled once with the system's C compiler into the cache directory), which holds no Python
lock. Per batch the caller enqueues, on its own stream ``S``, a write of a sequence number to a
*ready* word and a wait for a *done* word to reach it (``cuStreamWriteValue64`` /
``cuStreamWaitValue64``), and hands the descriptor arrays to the thread; the thread makes a side
stream wait for *ready*, issues the batch there and writes *done*. ``S``'s later work therefore
runs after the copies and the copies after ``S``'s earlier work: the stream order of a batch
issued on ``S``, with no SM used (stream memory operations run in the GPU's front end).

A *stepped* entry (``issue_stepped``) carries several batches (a load's layers): the caller's
stream gets the *ready* write alone, the thread issues the batches back to back and writes
*done* after each, and the caller orders its stream after batch ``k`` with ``wait_done`` (then
records that layer's event), or after every batch in one call with ``wait_record``, which also
records each layer's events (``cuEventRecord``) from C. Per batch, the plain entry's round trip
(batch ``k`` waits for
``S`` to pass batch ``k - 1``'s *done* and write *ready*: two stream memory operations seen by
two streams) is gone from between the copies.

What the caller must keep: the descriptor arrays alive until the thread has issued them
(``CopyIssuer`` holds a reference per pending batch and drops it once ``hc_issued`` passes it).
A failed call in the thread still writes *done* (``S`` never waits forever) and is raised as
``CopyEngineError`` by the next ``issue`` or ``check`` on that issuer, naming the stage.

``load_issuer_library`` returns ``None`` with a reason where it cannot work (no C compiler, no
driver entry points): the copier then issues inline, on the caller's thread, as before.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache_ref.errors import HiCacheFault

SOURCE = Path(__file__).with_name("copy_issuer.c")
RING_CAPACITY = 1024
"""Batches one issuer queues before ``issue`` blocks (a load of 61 layers queues 61)."""
STAGES = {1: "side-stream wait", 2: "cudaMemcpyBatchAsync", 3: "done write", 4: "caller ops"}


class CopyIssuerError(HiCacheFault):
    """The issuing thread (or the stream operations around it) failed."""


def _cache_dir() -> Path:
    root = os.environ.get("HICACHE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hicache_ref"
    )
    return Path(root) / "native"


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    void_p, size_t, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
    library.hc_create.restype = void_p
    library.hc_create.argtypes = [void_p, ctypes.c_int, void_p, void_p, void_p, u64, u64, size_t,
                                  void_p]  # fmt: skip
    library.hc_issue.restype = ctypes.c_int
    library.hc_issue.argtypes = [void_p, void_p, void_p, void_p, void_p, size_t, void_p, size_t,
                                 size_t]  # fmt: skip
    library.hc_issue_stepped.restype = u64
    library.hc_issue_stepped.argtypes = [void_p, void_p, void_p, void_p, void_p, size_t, void_p,
                                         size_t, size_t, ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    library.hc_wait.restype = ctypes.c_int
    library.hc_wait.argtypes = [void_p, void_p, u64]
    library.hc_wait_record.restype = ctypes.c_int
    library.hc_wait_record.argtypes = [void_p, void_p, u64, size_t, void_p, size_t, void_p]
    library.hc_drain.restype = None
    library.hc_drain.argtypes = [void_p]
    library.hc_error.restype = ctypes.c_int
    library.hc_error.argtypes = [void_p, ctypes.POINTER(ctypes.c_int)]
    library.hc_issued.restype = u64
    library.hc_issued.argtypes = [void_p]
    library.hc_destroy.restype = None
    library.hc_destroy.argtypes = [void_p]
    return library


_LIBRARY_LOCK = threading.Lock()


def load_issuer_library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled ``copy_issuer.c`` (built once per source version), or ``None`` and why."""
    with _LIBRARY_LOCK:  # one build, even when two threads ask first at once
        return _built_library()


@functools.cache
def _built_library() -> tuple[ctypes.CDLL | None, str]:
    return _build()


def _build() -> tuple[ctypes.CDLL | None, str]:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    target = _cache_dir() / f"copy_issuer-{digest}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            return None, "no C compiler (cc) to build copy_issuer.c"
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, "-O2", "-shared", "-fPIC", "-pthread", str(SOURCE), "-o",
                       str(built)]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                return None, f"building copy_issuer.c failed: {result.stderr.strip()[:200]}"
            os.replace(built, target)  # atomic: concurrent builders agree on one file
    try:
        return _declare(ctypes.CDLL(str(target))), ""
    except OSError as error:
        return None, f"loading {target}: {error}"


def function_address(function: Any) -> int:
    """The C address of a ``ctypes`` foreign function."""
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


@dataclass
class CopyIssuer:
    """One native issuing thread for batches issued on one caller stream."""

    library: ctypes.CDLL
    handle: int
    flags: torch.Tensor | None
    """The ready and done words (device memory on a GPU; host memory for the CPU stand-ins)."""
    side: object
    """What keeps the side stream alive (a ``torch.cuda.Stream``), or ``None``."""
    _pending: collections.deque[tuple[int, object]] = field(default_factory=collections.deque)
    _enqueued: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def create(
        cls,
        library: ctypes.CDLL,
        *,
        batch: int,
        runtime13: bool,
        wait: int,
        write: int,
        side_stream: int,
        flags: torch.Tensor,
        side: object = None,
        memops: int = 0,
    ) -> CopyIssuer:
        """Start a thread issuing ``batch`` on ``side_stream``; ``flags`` holds two int64 words
        (ready, done) starting at 0, addressable by ``wait`` and ``write``; ``memops`` (0: none)
        enqueues the caller's write and wait in one call."""
        assert flags.dtype == torch.int64 and flags.numel() >= 2 and flags.is_contiguous()
        ready, done = flags.data_ptr(), flags.data_ptr() + 8
        handle = library.hc_create(
            batch, int(runtime13), wait, write, side_stream, ready, done, RING_CAPACITY, memops
        )
        if not handle:
            raise CopyIssuerError("hc_create failed (out of memory or no thread)")
        return cls(library, handle, flags, side)

    def issue(
        self,
        caller_stream: int,
        dsts: int,
        srcs: int,
        sizes: int,
        count: int,
        attrs: int,
        *,
        keep: object,
        repeat: int = 1,
        stride: int = 0,
    ) -> None:
        """Order ``repeat`` batches of ``count`` copies on ``caller_stream`` (see the module
        doc); ``keep`` owns the arrays and is held until the thread has issued them."""
        with self._lock:
            code = self.library.hc_issue(
                self.handle, caller_stream, dsts, srcs, sizes, count, attrs, repeat, stride
            )
            if code != 0:
                self.check()
                raise CopyIssuerError(f"queuing a copy batch failed with CUDA error {code}")
            self._keep_until_issued(keep)

    def issue_stepped(
        self,
        caller_stream: int,
        dsts: int,
        srcs: int,
        sizes: int,
        count: int,
        attrs: int,
        *,
        keep: object,
        repeat: int,
        stride: int,
    ) -> int:
        """Queue ``repeat`` batches that the side stream runs back to back, batch ``k`` writing
        *done* = ``first + k``; returns ``first``. ``caller_stream`` gets only the *ready*
        write: the caller orders it after batch ``k`` with ``wait_done(caller_stream, first +
        k)``, in ``k`` order, and must wait for the last batch before any work that may depend
        on the copies (``CudaBatchCopier.issue_rows_stepped`` does both)."""
        assert repeat >= 1
        error = ctypes.c_int(0)
        with self._lock:
            first = self.library.hc_issue_stepped(
                self.handle, caller_stream, dsts, srcs, sizes, count, attrs, repeat, stride,
                ctypes.byref(error),
            )  # fmt: skip
            if error.value != 0:
                self.check()
                raise CopyIssuerError(f"queuing a copy batch failed with CUDA error {error.value}")
            self._keep_until_issued(keep)
        return int(first)

    def _keep_until_issued(self, keep: object) -> None:
        """Hold ``keep`` (an entry's arrays) until the thread has issued that entry; drop the
        ones it has (under ``_lock``)."""
        self._enqueued += 1
        self._pending.append((self._enqueued, keep))
        if len(self._pending) > 8:
            issued = self.library.hc_issued(self.handle)
            while self._pending and self._pending[0][0] <= issued:
                self._pending.popleft()

    def wait_done(self, caller_stream: int, value: int) -> None:
        """Order ``caller_stream`` after the batch whose *done* value is ``value``."""
        code = self.library.hc_wait(self.handle, caller_stream, value)
        if code != 0:
            self.check()
            raise CopyIssuerError(
                f"queuing a wait for copy batch {value} failed with CUDA error {code}"
            )

    def wait_record(
        self, caller_stream: int, first: int, steps: int, events: int, per_step: int, record: int
    ) -> None:
        """``wait_done(caller_stream, first + k)`` for ``k < steps`` in turn, each followed by
        the records of its ``per_step`` events (``events``: the address of ``steps * per_step``
        event handles, ``NULL`` entries skipped) with ``record`` (``cuEventRecord``): one native
        call. After a failure the last batch's wait is still queued, then the error raised."""
        code = self.library.hc_wait_record(
            self.handle, caller_stream, first, steps, events, per_step, record
        )
        if code != 0:
            self.check()
            raise CopyIssuerError(
                f"queuing the waits and event records of copy batches {first} .. "
                f"{first + steps - 1} failed with CUDA error {code}"
            )

    def check(self) -> None:
        """Raise the first failure the thread (or a caller's stream operation) met, if any."""
        stage = ctypes.c_int(0)
        code = self.library.hc_error(self.handle, ctypes.byref(stage))
        if code != 0:
            raise CopyIssuerError(
                f"the copy issuer's {STAGES.get(stage.value, 'call')} failed with CUDA error "
                f"{code}; the batches after it were not copied (use copy_path='triton' or "
                "'runs', or HICACHE_COPY_ISSUE=inline to issue on the caller's thread)"
            )

    def drain(self) -> None:
        """Wait until the thread has issued every queued batch (not until they completed)."""
        self.library.hc_drain(self.handle)
        with self._lock:
            self._pending.clear()
        self.check()

    def close(self) -> None:
        """Stop the thread after it has issued what is queued."""
        if self.handle:
            self.library.hc_destroy(self.handle)
            self.handle = 0
            self._pending.clear()


@dataclass(frozen=True)
class CpuStandIns:
    """``copy_issuer.c``'s CPU stand-ins for the three entry points (tests without a GPU): a
    wait on the side stream (handle 0) spins, one on a caller stream (non-zero) returns."""

    batch: int
    wait: int
    write: int
    memops: int
    fail: int
    record: int
    """An event record: the event is a uint64 word that gets the caller's last waited value."""
    record_fail: int


def cpu_stand_ins(library: ctypes.CDLL) -> CpuStandIns:
    """The addresses of the CPU stand-ins in ``library``."""
    return CpuStandIns(
        batch=function_address(library.hc_cpu_batch),
        wait=function_address(library.hc_cpu_wait),
        write=function_address(library.hc_cpu_write),
        memops=function_address(library.hc_cpu_memops),
        fail=function_address(library.hc_cpu_fail),
        record=function_address(library.hc_cpu_record),
        record_fail=function_address(library.hc_cpu_record_fail),
    )
