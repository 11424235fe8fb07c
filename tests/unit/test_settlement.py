"""Parent settlement: complete only if every child completed; otherwise partial with a count."""

from __future__ import annotations

import pytest

from umbra.domain.settlement import Settlement, settle


@pytest.mark.parametrize(
    ("children", "expected"),
    [
        (["complete"], Settlement("complete", "all 1 children complete", 1, 0)),
        (["complete"] * 3, Settlement("complete", "all 3 children complete", 3, 0)),
        (["complete", "failed", "complete"], Settlement("partial", "1 of 3 children failed", 3, 1)),
        (["cancelled", "complete"], Settlement("partial", "1 of 2 children failed", 2, 1)),
        (["partial", "complete"], Settlement("partial", "1 of 2 children failed", 2, 1)),
        (["failed"] * 3 + ["complete"] * 46, Settlement("partial", "3 of 49 children failed", 49, 3)),
        (["failed", "cancelled"], Settlement("partial", "2 of 2 children failed", 2, 2)),
        (["complete", "running"], None),
        (["complete", "queued"], None),
        (["complete", "blocked"], None),  # a blocked child is open until it fails on its timeout
        ([], None),
    ],
)
def test_the_settlement_table(children, expected):
    assert settle(children) == expected


def test_a_child_missing_from_the_view_keeps_the_parent_open():
    assert settle(["complete", "complete"], expected_children=3) is None
    assert settle(["complete", "complete", "complete"], expected_children=3).outcome == "complete"
