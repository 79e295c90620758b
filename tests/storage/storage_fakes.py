"""Test doubles for the storage tier: a small host pool, a fake controller, a tree-side driver.

``FakeHostPool`` keeps KV in a CPU tensor in one of two layouts but always hands out pages in
one canonical flat order (kv, layer, token, head, dim), like the real host pools.
``FakeStorageController`` is the smallest class that inherits ``StorageMixin``.
``TreeSide`` plays the radix tree's part of a prefetch: terminate, split the bounce buffer,
drain the release queue into the pool, and remember every slot it freed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from hicache_ref.controller.storage_mixin import StorageMixin
from hicache_ref.errors import DoubleFreeError
from hicache_ref.ids import HostSlot
from hicache_ref.storage.operations import PrefetchOperation, compute_prefetch_split

LAYOUTS = ("layer_first", "page_first")


class FakeHostPool:
    """A host KV pool over a CPU tensor with a page-granular FIFO free list."""

    def __init__(
        self,
        size: int,
        page_size: int,
        layout: str = "layer_first",
        layer_num: int = 2,
        head_num: int = 2,
        head_dim: int = 4,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        assert layout in LAYOUTS and size % page_size == 0
        self.size = size
        self.page_size = page_size
        self.layout = layout
        self.layer_num = layer_num
        self.dtype = dtype
        if layout == "layer_first":
            shape = (2, layer_num, size, head_num, head_dim)
        else:
            shape = (2, size, layer_num, head_num, head_dim)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)
        self.free_slots: list[int] = list(range(size))
        self.on_set_page: Callable[[int], None] | None = None

    def _canonical(self) -> torch.Tensor:
        """A (kv, layer, token, head, dim) view of the buffer, whatever the layout."""
        if self.layout == "layer_first":
            return self.kv_buffer
        return self.kv_buffer.permute(0, 2, 1, 3, 4)

    def _page_view(self, index: int) -> torch.Tensor:
        assert index % self.page_size == 0, f"page head {index} is not page aligned"
        return self._canonical()[:, :, index : index + self.page_size]

    def get_data_page(self, index: HostSlot, flat: bool = True) -> torch.Tensor:
        page = self._page_view(int(index)).contiguous()
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self._page_view(0).contiguous().flatten())

    def set_from_flat_data_page(self, index: HostSlot, data: torch.Tensor) -> None:
        view = self._page_view(int(index))
        view.copy_(data.reshape(view.shape))
        if self.on_set_page is not None:
            self.on_set_page(int(index))

    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert need_size % self.page_size == 0
        if need_size > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return torch.tensor(taken, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> int:
        slots = indices.tolist()
        if set(slots) & set(self.free_slots) or len(set(slots)) != len(slots):
            raise DoubleFreeError(f"double free of host slots {sorted(slots)}")
        self.free_slots.extend(slots)
        return len(slots)

    def available_size(self) -> int:
        return len(self.free_slots)

    def fill(self, indices: torch.Tensor, seed: int) -> None:
        """Write distinct, seed-dependent values into the given token slots."""
        canonical = self._canonical()
        for offset, slot in enumerate(indices.tolist()):
            values = torch.arange(canonical[:, :, slot].numel(), dtype=torch.float32)
            canonical[:, :, slot] = (
                (values + 1000 * seed + offset).reshape(canonical[:, :, slot].shape).to(self.dtype)
            )

    def read(self, indices: torch.Tensor) -> torch.Tensor:
        """The KV of the given token slots, canonical order (a copy)."""
        return self._canonical()[:, :, indices].clone()


class FakeDevicePool:
    def __init__(self, size: int) -> None:
        self.size = size


class MLATokenToKVPool(FakeDevicePool):
    """Named like SGLang's MLA pool, which is all the mixin looks at."""


class FakeStorageController(StorageMixin):
    """The attributes the mixin relies on, and nothing else."""

    def __init__(
        self,
        host_pool: FakeHostPool,
        *,
        executor: str = "manual",
        device_pool: FakeDevicePool | None = None,
        uses_cp_hicache: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.mem_pool_host = host_pool  # type: ignore[assignment]
        self.mem_pool_device = device_pool or FakeDevicePool(host_pool.size // 4)  # type: ignore[assignment]
        self.page_size = host_pool.page_size
        self.uses_cp_hicache = uses_cp_hicache
        self.enable_storage = False
        self.storage_backend = None
        self.storage_backend_type = None
        self.storage_stop_event = threading.Event()
        self.storage_executor = executor
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._init_storage_state()

    def reset(self) -> None:
        self._reset_storage()


class TreeSide:
    """The tree's half of a prefetch, recording every host slot it frees."""

    def __init__(self, controller: FakeStorageController, host_pool: FakeHostPool) -> None:
        self.controller = controller
        self.host_pool = host_pool
        self.freed: list[int] = []

    def drain_releases(self) -> list[int]:
        """Free every queued release page into the host pool (SGLang's scheduler does this)."""
        released: list[int] = []
        release_queue = self.controller.host_mem_release_queue
        for _ in range(release_queue.qsize()):
            page = release_queue.get_nowait()
            self.host_pool.free(page)
            released.extend(page.tolist())
        self.freed.extend(released)
        return released

    def finish_prefetch(self, operation: PrefetchOperation, matched_tokens: int = 0) -> int:
        """Terminate, free [:matched], release [min:completed] (one rank: min == completed)."""
        completed, _ = self.controller.terminate_prefetch(operation)
        split = compute_prefetch_split(
            operation.bounce_buffer_tokens, matched_tokens, completed, completed
        )
        start, end = split.freed_by_tree
        if end > start:
            self.host_pool.free(operation.host_indices[start:end])
            self.freed.extend(operation.host_indices[start:end].tolist())
            operation.record_release(start, end, "tree")
        start, end = split.released_by_tree
        operation.record_release(start, end, "tree")
        self.controller.append_host_mem_release(operation.host_indices[start:end])
        return completed


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Spin (1 ms naps) until ``predicate`` holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s}s")
        time.sleep(0.001)
