"""The tree half of an independent side pool, as upstream's hybrid radix cache drives it.

Upstream's unified radix cache (0.5.19+, ``unified_cache/components/swa.py``) names a side pool
in every transfer by a ``PoolTransfer`` of that pool, never riding on the KV indices:

- backup (``BACKUP_HOST``): ``PoolTransfer(name=SWA, device_indices=<the node's SWA rows>)``
  beside the KV rows; the controller resolves its host slots from the SWA host pool
  (``HostPoolGroup.resolve_host_transfers``, all or nothing with the anchor's) and writes them
  into that transfer, which the tree then keeps as the node's SWA host value;
- load (``LOAD_BACK``): ``PoolTransfer(name=SWA, host_indices=<the node's SWA host slots>)``;
  the controller allocates the SWA device rows through the entry's ``device_alloc_fn``
  (``_resolve_device_transfers``, rolled back with the KV rows when short), and the tree reads
  them off the transfer;
- host eviction (``free_host_values``): the SWA host slots go back to their own pool
  (``HostPoolGroup.free(..., pool=SWA)``); device eviction frees the SWA rows through the
  allocator (``free_swa_segment``), which the harness's tree does itself.

A Mamba state pool (``unified_cache/components/mamba.py``) is named the same way with its one
state slot; a load may also name a second ``MAMBA`` transfer with the same host slot and
``device_indices=<the request's slot>`` (the per-request copy-on-write into a slot the caller
allocated, ``prepare_load_back``), which the controller must copy into as given.

``SglangSidePools`` is that protocol over one controller (the harness's ``SidePoolsLike``).
What the tree records comes from the transfers the controller filled in; every byte is then
checked at those rows and slots against the content oracle, and the slots against the
harness's own pools' allocators (INV-05, INV-36).
"""

from __future__ import annotations

from typing import Any

import torch


def side_pool_name(names: Any, pool_group: str) -> Any:
    """Upstream's ``PoolName`` of a side-pool world's pool: ``SWA`` or ``MAMBA``."""
    return {"swa": names.SWA, "mamba": names.MAMBA}[pool_group]


class SglangSidePools:
    """The side pool (``SWA`` or ``MAMBA``) named in every write, load and host release of one
    controller. A Mamba node's transfer names its one state slot
    (``MambaComponent.build_hicache_transfers``: ``device_indices=<the node's slot>`` on a
    backup, ``host_indices=<its host slot>`` on a load)."""

    def __init__(self, controller: Any, pool_transfer: Any, name: Any) -> None:
        self._controller = controller
        self._transfer = pool_transfer
        self._name = name

    def write(
        self, device_indices: torch.Tensor, node_id: int, side_device: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        transfer = self._transfer(name=self._name, device_indices=side_device)
        pool = self._controller.mem_pool_host.get_pool(self._name)
        watched = hasattr(pool, "node_slots")  # a state pool: its host slots per node judged
        if watched:
            pool.node_slots = len(side_device)
        try:
            host = self._controller.write(device_indices, None, node_id, extra_pools=[transfer])
        finally:
            if watched:
                pool.node_slots = None
        if host is None:
            return None
        return host, _resolved(transfer.host_indices, "host_indices", "write")

    def load(
        self,
        host_indices: torch.Tensor,
        node_id: int,
        side_host: torch.Tensor,
        request: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        transfer = self._transfer(name=self._name, host_indices=side_host)
        extra = [transfer]
        if request is not None:  # the per-request copy-on-write into the caller's slot
            extra.append(
                self._transfer(name=self._name, host_indices=side_host, device_indices=request)
            )
        device = self._controller.load(host_indices, None, node_id, extra_pools=extra)
        if device is None:
            return None
        return device, _resolved(transfer.device_indices, "device_indices", "load")

    def evict_host(self, side_host: torch.Tensor) -> None:
        self._controller.mem_pool_host.free(side_host, pool=self._name)


def _resolved(indices: Any, field: str, verb: str) -> torch.Tensor:
    """A side transfer's indices the controller must have filled in by now."""
    if not isinstance(indices, torch.Tensor):
        # the radix cache asserts the same before it commits the node's side value
        raise AssertionError(
            f"a {verb} that returned indices left the side transfer's {field} unresolved "
            f"({indices!r}); HostPoolGroup resolves every named side pool or none"
        )
    return indices
