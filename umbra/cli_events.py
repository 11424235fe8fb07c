"""``umbra events tail|replay`` and ``umbra verify``: reading the log as an auditor.

``tail`` and ``replay`` are HTTP clients: they see what an API key of one
organization may see (``events:read``), nothing more. ``tail`` pages through
``GET /v1/events``; with ``--follow`` it holds ``/v1/events/stream`` open and,
after a dropped connection, resumes with ``Last-Event-ID`` so no event is missed
or printed twice. ``replay`` folds a job's history with the queue projection's
own fold (a node's with the node view's), so what it prints is exactly what a
rebuild would store.

``verify`` is an operator command on the database itself: it rebuilds every
projection from the log and diffs it against the live tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import datetime
from typing import Any, AsyncIterator, Iterable
from uuid import UUID

import anyio
import httpx
import msgspec

from umbra import jitter
from umbra.errors import InvalidRequest, NotFound, UmbraError
from umbra.events import documents
from umbra.settings import server_url

SERVER_HELP = ("service URL (default UMBRA_SERVER, else http://UMBRA_HOST:UMBRA_PORT: the loopback for a wildcard or "
               "unset host, port 8080 if unset)")

PAGE_SIZE = 1000
#: What a key may hold to be sent in a header at all (visible ASCII); a key of any other shape is the server's to refuse.
_SENDABLE = re.compile(r"[!-~]+")


# -- HTTP ------------------------------------------------------------------------


def _client(args, scope: str = "events:read") -> httpx.AsyncClient:
    key = (args.api_key or os.environ.get("UMBRA_API_KEY") or "").strip()  # a key read from a file keeps its newline
    if not key:
        raise InvalidRequest(f"An API key with {scope} is required: pass --api-key or set UMBRA_API_KEY.")
    if not _SENDABLE.fullmatch(key):
        # Checked here, not left to the HTTP library: its refusal of the header quotes it, key and all.
        raise InvalidRequest("The API key (--api-key or UMBRA_API_KEY) holds a character no key has (a space, a control "
                             "character, a non-ASCII letter); give it as create-key printed it.")  # fmt: skip
    server = args.server or server_url()
    return httpx.AsyncClient(
        base_url=server.rstrip("/"),
        headers={"Authorization": f"Bearer {key}", "User-Agent": "umbra-cli"},
        timeout=httpx.Timeout(30.0, read=None),
    )


async def _get_json(client: httpx.AsyncClient, path: str, **params) -> Any:
    from umbra.agent.client import raise_for_error

    response = await client.get(path, params=params or None)
    raise_for_error(response)
    return documents.decode(response.content)


# -- SSE ---------------------------------------------------------------------------


class SseParser:
    """Server-Sent Events, one line at a time: a message per blank line.

    Handles what the service sends (``id``, ``event``, ``data``, ``retry``,
    comments); ``last_id`` is where a reconnect resumes.
    """

    def __init__(self) -> None:
        self.last_id: str | None = None
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> tuple[str, str, str | None] | None:
        """Returns ``(event, data, id)`` when ``line`` ends a message."""
        if line == "":
            message = (self._event or "message", "\n".join(self._data), self.last_id) if self._data else None
            self._event, self._data = "", []
            return message
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        return None


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an event stream, as SSE ends them: at CR LF, CR or LF, and nowhere else.

    Not ``httpx``'s ``aiter_lines``, which also ends a line at U+2028, U+0085
    and the like (``str.splitlines``): JSON may carry those raw, and a
    ``data:`` line torn at one is two lines of broken JSON.
    """
    pending = b""
    for_cr = False  # the last chunk ended in CR: a LF starting this one ends nothing more
    async for chunk in chunks:
        if for_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        for_cr = chunk.endswith(b"\r")
        pieces = _LINE_END.split(pending + chunk)
        pending = pieces.pop()
        for piece in pieces:
            yield piece.decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")


_LINE_END = re.compile(rb"\r\n|\r|\n")


# -- tail ------------------------------------------------------------------------


