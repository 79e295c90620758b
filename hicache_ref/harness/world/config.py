"""One harness case's configuration: pool geometry, layout, backend, CP and draft shape.

Every case of a state machine draws one ``HarnessConfig``; a trace's header stores it, so a
trace rebuilds exactly the same world without Hypothesis.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

PoolKind = Literal["mha", "mla", "nsa"]
Layout = Literal["layer_first", "page_first", "page_first_direct", "page_head", "layer_page_first"]
IoBackend = Literal["direct", "kernel"]
AllocPolicy = Literal["fifo", "lifo", "random"]
CopyPath = Literal["gather", "runs", "batch", "triton"]
StorageBackendName = Literal["memory", "file", "upstream_file"]
StoragePolicy = Literal["best_effort", "wait_complete", "timeout"]
STORAGE_RANKS_MAX = 4
PoolGroup = Literal["none", "anchor", "packed", "sidecar", "swa", "mamba"]
SIDE_POOL_GROUPS = ("swa", "mamba")
STATE_POOL_GROUPS = ("mamba",)
"""Side pools that hold one state slot per node (a page of one slot), not rows per token."""
STORAGE_DRAFT_GROUPS = ("none", "sidecar")
PP_GROUPS = ("anchor", "sidecar", "swa", "mamba")
"""The pool groups of a PP world: KV alone, with the draft pool riding on its slots, or with an
independent side pool (an SWA window, a Mamba state page) whose window each rank allocates."""
"""How a storage world may carry a draft pool: as a draft pair (the reference) or upstream's
``DRAFT`` sidecar; either way its pages are stored beside the KV's (``storage/pool_transfers.py``)."""
"""Pool groups whose side pool has its own device rows and host slots (an independent pool)."""

LEGAL_LAYOUTS: dict[str, tuple[str, ...]] = {
    "direct": ("layer_first", "page_first_direct", "layer_page_first"),
    "kernel": ("layer_first", "page_first", "page_head"),
}
"""The (io backend, host layout) pairs the pools drive (``pools/host_layout.py`` is the source;
a test keeps the two equal)."""
MHA_ONLY_LAYOUTS = ("page_head",)


