"""The one seam between the state machines and an implementation under test.

An ``Implementation`` declares what it supports (``capabilities``) and builds one controller per
simulated rank from pools the harness made. The machines draw only configurations the target
supports and then drive it through the seed's public API, in the order data flows:

- ``ControllerLike``: write -> start_writing -> ack_write_queue -> evict_device -> load ->
  start_loading -> layer_done_counter (set_consumer) -> ack_load_queue -> evict_host -> reset;
- ``CpControllerLike`` (capability ``cp``): reserve_write_cp -> submit_write_cp_all_layer ->
  load_cp -> evict_cp_host, and the undrained-ack gate;
- ``PerLayerWriteLike`` (capability ``per_layer_write``): submit_write_cp_per_layer ->
  submit_write_cp_layer / on_layer_end -> cancel_layer_write_state, pending_layer_writes;
- ``DraftControllerLike`` (capability ``draft``): attach_draft_pool (or the constructor's
  draft pool arguments); draft transfers then ride along with every target transfer.

``detect_capabilities`` reads which of these a controller class really has, so an adapter that
declares more than its class offers fails at once, naming the missing method. ``snapshot_rank``
reads one rank as plain data (``invariants/snapshot.py``): the ack queues from the
implementation, the pages from the harness's own pools, which a controller cannot misreport.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

import torch

from hicache_ref.device.protocol import DeviceModule, EventT, StreamT
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.world.config import HarnessConfig
from hicache_ref.invariants.snapshot import AckRow, RankSnapshot

if TYPE_CHECKING:
    from hicache_ref.pools.allocator import PagedTokenToKVPoolAllocator
    from hicache_ref.pools.cp_layout import CpSharedKVLayout
    from hicache_ref.pools.device_pool import KVCache
    from hicache_ref.pools.host_pool import HostKVCache

CAPABILITIES = frozenset(
    {
        "cp",  # reserve_write_cp / load_cp / evict_cp_host over a CpSharedKVLayout
        "draft",  # attach_draft_pool: draft transfers ride along
        "per_layer_write",  # submit_write_cp_per_layer(catch_up_all_layers=False) + on_layer_end
        "storage",  # attach_storage_backend / prefetch / write_storage
        "storage:lock_points",  # the tier's threads park at an operation's lock only in a world
        # with storage_lock_points (this project's StorageTier; upstream's always park there)
        "storage:batch_steps",  # a storage_step runs what the reference's thread loop bodies
        # run: one hit query, one page batch of IO, one progress ack, one backup op (the
        # granularity a storage vector's steps pin)
        "io:direct",
        "io:kernel",
        "layout:layer_first",
        "layout:page_first",
        "layout:page_first_direct",
        "layout:page_head",  # upstream's MHA-only kernel layout
        "layout:layer_page_first",  # the fork's direct layout
        "pool:mha",
        "pool:mla",
        "pool:nsa",
        "pool:hybrid",  # the allocator's KV cache is a HybridLinearKVPool (unwrapped to its full pool)
        "guards",  # refuses unsafe calls (free in flight, second backup) with the invariant id
        "multi_consumer",  # layer_done_counter.set_consumer takes a list of producer slots and
        # wait_until waits on every one of them (one forward batch over several loads)
        "reset_drains",  # reset() synchronizes the write and load streams before clearing, so
        # no copy issued before it lands after it (a reset with copies in flight is safe)
        "fence_streams",  # write_fence_stream / load_fence_stream: set to the forward stream,
        # every D2H / H2D first waits for it (the forward on its own stream, F11's shape)
    }
)

GROUP_CAPABILITIES = frozenset(
    {"pool_group", "pool_group:packed", "pool_group:sidecar", "pool_group:swa", "pool_group:mamba"}
)
"""What upstream 0.5.19+'s ``HybridCacheController`` declares: the host pools arrive as a
``HostPoolGroup``; ``:packed`` / ``:sidecar`` carry the draft pool in it, ``:swa`` as an
independent side pool (its own rows and slots: the controller has ``side_pools``, a
``SidePoolsLike``), ``:mamba`` as an independent state pool (one slot per node). None is in ``CAPABILITIES`` (what an outside implementation copies: its
adapter would have to hand the side pool over), but the reference declares ``:swa`` too
(``SIDE_POOL_CAPABILITY``): it holds an independent side pool itself
(``controller/side_pool.py``), and takes its pools and its draft pair directly otherwise; the
harness checks a grouped draft with the same byte model as a draft pair."""

LOCK_POINTS_CAPABILITY = "storage:lock_points"
"""The tier parks its threads at an operation's lock only where the world asks
(``storage_lock_points``); the machines draw the field only for such an implementation."""

STORAGE_SIDECAR_CAPABILITY = "storage:sidecar"
"""A storage world carries the draft pool as a KV-derived sidecar into L3 (``batch_*_v2``,
``storage/pool_transfers.py``): the reference's draft pair, upstream 0.5.19+'s ``DRAFT`` entry
of a ``HostPoolGroup`` (``pool_group="sidecar"``). Not in ``CAPABILITIES``: an outside
implementation declares it once its storage stores a draft pool."""

STORAGE_SWA_CAPABILITY = "storage:swa"
"""A storage world may carry an independent SWA side pool (``pool_group="swa"`` with
``storage_swa_window``): its L3 pages are stored under ``<key>.swa`` by ``batch_set_v2`` and found
and read back as the trailing window of the hit (``PoolHitPolicy.TRAILING_PAGES``:
``_sync_trailing_keys``, ``_page_transfer_sidecar``; INV-39). Upstream 0.5.19+ (its
``HybridCacheController``) and the reference (``controller/storage/side_window.py``): not in
``CAPABILITIES``."""

STORAGE_MAMBA_CAPABILITY = "storage:mamba"
"""A storage world may carry an independent Mamba state pool (``pool_group="mamba"`` with
``storage_swa_window=1``): a backup stores the node's one state slot under its last page key
(``<key>.mamba``, ``PoolHitPolicy.TRAILING_PAGES``), a prefetch names one placeholder key, which
the controller turns into the served hit's last page key and reads after the KV pages (the
last-hit-page form of ``_sync_trailing_keys``; INV-39). Upstream 0.5.19+, where the tree's
Mamba component stores its state in L3, and the reference: not in ``CAPABILITIES``."""

STORAGE_PP_CAPABILITY = "storage:pp"
"""The storage ranks may be 2 pipeline-parallel ranks (``storage_pp``): 0.5.21+'s hybrid
controller in ``buffer_only`` mode, whose PP rank 0 submits prefetch tickets that a PP command
thread broadcasts to every rank (``harness/driver/pp_tree.py``, INV-38). Upstream 0.5.21+ only
(0.5.21 - 0.5.22's tickets carry PP rank 0's hit): not in ``CAPABILITIES``."""

STORAGE_BUFFER_CAPABILITY = "storage:buffer_only"
"""A storage world may run in ``buffer_only`` host memory (``storage_buffer_only``): the
controller's buffer-mode capacity and rate limit, under the buffer pipeline's tree half with the
tree's own storage existence beliefs (``harness/driver/storage_buffer.py``, INV-41). Upstream
0.5.19+ (its hybrid controller with ``host_memory_mode`` and the tree's
``StorageExistenceCache``: flat through 0.5.21, per pool with the controller's rank-agreed
per-pool query verdicts from 0.5.22) and the reference (``controller/storage/buffer_mode.py``,
the beliefs it holds for the tree, ``controller/storage/existence_beliefs.py``): not in
``CAPABILITIES``."""

HOST_PRESSURE_CAPABILITY = "storage:host_pressure"
"""The tier serves a prefetch whose hit the tree cut to a shorter bounce buffer (host pressure:
``storage_host_pressure``): every implementation whose tree allocates the bounce at the hit
(0.5.16+; the reference). Not in ``CAPABILITIES``: an outside tier declares it."""

SIDE_POOL_CAPABILITY = "pool_group:swa"
"""An independent side pool: the controller's ``side_pools`` (a ``SidePoolsLike``) names it on
every write, load and host release (``pool_group="swa"`` worlds)."""

STATE_POOL_CAPABILITY = "pool_group:mamba"
"""An independent Mamba state pool (``pool_group="mamba"``): one state slot per node, named
through the same ``side_pools`` calls as an SWA pool (upstream 0.5.19+'s ``MAMBA`` entry of a
``HostPoolGroup``; the reference's ``attach_side_pool(name="mamba")``)."""

CAPABILITY_METHODS: dict[str, tuple[str, ...]] = {
    "cp": ("reserve_write_cp", "submit_write_cp_all_layer", "load_cp", "evict_cp_host"),
    "per_layer_write": (
        "submit_write_cp_per_layer",
        "submit_write_cp_layer",
        "on_layer_end",
        "cancel_layer_write_state",
    ),
    "draft": ("attach_draft_pool",),
}
"""The methods a controller class must have for each capability that can be detected."""

DRAFT_CONSTRUCTOR_ARGS = ("draft_mem_pool_host", "draft_mem_pool_device")


# -- the contract -------------------------------------------------------------------------------
class AckLike(Protocol):
    """An ack the tree drains once ``finish_event.query()`` is True (SGLang's ``HiCacheAck``)."""

    @property
    def finish_event(self) -> EventT: ...
    @property
    def node_ids(self) -> Sequence[int]: ...


class AckQueue(Protocol):
    """An ack queue as the tree uses it: scanned front to back, drained by deleting a prefix."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[AckLike]: ...
    def __delitem__(self, key: slice, /) -> None: ...


class LayerCounterLike(Protocol):
    """``layer_done_counter``: the forward sets the consumer slot before reading a layer."""

    def set_consumer(self, index: int, /) -> None: ...


class ControllerLike(Protocol):
    """The seed API surface the harness drives (what SGLang's radix cache calls)."""

    @property
    def ack_write_queue(self) -> AckQueue: ...
    @property
    def ack_load_queue(self) -> AckQueue: ...
    @property
    def layer_done_counter(self) -> LayerCounterLike: ...
    @property
    def write_stream(self) -> StreamT: ...
    @property
    def load_stream(self) -> StreamT: ...

    def write(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> object:
        """Non-CP: the host indices, or None when the host is full."""
        ...

    def start_writing(self) -> None: ...
    def load(
        self, host_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> torch.Tensor | None: ...
    def start_loading(self) -> int: ...
    def evict_device(self, device_indices: torch.Tensor) -> int: ...
    def evict_host(self, host_indices: torch.Tensor, backup_only: bool = True) -> int: ...
    def reset(self) -> None: ...


@runtime_checkable
class UndrainedGateLike(Protocol):
    """The fast duplicate-backup gate (INV-02); optional outside CP."""

    def node_has_undrained_write_ack(self, node_id: int) -> bool: ...


class CpMetadataLike(Protocol):
    """What the harness reads of a node's CP metadata: only the host slots the implementation
    chose. Owned positions, padding and page owners it computes from its own layout."""

    @property
    def host_indices(self) -> torch.Tensor: ...
    @property
    def draft_host_indices(self) -> torch.Tensor | None: ...


@runtime_checkable
class WriteReservationLike(Protocol):
    """A ``reserve_write_cp`` success (``HiCacheWriteReservation``): passed back to the submits."""

    @property
    def metadata(self) -> CpMetadataLike: ...
    @property
    def host_indices(self) -> torch.Tensor: ...


class WriteFailureLike(Protocol):
    """A ``reserve_write_cp`` refusal (``HiCacheWriteFailure``): a value naming its cause."""

    @property
    def reason(self) -> str: ...


class CpNodeLike(Protocol):
    """What ``load_cp`` reads from a radix node: its id, host length and CP metadata."""

    id: int
    host_len: int
    cp_hicache: CpMetadataLike


@runtime_checkable
class CpControllerLike(UndrainedGateLike, Protocol):
    """Capability ``cp``: backups and loads of CP shared KV (all layers at once)."""

    def reserve_write_cp(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> WriteReservationLike | WriteFailureLike: ...
    def submit_write_cp_all_layer(self, reservation: WriteReservationLike) -> None: ...
    def load_cp(
        self, nodes_to_load: Sequence[CpNodeLike], node_id: int = -1
    ) -> torch.Tensor | None: ...
    def evict_cp_host(self, metadata: CpMetadataLike, backup_only: bool = True) -> int: ...


@runtime_checkable
class PerLayerWriteLike(Protocol):
    """Capability ``per_layer_write``: CP backups driven layer by layer by the forward."""

    @property
    def pending_layer_writes(self) -> Collection[int]: ...

    def submit_write_cp_per_layer(
        self, reservation: WriteReservationLike, *, catch_up_all_layers: bool = True
    ) -> None: ...
    def submit_write_cp_layer(
        self,
        reservation: WriteReservationLike,
        layer_id: int,
        *,
        submit_target: bool = True,
        submit_draft: bool = True,
    ) -> None: ...
    def on_layer_end(self, layer_id: int, source: str = "target") -> None: ...
    def cancel_layer_write_state(self, node_id: int) -> bool: ...


class DraftControllerLike(Protocol):
    """Capability ``draft``: a draft pool pair whose transfers ride along."""

    def attach_draft_pool(
        self, draft_mem_pool_device: KVCache | None, draft_mem_pool_host: HostKVCache | None
    ) -> None: ...


@dataclass(frozen=True)
class BuildRequest:
    """Everything an implementation needs to build the controller of one rank."""

    config: HarnessConfig
    rank: int
    device_module: DeviceModule
    allocator: PagedTokenToKVPoolAllocator
    host_pool: HostKVCache
    cp_layout: CpSharedKVLayout | None
    draft_device_pool: KVCache | None
    draft_host_pool: HostKVCache | None
    storage_collectives: object | None = None
    """This rank's handle on the storage world's rank group (``controller/storage/
    collectives.RankCollectives``) when the config has a storage tier; None otherwise."""
    side_allocator: PagedTokenToKVPoolAllocator | None = None
    """An independent side pool's own device allocator over ``draft_device_pool``
    (``config.has_side_pools``; ``harness/world/side_pools.py``)."""


@runtime_checkable
class SidePoolsLike(Protocol):
    """The tree's calls that name an independent side pool (``config.has_side_pools``), on the
    controller as ``side_pools``: what upstream's hybrid radix cache passes as ``extra_pools``.

    ``write`` backs up a node's anchor rows and its side rows (the side pool's own device
    rows, which the tree allocated) and returns (anchor host slots, side host slots), or None
    when either host pool is short (nothing held then); ``load`` loads a node's anchor host
    slots and side host slots into fresh rows of each pool's own allocator and returns (anchor
    rows, side rows), or None (nothing held); ``evict_host`` releases the side host slots (the
    anchor's go through the controller's ``evict_host``). The side rows are freed through the
    side allocator, as the tree frees an SWA segment. In a Mamba world with ``state_cow`` a
    load also names ``request``: a state slot the tree allocated for a request, which the load
    fills with the node's state too (upstream's copy-on-write ``LOAD_BACK`` transfer); the
    tree owns it (it frees it, on a refusal too)."""

    def write(
        self, device_indices: torch.Tensor, node_id: int, side_device: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    def load(
        self,
        host_indices: torch.Tensor,
        node_id: int,
        side_host: torch.Tensor,
        request: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    def evict_host(self, side_host: torch.Tensor) -> None: ...


class Implementation(Protocol):
    """An implementation under test: the three required hooks (``name``, ``capabilities``,
    ``build_controller``) and the three optional ones (``snapshot``, ``refine_config``,
    ``source_tree``), which ``contract.ImplementationBase`` defines with their defaults.
    ``contract.adopt`` gives any object with the required hooks the optional ones."""

    name: str
    capabilities: frozenset[str]
    source_tree: str

    def build_controller(self, request: BuildRequest) -> ControllerLike: ...
    def snapshot(self, rank: RankLike, gate_ids: Iterable[int]) -> RankSnapshot: ...
    def refine_config(self, config: HarnessConfig) -> HarnessConfig: ...


class RankLike(Protocol):
    """What ``snapshot_rank`` reads of one simulated rank (``harness/world.Rank``)."""

    @property
    def rank(self) -> int: ...
    @property
    def controller(self) -> ControllerLike: ...
    @property
    def allocator(self) -> PagedTokenToKVPoolAllocator: ...
    @property
    def host_pool(self) -> HostKVCache: ...
    @property
    def draft_host_pool(self) -> HostKVCache | None: ...
    @property
    def cp_layout(self) -> CpSharedKVLayout | None: ...
    @property
    def per_layer(self) -> PerLayerWriteLike | None: ...
    @property
    def gate(self) -> UndrainedGateLike | None: ...


def is_write_failure(
    result: WriteReservationLike | WriteFailureLike,
) -> TypeGuard[WriteFailureLike]:
    """Whether a ``reserve_write_cp`` result is a refusal. Told apart by shape, not by class:
    an implementation may define its own records (the seed has its own ``HiCacheWriteFailure``)."""
    return hasattr(result, "reason") and not hasattr(result, "host_indices")


def as_reservation(result: WriteReservationLike | WriteFailureLike) -> WriteReservationLike | None:
    """The reservation, or None when ``result`` is a refusal."""
    if is_write_failure(result) or not isinstance(result, WriteReservationLike):
        return None
    return result


# -- capabilities -------------------------------------------------------------------------------
def missing_methods(controller_class: type, capability: str) -> list[str]:
    """The methods ``capability`` needs that ``controller_class`` lacks (empty: it has them)."""
    methods = CAPABILITY_METHODS.get(capability, ())
    missing = [m for m in methods if not callable(getattr(controller_class, m, None))]
    if capability == "draft" and missing and _takes_draft_pools(controller_class):
        return []  # the constructor takes the draft pools instead
    if capability == "draft" and callable(getattr(controller_class, "set_draft_kv_pool", None)):
        return []  # upstream 0.5.11 - 0.5.18 take the draft pair after construction
    return missing


def _takes_draft_pools(controller_class: type) -> bool:
    try:
        parameters = inspect.signature(controller_class).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in DRAFT_CONSTRUCTOR_ARGS)


def detect_capabilities(controller_class: type) -> frozenset[str]:
    """The detectable capabilities (``CAPABILITY_METHODS``) ``controller_class`` really has."""
    return frozenset(
        cap for cap in CAPABILITY_METHODS if not missing_methods(controller_class, cap)
    )


def check_declared_capabilities(
    declared: frozenset[str], controller_class: type, impl_name: str
) -> frozenset[str]:
    """``declared``, after checking the class has every detectable capability it declares."""
    for capability in sorted(declared & set(CAPABILITY_METHODS)):
        missing = missing_methods(controller_class, capability)
        # Verify the adapter does not promise a capability its class lacks
        if missing:
            raise HiCacheInputError(
                f"implementation {impl_name!r} declares capability {capability!r} but "
                f"{controller_class.__name__} has no {missing[0]} (implement it, or drop "
                f"{capability!r} from its capabilities)"
            )
    return declared


@dataclass(frozen=True)
class Unsupported:
    reasons: Sequence[str] = field(default_factory=tuple)


def unsupported_reasons(capabilities: frozenset[str], config: HarnessConfig) -> list[str]:
    """Why ``config`` is outside ``capabilities`` (empty when it is supported)."""
    needed = {f"io:{config.io_backend}", f"layout:{config.layout}", f"pool:{config.pool_kind}"}
    if config.uses_cp:
        needed.add("cp")
    if config.has_draft:
        needed.add("draft")
    if config.hybrid:
        needed.add("pool:hybrid")
    if config.uses_storage:
        needed.add("storage")
        if config.has_state_pool:  # a node's Mamba state goes to L3 (v2 calls, trailing)
            needed.add(STORAGE_MAMBA_CAPABILITY)
        elif config.has_side_pools:  # the side pool's window goes to L3 (v2 calls, trailing)
            needed.add(STORAGE_SWA_CAPABILITY)
        elif config.has_draft:  # the draft pool's pages go to L3 beside the KV's (v2 calls)
            needed.add(STORAGE_SIDECAR_CAPABILITY)
        if config.storage_host_pressure:  # the tree cuts a hit to the room it has
            needed.add(HOST_PRESSURE_CAPABILITY)
        if config.storage_pp:  # PP ranks exchanging prefetch tickets
            needed.add(STORAGE_PP_CAPABILITY)
        if config.storage_buffer_only:  # host memory as a staging buffer, beliefs of L3
            needed.add(STORAGE_BUFFER_CAPABILITY)
    if config.forward_stream:
        needed.add("fence_streams")
    if config.pool_group == "anchor":
        needed.add("pool_group")
    elif config.has_side_pools:  # no group needed: the controller holds the side pool itself
        needed.add(f"pool_group:{config.pool_group}")
        needed.discard("draft")
    elif config.pool_group != "none":
        needed |= {"pool_group", f"pool_group:{config.pool_group}"}
        needed.discard("draft")  # the draft rides in the group, not as a draft pair
    return sorted(needed - capabilities)


def supports(capabilities: frozenset[str], config: HarnessConfig) -> bool:
    return not unsupported_reasons(capabilities, config)


# -- snapshots ----------------------------------------------------------------------------------
def _ack_rows(queue: AckQueue) -> tuple[AckRow, ...]:
    return tuple(
        AckRow(tuple(map(int, ack.node_ids)), bool(ack.finish_event.query())) for ack in queue
    )


def snapshot_rank(rank: RankLike, gate_ids: Iterable[int] = ()) -> RankSnapshot:
    """One rank as plain data, for any implementation with SGLang's attribute names.

    Pages come from the harness's own allocator and host pools; from the implementation only
    its ack queues, its pending per-layer writes, its producer slots and its gate's answers.
    """
    controller, per_layer, gate_fn = rank.controller, rank.per_layer, rank.gate
    pending = (
        frozenset(map(int, per_layer.pending_layer_writes))
        if per_layer is not None
        else frozenset()
    )
    if gate_fn is not None:
        asks = gate_fn.node_has_undrained_write_ack
        gate: tuple[tuple[int, bool], ...] | None = tuple((int(n), bool(asks(n))) for n in gate_ids)
    else:
        gate = None
    counter = controller.layer_done_counter
    side_allocator = getattr(rank, "side_allocator", None)  # an independent side pool's
    separate = rank.cp_layout is not None or side_allocator is not None
    draft_pool = rank.draft_host_pool if separate else None
    side_pages = None
    if side_allocator is not None:
        side_pages = frozenset(side_allocator.allocated_page_ids())
    return RankSnapshot(
        rank=rank.rank,
        write_acks=_ack_rows(controller.ack_write_queue),
        load_acks=_ack_rows(controller.ack_load_queue),
        device_pages=frozenset(rank.allocator.allocated_page_ids()),
        host_pages=frozenset(rank.host_pool.allocated_pages()),
        draft_host_pages=None if draft_pool is None else frozenset(draft_pool.allocated_pages()),
        pending_layer_writes=pending,
        producer_slots=int(getattr(counter, "num_counters", 0)),
        producer_index=int(getattr(counter, "producer_index", -1)),
        consumer_indices=tuple(map(int, getattr(counter, "consumer_indices", ()))),
        gate_answers=gate,
        side_device_pages=side_pages,
    )
