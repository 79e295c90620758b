"""Context-parallel load-back: replay the write-time owner pattern, then load owned pages.

``load_cp(nodes)`` asks the allocator for fresh logical pages whose owners repeat each node's
recorded ``page_owners`` (INV-03), maps this rank's owned positions of the new allocation to
physical locations, and queues one op carrying the caller's node id. A rank that owns nothing
still queues a zero-length op, so ``start_loading`` merges the same node ids on every rank
(INV-14). ``evict_cp_host`` frees a node's target and draft host slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hicache_ref.controller.base import ControllerState
from hicache_ref.controller.operations import CacheOperation
from hicache_ref.errors import HiCacheInputError, InvariantViolation, MissingCpMetadataError


class CpNode(Protocol):
    """What ``load_cp`` reads from a radix node: its id, host length and CP metadata."""

    id: int
    host_len: int
    cp_hicache: Any


class CpLoadMixin(ControllerState):
    """``load_cp`` and ``evict_cp_host``."""

    def load_cp(self, nodes_to_load: Sequence[CpNode], node_id: int = -1) -> torch.Tensor | None:
        """Allocate pages with the recorded owner pattern and queue the owned pages' H2D.

        Returns the visible device indices (``[:valid_len]`` of each node, concatenated), or None
        when the allocator cannot match the owner pattern (the caller falls back to a cache miss).
        """
        if self.cp_shared_kv_layout is None:
            raise HiCacheInputError("load_cp needs a controller built with cp_shared_kv_layout")
        layout = self.cp_shared_kv_layout
        metas = []
        for node in nodes_to_load:
            meta = getattr(node, "cp_hicache", None)
            if meta is None:
                raise MissingCpMetadataError(
                    f"load_cp called with node {getattr(node, 'id', '?')} that has no cp_hicache "
                    "metadata (only nodes backed up through reserve_write_cp can be CP-loaded)"
                )
            if self.has_draft_hicache and meta.draft_host_indices is None:
                raise MissingCpMetadataError(
                    f"node {getattr(node, 'id', '?')}: a draft pool is attached but the node's "
                    "metadata has no draft_host_indices (it was backed up without the draft)"
                )
            if int(meta.valid_len) != int(node.host_len):
                raise HiCacheInputError(
                    f"node {getattr(node, 'id', '?')}: host_len={node.host_len} differs from the "
                    f"CP metadata valid_len={meta.valid_len}"
                )
            metas.append(meta)
        page_owners = [int(o) for meta in metas for o in meta.page_owners.tolist()]
        device_indices = self.mem_pool_device_allocator.alloc_pages_with_owners(page_owners)
        if device_indices is None:
            return None  # fail closed: never proceed with a non-matching owner pattern
        try:
            return self._queue_cp_load(metas, device_indices, page_owners, node_id, layout)
        except Exception:
            # Nothing half-allocated after an error (INV-17)
            self.mem_pool_device_allocator.free(device_indices)
            raise

    def _queue_cp_load(
        self,
        metas: list[Any],
        device_indices: torch.Tensor,
        page_owners: list[int],
        node_id: int,
        layout: Any,
    ) -> torch.Tensor:
        expected = sum(int(meta.padded_len) for meta in metas)
        if device_indices.numel() != expected:
            raise InvariantViolation(
                "INV-03",
                f"alloc_pages_with_owners returned {device_indices.numel()} locs for "
                f"{len(page_owners)} pages; expected padded length {expected}",
            )
        self._verify_owner_replay(device_indices, page_owners, layout)
        host_chunks: list[torch.Tensor] = []
        draft_chunks: list[torch.Tensor] = []
        physical_chunks: list[torch.Tensor] = []
        visible_chunks: list[torch.Tensor] = []
        offset = 0
        for meta in metas:
            node_locs = device_indices[offset : offset + int(meta.padded_len)]
            offset += int(meta.padded_len)
            visible_chunks.append(node_locs[: int(meta.valid_len)])
            owned = meta.owned_positions.to(device_indices.device)
            if owned.numel() == 0:
                continue
            physical_chunks.append(layout.logical_locs_to_physical(node_locs[owned]))
            host_chunks.append(meta.host_indices)
            if self.has_draft_hicache:
                draft_chunks.append(meta.draft_host_indices)
        visible = (
            torch.cat(visible_chunks)
            if visible_chunks
            else torch.empty((0,), dtype=device_indices.dtype, device=device_indices.device)
        )
        if not host_chunks:
            # Zero-owned rank: still queue the node id so ack rows match across ranks (INV-14)
            empty = torch.empty((0,), dtype=torch.int64)
            self.load_queue.append(CacheOperation(empty, empty.clone(), node_id))
            return visible
        host_indices = torch.cat(host_chunks)
        physical = torch.cat(physical_chunks)
        self._check_indices(host_indices, "CP host_indices", page_aligned=True)
        self._check_indices(physical, "CP physical_device_indices", page_aligned=True)
        self.load_queue.append(CacheOperation(host_indices, physical, node_id))
        if self.has_draft_hicache:
            draft_host = torch.cat(draft_chunks)
            self._check_indices(draft_host, "CP draft_host_indices", page_aligned=True)
            self.draft_load_queue.append(CacheOperation(draft_host, physical.clone(), node_id))
        return visible

    def _verify_owner_replay(
        self, device_indices: torch.Tensor, page_owners: list[int], layout: Any
    ) -> None:
        """The fresh pages must repeat the recorded owner pattern (INV-03, bug class 3)."""
        first_locs = device_indices[:: self.page_size]
        got = layout.owner_for_logical_pages(
            torch.div(first_locs, self.page_size, rounding_mode="floor")
        ).tolist()
        if [int(o) for o in got] != page_owners:
            raise InvariantViolation(
                "INV-03",
                f"allocated pages have owners {got[:8]}, the recorded pattern is "
                f"{page_owners[:8]} (alloc_pages_with_owners must replay page_owners, or each "
                "rank loads its bytes into pages another rank owns)",
            )

    def evict_cp_host(self, metadata: Any, backup_only: bool = True) -> int:
        """Free a CP node's target (and draft) host slots; refused while a copy uses them."""
        if not backup_only:
            raise HiCacheInputError("evict_cp_host supports backup_only=True only")
        if metadata is None:
            raise MissingCpMetadataError("evict_cp_host needs the node's cp_hicache metadata")
        draft_host = getattr(metadata, "draft_host_indices", None)
        if self.has_draft_hicache and draft_host is None:
            raise MissingCpMetadataError(
                "a draft pool is attached but the metadata has no draft_host_indices"
            )
        host_indices = metadata.host_indices
        if self.has_draft_hicache and draft_host is not None and len(draft_host):
            # Check both pools before freeing either, so a refusal frees nothing (INV-17)
            self._check_indices(draft_host, "draft_host_indices", page_aligned=True)
            self._check_no_pending_layer_write("draft_host", draft_host, "evict_cp_host")
            self.inflight.check_not_in_flight(
                "draft_host", self._pages(draft_host), "INV-07", "evict_cp_host"
            )
        if len(host_indices):
            self._check_indices(host_indices, "host_indices", page_aligned=True)
            self._check_no_pending_layer_write("host", host_indices, "evict_cp_host")
            self.inflight.check_not_in_flight(
                "host", self._pages(host_indices), "INV-07", "evict_cp_host"
            )
            self.mem_pool_host.free(host_indices)
        if self.has_draft_hicache and draft_host is not None and len(draft_host):
            _, draft_host_pool = self._require_draft_pools()
            draft_host_pool.free(draft_host)
        return len(host_indices)