#: Characters a terminal acts on rather than shows: C0 and C1 controls (ANSI escapes among them), line and
#: paragraph separators, and the bidirectional overrides that reorder what is shown.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on written as its escape (``\\x1b``, ``\\u202e``).

    What the CLI prints as text comes from the service, and some of it from a
    node or a submitter: a node named with an ANSI escape or a newline would
    otherwise rewrite or forge lines on an operator's terminal.
    """
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


#: A character outside ASCII: written as a JSON escape, as ``json.dumps`` does by default.
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def to_json_text(value: Any, *, compact: bool = False) -> str:
    """``value`` as one line of JSON, its numbers as the service sent them (:mod:`umbra.events.documents`).

    Spaced after commas and colons unless ``compact``. Every character outside
    ASCII is escaped: a line separator (U+2028) or a NEL in a payload would
    otherwise end the line for a reader splitting the output into lines.
    """
    encoded = documents.encode(value)
    text = (encoded if compact else msgspec.json.format(encoded, indent=0)).decode()
    return _NON_ASCII.sub(lambda char: json.dumps(char.group()).strip('"'), text) if not text.isascii() else text


def format_event(event: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return to_json_text(event, compact=True)
    data = {k: v for k, v in (event.get("data") or {}).items() if k != "type"}  # the type has its own column
    data = to_json_text(data, compact=True)
    return f"{event['position']:>8}  {event['recorded_at']}  {event['type']:<18} {event['stream']}  {data}"


async def _page_through(client: httpx.AsyncClient, after: int, as_json: bool) -> int:
    while True:
        page = await _get_json(client, "/v1/events", after=after, limit=PAGE_SIZE)
        for event in page["events"]:
            print(format_event(event, as_json), flush=True)
        if not page["events"]:
            return after
        after = int(page["next"])


async def _follow(client: httpx.AsyncClient, after: int, as_json: bool) -> None:
    from umbra.agent.client import ServiceError, raise_for_error
    from umbra.agent.runner import backoff_delay

    failures = 0
    reached = False  # whether the server ever answered: until it does, a refused connection is a mistake
    while True:
        parser = SseParser()
        try:
            headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after)}
            async with client.stream("GET", "/v1/events/stream", headers=headers) as response:
                reached = True
                if response.status_code >= 400:
                    await response.aread()
                    raise_for_error(response)
                failures = 0
                async for line in sse_lines(response.aiter_bytes()):
                    message = parser.feed(line)
                    if message is None:
                        continue
                    if message[0] == "error":  # the stream's last word (its credential was revoked)
                        body = documents.decode(message[1])
                        raise ServiceError(401, str(body.get("error")), str(body.get("message")))
                    event = documents.decode(message[1])
                    after = max(after, int(event["position"]))
                    print(format_event(event, as_json), flush=True)
        except (httpx.TransportError, ServiceError) as exc:
            # The server or its database is restarting (a dropped connection, a 5xx, a 429): try again
            # from the last event printed. A refusal of the request itself (401, 403, 422) is final.
            if isinstance(exc, ServiceError) and exc.status < 500 and exc.status != 429:
                raise
            if not reached:  # a wrong --server (or none listening yet): said at once, as tail without --follow does
                raise
            failures += 1
            delay = max(backoff_delay(failures, 0.5, 15.0), getattr(exc, "retry_after", None) or 0.0)
            reason = type(exc).__name__ if isinstance(exc, httpx.TransportError) else f"HTTP {exc.status} {exc.code}"
            print(f"umbra: stream interrupted ({reason}); resuming after {after} in {delay:.1f}s", file=sys.stderr)
            await anyio.sleep(delay)
            continue
        # The server ended the stream (it is shutting down): reconnect shortly.
        await anyio.sleep(jitter.uniform(0.5, 1.5))


def cmd_tail(args) -> int:
    async def main() -> int:
        async with _client(args) as client:
            if args.follow:
                await _follow(client, args.after, args.json)
            else:
                await _page_through(client, args.after, args.json)
        return 0

    return anyio.run(main)


# -- replay ------------------------------------------------------------------------


def recorded_from_json(event: dict[str, Any]):
    """An API Event object back into the store's RecordedEvent, decoded as stored events are."""
    from umbra.events.store import RecordedEvent
    from umbra.events.types import decode_event

    return RecordedEvent(
        position=int(event["position"]),
        stream=event["stream"],
        version=int(event["version"]),
        organization_id=UUID(event["organization_id"]),
        event=decode_event(documents.encode({**event["data"], "type": event["type"]})),
        metadata=event.get("metadata") or {},
        recorded_at=datetime.fromisoformat(event["recorded_at"].replace("Z", "+00:00")),
    )


