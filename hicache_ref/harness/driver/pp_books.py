"""What the harness itself saw of a PP world's tickets and host slots (``pp_tree.PpTree``'s books).

INV-38 judges a PP world from the harness's own records, never from the controller's states. Per
rank, in the order a ticket meets them:

- ``TicketLog``: one ticket as the rank's command thread took it off the command group's
  broadcast: the keys it queried, the hit it staged, whether its sync thread published it, and
  every page its IO thread wrote into a slot the ticket did not hold then;
- ``RankBook``: who holds each host slot of the rank (a ticket's request, ``write``), its
  tickets in take order, and what its scheduler received and finished; in a world with an
  independent side pool (an SWA window, a Mamba state), who holds each of the side pool's slots
  too (its own slots: a ticket's window), and the window slots each ticket's command thread
  allocated, in order;
- ``watch_host_pool``: the KV host pool's ``alloc`` / ``free`` / ``set_from_flat_data_page``
  wrapped, so the book learns each slot's holder as the slot changes hands, and each page the
  IO thread lands is judged against the holder of its slots at that moment (a draft sidecar's
  pages too: they ride on the KV's slots; a window's against the side pool's holders, a page
  of the side pool's own size: one slot for a Mamba state).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hicache_ref.controller.storage.records import StorageStepKind
from hicache_ref.harness.adapters.sglang_storage import PP_TICKET_FUNC, THREAD_FUNCS
from hicache_ref.storage.pool_transfers import WINDOW_POOLS

COMMAND = "pp_command"  # slots the command thread allocated before it took any ticket
WRITE = "write"  # slots any other thread allocated (a backup's staging)
FREE = "free"  # a host slot nobody holds
IO_FUNC = THREAD_FUNCS[StorageStepKind.IO]


@dataclass
class TicketLog:
    """The harness's record of one ticket on one rank (``PpTicketRecord`` when judged)."""

    request_id: str
    epoch: int
    keys: tuple[str, ...] = ()
    hit_tokens: int | None = None
    ready: bool = False
    ended: bool = False  # the rank's command thread finished its loop body for it
    shard_tokens: int | None = None  # a carried hit's: what this rank's shard held at the query
    stray_writes: tuple[tuple[int, str], ...] = ()  # (slot, its holder) of each page the rank's
    # IO wrote for the ticket into a slot the ticket did not hold at that moment (an SWA
    # window's page: its side pool's slot, the holder marked ``(swa)``)
    window_keys: int = 0  # the SWA window the ticket's spec names, in pages (0: none)


@dataclass
class RankBook:
    """What the harness saw of one rank's host slots and tickets."""

    owners: dict[int, str] = field(default_factory=dict)  # host slot -> ticket or WRITE
    tickets: list[TicketLog] = field(default_factory=list)
    seen: int = 0  # broadcasts of this rank already turned into tickets
    relayed: set[str] = field(default_factory=set)  # requests this rank's scheduler received
    released: set[tuple[int, str]] = field(default_factory=set)  # (epoch, request) it finished
    side_owners: dict[int, str] = field(default_factory=dict)  # side pool slot -> its holder
    side_staged: dict[tuple[int, str], list[int]] = field(default_factory=dict)  # (epoch,
    # request) -> the window slots its command thread allocated, in order
    side_given_back: dict[tuple[int, str], set[int]] = field(default_factory=dict)  # of those,
    # the ones the controller gave back on its SWA release queue (drained since)

    def ticket(self, rid: str, epoch: int) -> TicketLog | None:
        return next(
            (t for t in reversed(self.tickets) if t.request_id == rid and t.epoch == epoch), None
        )


class WorldClock(Protocol):
    """What the watch reads of the world as a page lands: its page size and current epoch."""

    page: int
    epoch: int


