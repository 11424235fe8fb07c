"""The effective status of a node, computed on read.

A stored ``online`` is a claim the node made the last time it spoke. Only that
status is derived away: silent for longer than the stale threshold (three missed
10 s heartbeats by default), or never heard from, it reads as ``offline``.
``provisioning``, ``draining`` and ``retired`` are an administrator's or the
pairing flow's intent and never expire. Callers pass the database clock.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Collection

DEFAULT_STALE_SECONDS = 45


def effective_status(
    stored: str, last_seen_at: datetime | None, now: datetime, *, stale_seconds: int = DEFAULT_STALE_SECONDS
) -> str:
    if stored != "online":
        return stored
    if last_seen_at is None or now - last_seen_at > timedelta(seconds=stale_seconds):
        return "offline"
    return "online"


def stored_statuses_for(effective: Collection[str]) -> set[str]:
    """The stored statuses that can read as one of ``effective``: each itself, and a stored ``online`` for
    ``offline`` too (a node gone silent reads offline before the sweeper records it)."""
    return set(effective) | ({"online"} if "offline" in effective else set())
