"""What a handler says of its progress, as the agent keeps it for the next renewal: checked when said, made
storable, and carried once."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from umbra.agent.client import PROGRESS_MESSAGE_MAX, Claim


def claim() -> Claim:
    return Claim(job={"id": "j", "kind": "train", "attempt": 1}, placement={}, lease_expires_at=datetime.now(timezone.utc),
                 lease_seconds=60.0)  # fmt: skip


def test_what_was_said_is_carried_by_the_next_renewal_only_until_it_arrives():
    c = claim()
    assert c.progress_note.unsent() is None
    c.report_progress(0.25, "epoch 1 of 4")
    assert c.progress_note.unsent() == {"fraction": 0.25, "message": "epoch 1 of 4"}
    c.progress_note.sent = c.progress_note.unsent()
    assert c.progress_note.unsent() is None  # arrived: the next renewal carries nothing
    c.report_progress(message="loading")
    assert c.progress_note.unsent() == {"message": "loading"}


def test_a_message_is_made_storable_and_cut_to_what_the_server_takes():
    c = claim()
    c.report_progress(1, "a\x00b \udcff" + "x" * 1000)
    said = c.progress_note.unsent()
    assert said["fraction"] == 1.0 and said["message"].startswith("a\ufffdb \\udcff")
    assert len(said["message"]) == PROGRESS_MESSAGE_MAX and said["message"].endswith("…")


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), float("inf"), True, "half"])
def test_a_fraction_outside_zero_to_one_is_refused_where_it_is_said(fraction):
    with pytest.raises(ValueError):
        claim().report_progress(fraction)


def test_saying_nothing_is_refused():
    with pytest.raises(ValueError):
        claim().report_progress()