def watch_host_pool(
    book: RankBook, controller: Any, received: Sequence[Any], world: WorldClock
) -> None:
    """Wrap the rank's KV host pool so ``book`` follows its slots (the harness's own view):
    the command thread allocates for the last ticket it took off ``received`` (its broadcast
    log), anyone else for a write; a page the IO thread writes is judged against the holder of
    its slots as it lands (the harness's main thread waits while a granted thread runs, so no
    free races the look). An independent side pool (SWA, Mamba) is watched the same way, in its
    own slots (``book.side_owners``); a sidecar riding on the KV's slots, against the KV's."""
    lock = threading.Lock()

    def owner() -> str:
        if getattr(threading.current_thread(), "function", "") != PP_TICKET_FUNC:
            return WRITE
        tickets = [m.objects[0] for m in received if m.objects and m.objects[0] is not None]
        return str(tickets[-1].handle.rid) if tickets else COMMAND

    pool = controller.mem_pool_host.anchor_entry.host_pool
    _watch_pool(pool, book.owners, owner, lock, None)
    watched_slots = _slot_judge(book, book.owners, controller, world, lock, "")
    _watch_pages(pool, watched_slots)
    for entry in getattr(controller.mem_pool_host, "entries", ()):
        if entry.host_pool is pool:
            continue
        if name := _side_name(entry):  # an independent side pool (SWA, Mamba): its own slots
            staged = _staged_into(book, world)
            _watch_pool(entry.host_pool, book.side_owners, owner, lock, staged)
            mark, page = f" ({name})", int(entry.host_pool.page_size)
            side_judge = _slot_judge(book, book.side_owners, controller, world, lock, mark, page)
            _watch_pages(entry.host_pool, side_judge)
        else:  # a sidecar riding on the KV's slots: its pages judged as KV pages at the slot
            _watch_pages(entry.host_pool, watched_slots)


def _side_name(entry: Any) -> str:
    """The entry's pool name if it is an independent window pool (``swa``, ``mamba``), else ""."""
    name = getattr(entry, "name", None)
    value = str(getattr(name, "value", name))
    return value if value in WINDOW_POOLS else ""


def _staged_into(book: RankBook, world: WorldClock) -> Any:
    def staged(held_by: str, slots: list[int]) -> None:
        if held_by not in (WRITE, COMMAND):
            book.side_staged.setdefault((world.epoch, held_by), []).extend(slots)

    return staged


def _watch_pool(pool: Any, owners: dict[int, str], owner: Any, lock: Any, staged: Any) -> None:
    """``pool``'s ``alloc`` / ``free`` wrapped: ``owners`` follows each slot's holder."""
    alloc, free = pool.alloc, pool.free

    def watched_alloc(need_size: int, *args: Any, **kwargs: Any) -> Any:
        indices = alloc(need_size, *args, **kwargs)
        if indices is not None:
            held_by = owner()
            slots = [int(slot) for slot in indices.tolist()]
            with lock:
                for slot in slots:
                    owners[slot] = held_by
            if staged is not None:
                staged(held_by, slots)
        return indices

    def watched_free(indices: Any, *args: Any, **kwargs: Any) -> Any:
        freed = free(indices, *args, **kwargs)
        with lock:
            for slot in indices.tolist():
                owners.pop(int(slot), None)
        return freed

    pool.alloc, pool.free = watched_alloc, watched_free


def _slot_judge(
    book: RankBook,
    owners: dict[int, str],
    controller: Any,
    world: WorldClock,
    lock: Any,
    mark: str,
    page: int = 0,
) -> Any:
    def watched_slots(index: Any) -> None:
        """The IO thread landed a page of its ticket at slot ``index``: who held it."""
        if getattr(threading.current_thread(), "function", "") != IO_FUNC:
            return
        rid = controller.storage.current_request(StorageStepKind.IO)
        start = int(index)
        with lock:
            holders = [owners.get(s, FREE) for s in range(start, start + (page or world.page))]
        strays = tuple((start + i, f"{h}{mark}") for i, h in enumerate(holders) if h != rid)
        log = book.ticket(str(rid), world.epoch)
        if strays and log is not None:
            log.stray_writes += strays

    return watched_slots


def _watch_pages(pool: Any, watched_slots: Any) -> None:
    """Each page landed in ``pool`` is judged at its slot as it lands."""
    page_set = pool.set_from_flat_data_page

    def watched_page_set(index: Any, data_page: Any) -> None:
        page_set(index, data_page)
        watched_slots(index)

    pool.set_from_flat_data_page = watched_page_set
