"""The event log over HTTP: paged, per job, and as a resumable SSE stream.

All three read the caller's organization only, in position order, which the
store's append lock makes commit order: ``position > P`` is a gap-free cursor,
so a page's ``next`` and an SSE message's ``id`` are all a reader needs to
resume without a gap or a duplicate.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import msgspec
from starlette.requests import Request

from umbra.errors import NotFound
from umbra.events import store
from umbra.events.types import Timestamp

from .http import authenticated, json_response, path_uuid
from .params import bounded_int, query_int
from .routing import endpoint
from .sse import TOO_MANY_STREAMS, LogWatch, StreamRead, message, sse_stream, stream_principal, watched_reads

#: Largest page a client may ask for; the stream reads in batches of this size.
MAX_PAGE = 1000
MAX_POSITION = 2**63 - 1


class EventOut(msgspec.Struct, kw_only=True):
    """An event as the API shows it (``store.StoredEvent``: ``data`` and ``metadata`` as stored)."""

    position: int
    stream: str
    version: int
    type: str
    organization_id: UUID
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: Timestamp


class EventPage(msgspec.Struct, kw_only=True):
    events: list[EventOut]
    #: Pass as ``after`` to get the following page; equals ``after`` when nothing is new.
    next: int


class StreamHistory(msgspec.Struct, kw_only=True):
    """One stream's whole history (a job's or a node's), in stream order."""

    events: list[EventOut]


async def list_events(request: Request):
    async with authenticated(request, "events:read") as (who, conn):
        after = query_int(request, "after", default=0, minimum=0, maximum=MAX_POSITION)
        limit = query_int(request, "limit", default=100, minimum=1, maximum=MAX_PAGE)
        batch, _ = await store.read_log_as_stored(conn, after=after, limit=limit, organization_id=who.organization_id)
    return json_response({"events": batch, "next": batch[-1].position if batch else after})


def _history(stream_of, code: str, noun: str):
    """A stream's whole history in stream order, for one object of the caller's organization."""

    async def history(request: Request):
        async with authenticated(request, "events:read") as (who, conn):
            object_id = path_uuid(request, "id", code=code)
            recorded = await store.read_stream_as_stored(conn, stream_of(object_id))
        if not recorded or recorded[0].organization_id != who.organization_id:
            raise NotFound(code, f"No {noun} {object_id} in this organization.")
        return json_response({"events": recorded})

    return history


job_events = _history(store.job_stream, "job_not_found", "job")
node_events = _history(store.node_stream, "node_not_found", "node")


def resume_position(request: Request) -> int:
    """``Last-Event-ID`` (an EventSource reconnecting) wins over ``after``; a malformed ``after`` is refused either way."""
    after = query_int(request, "after", default=0, minimum=0, maximum=MAX_POSITION)
    last_id = request.headers.get("last-event-id")
    if last_id is not None and last_id.strip():
        return bounded_int(last_id, "Last-Event-ID", minimum=0, maximum=MAX_POSITION)
    return after


async def stream_events(request: Request):
    services = request.app.state.services
    who = await stream_principal(request, "events:read")
    after = resume_position(request)
    watch: LogWatch = request.app.state.log_watch
    return sse_stream(watched_reads(services, watch, who, _log_reader(who.organization_id, after)), name="events", watch=watch,
                      who=who, most=services.settings.max_streams_per_organization)  # fmt: skip


def _log_reader(organization_id: UUID, after: int) -> StreamRead:
    """Reads of the organization's events after ``after``, a page each, each read going on from the last."""
    last = after

    async def read(conn) -> tuple[list[bytes], bool]:
        nonlocal last
        batch, more = await store.read_log_as_stored(conn, after=last, limit=MAX_PAGE, organization_id=organization_id)
        if batch:
            last = batch[-1].position
        return [message(r, event=r.type, id=r.position) for r in batch], more

    return read


_AFTER = (int, False, "Return events with a position greater than this (default 0).")

routes = [
    endpoint(
        "GET",
        "/v1/events",
        list_events,
        summary="A page of the organization's events in commit order.",
        auth="api_key",
        scopes=("events:read",),
        query={"after": _AFTER, "limit": (int, False, f"Page size, 1..{MAX_PAGE} (default 100).")},
        response=EventPage,
    ),
    endpoint(
        "GET",
        "/v1/events/stream",
        stream_events,
        summary="The organization's events as a resumable Server-Sent-Events stream (id = position).",
        auth="api_key",
        scopes=("events:read",),
        query={
            "after": (int, False, "Start after this position; the Last-Event-ID header takes precedence."),
            "access_token": (str, False, "The API key, for EventSource clients that cannot send headers."),
        },
        produces="text/event-stream",
        response=EventOut,
        errors=TOO_MANY_STREAMS,
    ),
    endpoint(
        "GET",
        "/v1/jobs/{id}/events",
        job_events,
        summary="A job's whole history in stream order.",
        auth="api_key",
        scopes=("events:read",),
        response=StreamHistory,
    ),
    endpoint(
        "GET",
        "/v1/nodes/{id}/events",
        node_events,
        summary="A node's whole history in stream order: pairing, heartbeats that changed it, drain, retirement...",
        auth="api_key",
        scopes=("events:read",),
        response=StreamHistory,
    ),
]
