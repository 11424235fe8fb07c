"""Projection snapshots, their live SSE stream, and verification.

A snapshot is read in one ``REPEATABLE READ`` transaction together with the
organization's head position, so ``position`` is exactly the log position the
rows reflect. The stream sends a full ``queue`` and ``nodes`` view on open and
then, whenever the log moves (a hint) or time passes (the safety poll), a fresh
view of each one that changed (and only those): a job or node row folded a newer event, or a
node's *effective* status flipped with no event at all (a node going stale
reads ``offline`` 45 s after its last heartbeat, before the sweeper records
``node.went_offline``). Messages carry whole views, so a client never has to
merge partial updates; ``changed`` lists the job ids that moved, up to
:data:`MOST_CHANGED` (``changed_truncated`` says more did: a batch of 10,000
would otherwise make one message of 370 KB), and a nodes message the node ids.

A key that may read a view may stream it: the nodes view is also given to
``nodes:admin``, the operator's key, so the stream of that view alone is too.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import msgspec
from starlette.requests import Request

from umbra import paging
from umbra.compute import nodes as node_reads
from umbra.errors import RateLimited
from umbra.events import store
from umbra.projections import job_counts
from umbra.projections import jobs as job_rows
from umbra.projections.verify import verify

from .http import authenticated, json_response
from .nodes import node_out
from .params import query_int, query_list
from .routing import endpoint
from .sse import TOO_MANY_STREAMS, LogWatch, StreamRead, message, sse_stream, stream_principal, watched_reads

#: Non-terminal jobs listed in a queue view: running first, then blocked (the ones a person looks at:
#: what runs where, and what cannot run), then queued, each by priority and age.
MAX_LISTED_JOBS = 1000
DEFAULT_LISTED_JOBS = 200
VIEWS = ("queue", "nodes")
READ_SCOPES = ("jobs:read", "events:read")

#: The first ``%(limit)s`` open jobs in that order: each status's first ones by an index-ordered scan that stops
#: at the limit (running and blocked ones by ``jobs_running_and_blocked_listed``, migration 0051, queued ones
#: by ``jobs_claimable``), then those at most three times the limit put in order. Ordered in one query by
#: ``status = 'running' DESC, status = 'blocked' DESC, priority, seq``, which no index serves, every read sorted
#: every open job of the organization (0.75 s with 600,000 open among 4.6 million), and each of its streams
#: reads the view again whenever its jobs move.
_OPEN_JOBS = f"""
SELECT {", ".join(job_rows.COLUMNS)}, listed_first FROM (
    (SELECT 0 AS listed_first, {job_rows.SELECT_LIST} FROM jobs
     WHERE organization_id = %(org)s AND status = 'running' ORDER BY priority, seq LIMIT %(limit)s)
    UNION ALL
    (SELECT 1 AS listed_first, {job_rows.SELECT_LIST} FROM jobs
     WHERE organization_id = %(org)s AND status = 'blocked' ORDER BY priority, seq LIMIT %(limit)s)
    UNION ALL
    (SELECT 2 AS listed_first, {job_rows.SELECT_LIST} FROM jobs
     WHERE organization_id = %(org)s AND status = 'queued' ORDER BY priority, seq LIMIT %(limit)s)
) AS open_jobs
ORDER BY listed_first, priority, seq
LIMIT %(limit)s
"""
#: Those jobs, cut short once their documents pass :data:`umbra.paging.PAGE_BYTES`.
_LISTED_JOBS = paging.bounded(_OPEN_JOBS, sizes=job_rows.DOCUMENT_BYTES, order="listed_first, priority, seq")
#: The ``Retry-After`` of a verify refused because another of its organization's is running.
VERIFY_RETRY_SECONDS = 5
#: The most job ids a queue message lists as moved.
MOST_CHANGED = 1000
#: The jobs that moved since a position, in the order they moved: the end of ``jobs_by_position`` (migration
#: 0051), whatever the organization's history (without it every read of a stream whose log moved scanned
#: all the organization's jobs: 0.6 s at 4.6 million).
_MOVED_JOBS = f"SELECT id FROM jobs WHERE organization_id = %s AND position > %s ORDER BY position LIMIT {MOST_CHANGED + 1}"


class QueueView(msgspec.Struct, kw_only=True):
    position: int
    counts: dict[str, int]
    jobs: list[dict[str, Any]]
    #: True when more non-terminal jobs exist than are listed.
    truncated: bool = False


class NodesView(msgspec.Struct, kw_only=True):
    position: int
    nodes: list[dict[str, Any]]


class VerifyResult(msgspec.Struct, kw_only=True):
    ok: bool
    differences: list[dict[str, Any]]


async def _snapshot_transaction(conn):
    await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")


async def read_queue(conn, organization_id: UUID, limit: int) -> dict[str, Any]:
    """The queue view; call inside a snapshot transaction."""
    position = await store.head_position(conn, organization_id)
    counts = await job_counts.of_organization(conn, organization_id)
    rows = await (await conn.execute(_LISTED_JOBS, {"org": organization_id, "limit": limit + 1,
                                                    "page_bytes": paging.PAGE_BYTES})).fetchall()  # fmt: skip
    listed = [job_rows.to_json(job_rows.from_db(row)) for row in rows[:limit]]
    return {"position": position, "counts": counts, "jobs": listed, "truncated": len(rows) > limit or paging.cut_short(rows)}


async def read_nodes(conn, organization_id: UUID, stale_seconds: int) -> dict[str, Any]:
    """The nodes view with effective statuses; call inside a snapshot transaction."""
    return (await _read_nodes(conn, organization_id, stale_seconds))[0]


async def _read_nodes(
    conn, organization_id: UUID, stale_seconds: int
) -> tuple[dict[str, Any], list[node_reads.NodeView]]:
    """The nodes view, and the node reads it was made of (in its order)."""
    position = await store.head_position(conn, organization_id)
    views = await node_reads.load_schedulable_view(conn, organization_id, stale_seconds=stale_seconds)
    return {"position": position, "nodes": [msgspec.to_builtins(node_out(v)) for v in views]}, views


async def queue_snapshot(request: Request):
    async with authenticated(request, *READ_SCOPES) as (who, conn):
        limit = query_int(request, "limit", default=DEFAULT_LISTED_JOBS, minimum=0, maximum=MAX_LISTED_JOBS)
        async with conn.transaction():
            await _snapshot_transaction(conn)
            view = await read_queue(conn, who.organization_id, limit)
    return json_response(view)


async def nodes_snapshot(request: Request):
    services = request.app.state.services
    async with authenticated(request, *READ_SCOPES, "nodes:admin") as (who, conn):
        async with conn.transaction():
            await _snapshot_transaction(conn)
            view = await read_nodes(conn, who.organization_id, services.settings.heartbeat_stale_seconds)
    return json_response(view)


async def verify_projections(request: Request):
    """One verify of an organization at a time in this process; the next is refused 429 while it runs.

    A verify holds its pooled connection, and everything it rebuilt, for as long as it folds (seconds on a
    large organization): ten sent at once by one admin held every connection of the pool, and every other
    organization's requests waited for one.
    """
    verifying: set[UUID] = request.app.state.services.verifying
    async with authenticated(request, "nodes:admin") as (who, conn):
        if who.organization_id in verifying:
            raise RateLimited("A verify of this organization is already running; try again once it is done.",
                              VERIFY_RETRY_SECONDS)
        verifying.add(who.organization_id)
        try:
            differences = await verify(conn, who.organization_id)
        finally:
            verifying.discard(who.organization_id)
    return json_response({"ok": not differences, "differences": differences})


async def stream_projections(request: Request):
    services = request.app.state.services
    who = await stream_principal(request, *READ_SCOPES, "nodes:admin")
    views = query_list(request, "views", allowed=VIEWS, default=VIEWS)
    if views != ("nodes",):
        who.require(*READ_SCOPES)  # nodes:admin reads the nodes view alone
    watch: LogWatch = request.app.state.log_watch
    reader = _view_reader(who.organization_id, views, services.settings.heartbeat_stale_seconds)
    return sse_stream(watched_reads(services, watch, who, reader), name="projections", watch=watch,
                      who=who, most=services.settings.max_streams_per_organization)  # fmt: skip


def _node_key(read: node_reads.NodeView, node: dict[str, Any]) -> tuple:
    """What makes a node worth re-sending: any folded change, or its effective reading (its devices' ``busy``
    included, which its running jobs move).

    A folded change is told by the row's version, not its ``updated_at``: an event is stamped no earlier
    than the one before it on its stream, so a command whose transaction began before that one committed
    records its change at the same time, and the change was never sent."""
    return (read.state.version, node["status"], node["schedulable"], node["last_heartbeat_at"] is None,
            tuple(device["busy"] for device in node["devices"]))  # fmt: skip


def _view_reader(organization_id: UUID, views: tuple[str, ...], stale: float) -> StreamRead:
    """Reads of the views, each sending only what changed since the last one that was read."""
    last_position: int | None = None
    sent_nodes: dict[str, tuple] | None = None

    async def read(conn) -> tuple[list[bytes], bool]:
        nonlocal last_position, sent_nodes
        out: list[bytes] = []
        node_keys = None
        async with conn.transaction():
            await _snapshot_transaction(conn)
            head = await store.head_position(conn, organization_id)
            if "queue" in views and (last_position is None or head > last_position):
                # Only a job row that folded a newer event changes the queue view: a log that moved for
                # nodes alone (heartbeats, pairings, drains) sends no queue message.
                moved = [] if last_position is None else await (await conn.execute(
                    _MOVED_JOBS, (organization_id, last_position))).fetchall()  # fmt: skip
                if last_position is None or moved:
                    queue = await read_queue(conn, organization_id, DEFAULT_LISTED_JOBS)
                    if last_position is not None:
                        queue["changed"] = [str(job_id) for (job_id,) in moved[:MOST_CHANGED]]
                        queue["changed_truncated"] = len(moved) > MOST_CHANGED
                    out.append(message(queue, event="queue"))
            if "nodes" in views:
                nodes, reads = await _read_nodes(conn, organization_id, stale)
                keys = {n["id"]: _node_key(r, n) for r, n in zip(reads, nodes["nodes"])}
                if keys != sent_nodes:
                    changed = [i for i, k in keys.items() if sent_nodes is None or sent_nodes.get(i) != k]
                    out.append(message({**nodes, "changed": changed}, event="nodes"))
                    node_keys = keys
        last_position = head  # only once the whole read has succeeded
        if node_keys is not None:
            sent_nodes = node_keys
        return out, False

    return read


routes = [
    endpoint(
        "GET",
        "/v1/projections/queue",
        queue_snapshot,
        summary="Job counts by status and the open jobs, as of a log position.",
        auth="api_key",
        scopes=READ_SCOPES,
        query={"limit": (int, False, f"Open jobs to list, 0..{MAX_LISTED_JOBS} (default {DEFAULT_LISTED_JOBS}).")},
        response=QueueView,
    ),
    endpoint(
        "GET",
        "/v1/projections/nodes",
        nodes_snapshot,
        summary="Every node with its effective status, as of a log position.",
        auth="api_key",
        scopes=(*READ_SCOPES, "nodes:admin"),
        response=NodesView,
    ),
    endpoint(
        "GET",
        "/v1/projections/stream",
        stream_projections,
        summary="Server-Sent Events: a queue and nodes view on open, then each view again when it changes "
        "(nodes:admin may stream views=nodes alone).",
        auth="api_key",
        scopes=(*READ_SCOPES, "nodes:admin"),
        query={
            "views": (str, False, "Comma-separated views: queue, nodes (default both)."),
            "access_token": (str, False, "The API key, for EventSource clients that cannot send headers."),
        },
        produces="text/event-stream",
        response=QueueView,
        errors=TOO_MANY_STREAMS,
    ),
    endpoint(
        "POST",
        "/v1/projections/verify",
        verify_projections,
        summary="Rebuild the organization's projections from the log and compare them with the live views.",
        auth="api_key",
        scopes=("nodes:admin",),
        response=VerifyResult,
        errors={429: "Too many wrong secrets for this token's prefix lately, or a verify of this organization "
                     "already running in this process, which holds a pooled connection for as long as it "
                     "rebuilds (`rate_limited`, with `Retry-After`)."},
    ),
]
