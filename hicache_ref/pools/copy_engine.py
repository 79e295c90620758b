"""Executors of a batch of ``(dst, src, size)`` copies: the GPU's copy engine, or ``memmove``.

``CudaBatchCopier`` calls ``cudaMemcpyBatchAsync`` through ``ctypes`` on the CUDA runtime that
torch already loaded (found in ``/proc/self/maps``, else next to torch's CUDA libraries). The
copies run on the copy engine, no SM is used, in stream order on the given stream (one
attribute for the whole batch: ``cudaMemcpySrcAccessOrderStream``, host/device location hints).
The runtime's signature changed in CUDA 13 (``failIdx`` was dropped), so the binding reads
``cudaRuntimeGetVersion``:

- 12.8 / 12.9: ``(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, size_t* failIdx, stream)``
- 13.x:        ``(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)``

The runtime reads the three arrays during the call, so they may be freed once it returns. It
refuses the legacy default stream (``cudaErrorInvalidValue``); ``issue_on_stream`` routes a
batch issued there through a side stream that waits for the current one and is waited for.
Every return code is checked: a failure raises ``CopyEngineError`` with the runtime's name.

Its cost is on the CPU and per copy: the runtime spends ~6 us plus ~0.46 us per copy in the
call (measured on an H200, CUDA 13.0, ``benchmarks/copy_issue.py``), so a layer of 512 page
copies costs ~240 us to issue. ``issue_rows`` therefore hands the call to a native issuing
thread (``copy_issuer``: the caller enqueues two stream operations and a queue entry) where one
can be built, and issues inline on the caller's thread otherwise or when
``HICACHE_COPY_ISSUE=inline`` (``threaded`` says which).

``memmove_copies`` is the CPU executor of the very same arrays (``SimDevice``): one
``ctypes.memmove`` per copy, so the pointer arithmetic is fuzzed byte for byte on the CPU.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_ref.errors import HiCacheFault, HiCacheInputError
from hicache_ref.pools.copy_issuer import CopyIssuer, function_address, load_issuer_library
from hicache_ref.pools.layer_records import LayerRecords

CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CUDA_MEM_LOCATION_TYPE_DEVICE = 1
CUDA_MEM_LOCATION_TYPE_HOST = 2
CUDA_MEMCPY_FLAG_DEFAULT = 0
BATCH_RUNTIME_VERSION_MIN = 12080
"""``cudaMemcpyBatchAsync`` appeared in CUDA 12.8."""
ISSUE_ENV = "HICACHE_COPY_ISSUE"
"""``inline``: issue every batch on the caller's thread (default: the native issuing thread)."""


class CopyEngineError(HiCacheFault):
    """The CUDA runtime refused or failed a batch of copies (or cannot be found)."""


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


def memmove_copies(dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor) -> None:
    """Execute a batch on the CPU: ``memmove(dst, src, size)`` for each entry, in order."""
    assert dsts.numel() == srcs.numel() == sizes.numel()
    for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(dst, src, size)


def find_libcudart_paths() -> list[str]:
    """Candidate ``libcudart.so`` paths, the one this process loaded first."""
    loaded: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "libcudart.so" in os.path.basename(path) and path not in loaded:
                    loaded.append(path)
    except OSError:
        pass
    torch_dir = os.path.dirname(torch.__file__)
    site = os.path.dirname(torch_dir)
    patterns = [
        os.path.join(torch_dir, "lib", "libcudart.so*"),
        os.path.join(site, "nvidia", "cu13", "lib", "libcudart.so*"),
        os.path.join(site, "nvidia", "cuda_runtime", "lib", "libcudart.so*"),
        "/usr/local/cuda/lib64/libcudart.so*",
    ]
    found = [path for pattern in patterns for path in sorted(glob.glob(pattern))]
    return loaded + [path for path in found if path not in loaded]


def _check(code: int, what: str, library: ctypes.CDLL) -> None:
    if code == 0:
        return
    get_name = library.cudaGetErrorName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = (ctypes.c_int,)
    name = get_name(code)
    label = name.decode() if name else "unknown"
    raise CopyEngineError(f"{what} failed with CUDA error {code} ({label})")


