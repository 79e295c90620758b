"""What a harness asks the oracle: owners, predicted and expected tags, ack rows, lifecycles."""

from __future__ import annotations

from hicache_ref.oracle import (
    EvictDevice,
    InFlightUse,
    Insert,
    Store,
    Write,
    decode_tag,
    get_device_page_owner,
    get_device_page_users,
    get_device_pages,
    get_device_tag,
    get_expected_resident_tags,
    get_host_page_owner,
    get_host_page_users,
    get_host_pages,
    get_lifecycle,
    run_ops,
)

from .worlds import backed_up, play, world


def test_owners_follow_the_write_lifecycle() -> None:
    config = world(layers=1, tokens=(3,), device_pages=2, host_pages=2)
    state, _ = play(config, [Insert(0), Store(0, 0), Write(0)])
    assert get_device_page_owner(state, 0).kind == "owned"
    assert get_host_page_owner(state, 1).kind == "reserved"
    assert get_host_page_owner(state, 0).node == 0
    state = backed_up(config, 0)
    assert get_host_page_owner(state, 1).kind == "owned"
    assert get_host_pages(state, 0) == ((0, 1),)


def test_expected_tags_cover_only_settled_copies_and_skip_padding() -> None:
    # 3 tokens on 2 pages of 2: the fourth slot is padding and has no expectation
    config = world(layers=1, tokens=(3,), device_pages=2, host_pages=2)
    state, _ = play(config, [Insert(0), Store(0, 0)])
    assert get_expected_resident_tags(state) == ()  # the store is still queued
    state = backed_up(config, 0)
    expected = get_expected_resident_tags(state)
    assert {(e.rank, e.slot) for e in expected} == {
        (-1, 0),
        (-1, 1),
        (-1, 2),
        (0, 0),
        (0, 1),
        (0, 2),
    }
    assert all(decode_tag(config, e.tag) == (0, e.token) for e in expected)
    state, _ = run_ops(state, [EvictDevice(0)])
    assert get_lifecycle(state, 0) == "host_only" and get_device_pages(state, 0) == ()
    assert {e.rank for e in get_expected_resident_tags(state)} == {0}
    assert decode_tag(config, get_device_tag(state, 0, 0)) is None  # freed and wiped


def test_in_flight_users_name_the_queued_copy() -> None:
    config = world(layers=1, tokens=(2,), device_pages=2, host_pages=2)
    state, _ = play(config, [Insert(0), Store(0, 0), Write(0)])
    assert [u.kind for u in get_device_page_users(state, 0)] == ["StoreKv", "copy_d2h"]
    assert get_host_page_users(state, 0) == (InFlightUse("write", "copy_d2h", (0,)),)
    assert get_host_page_users(backed_up(config, 0), 0) == ()