def _folds(stream: str):
    """The fold of a stream's projection and the state's API shape: a job's (the Job object) or a node's."""
    if stream.startswith("node:"):
        from umbra.projections.nodes import fold as fold_node

        return fold_node, lambda state: msgspec.json.decode(msgspec.json.encode(state.as_row()))  # tuples as lists
    from umbra.projections.jobs import fold as fold_job, to_json

    return fold_job, to_json


def replay(events: Iterable[dict[str, Any]], *, up_to: int | None = None):
    """Fold one stream's events in order (a job's or a node's); returns ``[(event, status after it)]``
    and the state, in the API's shape (``None`` when no event was folded).

    A stream that opens with an event this release cannot read (a newer release's ``job.submitted.v2``) has
    nothing to start a state from: refused, naming it, as the server's folds skip it and ``verify`` names it."""
    from umbra.projections.jobs import opens_unreadably

    state, steps, shape = None, [], None
    for event in events:
        if up_to is not None and int(event["position"]) > up_to:
            break
        fold, shape = _folds(event["stream"])
        recorded = recorded_from_json(event)
        if state is None and opens_unreadably(recorded):
            raise UmbraError("written_by_newer_release", f"{event['stream']} opens with {event['type']}, which a newer "
                             "release of Umbra wrote and this one cannot read: replay it with that release.")  # fmt: skip
        state = fold(state, recorded)
        steps.append((event, state.status))
    return steps, (None if state is None else shape(state))


async def _history(client: httpx.AsyncClient, object_id: UUID) -> dict[str, Any]:
    """The job's history, or else the node's: ids are never shared, so one id names one stream."""
    from umbra.agent.client import ServiceError

    try:
        return await _get_json(client, f"/v1/jobs/{object_id}/events")
    except ServiceError as exc:
        if exc.status != 404:
            raise
    try:
        return await _get_json(client, f"/v1/nodes/{object_id}/events")
    except ServiceError as exc:
        if exc.status != 404:
            raise
    raise NotFound("job_not_found", f"No job or node {object_id} in this organization.")


def cmd_replay(args) -> int:
    async def main() -> int:
        async with _client(args) as client:
            history = await _history(client, args.stream_id)
        steps, state = replay(history["events"], up_to=args.as_of)
        if state is None:
            raise InvalidRequest(f"{args.stream_id} had no events at or before position {args.as_of}.")
        if args.json:
            print(to_json_text({"events": [e for e, _ in steps], "state": state}))
            return 0
        for event, status in steps:
            print(f"{format_event(event, False)}  -> {status}")
        print()
        for key, value in state.items():
            shown = "—" if value is None else to_json_text(value) if isinstance(value, (dict, list)) else value
            print(printable(f"{key:>17}: {shown}"))
        return 0

    return anyio.run(main)


# -- verify ------------------------------------------------------------------------

#: Seconds between "still working" lines while a long verification runs.
PROGRESS_SECONDS = 5.0

_NODES = "SELECT count(*) FROM nodes WHERE %s::uuid IS NULL OR organization_id = %s"


async def _views_size(conn, organization_id: UUID | None) -> tuple[int, int]:
    """The jobs and the nodes the views hold: as many streams as verify folds, when they agree. The jobs from
    ``job_counts``, a row per organization and status, and not a count of the log's distinct streams, which
    read and sorted the log whole (seconds at a million jobs) before verify had begun."""
    from umbra.projections import job_counts

    if organization_id is None:
        jobs = sum(row[1] for row in await job_counts.totals(conn))
    else:
        jobs = sum((await job_counts.of_organization(conn, organization_id)).values())
    nodes = (await (await conn.execute(_NODES, (organization_id, organization_id))).fetchone())[0]
    return jobs, nodes


