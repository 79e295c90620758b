"""The content oracle's rows: every element is the scalar of its (node, layer, component,
position) plus ``k/1024``, for target and draft rows, whatever position tensor is handed in."""

from __future__ import annotations

import torch

from hicache_ref.harness.world.content import (
    compute_row_value,
    describe_row,
    expected_rows,
    expected_rows_of_layers,
)


def test_rows_hold_the_scalar_of_each_position_plus_the_element_ramp() -> None:
    positions = torch.tensor([0, 3, 5, 65535])
    for draft in (False, True):
        rows = expected_rows(7, draft, 2, 1, positions, (2, 2))
        assert rows.shape == (4, 2, 2)
        for i, position in enumerate(positions.tolist()):
            base = compute_row_value(7, draft, 2, 1, position)
            assert rows[i].reshape(-1).tolist() == [base + k / 1024 for k in range(4)]
        assert describe_row(float(rows[1, 0, 0])) == (
            f"node-content 7 {'draft' if draft else 'target'} layer 2 component 1 position 3"
        )


def test_the_same_positions_give_the_same_rows_on_every_call() -> None:
    # the float form of a position tensor is cached: a second tensor with other values must
    # not be answered from the first one's entry
    first, second = torch.tensor([1, 2]), torch.tensor([8, 9])
    assert torch.equal(
        expected_rows(3, False, 0, 0, first, (1,)), expected_rows(3, False, 0, 0, first, (1,))
    )
    assert expected_rows(3, False, 0, 0, second, (1,)).reshape(-1).tolist() == [
        compute_row_value(3, False, 0, 0, 8),
        compute_row_value(3, False, 0, 0, 9),
    ]


def test_all_layers_at_once_are_the_rows_of_each_layer() -> None:
    positions = torch.tensor([0, 3, 7, 100, 65535])
    for draft in (False, True):
        for row_shape in [(1, 4), (2, 2), (1,), (2, 3)]:
            block = expected_rows_of_layers(123, draft, 4, 3, positions, row_shape)
            assert block.shape == (4, 5, *row_shape)
            for layer in range(4):
                assert torch.equal(
                    block[layer], expected_rows(123, draft, layer, 3, positions, row_shape)
                )
