"""Pure arithmetic of the oracle: channels, content tags, owned positions, allocators, holders.

Every function here takes and returns plain ints and tuples, so CrossHair can check the
``pre:``/``post:`` contracts in the docstrings (``.ci/crosshair.sh``).

A *holder* is one int per page: ``FREE`` (-1), a node id ``n >= 0`` (the node owns the page), or
``-2 - n`` (the page is reserved for node ``n``'s in-flight backup and becomes owned when the
write ack drains).
"""

from __future__ import annotations

FREE = -1
"""Holder value of a free page."""
GARBAGE = 0
"""Content tag of a slot that holds no node's KV (never written, or freed)."""


def compute_channel(layer_num: int, is_draft: bool, layer: int) -> int:
    """The channel of (pool, layer): target layers first, then draft layers.

    pre: layer_num >= 1 and layer >= 0
    pre: is_draft or layer < layer_num
    post: __return__ >= 0
    post: (__return__ >= layer_num) == is_draft
    post: compute_channel_layer(layer_num, __return__) == layer
    """
    return layer_num + layer if is_draft else layer


def compute_channel_layer(layer_num: int, channel: int) -> int:
    """The pool-local layer of ``channel``.

    pre: layer_num >= 1 and channel >= 0
    post: 0 <= __return__ <= channel
    """
    return channel - layer_num if channel >= layer_num else channel


def compute_pool_index(layer_num: int, channel: int) -> int:
    """0 for a target channel, 1 for a draft channel.

    pre: layer_num >= 1 and channel >= 0
    post: __return__ in (0, 1)
    post: (__return__ == 1) == (channel >= layer_num)
    """
    return 1 if channel >= layer_num else 0


def compute_token_tag(node: int, token: int, stride: int) -> int:
    """The content tag of token ``token`` of node ``node``: what its KV slots must hold.

    pre: node >= 0 and stride >= 1 and 0 <= token < stride
    post: __return__ > GARBAGE
    post: decode_token_tag(__return__, stride) == (node, token)
    """
    return 1 + node * stride + token


def decode_token_tag(tag: int, stride: int) -> tuple[int, int] | None:
    """``(node, token)`` of a content tag, or None for ``GARBAGE``.

    pre: tag >= 0 and stride >= 1
    post: (__return__ is None) == (tag == GARBAGE)
    """
    if tag == GARBAGE:
        return None
    return divmod(tag - 1, stride)