class HarnessConfig(BaseModel):
    """The world a case runs in. Sizes are in pages; every rank gets the same geometry."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    page_size: int = 4
    layer_num: int = 2
    draft_layer_num: int = 0
    pool_kind: PoolKind = "mha"
    layout: Layout = "layer_first"
    io_backend: IoBackend = "direct"
    cp_size: int = 0
    """0: no CP layout; n >= 1: CP shared KV over n simulated ranks driven in lockstep."""
    device_pages: int = 12
    host_pages: int = 16
    alloc_policy: AllocPolicy = "fifo"
    draft_alloc_policy: AllocPolicy = "fifo"
    draft_host_pages: int = 0
    """Draft host pool size under CP (0: same as host_pages). Non-CP drafts reuse target slots,
    except an independent side pool (``pool_group="swa"``), whose host pool this sizes."""
    num_counters: int = 5
    settle_records: bool = False
    """Event records and satisfied waits complete on reaching their stream's head (GPU-like)."""
    hybrid: bool = False
    """The allocator's KV cache is a ``HybridLinearKVPool`` (full-attention layers interleaved
    with linear-attention ones) that the controller must unwrap to its ``full_kv_pool``."""
    forward_stream: bool = False
    """The forward runs on its own stream (overlap scheduling) while the tree calls the
    controller from the default stream; the harness sets the controller's ``write_fence_stream``
    and ``load_fence_stream`` to it (capability ``fence_streams``, F11's shape). Without CP:
    CP per-layer backups record their fences inside the forward's own layer hooks."""
    pool_group: PoolGroup = "none"
    """How the host pools reach the controller: ``none``, the pools themselves (every
    controller); as upstream 0.5.19+'s ``HostPoolGroup`` for its ``HybridCacheController``:
    ``anchor`` (the KV pool alone), ``packed`` (the draft pool packed as MTP draft layers of
    the KV host pool: ``layer_mapper``, ``is_draft``), ``sidecar`` (the draft pool as a side
    pool whose transfers ride on the KV indices: a ``PoolTransfer`` with
    ``indices_from_pool=KV``), ``swa`` (the draft pool as an independent SWA side pool: its own
    device rows from its own allocator, its own host slots from its own host pool, its layers
    interleaved with the KV layers in the transfer ids, so the anchor has no mapping for them;
    ``harness/world/side_pools.py``), ``mamba`` (the draft pool as an independent Mamba state
    pool: one state slot per node, not one row per token, from its own allocator and its own
    host pool, whose pages are single slots; ``side_pools.make_state_pool``). Capability
    ``pool_group`` (``:packed``, ``:sidecar``, ``:swa``, ``:mamba``); no CP."""
    side_device_pages: int = 0
    """Device pages of an independent side pool's own allocator (``pool_group="swa"``: pages of
    ``page_size`` rows; ``"mamba"``: state slots, a page being one slot); its host pages are
    ``draft_host_pages`` (of the same size)."""
    state_cow: bool = False
    """In a Mamba world (``pool_group="mamba"``): every load also copies the node's state into
    a request's own state slot, which the tree allocates from the state pool first (upstream's
    per-request copy-on-write ``LOAD_BACK`` transfer: ``prepare_load_back`` allocates it, the
    second ``MAMBA`` transfer names it with ``device_indices``); its bytes are checked when the
    load is drained, and the slot is freed then (the request done with it)."""
    copy_path: CopyPath = "gather"
    """How the host pools execute a copy: ``gather`` (index_select, the CPU path), ``runs``
    (the run-merged slice copies, ``plan_runs``), ``batch`` (the copy engine's pointer arrays,
    executed by ``memmove`` on the simulator; not with ``page_head``) or ``triton`` (the
    zero-copy kernel, under Triton's interpreter here), so each is fuzzed on any machine."""
    storage_ranks: int = 0
    """0: no L3 storage tier; n in 1..4: a storage world of n TP ranks (rank 0 is the tree's
    controller, the others storage peers), all stepped in lockstep (``harness/world/storage_world.py``).
    With a draft pool (``storage_sidecar``) every rank's draft pages go to L3 beside its KV."""
    storage_backend: StorageBackendName = "memory"
    """The shared L3: one ``MemoryStore``, one directory of ``FileStorage`` files, or upstream's
    own ``HiCacheFile`` (0.5.23, read from the wheel tree) over one directory."""
    storage_faults: bool = False
    """Seeded background faults on every rank's backend (misses, holes, short reads, failed,
    partial and dropped writes, exceptions); ``inject_fault`` steps add one-shot faults either way."""
    storage_batch_pages: int = 2
    """Pages per storage batch (upstream's ``STORAGE_BATCH_SIZE``, small so batches repeat)."""
    storage_policy: StoragePolicy = "best_effort"
    """The tree's prefetch stop policy (``check_prefetch_progress``)."""
    storage_points: bool = False
    """Schedule points: every storage thread runs on a real thread and parks at each backend
    call, collective and control-queue put as well as at its wait for work; the machine grants
    one thread at a time and draws each backend call's outcome (``harness/schedule/``,
    ``schedule_point`` steps). Off: a storage step is one whole loop body."""
    storage_page_points: bool = False
    """With ``storage_points``: the IO thread also parks before each host page it writes from
    a storage read (``page_write``), so a count or an ack that runs ahead of a page's bytes is
    seen by the tree before the bytes land. A field of its own so traces recorded before it
    replay with the same grants."""
    storage_lock_points: bool = False
    """With ``storage_points``: this project's tier also parks its threads before each acquire
    of an operation's lock (``lock``: the hit query's and the IO's looks at termination), so a
    termination by the tree lands right before a thread looks. Upstream's threads park at their
    operation locks in every world with points (their traces always had these grants); a field
    of its own so the reference's older traces replay with the same grants."""
    storage_host_pressure: bool = False
    """The tree half serves a hit that does not fit the free host pages with a shorter bounce
    buffer (the free whole pages every rank has, at least the prefetch threshold) and cuts the
    hit to it, as 0.5.16 - 0.5.21's radix caches do when ``evict_host`` made no room (0.5.23:
    the hybrid controller's ``allocate_storage_hit(allow_partial=True)``, called where the
    controller has it). Off: such a hit is revoked. Drawn last, so older traces replay alike."""
    storage_pp: bool = False
    """The storage ranks are 2 pipeline-parallel ranks (TP 1 each) of 0.5.21+'s hybrid controller
    in ``buffer_only`` host memory: PP rank 0 submits prefetch tickets, its PP command thread
    broadcasts them over the PP command group, and every rank queries and allocates in ticket
    order (``harness/driver/pp_tree.py``; capability ``storage:pp``; INV-38). Its pool group is
    KV alone (``anchor``), with the draft pool riding on the KV's slots (``sidecar``), or with
    the draft pool as an independent SWA side pool of its own slots (``swa``, with
    ``storage_swa_window``: each rank allocates a ticket's window itself; INV-38, INV-39), or as a
    Mamba state pool (``mamba``, ``storage_swa_window=1``: every ticket names the one state page,
    which each rank allocates as one slot of its own; INV-38, INV-39)."""
    storage_swa_window: int = 0
    """In a storage world with an independent side pool (``pool_group="swa"``, capability
    ``storage:swa``): the SWA window in pages (1 .. 3, a chain's most). A backup stores the
    side pool's page of every page of the chain beside its KV page; a prefetch names the trailing
    window (``PoolHitPolicy.TRAILING_PAGES``), as upstream's hybrid radix cache does
    (``harness/driver/storage_side.py``). 0 elsewhere. Drawn last, so older traces replay alike;
    the machine draws such a world under host pressure, where other requests hold all but one
    or two of every rank's free host pages while a prefetch's query runs
    (``storage_side_book.SideBook.crowd``), so hits are often served cut below the window.
    With a Mamba state pool (``pool_group="mamba"``, capability ``storage:mamba``) it is 1: a
    backup stores the node's one state slot under its last page key, a prefetch names one
    placeholder key, and the tree stages one state slot at the hit (upstream's Mamba component:
    one ``TRAILING_PAGES`` page per node)."""
    storage_buffer_only: bool = False
    """The storage ranks' host memory is a staging buffer, not a cache tier (upstream's
    ``--hicache-host-memory-mode buffer_only``, capability ``storage:buffer_only``): the
    controller is built in ``buffer_only`` mode (its prefetch capacity and rate limit charge
    loads only, not write staging) and the tree half is upstream's ``BufferModePipeline``'s, as
    the harness models it (``harness/driver/storage_buffer.py``): a backup's host pages are
    staging freed at its storage ack, a write whose pages are believed stored (or in flight) is
    skipped, and each rank's storage existence beliefs (upstream's own
    ``StorageExistenceCache``, or the reference's) are taught at the storage ack and by a
    rank-agreed hit, and healed by a drained hit query (INV-41). A storage world over the KV pool alone: upstream's
    hybrid controller's (``pool_group="anchor"``), or the reference's (``pool_group="none"``, no
    draft or side pool; its controller holds the beliefs for the tree,
    ``controller/storage/existence_beliefs.py``), never a PP one (the PP gate's worlds are
    buffer_only already). Drawn last, so older traces replay alike."""
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> HarnessConfig:
        if self.page_size < 1 or self.layer_num < 1 or self.draft_layer_num < 0:
            raise ValueError("page_size and layer_num must be >= 1, draft_layer_num >= 0")
        if self.layout not in LEGAL_LAYOUTS[self.io_backend]:
            raise ValueError(
                f"layout {self.layout!r} cannot be used with io_backend {self.io_backend!r}; "
                f"legal: {LEGAL_LAYOUTS[self.io_backend]}"
            )
        if self.layout in MHA_ONLY_LAYOUTS and self.pool_kind != "mha":
            raise ValueError(f"layout {self.layout!r} holds MHA pools only (upstream: page_head)")
        if not 0 <= self.cp_size <= 8:
            raise ValueError(f"cp_size={self.cp_size} must be in [0, 8] (0 = no CP)")
        if self.cp_size >= 1 and self.pool_kind != "nsa":
            raise ValueError("CP shared KV needs pool_kind='nsa' (the controller requires NSA)")
        if self.pool_group != "none" and self.cp_size >= 1:
            raise ValueError(f"pool_group={self.pool_group!r} is drawn without CP (cp_size=0)")
        if self.pool_group in ("packed", "sidecar", *SIDE_POOL_GROUPS) and not self.has_draft:
            raise ValueError(
                f"pool_group={self.pool_group!r} carries a draft pool: draft_layer_num >= 1"
            )
        if self.has_side_pools and (self.side_device_pages < 1 or self.draft_host_pages < 1):
            raise ValueError(
                f"pool_group={self.pool_group!r} is an independent side pool: it needs "
                "side_device_pages >= 1 and draft_host_pages >= 1 (its own rows and slots)"
            )
        if self.side_device_pages and not self.has_side_pools:
            raise ValueError(
                "side_device_pages is the device size of an independent side pool only "
                f"(pool_group in {SIDE_POOL_GROUPS})"
            )
        if self.state_cow and not self.has_state_pool:
            raise ValueError("state_cow is a Mamba world's (pool_group='mamba')")
        if self.pool_group == "anchor" and self.has_draft:
            raise ValueError("pool_group='anchor' has no draft pool; use 'packed' or 'sidecar'")
        if self.forward_stream and self.cp_size >= 1:
            raise ValueError("forward_stream is drawn without CP (cp_size=0)")
        if self.device_pages < 2 * self.num_ranks or self.host_pages < 1:
            raise ValueError("device_pages must be >= 2*cp_size and host_pages >= 1")
        if not 0 <= self.storage_ranks <= STORAGE_RANKS_MAX or self.storage_batch_pages < 1:
            raise ValueError(
                f"storage_ranks={self.storage_ranks} must be in [0, {STORAGE_RANKS_MAX}] and "
                f"storage_batch_pages >= 1"
            )
        if self.storage_page_points and not self.storage_points:
            raise ValueError("storage_page_points needs storage_points (a page point is one)")
        if self.storage_host_pressure and not self.storage_ranks:
            raise ValueError("storage_host_pressure is a storage world's (storage_ranks >= 1)")
        if self.storage_lock_points and not self.storage_points:
            raise ValueError("storage_lock_points needs storage_points (a lock point is one)")
        if self.storage_pp and (self.storage_ranks != 2 or self.pool_group not in PP_GROUPS):
            raise ValueError(
                "storage_pp is a world of 2 PP storage ranks over a KV-only pool group, one "
                "with the draft pool as its KV-derived sidecar, or one with an independent SWA "
                "side pool or Mamba state pool (storage_ranks=2, pool_group 'anchor', "
                "'sidecar', 'swa' or 'mamba')"
            )
        if self.storage_ranks and (
            self.uses_cp
            or (
                self.has_draft
                and self.pool_group not in STORAGE_DRAFT_GROUPS
                and not self.has_side_pools
            )
        ):
            raise ValueError(
                "a storage world has no CP (CP HiCache refuses a storage attach), and a draft "
                "pool only as a KV-derived sidecar (pool_group 'none' for a draft pair, or "
                "'sidecar'), whose pages ride into L3 with the KV's, or as an independent SWA "
                "side pool or Mamba state pool (pool_group 'swa' or 'mamba' with "
                "storage_swa_window)"
            )
        swa_storage = self.storage_ranks >= 1 and self.has_side_pools
        if swa_storage != (self.storage_swa_window > 0) or self.storage_swa_window > 3:
            raise ValueError(
                f"storage_swa_window={self.storage_swa_window} is the SWA window (1 .. 3 pages) "
                "of a storage world with an independent side pool (pool_group='swa' or "
                "'mamba', storage_ranks >= 1), and 0 in every other world"
            )
        if swa_storage and self.has_state_pool and self.storage_swa_window != 1:
            raise ValueError(
                f"storage_swa_window={self.storage_swa_window} in a Mamba storage world: a state "
                "pool's trailing window is one page (one state per node, stored under the "
                "node's last page key); set storage_swa_window=1"
            )
        if self.storage_buffer_only and not self.may_run_buffer_only:
            raise ValueError(
                "storage_buffer_only is a storage world over the KV pool alone (storage_ranks "
                ">= 1; pool_group='anchor' for upstream's hybrid controller, or 'none' with no "
                "draft or side pool for the reference), not a PP one (the PP gate's worlds are "
                "buffer_only already)"
            )
        return self

    @property
    def may_run_buffer_only(self) -> bool:
        """A storage world over the KV pool alone, not PP: upstream's group's KV pool
        (``pool_group="anchor"``) or the reference's (``"none"``, no draft or side pool)."""
        kv_alone = self.pool_group == "anchor" or (
            self.pool_group == "none" and not self.has_draft and not self.has_side_pools
        )
        return bool(self.storage_ranks) and kv_alone and not self.storage_pp

    @property
    def uses_cp(self) -> bool:
        return self.cp_size >= 1

    @property
    def num_ranks(self) -> int:
        return max(1, self.cp_size)

    @property
    def has_draft(self) -> bool:
        return self.draft_layer_num > 0

    @property
    def has_side_pools(self) -> bool:
        """The draft pool is an independent side pool (its own rows, slots and allocators)."""
        return self.pool_group in SIDE_POOL_GROUPS

    @property
    def has_state_pool(self) -> bool:
        """The side pool holds one state slot per node (Mamba), not rows per token."""
        return self.pool_group in STATE_POOL_GROUPS

    @property
    def side_page_size(self) -> int:
        """Slots per page of the side pool's allocator and host pool: a state pool's page is
        one slot; an SWA pool's is the anchor's page."""
        return 1 if self.has_state_pool else self.page_size

    def side_rows(self, tokens: int) -> int:
        """Rows (slots) a node of ``tokens`` tokens holds in the side pool: one state slot in a
        state pool, one row per token otherwise."""
        return 1 if self.has_state_pool else tokens

    @property
    def uses_storage(self) -> bool:
        return self.storage_ranks >= 1

    def describe(self) -> str:
        draft = f" draft={self.draft_layer_num}L" if self.has_draft else ""
        cp = f" cp={self.cp_size}" if self.uses_cp else ""
        runs = f" copy={self.copy_path}" if self.copy_path != "gather" else ""
        runs += " hybrid" if self.hybrid else ""
        if self.uses_storage:
            faults = "+faults" if self.storage_faults else ""
            faults += "+points" if self.storage_points else ""
            faults += "+pages" if self.storage_page_points else ""
            faults += "+locks" if self.storage_lock_points else ""
            faults += "+pressure" if self.storage_host_pressure else ""
            faults += "+pp" if self.storage_pp else ""
            faults += "+buffer" if self.storage_buffer_only else ""
            window = f"+swa{self.storage_swa_window}" if self.storage_swa_window else ""
            faults += "+state" if window and self.has_state_pool else window
            runs += f" storage={self.storage_ranks}r/{self.storage_backend}{faults}"
        runs += " fwd-stream" if self.forward_stream else ""
        runs += f" group={self.pool_group}" if self.pool_group != "none" else ""
        if self.has_side_pools:
            unit = "slot" if self.has_state_pool else "p"
            runs += f" side={self.side_device_pages}{unit}/{self.draft_host_pages}h{unit}"
            runs += "+cow" if self.state_cow else ""
        return (
            f"{self.pool_kind} {self.layer_num}L page={self.page_size} {self.layout}/"
            f"{self.io_backend} alloc={self.alloc_policy}{cp}{draft}{runs}"
        )