def format_difference(difference: dict[str, Any]) -> str:
    view, row_id, field = difference["view"], difference["id"], difference["field"]
    if field is None:
        side = "only in the rebuild" if difference["rebuilt"] else "only in the live table"
        return f"{view} {row_id}: row {side}"
    return f"{view} {row_id}: {field}: rebuilt {difference['rebuilt']} != live {difference['live']}"


async def _progress(started: float) -> None:
    while True:
        await anyio.sleep(PROGRESS_SECONDS)
        print(f"umbra verify: still folding ({anyio.current_time() - started:.0f}s)", file=sys.stderr, flush=True)


async def _verify(conn, args) -> int:
    from umbra.compute.accounts import require_organization
    from umbra.projections.verify import verify

    if args.org is not None:  # a mistyped id would otherwise read as a clean audit of nothing
        await require_organization(conn, args.org)
    jobs, nodes = await _views_size(conn, args.org)
    scope = f"organization {args.org}" if args.org else "all organizations"
    print(f"umbra verify: rebuilding {jobs} jobs and {nodes} nodes from the log ({scope})", file=sys.stderr, flush=True)
    started = anyio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_progress, started)
        differences = await verify(conn, args.org)
        tg.cancel_scope.cancel()
    elapsed = anyio.current_time() - started
    try:
        if args.json:
            print(to_json_text({"ok": not differences, "differences": differences}))
        else:
            for difference in differences:
                print(format_difference(difference))
            verdict = f"{len(differences)} difference(s)" if differences else "views match the log"
            print(f"{verdict} ({jobs} jobs, {nodes} nodes, {elapsed:.1f}s)")
    except BrokenPipeError:  # `umbra verify | head`: the reader stopped reading, and the status is still the verdict
        from umbra.cli import detach_stdout

        detach_stdout()
    return 1 if differences else 0


# -- registration ------------------------------------------------------------------


def _add_http_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=None, help=SERVER_HELP)
    p.add_argument("--api-key", default=None, help="API key with events:read (default UMBRA_API_KEY)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per line for tail)")


def register(sub: argparse._SubParsersAction) -> None:
    from umbra.cli import _uuid, _with_database

    events = sub.add_parser("events", help="read the event log: tail it, replay a job or a node")
    events_sub = events.add_subparsers(dest="events_command", required=True)

    p = events_sub.add_parser("tail", help="print the organization's events in commit order",
                              description="Print the organization's events in commit order; --follow keeps streaming.")
    p.add_argument("--follow", "-f", action="store_true", help="keep streaming new events (resumes after disconnects)")
    p.add_argument("--after", type=int, default=0, help="start after this log position (default 0: from the beginning)")
    _add_http_options(p)
    p.set_defaults(func=cmd_tail)

    p = events_sub.add_parser("replay", help="print a job's or a node's events and the state they fold to",
                              description="Print a job's (or a node's) events, the status after each, and the state "
                                          "they fold to.")  # fmt: skip
    p.add_argument("stream_id", metavar="ID", type=_uuid, help="a job's or a node's id")
    p.add_argument("--as-of", type=int, default=None, help="fold only events at or before this log position")
    _add_http_options(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser(
        "verify",
        help="rebuild the projections from the log and diff them against the live tables",
        description="Rebuild the queue and node views from the event log (on the database directly) and "
        "compare them row by row with the live tables. Exits 1 when anything differs, 2 when it could not "
        "compare (the database unreachable or behind this version, an unknown --org).",
    )
    p.add_argument("--org", type=_uuid, default=None, help="only this organization (default: all)")
    p.add_argument("--json", action="store_true", help='print {"ok", "differences"} as JSON')
    # 1 means drift alone (as for diff(1)), so `umbra verify || alert "views drifted"` never alerts for an outage
    p.set_defaults(func=_with_database(_verify, migrating=False), failure_status=2)
