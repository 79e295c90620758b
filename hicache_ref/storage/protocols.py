"""What the storage tier needs from a host pool, as a structural ``Protocol``.

Storage moves whole pages between a host pool and a backend in one *flat* format:
``get_data_page(index)`` returns page ``index // page_size`` as a 1-D tensor in the pool's
canonical (layout-independent) order, and ``set_from_flat_data_page(index, data)`` scatters such a
tensor back into whatever layout the pool uses. Because the flat format does not depend on the
layout, a page written under ``layer_first`` reads back correctly under ``page_first`` (bug
class 21). Parameters are positional-only so any pool with these shapes conforms.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hicache_ref.ids import HostSlot


class StorageHostPool(Protocol):
    """The host-pool surface that storage backends and the storage tier use."""

    @property
    def page_size(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def layout(self) -> str: ...

    def get_data_page(self, index: HostSlot, flat: bool = True, /) -> torch.Tensor: ...

    def get_dummy_flat_data_page(self) -> torch.Tensor: ...

    def set_from_flat_data_page(self, index: HostSlot, data: torch.Tensor, /) -> object: ...

    def alloc(self, need_size: int, /) -> torch.Tensor | None: ...

    def free(self, indices: torch.Tensor, /) -> object: ...
