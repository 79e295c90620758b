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

Its cost is on the CPU and per copy: the runtime spends ~0.5-0.9 us in the call for each copy
(measured on an H200, CUDA 13.0, whatever the location hints), so a layer of 512 page copies
costs ~0.5 ms to issue; the copies of one call start once it returns, and the next layer's call
overlaps them.

``memmove_copies`` is the CPU executor of the very same arrays (``SimDevice``): one
``ctypes.memmove`` per copy, so the pointer arithmetic is fuzzed byte for byte on the CPU.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_ref.errors import HiCacheFault, HiCacheInputError

CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CUDA_MEM_LOCATION_TYPE_DEVICE = 1
CUDA_MEM_LOCATION_TYPE_HOST = 2
CUDA_MEMCPY_FLAG_DEFAULT = 0
BATCH_RUNTIME_VERSION_MIN = 12080
"""``cudaMemcpyBatchAsync`` appeared in CUDA 12.8."""


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
    _function: Any = field(init=False, repr=False)
    _side_streams: dict[int, torch.cuda.Stream] = field(default_factory=dict)
    _attrs: dict[tuple[bool, int], _MemcpyAttributes] = field(default_factory=dict)

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


_COPIER: CudaBatchCopier | None = None
_COPIER_LOCK = threading.Lock()


def load_cuda_batch_copier() -> CudaBatchCopier:
    """The process's ``CudaBatchCopier`` (loaded once), or ``CopyEngineError`` saying why not."""
    global _COPIER
    with _COPIER_LOCK:
        if _COPIER is not None:
            return _COPIER
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
                _COPIER = CudaBatchCopier(library, path, version.value)
                return _COPIER
            except (OSError, AttributeError, CopyEngineError) as error:
                errors.append(f"{path}: {error}")
        raise CopyEngineError(
            "no CUDA runtime with cudaMemcpyBatchAsync found ("
            + ("; ".join(errors) or "no libcudart.so loaded or installed")
            + "); use copy_path='runs'"
        )