@dataclass
class CudaBatchCopier:
    """``cudaMemcpyBatchAsync`` on the CUDA runtime of this process (see the module doc)."""

    library: ctypes.CDLL
    path: str
    runtime_version: int
    calls: int = 0
    """Batches issued (one runtime call each)."""
    default_stream_reroutes: int = 0
    """Batches issued on the legacy default stream and routed through a side stream."""
    threaded: bool = field(default_factory=lambda: os.environ.get(ISSUE_ENV) != "inline")
    """``issue_rows`` goes through the native issuing thread (``copy_issuer``)."""
    threaded_missing: str = ""
    """Why the issuing thread is not used (its build or the driver's entry points failed)."""
    threaded_batches: int = 0
    """Batches handed to an issuing thread."""
    _function: Any = field(init=False, repr=False)
    _side_streams: dict[int, torch.cuda.Stream] = field(default_factory=dict)
    _attrs: dict[tuple[bool, int], _MemcpyAttributes] = field(default_factory=dict)
    _issuers: dict[int, CopyIssuer] = field(default_factory=dict)
    _attr_addresses: dict[tuple[bool, int], int] = field(default_factory=dict)
    """Addresses of ``attributes``, by direction and device."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        # Verify the runtime has the batch API (CUDA 12.8+)
        if self.runtime_version < BATCH_RUNTIME_VERSION_MIN:
            raise CopyEngineError(
                f"cudaMemcpyBatchAsync needs CUDA runtime 12.8+, {self.path} is "
                f"{self.runtime_version}; use copy_path='runs' or 'triton'"
            )
        function = self.library.cudaMemcpyBatchAsync
        function.restype = ctypes.c_int
        pointers: list[Any] = [ctypes.c_void_p] * 3 + [ctypes.c_size_t]
        tail: list[Any] = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        if self.runtime_version < 13000:
            tail.append(ctypes.c_void_p)  # size_t* failIdx (dropped in CUDA 13)
        function.argtypes = [*pointers, *tail, ctypes.c_void_p]
        self._function = function
        self._attr_index = (ctypes.c_size_t * 1)(0)
        self._fail_index = ctypes.c_size_t(0)

    def attributes(self, *, d2h: bool, device_index: int) -> _MemcpyAttributes:
        """One attribute for a whole batch: stream order, host and device location hints."""
        key = (d2h, device_index)
        if key not in self._attrs:
            host = _MemLocation(CUDA_MEM_LOCATION_TYPE_HOST, 0)
            device = _MemLocation(CUDA_MEM_LOCATION_TYPE_DEVICE, device_index)
            self._attrs[key] = _MemcpyAttributes(
                CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                device if d2h else host,
                host if d2h else device,
                CUDA_MEMCPY_FLAG_DEFAULT,
            )
        return self._attrs[key]

    def issue(
        self,
        dsts: torch.Tensor,
        srcs: torch.Tensor,
        sizes: torch.Tensor,
        *,
        d2h: bool,
        device_index: int,
        stream_handle: int,
    ) -> None:
        """One runtime call for the batch on ``stream_handle`` (not the legacy default stream)."""
        count = dsts.numel()
        # Verify three CPU int64 arrays of one length, and a stream the API accepts
        assert srcs.numel() == count and sizes.numel() == count
        assert all(t.dtype == torch.int64 and t.device.type == "cpu" for t in (dsts, srcs, sizes))
        assert all(t.is_contiguous() for t in (dsts, srcs, sizes))
        if stream_handle == 0:
            raise HiCacheInputError(
                "cudaMemcpyBatchAsync refuses the legacy default stream; issue on a "
                "torch.cuda.Stream (issue_on_stream reroutes automatically)"
            )
        if count == 0:
            return
        attrs = self.attributes(d2h=d2h, device_index=device_index)
        args: list[object] = [
            dsts.data_ptr(),
            srcs.data_ptr(),
            sizes.data_ptr(),
            count,
            ctypes.addressof(attrs),
            ctypes.addressof(self._attr_index),
            1,
        ]
        if self.runtime_version < 13000:
            self._fail_index.value = 0
            args.append(ctypes.addressof(self._fail_index))
        code = self._function(*args, stream_handle)
        self.calls += 1
        if code != 0:
            failed = f" (failIdx {self._fail_index.value})" if self.runtime_version < 13000 else ""
            _check(code, f"cudaMemcpyBatchAsync of {count} copies{failed}", self.library)

    def issue_on_stream(
        self,
        dsts: torch.Tensor,
        srcs: torch.Tensor,
        sizes: torch.Tensor,
        *,
        d2h: bool,
        device: torch.device,
    ) -> None:
        """Issue on torch's current stream of ``device``; the default stream goes through a side
        stream ordered after it (and it after the side stream)."""
        device_index = 0 if device.index is None else device.index
        current = torch.cuda.current_stream(device)
        if current.cuda_stream != 0:
            self.issue(
                dsts, srcs, sizes, d2h=d2h, device_index=device_index,
                stream_handle=current.cuda_stream,
            )  # fmt: skip
            return
        side = self._side_streams.get(device_index)
        if side is None:
            side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            self._side_streams[device_index] = side
        side.wait_stream(current)
        self.issue(
            dsts, srcs, sizes, d2h=d2h, device_index=device_index, stream_handle=side.cuda_stream
        )
        current.wait_stream(side)
        self.default_stream_reroutes += 1

    def issue_rows(
        self, rows: RowBatches, device: torch.device, start: int = 0, stop: int | None = None
    ) -> None:
        """Issue rows ``start .. stop - 1`` of ``rows`` (default: all; one batch per layer) on
        torch's current stream of ``device``: through the issuing thread when ``threaded``, else
        one ``issue_on_stream`` per row. A range of a table's rows is pointer arithmetic, so a
        per-layer launch slices no tensor."""
        if stop is None:
            stop = rows.rows_num
        # Verify a non-empty range of the table's rows (the thread reads memory past the end)
        assert 0 <= start < stop <= rows.rows_num, (start, stop, rows.rows_num)
        if self.threaded:
            # Verify no graph is being captured: the thread's copies would stay out of it while
            # the caller's stream operations went in (inline issue is refused there by the
            # runtime itself, cudaErrorStreamCaptureUnsupported)
            if torch._C._cuda_isCurrentStreamCapturing():
                raise HiCacheInputError(
                    "copy_path='batch' cannot be captured into a CUDA graph (the copy engine's "
                    "batch call is not capturable); issue transfers outside graph capture"
                )
            # the raw handle: torch.cuda.current_stream() costs ~6 us on the issue path
            handle = torch._C._cuda_getCurrentRawStream(rows.device_index)
            issuer = self._issuers.get(handle)
            if issuer is None:
                issuer = self._new_issuer(torch.cuda.current_stream(device), device)
            if issuer is not None:
                attrs = self._attr_address(rows)
                offset = start * rows.row_bytes
                issuer.issue(
                    handle, rows.dsts_ptr + offset, rows.srcs_ptr + offset, rows.sizes_ptr,
                    rows.count_num, attrs, keep=rows, repeat=stop - start, stride=rows.row_bytes,
                )  # fmt: skip
                self.threaded_batches += stop - start
                return
        for row in range(start, stop):
            self.issue_on_stream(
                rows.dsts[row], rows.srcs[row], rows.sizes, d2h=rows.d2h, device=device
            )

    def issue_rows_stepped(
        self,
        rows: RowBatches,
        device: torch.device,
        after_row: Callable[[int], None],
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        """``issue_rows(rows, device, row, row + 1)`` then ``after_row(row)`` for each row of
        ``start .. stop - 1`` in order, on torch's current stream: the same stream order. Through
        the issuing thread, the rows go to it as one stepped entry (``issue_stepped``): the copy
        engine runs them back to back, and the current stream waits for row ``k``'s *done*
        before ``after_row(k)``, instead of one ready/done round trip through the current stream
        per row. The last wait is queued even when ``after_row`` raises. ``after_row`` given as
        ``LayerRecords`` whose events all have handles: the waits and the records are one native
        call (``CopyIssuer.wait_record``)."""
        if stop is None:
            stop = rows.rows_num
        # Verify a non-empty range of the table's rows (the thread reads memory past the end)
        assert 0 <= start < stop <= rows.rows_num, (start, stop, rows.rows_num)
        issuer = None
        handle = 0
        if self.threaded and not torch._C._cuda_isCurrentStreamCapturing():
            handle = torch._C._cuda_getCurrentRawStream(rows.device_index)
            issuer = self._issuers.get(handle)
            if issuer is None:
                issuer = self._new_issuer(torch.cuda.current_stream(device), device)
        if issuer is None:  # inline, or under capture (issue_rows says why, once per row)
            for row in range(start, stop):
                self.issue_rows(rows, device, row, row + 1)
                after_row(row)
            return
        records = after_row.handles(start, stop) if isinstance(after_row, LayerRecords) else None
        record = _driver_event_record() if records is not None else 0
        first = issuer.issue_stepped(
            handle, rows.dsts_ptr + start * rows.row_bytes, rows.srcs_ptr + start * rows.row_bytes,
            rows.sizes_ptr, rows.count_num, self._attr_address(rows), keep=rows,
            repeat=stop - start, stride=rows.row_bytes,
        )  # fmt: skip
        self.threaded_batches += stop - start
        if records is not None and record:
            # every wait and every layer's event records in one native call (layer_records)
            issuer.wait_record(
                handle, first, stop - start, records.address, records.per_step, record
            )
            return
        waited = -1
        try:
            for k, row in enumerate(range(start, stop)):
                issuer.wait_done(handle, first + k)
                waited = k
                after_row(row)
        finally:
            if waited < stop - start - 1:
                issuer.wait_done(handle, first + stop - start - 1)

    def _attr_address(self, rows: RowBatches) -> int:
        """The address of the one attribute of ``rows``' batches (kept per direction and
        device)."""
        key = (rows.d2h, rows.device_index)
        address = self._attr_addresses.get(key)
        if address is None:
            address = ctypes.addressof(
                self.attributes(d2h=rows.d2h, device_index=rows.device_index)
            )
            self._attr_addresses[key] = address
        return address

    def _new_issuer(self, stream: torch.cuda.Stream, device: torch.device) -> CopyIssuer | None:
        """The issuing thread for ``stream`` (``None``, and ``threaded`` off, where it cannot
        work here: the reason goes to ``threaded_missing``)."""
        with self._lock:
            if stream.cuda_stream in self._issuers:
                return self._issuers[stream.cuda_stream]
            library, why = load_issuer_library()
            driver_functions = _driver_value_functions() if library is not None else None
            if library is None or driver_functions is None:
                self.threaded = False
                self.threaded_missing = why or "no cuStreamWaitValue64 in libcuda.so.1"
                return None
            wait, write, memops = driver_functions
            # the highest priority: the forward waits on these copies, and priority is what the
            # GPU's scheduler weighs when busy compute streams compete with the side stream.
            # Its own stream, never one of torch's pool: a pool stream is handed out again, and
            # two issuers whose side waits share one stream deadlock (one's wait for its caller's
            # ready word holds the other's batch, which that caller's stream waits behind)
            side = self._dedicated_stream(device)
            issuer = CopyIssuer.create(
                library,
                batch=function_address(self._function),
                runtime13=self.runtime_version >= 13000,
                wait=wait,
                write=write,
                side_stream=side.cuda_stream,
                flags=torch.zeros(2, dtype=torch.int64, device=device),
                side=side,
                memops=memops,
            )
            self._issuers[stream.cuda_stream] = issuer
            return issuer

    def _dedicated_stream(self, device: torch.device) -> torch.cuda.ExternalStream:
        """A new non-blocking stream of the device's highest priority, created for one issuer
        and kept for the process (``cudaStreamCreateWithPriority``, outside torch's pool)."""
        least, greatest = ctypes.c_int(0), ctypes.c_int(0)
        handle = ctypes.c_void_p(0)
        with torch.cuda.device(device):
            _check(
                self.library.cudaDeviceGetStreamPriorityRange(
                    ctypes.byref(least), ctypes.byref(greatest)
                ),
                "cudaDeviceGetStreamPriorityRange",
                self.library,
            )
            _check(
                self.library.cudaStreamCreateWithPriority(
                    ctypes.byref(handle),
                    ctypes.c_uint(1),  # cudaStreamNonBlocking
                    greatest,
                ),
                "cudaStreamCreateWithPriority",
                self.library,
            )
        assert handle.value is not None
        return torch.cuda.ExternalStream(handle.value, device=device)  # type: ignore[no-untyped-call]

    def drain(self) -> None:
        """Wait until every issuing thread has issued what it was given; raise its failure."""
        for issuer in list(self._issuers.values()):
            issuer.drain()


@dataclass(frozen=True)
class RowBatches:
    """``rows`` consecutive batches of ``count`` copies: row ``r`` of ``dsts`` / ``srcs`` (CPU
    int64, ``[rows, count]``, contiguous) with one ``sizes`` array for all."""

    dsts: torch.Tensor
    srcs: torch.Tensor
    sizes: torch.Tensor
    d2h: bool
    device_index: int
    dsts_ptr: int = field(init=False)
    srcs_ptr: int = field(init=False)
    sizes_ptr: int = field(init=False)
    rows_num: int = field(init=False)
    """``rows``, read once (the issue path asks it per launch)."""
    count_num: int = field(init=False)
    """``count``, read once."""
    row_bytes: int = field(init=False)
    """Bytes between two rows of ``dsts`` (and of ``srcs``)."""

    def __post_init__(self) -> None:
        # Verify the shapes the pointer arithmetic of the issuing thread assumes
        assert self.dsts.shape == self.srcs.shape and self.dsts.dim() == 2
        assert self.sizes.shape == (self.dsts.shape[1],)
        assert all(t.dtype == torch.int64 and t.device.type == "cpu" for t in self.arrays())
        assert all(t.is_contiguous() for t in self.arrays())
        object.__setattr__(self, "dsts_ptr", self.dsts.data_ptr())
        object.__setattr__(self, "srcs_ptr", self.srcs.data_ptr())
        object.__setattr__(self, "sizes_ptr", self.sizes.data_ptr())
        object.__setattr__(self, "rows_num", int(self.dsts.shape[0]))
        object.__setattr__(self, "count_num", int(self.dsts.shape[1]))
        object.__setattr__(self, "row_bytes", self.count_num * 8)

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dsts, self.srcs, self.sizes

    @property
    def rows(self) -> int:
        return self.rows_num

    @property
    def count(self) -> int:
        return self.count_num


def _driver_value_functions() -> tuple[int, int, int] | None:
    """Addresses of ``cuStreamWaitValue64``, ``cuStreamWriteValue64`` and
    ``cuStreamBatchMemOp`` (``_v2``; 0 where the last is missing) in the driver, or ``None``."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for suffix in ("_v2", ""):
        try:
            wait = getattr(driver, f"cuStreamWaitValue64{suffix}")
            write = getattr(driver, f"cuStreamWriteValue64{suffix}")
        except AttributeError:
            continue
        memops = getattr(driver, f"cuStreamBatchMemOp{suffix}", None)
        batched = 0 if memops is None else function_address(memops)
        return function_address(wait), function_address(write), batched
    return None


@functools.cache
def _driver_event_record() -> int:
    """The address of ``cuEventRecord`` in the driver, or 0 (event records then go through
    Python, ``LayerRecords.__call__``)."""
    try:
        return function_address(ctypes.CDLL("libcuda.so.1").cuEventRecord)
    except (OSError, AttributeError):
        return 0


_LOADING = threading.Lock()
"""Held while the runtime is looked for, so two threads load one copier, not two."""


def load_cuda_batch_copier() -> CudaBatchCopier:
    """The process's ``CudaBatchCopier`` (loaded once), or ``CopyEngineError`` saying why not
    (a failure is not remembered: the next call looks again)."""
    with _LOADING:
        return _load_cuda_batch_copier()


@functools.cache
def _load_cuda_batch_copier() -> CudaBatchCopier:
    torch.cuda.init()  # type: ignore[no-untyped-call]
    errors: list[str] = []
    for path in find_libcudart_paths():
        try:
            library = ctypes.CDLL(path)
            version = ctypes.c_int(0)
            get_version = library.cudaRuntimeGetVersion
            get_version.restype = ctypes.c_int
            get_version.argtypes = (ctypes.c_void_p,)
            _check(get_version(ctypes.addressof(version)), "cudaRuntimeGetVersion", library)
            return CudaBatchCopier(library, path, version.value)
        except (OSError, AttributeError, CopyEngineError) as error:
            errors.append(f"{path}: {error}")
    raise CopyEngineError(
        "no CUDA runtime with cudaMemcpyBatchAsync found ("
        + ("; ".join(errors) or "no libcudart.so loaded or installed")
        + "); use copy_path='runs'"
    )
