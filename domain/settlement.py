"""Settling a container job from its children's outcomes.

A parent that was decomposed settles when every child is terminal, in the
same transaction as the child's terminal event (so no window exists where all
children are done and the parent still looks busy). "Some done" and "failed"
are different facts: any child that failed, was cancelled or itself ended
``partial`` makes the parent ``partial`` with a count, never ``complete`` and
never ``failed``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Literal

from umbra.events.types import TERMINAL_JOB_STATUSES

#: Child outcomes that count against the parent.
UNSUCCESSFUL = frozenset({"failed", "cancelled", "partial"})


@dataclass(frozen=True, slots=True)
class Settlement:
    outcome: Literal["complete", "partial"]
    detail: str
    children_total: int
    children_failed: int


def settle(child_statuses: Iterable[str], *, expected_children: int | None = None) -> Settlement | None:
    """The parent's outcome, or ``None`` while any child is still open.

    ``expected_children`` guards against settling on a partial view (fewer
    child rows than the decomposition created); with it, a missing child
    counts as open.
    """
    counts = Counter(child_statuses)
    total = sum(counts.values())
    if total == 0 or (expected_children is not None and total < expected_children):
        return None
    if any(status not in TERMINAL_JOB_STATUSES for status in counts):
        return None
    failed = sum(counts[status] for status in UNSUCCESSFUL)
    if failed:
        return Settlement("partial", f"{failed} of {total} children failed", total, failed)
    return Settlement("complete", f"all {total} children complete", total, 0)
