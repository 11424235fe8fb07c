"""A server process remembers the claim requests agents gave up on for a while, and not for ever."""

from __future__ import annotations

from uuid import uuid4

from umbra.api import agent
from umbra.api.agent import ABANDONED_SECONDS, AbandonedClaims


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def monotonic(self) -> float:
        return self.now


def test_an_abandoned_request_is_remembered_for_its_node_only_and_for_a_while(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(agent, "time", clock)
    node, other = uuid4(), uuid4()
    abandoned = AbandonedClaims()
    abandoned.add(node, "r-1")
    assert (node, "r-1") in abandoned
    assert (other, "r-1") not in abandoned and (node, "r-2") not in abandoned
    clock.now += ABANDONED_SECONDS + 1
    assert (node, "r-1") not in abandoned
    abandoned.add(node, "r-3")  # a later one lets the expired go
    assert len(abandoned._at) == 1


def test_past_its_cap_the_oldest_are_forgotten(monkeypatch):
    monkeypatch.setattr(agent, "MAX_ABANDONED", 100)
    node = uuid4()
    abandoned = AbandonedClaims()
    for n in range(150):
        abandoned.add(node, f"r-{n}")
    assert len(abandoned._at) == 100
    assert (node, "r-0") not in abandoned and (node, "r-149") in abandoned