def compute_page_count(tokens: int, page_size: int) -> int:
    """Whole pages needed for ``tokens`` tokens (the padded length over ``page_size``).

    pre: tokens >= 0 and page_size >= 1
    post: __return__ * page_size >= tokens
    post: (__return__ - 1) * page_size < tokens or __return__ == 0
    """
    return -(-tokens // page_size)


def compute_owned_positions(owners: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """Positions of the pages that ``rank`` owns, in page order (the CP ``owned_positions``).

    pre: rank >= 0
    post: all(owners[i] == rank for i in __return__)
    post: len(__return__) == owners.count(rank)
    post: list(__return__) == sorted(set(__return__))
    """
    return tuple(i for i, owner in enumerate(owners) if owner == rank)


def is_owned_holder(holder: int, node: int) -> bool:
    """Whether ``holder`` says the page belongs to ``node`` (owned or reserved).

    pre: node >= 0
    post: __return__ == (holder_node(holder) == node)
    """
    return holder == node or holder == -2 - node


def holder_node(holder: int) -> int:
    """The node a holder names, or -1 for a free page.

    post: __return__ >= -1
    post: (__return__ == -1) == (holder == FREE)
    """
    if holder >= 0:
        return holder
    if holder == FREE:
        return FREE
    return -2 - holder


def reserved_holder(node: int) -> int:
    """The holder value of a page reserved for ``node``'s in-flight backup.

    pre: node >= 0
    post: __return__ < FREE
    post: holder_node(__return__) == node
    """
    return -2 - node


def set_holders(holders: tuple[int, ...], pages: tuple[int, ...], value: int) -> tuple[int, ...]:
    """``holders`` with every page in ``pages`` set to ``value``.

    pre: all(0 <= p < len(holders) for p in pages)
    post: len(__return__) == len(holders)
    post: all(__return__[p] == value for p in pages)
    post: all(__return__[i] == holders[i] for i in range(len(holders)) if i not in pages)
    """
    if not pages:
        return holders
    updated = list(holders)
    for page in pages:
        updated[page] = value
    return tuple(updated)


def alloc_lowest_free(holders: tuple[int, ...], count: int) -> tuple[int, ...] | None:
    """The ``count`` lowest free pages, or None when fewer are free (a capacity shortfall).

    pre: count >= 0
    post: __return__ is None or len(__return__) == count
    post: __return__ is None or all(holders[p] == FREE for p in __return__)
    post: __return__ is None or len(set(__return__)) == len(__return__)
    post: (__return__ is None) == (holders.count(FREE) < count)
    """
    free = [i for i, holder in enumerate(holders) if holder == FREE]
    if len(free) < count:
        return None
    return tuple(free[:count])


def alloc_balanced(
    holders: tuple[int, ...], page_classes: tuple[int, ...], count: int
) -> tuple[int, ...] | None:
    """``count`` free pages, each from the class with the most free pages (ties: lowest class).

    The choice depends only on how many pages of each class are free, never on page ids, so
    two states that differ by a renaming of free pages inside a class allocate alike (the
    bounded checker's symmetry reduction relies on it).

    pre: len(page_classes) == len(holders)
    pre: all(c >= 0 for c in page_classes)
    pre: count >= 0
    post: __return__ is None or len(__return__) == count
    post: __return__ is None or all(holders[p] == FREE for p in __return__)
    post: __return__ is None or len(set(__return__)) == count
    post: (__return__ is None) == (holders.count(FREE) < count)
    """
    free_by_class: dict[int, list[int]] = {}
    for page, holder in enumerate(holders):
        if holder == FREE:
            free_by_class.setdefault(page_classes[page], []).append(page)
    if sum(len(pages) for pages in free_by_class.values()) < count:
        return None
    chosen: list[int] = []
    for _ in range(count):
        best = min(
            (c for c in free_by_class if free_by_class[c]),
            key=lambda c: (-len(free_by_class[c]), c),
        )
        chosen.append(free_by_class[best].pop(0))
    return tuple(chosen)


def alloc_with_owners(
    holders: tuple[int, ...], page_classes: tuple[int, ...], owners: tuple[int, ...]
) -> tuple[int, ...] | None:
    """Free pages whose classes repeat ``owners`` page by page (``alloc_pages_with_owners``).

    pre: len(page_classes) == len(holders)
    post: __return__ is None or len(__return__) == len(owners)
    post: __return__ is None or all(page_classes[p] == o for p, o in zip(__return__, owners))
    post: __return__ is None or all(holders[p] == FREE for p in __return__)
    post: __return__ is None or len(set(__return__)) == len(__return__)
    """
    chosen: list[int] = []
    for owner in owners:
        page = next(
            (
                p
                for p, holder in enumerate(holders)
                if holder == FREE and page_classes[p] == owner and p not in chosen
            ),
            None,
        )
        if page is None:
            return None
        chosen.append(page)
    return tuple(chosen)


def compute_drainable_prefix(complete: tuple[bool, ...]) -> int:
    """Length of the leading run of completed acks (``writing_check``/``loading_check``).

    post: 0 <= __return__ <= len(complete)
    post: all(complete[:__return__])
    post: __return__ == len(complete) or not complete[__return__]
    """
    count = 0
    for done in complete:
        if not done:
            break
        count += 1
    return count


def compute_next_producer(producer_index: int, num_counters: int) -> int:
    """The producer slot ``LayerDoneCounter.update_producer`` hands out next.

    pre: num_counters >= 1 and -1 <= producer_index < num_counters
    post: 0 <= __return__ < num_counters
    post: __return__ == (producer_index + 1) % num_counters
    """
    return (producer_index + 1) % num_counters


def compute_page_slots(page: int, page_size: int) -> tuple[int, ...]:
    """The token slots of ``page``: ``page * page_size + arange(page_size)`` (INV-01).

    pre: page >= 0 and page_size >= 1
    post: len(__return__) == page_size
    post: __return__[0] == page * page_size
    post: all(b == a + 1 for a, b in zip(__return__, __return__[1:]))
    """
    start = page * page_size
    return tuple(range(start, start + page_size))


def compute_pages_of_slots(slots: tuple[int, ...], page_size: int) -> tuple[int, ...] | None:
    """The pages that ``slots`` cover as whole aligned pages, or None if they do not (INV-01).

    pre: page_size >= 1
    pre: all(s >= 0 for s in slots)
    post: __return__ is None or len(__return__) * page_size == len(slots)
    post: __return__ is None or all(compute_page_slots(p, page_size) == slots[i * page_size:(i + 1) * page_size] for i, p in enumerate(__return__))
    """
    if len(slots) % page_size:
        return None
    pages: list[int] = []
    for start in range(0, len(slots), page_size):
        page = slots[start] // page_size
        if slots[start : start + page_size] != compute_page_slots(page, page_size):
            return None
        pages.append(page)
    return tuple(pages)
