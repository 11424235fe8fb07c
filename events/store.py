"""The event store: append with optimistic concurrency, read, and publish hints.

**Ordering (the gap problem).** Positions come from an identity column, which
is allocated at INSERT time while the row only becomes visible at COMMIT. Two
concurrent transactions can therefore commit out of position order, and a
reader tailing ``position > P`` would skip the earlier position for good.

We serialise appends on one transaction-scoped advisory lock taken in the same
statement that inserts, and held until commit. PostgreSQL makes a committed
transaction visible before it releases its locks, so the next appender cannot
allocate a position until every lower position is either visible or rolled
back: commit order equals position order, and ``position > P`` is a gap-free
cursor (holes left by rollbacks are permanent and harmless). This is the
eventsourcing/Commanded design. We chose it over an xid8 visibility horizon
because API.md's cursors are plain positions (``after=P``, SSE ``Last-Event-ID``),
which an xid-ordered read cannot offer, and over a post-commit sequencer because
the queue projection must be written in the appending transaction. Its cost is
one appender at a time between the insert and the commit flush; ``bench/append.py``
measures it against no guard, and group commit amortises it on the hot path.

Store functions take the caller's connection and never open their own: the
caller owns the transaction.
"""

from __future__ import annotations

import contextlib
import functools
from datetime import datetime
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from uuid import UUID

import msgspec
import psycopg
from psycopg.types.json import Jsonb

from umbra import metrics, paging
from umbra.db import PreparedStatement, service_lock_wait
from umbra.errors import ConcurrencyConflict

from . import documents
from .types import Event, UnknownEvent, decode_event, encode_event

#: Advisory lock key serialising appends ("umbralog" in ASCII).
LOG_LOCK_KEY = 0x756D6272616C6F67
#: The notification channel for "the log advanced" hints.
LOG_CHANNEL = "umbra_log"
#: The notification channel for "every parked claim of this organization, try again now": a change
#: that refuses some of them (a node's credentials revoked) makes no work to hint at.
RECHECK_CHANNEL = "umbra_recheck"
#: The notification channel for "this organization's jobs began waiting for others": the one reader that
#: looks at waiting jobs only while some wait (the sweeper's leader) looks again at once.
WAITING_CHANNEL = "umbra_waiting"


class RecordedEvent(msgspec.Struct, frozen=True):
    position: int
    stream: str
    version: int
    organization_id: UUID
    event: Event | UnknownEvent
    metadata: Mapping[str, Any]
    recorded_at: datetime

    @property
    def type(self) -> str:
        if isinstance(self.event, UnknownEvent):
            return self.event.type
        return self.event.__struct_config__.tag  # type: ignore[attr-defined]


class StoredEvent(msgspec.Struct, frozen=True):
    """An event as the log holds it: the API's Event object, ``data`` and ``metadata`` the JSON stored.

    The log is the auditor's record of what each writer said, so it is shown
    as stored, not decoded into this release's types (:class:`RecordedEvent`,
    what the folds read) and encoded again: that would drop the fields a newer
    release added to a type this one knows, and show an earlier release's
    events with the fields added since, at their defaults. ``type`` is the one
    recorded (a superseded version's own tag, not the one the folds upcast it
    to). Numbers are as ``jsonb`` writes them (docs/API.md); the JSON is only
    compacted. Nothing is decoded, so it is also the quicker read.
    """

    position: int
    stream: str
    version: int
    type: str
    organization_id: UUID
    data: msgspec.Raw
    metadata: msgspec.Raw
    #: Written by the encoder as RFC 3339, ``Z`` for UTC, as the API's other times.
    recorded_at: datetime


class PendingAppend(msgspec.Struct, frozen=True):
    """Events for one stream, to be appended at ``expected_version`` + 1, + 2, ..."""

    stream: str
    expected_version: int
    events: Sequence[Event]
    organization_id: UUID
    metadata: Mapping[str, Any] | None = None


def job_stream(job_id: UUID) -> str:
    return f"job:{job_id}"


def node_stream(node_id: UUID) -> str:
    return f"node:{node_id}"


#: When False, appends skip the ordering lock. Only the test that proves the
#: gap test can detect a missing guard turns it off.
ORDERING_GUARD = True

#: The ordering lock, waited for as the service's own locks are (:func:`umbra.db.service_lock_wait`): only
#: appends hold it, each until its commit, and under a burst of large submissions the queue for it is
#: longer than a pooled connection's bound on lock waits, which is meant for rows held elsewhere.
_ORDERING_LOCK = service_lock_wait("SELECT pg_advisory_xact_lock(%(lock)s)")

#: The one INSERT of an append: small batches through :func:`append_many`, and the group
#: commit's batches through :func:`append_statement`, which gives the events' time (the
#: transaction's ``umbra_now()``, read earlier) so that it can fold them before appending. Without
#: a given time, the column's default is what ``coalesce`` stores.
_APPEND_GUARDED = f"""
WITH ordering_guard AS ({_ORDERING_LOCK})
INSERT INTO events (stream, version, type, organization_id, data, metadata, recorded_at)
SELECT r.stream,
       -- A stream not at its expected version gets a NULL version: the statement fails, and the
       -- transaction with it, before any statement sent after it in the same message runs.
       CASE WHEN r.expected = 0 OR prior.recorded_at IS NOT NULL THEN r.version END,
       -- Never before the event it follows: a transaction that began before that one committed
       -- would otherwise stamp its event with its own, earlier, start.
       r.type, r.org, r.data, r.meta, greatest(coalesce(%(at)s, umbra_now()), prior.recorded_at)
FROM ordering_guard,
     ROWS FROM (jsonb_to_recordset(%(rows)s::jsonb)
       AS (stream text, version int, type text, org uuid, data jsonb, meta jsonb, expected int)) WITH ORDINALITY
       AS r(stream, version, type, org, data, meta, expected, n)
     -- The stream's event at the expected version, probed per row through events_stream_version
     -- (written as OR EXISTS, the planner may hash a scan of the whole log instead).
     LEFT JOIN LATERAL (
       SELECT e.recorded_at FROM events e WHERE e.stream = r.stream AND e.version = r.expected LIMIT 1
     ) AS prior ON true
ORDER BY r.n
RETURNING position, recorded_at
"""
_APPEND_UNGUARDED = _APPEND_GUARDED.replace(
    f"WITH ordering_guard AS ({_ORDERING_LOCK})\n", ""
).replace("FROM ordering_guard,\n", "FROM ")


class _Row(msgspec.Struct, array_like=False):
    stream: str
    version: int
    type: str
    org: UUID
    data: msgspec.Raw
    meta: msgspec.Raw
    expected: int


_EMPTY = msgspec.Raw(b"{}")

#: Appends of at least this many events travel by COPY (:func:`_append_copy`);
#: smaller ones are the one INSERT statement above (one round trip, not three).
COPY_MIN_EVENTS = 256

# COPY cannot return positions, so the copy path allocates them first: under the
# same ordering lock (taken here and held to commit), one nextval per event, and
# the time every event of the batch is recorded at: the transaction's clock (the
# recorded_at default), or the latest event of a stream it appends to, if later
# (as the INSERT path). The expected-version probe is the INSERT path's, per
# existing stream.
_RESERVE_GUARDED = f"""
WITH ordering_guard AS ({_ORDERING_LOCK}),
     reserved AS (SELECT nextval('events_position_seq') AS p FROM ordering_guard, generate_series(1, %(n)s)),
     prior AS (SELECT (SELECT e.recorded_at FROM events e WHERE e.stream = x.stream AND e.version = x.version LIMIT 1) AS at
               FROM unnest(%(streams)s::text[], %(versions)s::int[]) AS x(stream, version)),
     clock AS (SELECT greatest(umbra_now(), (SELECT max(at) FROM prior)) AS at)
SELECT (SELECT array_agg(p ORDER BY p) FROM reserved), clock.at, clock.at::text,
       (SELECT count(*) FROM prior WHERE at IS NULL)
FROM clock
"""
_RESERVE_UNGUARDED = _RESERVE_GUARDED.replace(
    f"WITH ordering_guard AS ({_ORDERING_LOCK}),\n     reserved", "WITH reserved"
).replace("FROM ordering_guard, generate_series", "FROM generate_series")
_COPY = "COPY events (position, stream, version, type, organization_id, data, metadata, recorded_at) FROM STDIN"
#: Rows per chunk handed to COPY: PostgreSQL inserts one chunk while the next is built.
_COPY_CHUNK = 2000


def _tail(metadata: Mapping[str, Any] | None, recorded_text: str) -> tuple[Mapping[str, Any], str]:
    """An event line's last two columns (metadata, recorded_at), and the metadata to return."""
    meta = copy_json(documents.encode(metadata)) if metadata else "{}"
    return metadata or {}, f"\t{meta}\t{recorded_text}\n"


def copy_text(value: str) -> str:
    """``value`` escaped for COPY's text format (backslash, tab, newline, carriage return)."""
    if "\\" in value or "\t" in value or "\n" in value or "\r" in value:
        return value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    return value


def copy_json(encoded: bytes) -> str:
    """msgspec JSON for a COPY text field: JSON escapes every control character, so only backslashes need doubling."""
    text = encoded.decode()
    return text.replace("\\", "\\\\") if "\\" in text else text


async def append_many(conn: psycopg.AsyncConnection, batch: Sequence[PendingAppend]) -> list[RecordedEvent]:
    """Append events to several streams in one statement (or one COPY, for large batches).

    Raises :class:`ConcurrencyConflict` when any stream is not at its expected
    version; the caller's transaction must then be rolled back (it is, when the
    exception leaves ``conn.transaction()``).
    """
    async with appending(conn, batch) as recorded:
        pass
    return recorded


@contextlib.asynccontextmanager
async def appending(
    conn: psycopg.AsyncConnection, batch: Iterable[PendingAppend], *, events: int | None = None
) -> AsyncIterator[list[RecordedEvent]]:
    """:func:`append_many` that lets the caller work while PostgreSQL is still inserting.

    The body gets the recorded events (positions, versions, ``recorded_at``)
    once they are allocated and sent; for a COPY, PostgreSQL may still be
    inserting them, and the append is only known to have succeeded when the
    block exits, which raises :class:`ConcurrencyConflict` if it did not. Do
    nothing in the body but compute from the events (no statements: the
    connection is busy with the COPY); a conflict at exit makes that work moot.

    ``events``, when given, is how many events ``batch`` carries in all. A
    large batch is then consumed lazily, item by item, while the COPY streams
    it (so building the items costs no extra time while PostgreSQL inserts);
    every item must start a new stream (expected version 0), which is checked
    as it comes, as is the total.
    """
    if events is None or events < COPY_MIN_EVENTS:
        items = list(batch)
        count = sum(len(item.events) for item in items)
        if events is not None and count != events:
            raise ValueError(f"the batch carries {count} events, not {events}")
        if count == 0:
            yield []
        elif count >= COPY_MIN_EVENTS:
            async with _appending_copy(conn, items, count, [item for item in items if item.expected_version > 0]) as recorded:
                yield recorded
        else:
            yield await _append_insert(conn, items)
    else:
        async with _appending_copy(conn, _new_streams(batch), events, []) as recorded:
            yield recorded


def _new_streams(batch: Iterable[PendingAppend]) -> Iterator[PendingAppend]:
    for item in batch:
        if item.expected_version != 0:
            raise ValueError(f"{item.stream}: a lazily appended batch may only start new streams")
        yield item


def _encoded_rows(batch: Sequence[PendingAppend]) -> tuple[list[tuple[PendingAppend, Event, int]], bytes]:
    """Each event of ``batch`` with its version, and all of them as the append's JSON rows."""
    rows: list[tuple[PendingAppend, Event, int]] = []
    for item in batch:
        for offset, event in enumerate(item.events):
            rows.append((item, event, item.expected_version + offset + 1))
    encoded = documents.encode(
        [
            _Row(
                stream=item.stream,
                version=version,
                type=event.__struct_config__.tag,  # type: ignore[attr-defined]
                org=item.organization_id,
                data=msgspec.Raw(encode_event(event)),
                meta=msgspec.Raw(documents.encode(item.metadata)) if item.metadata else _EMPTY,
                expected=item.expected_version,
            )
            for item, event, version in rows
        ]
    )
    return rows, encoded


async def _append_insert(conn: psycopg.AsyncConnection, batch: Sequence[PendingAppend]) -> list[RecordedEvent]:
    rows, encoded = _encoded_rows(batch)
    params = {"lock": LOG_LOCK_KEY, "rows": encoded.decode(), "at": None}
    try:
        cursor = await conn.execute(_APPEND_GUARDED if ORDERING_GUARD else _APPEND_UNGUARDED, params)
        returned = await cursor.fetchall()
    except psycopg.errors.UniqueViolation as exc:
        raise _conflict(batch) from exc
    except psycopg.errors.NotNullViolation as exc:  # the NULL version of a stream not at its expected one
        if exc.diag.column_name != "version":
            raise
        raise _conflict(batch) from exc
    appended(rows, returned)  # one row back per event, counted
    return [
        RecordedEvent(position, item.stream, version, item.organization_id, event, item.metadata or {}, recorded_at)
        for (position, recorded_at), (item, event, version) in zip(returned, rows)
    ]


APPEND_AT = PreparedStatement("umbra_append_at", _APPEND_GUARDED)


#: The append of :func:`append_statement`, with its arguments, ready for ``db.commit_with``.
AppendStatement = tuple[PreparedStatement, dict[str, Any]]


def append_statement(batch: Sequence[PendingAppend], *, recorded_at: datetime) -> tuple[AppendStatement, list[RecordedEvent]]:
    """The append of ``batch`` as a statement to send with the transaction's last ones, and its events.

    For a caller that folds its events before appending them, so that the
    append, the writes that follow from it and the ``COMMIT`` travel in one
    round trip (``db.commit_with``): the ordering lock is then held only
    while PostgreSQL runs them, not across round trips and the caller's own
    work. Every event is recorded at ``recorded_at``: the transaction's
    ``umbra_now()`` (the column's default), or later. The caller gives a time
    no earlier than the last event of any of the streams it appends to (the
    statement would record that event's time instead, later than the events
    returned here say, as every append never records before it). The events come
    back as they will be recorded, at position 0 until :func:`appended`
    reads their positions from the statement's rows. A stream not at its
    expected version fails the statement, and with it the transaction:
    nothing is written (it is not answered as a :class:`ConcurrencyConflict`;
    the caller rolls back).
    """
    rows, encoded = _encoded_rows(batch)
    recorded = [RecordedEvent(0, item.stream, version, item.organization_id, event, item.metadata or {}, recorded_at)
                for item, event, version in rows]  # fmt: skip
    return (APPEND_AT, {"lock": LOG_LOCK_KEY, "rows": encoded.decode(), "at": recorded_at}), recorded


def appended(recorded: Sequence[Any], returned: Sequence[Sequence[Any]]) -> list[int]:
    """The positions of an append's events, in order, from the rows its statement returned."""
    if len(returned) != len(recorded):  # cannot happen: a stream not at its version fails the statement
        raise RuntimeError(f"{len(recorded)} events appended, {len(returned)} positions returned")
    metrics.count_events_appended(len(returned))
    return [row[0] for row in returned]


@contextlib.asynccontextmanager
async def _appending_copy(
    conn: psycopg.AsyncConnection, batch: Iterable[PendingAppend], count: int, existing: Sequence[PendingAppend]
) -> AsyncIterator[list[RecordedEvent]]:
    """The same append as one reservation statement and one COPY.

    Same guarantees as the INSERT: the ordering lock is taken before any
    position is allocated and held to commit; a stream at version > 0 must
    have its expected version (the probe), and a version already taken, for a
    new stream too, is refused by ``events_stream_version`` (the COPY fails).
    Either way the caller gets :class:`ConcurrencyConflict`. The events are
    encoded once, msgspec JSON straight into COPY text, and sent in chunks.
    """
    cursor = await conn.execute(
        _RESERVE_GUARDED if ORDERING_GUARD else _RESERVE_UNGUARDED,
        {
            "lock": LOG_LOCK_KEY,
            "n": count,
            "streams": [item.stream for item in existing],
            "versions": [item.expected_version for item in existing],
        },
        binary=True,
    )
    positions, recorded_at, recorded_text, missing = await cursor.fetchone()  # type: ignore[misc]
    if missing:  # only a listed batch can hold existing streams
        raise _conflict(batch)  # type: ignore[arg-type]
    out: list[RecordedEvent] = []
    first: PendingAppend | None = None
    items = 0
    lines: list[str] = []
    at = iter(positions)
    # The items of a batch usually share their organization and metadata: format each once.
    orgs: dict[UUID, str] = {}
    tails: dict[int, tuple[Mapping[str, Any], str]] = {}
    try:
        async with conn.cursor().copy(_COPY) as copy:
            for item in batch:
                first = first or item
                items += 1
                stream = copy_text(item.stream)
                org = orgs.get(item.organization_id) or orgs.setdefault(item.organization_id, str(item.organization_id))
                metadata, tail = tails.get(id(item.metadata)) or tails.setdefault(
                    id(item.metadata), _tail(item.metadata, recorded_text)
                )
                version = item.expected_version
                for event in item.events:
                    position = next(at, None)
                    if position is None:
                        raise ValueError(f"the batch carries more than the {count} events reserved")
                    version += 1
                    tag = event.__struct_config__.tag  # type: ignore[attr-defined]
                    lines.append(f"{position}\t{stream}\t{version}\t{tag}\t{org}\t{copy_json(encode_event(event))}{tail}")
                    out.append(RecordedEvent(position, item.stream, version, item.organization_id, event, metadata, recorded_at))
                if len(lines) >= _COPY_CHUNK:
                    await copy.write("".join(lines))
                    lines.clear()
            if lines:
                await copy.write("".join(lines))
            if len(out) != count:
                raise ValueError(f"the batch carries {len(out)} events, not the {count} reserved")
            yield out
    except psycopg.errors.UniqueViolation as exc:
        assert first is not None
        raise _conflict_of(first, items) from exc
    metrics.count_events_appended(count)


def _conflict(batch: Sequence[PendingAppend]) -> ConcurrencyConflict:
    return _conflict_of(batch[0], len(batch))


def _conflict_of(first: PendingAppend, items: int) -> ConcurrencyConflict:
    return ConcurrencyConflict(first.stream if items == 1 else f"{first.stream} (+{items - 1})", first.expected_version)


async def append(
    conn: psycopg.AsyncConnection,
    stream: str,
    expected_version: int,
    events: Sequence[Event],
    *,
    organization_id: UUID,
    metadata: Mapping[str, Any] | None = None,
) -> list[RecordedEvent]:
    """Append ``events`` to ``stream``, which must be at ``expected_version``."""
    return await append_many(conn, [PendingAppend(stream, expected_version, events, organization_id, metadata)])


LOG_COLUMNS = "position, stream, version, organization_id, data::text, metadata::text, recorded_at"
#: The columns of :func:`stored_from_row`: the recorded type too, which the folds read from ``data``.
STORED_COLUMNS = "position, stream, version, type, organization_id, data::text, metadata::text, recorded_at"


def recorded_from_row(row: tuple) -> RecordedEvent:
    """An event as read from the log, from a row of :data:`LOG_COLUMNS`."""
    position, stream, version, organization_id, data, metadata, recorded_at = row
    return RecordedEvent(
        position=position,
        stream=stream,
        version=version,
        organization_id=organization_id,
        event=decode_event(data),
        metadata=documents.decode(metadata),
        recorded_at=recorded_at,
    )


#: Stored JSON without the spaces ``jsonb`` writes after each ``:`` and ``,`` (its numbers' text is kept).
_compact = functools.partial(msgspec.json.format, indent=-1)


def stored_from_row(row: tuple) -> StoredEvent:
    """An event as the log holds it, from a row of :data:`STORED_COLUMNS` (extra trailing columns are ignored)."""
    position, stream, version, type_, organization_id, data, metadata, recorded_at = row[:8]
    return StoredEvent(position, stream, version, type_, organization_id, msgspec.Raw(_compact(data)),
                       msgspec.Raw(_compact(metadata)), recorded_at)  # fmt: skip


_STREAM = (
    "SELECT {columns} FROM events WHERE stream = %s AND (%s::bigint IS NULL OR position <= %s)"
    " AND (%s::text[] IS NULL OR type = ANY(%s::text[])) ORDER BY version"
)


async def read_stream(
    conn: psycopg.AsyncConnection, stream: str, *, up_to_position: int | None = None, types: Sequence[str] | None = None
) -> list[RecordedEvent]:
    """A stream's events in version order, optionally only those at or before a position, or of ``types``
    (a job's claims, say, without the renewals of a long run)."""
    cursor = await conn.execute(_STREAM.format(columns=LOG_COLUMNS), (stream, up_to_position, up_to_position, types, types))
    return [recorded_from_row(row) for row in await cursor.fetchall()]


async def read_stream_as_stored(conn: psycopg.AsyncConnection, stream: str) -> list[StoredEvent]:
    """A stream's events in version order, as the log holds them (:class:`StoredEvent`: to show, not to fold)."""
    cursor = await conn.execute(_STREAM.format(columns=STORED_COLUMNS), (stream, None, None, None, None))
    return [stored_from_row(row) for row in await cursor.fetchall()]


async def count_by_stream(
    conn: psycopg.AsyncConnection, streams: Sequence[str], matching: Sequence[tuple[str, Mapping[str, Any]]], *,
    after: Mapping[str, int] | None = None,
) -> dict[str, list[int]]:
    """How many events each of ``streams`` holds that match each of ``matching`` (a type, and fields its
    data must hold, ``{}``: any), in ``matching``'s order; an event may match several. Only those past the
    version ``after`` gives a stream, if it gives one. Streams with none are left out."""
    types, data = [t for t, _ in matching], [Jsonb(dict(fields)) for _, fields in matching]
    names = list(streams)
    since = [(after or {}).get(stream, 0) for stream in names]
    cursor = await conn.execute(
        "SELECT e.stream, m.i, count(*) FROM unnest(%s::text[], %s::bigint[]) AS s(stream, after)"
        " JOIN events e ON e.stream = s.stream AND e.version > s.after"
        " JOIN unnest(%s::text[], %s::jsonb[]) WITH ORDINALITY AS m(type, data, i) ON e.type = m.type AND e.data @> m.data"
        " GROUP BY e.stream, m.i",
        (names, since, types, data),
    )
    counted: dict[str, list[int]] = {}
    for stream, index, count in await cursor.fetchall():
        counted.setdefault(stream, [0] * len(matching))[index - 1] = count
    return counted


async def last_by_stream(conn: psycopg.AsyncConnection, streams: Sequence[str], type_: str) -> dict[str, RecordedEvent]:
    """Each of ``streams``' last event of ``type_``; streams with none are left out."""
    cursor = await conn.execute(
        f"SELECT DISTINCT ON (stream) {LOG_COLUMNS} FROM events WHERE stream = ANY(%s) AND type = %s ORDER BY stream, version DESC",
        (list(streams), type_),
    )
    return {recorded.stream: recorded for recorded in map(recorded_from_row, await cursor.fetchall())}


async def read_log(
    conn: psycopg.AsyncConnection,
    *,
    after: int = 0,
    limit: int = 1000,
    organization_id: UUID | None = None,
) -> list[RecordedEvent]:
    """Events after ``after`` in commit order (= position order, see module doc)."""
    return [recorded_from_row(row) for row in await _log_rows(conn, LOG_COLUMNS, after, limit, organization_id)]


#: A page of an organization's log as stored, cut short once its documents pass :data:`umbra.paging.PAGE_BYTES`.
_STORED_PAGE = paging.bounded(
    f"SELECT {STORED_COLUMNS} FROM events WHERE organization_id = %(org)s AND position > %(after)s"
    " ORDER BY position LIMIT %(limit)s",
    sizes="octet_length(data) + octet_length(metadata)",
    order="position",
)


async def read_log_as_stored(
    conn: psycopg.AsyncConnection, *, after: int = 0, limit: int = 1000, organization_id: UUID
) -> tuple[list[StoredEvent], bool]:
    """:func:`read_log` of an organization as the log holds the events (:class:`StoredEvent`: to show, not to
    fold), and whether more may follow at once: the page is full, or cut short by its bytes."""
    rows = await (await conn.execute(_STORED_PAGE, {"org": organization_id, "after": after, "limit": limit,
                                                    "page_bytes": paging.PAGE_BYTES})).fetchall()  # fmt: skip
    return [stored_from_row(row) for row in rows], len(rows) == limit or paging.cut_short(rows)


async def _log_rows(
    conn: psycopg.AsyncConnection, columns: str, after: int, limit: int, organization_id: UUID | None
) -> list[tuple]:
    if organization_id is None:
        cursor = await conn.execute(
            f"SELECT {columns} FROM events WHERE position > %s ORDER BY position LIMIT %s", (after, limit)
        )
    else:
        cursor = await conn.execute(
            f"SELECT {columns} FROM events WHERE organization_id = %s AND position > %s ORDER BY position LIMIT %s",
            (organization_id, after, limit),
        )
    return await cursor.fetchall()


#: Every job stream's events, stream by stream in job id order (a UUID's order: its text's, a job's id's),
#: each stream's in position order. Sorted by PostgreSQL, which spills to disk beyond ``work_mem``: at 1,000,000
#: jobs (3,000,000 events) 1 GB of temporary files and about 10 s of the server's CPU, of a verify's 85 s. Read in
#: the order of ``events_stream_version`` instead (``ORDER BY stream, version``: the same order), with no sort and
#: no temporary file, the server did no less work (the heap read in stream order, page by page at random, against
#: one pass) and verify took as long or longer; a log larger than memory would be read at random from disk.
#: docs/PERFORMANCE.md (Rebuild) has the figures.
_JOB_STREAMS = (
    f"SELECT {LOG_COLUMNS} FROM events WHERE left(stream, 4) = 'job:'{{organization}}"
    " ORDER BY substr(stream, 5)::uuid, position"
)


async def read_job_streams(
    conn: psycopg.AsyncConnection, *, organization_id: UUID | None = None, page: int = 1000
) -> AsyncIterator[list[RecordedEvent]]:
    """Every job stream's events, one stream after another in job id order, in pages of ``page`` events.

    Read through a server-side cursor: however long the log, only a page is held here. Call inside a
    transaction (the cursor lives until it ends), as ``verify`` does in its snapshot.
    """
    query = _JOB_STREAMS.format(organization="" if organization_id is None else " AND organization_id = %s")
    async with conn.cursor(name="umbra_job_streams") as cursor:
        await cursor.execute(query, () if organization_id is None else (organization_id,))
        while rows := await cursor.fetchmany(page):
            yield [recorded_from_row(row) for row in rows]


async def head_position(conn: psycopg.AsyncConnection, organization_id: UUID | None = None) -> int:
    """The highest committed position visible now (0 for an empty log)."""
    if organization_id is None:
        cursor = await conn.execute("SELECT coalesce(max(position), 0) FROM events")
    else:
        cursor = await conn.execute(
            "SELECT coalesce(max(position), 0) FROM events WHERE organization_id = %s", (organization_id,)
        )
    return (await cursor.fetchone())[0]


#: Room for hints in one NOTIFY payload, under PostgreSQL's 8000-byte limit: about 140 organizations.
MAX_HINT_PAYLOAD = 7800


def hint_payload(organization_id: UUID, position: int, claimable: int = 0) -> str:
    """One organization's hint: ``<org hex> <position> <claimable jobs>``."""
    return f"{organization_id.hex} {position} {claimable}"


def event_metadata(actor: str | None, request_id: str | None = None) -> dict[str, str]:
    """An event's metadata: who caused it and, for a command that came over HTTP, the request's id.

    The request id is the one the server answers in ``X-Request-ID`` and logs,
    so an auditor can go from an event to the request, and back.
    """
    return {key: value for key, value in (("actor", actor), ("request_id", request_id)) if value}


def merge_hints(merged: dict[UUID, list[int]], hints: Iterable[tuple[UUID, int, int]]) -> dict[UUID, list[int]]:
    """Fold ``(organization_id, position, claimable)`` hints into ``merged``: per organization
    ``[highest position, summed claimable count]``. Returns ``merged``."""
    for org, position, claimable in hints:
        slot = merged.setdefault(org, [0, 0])
        slot[0] = max(slot[0], position)
        slot[1] += claimable
    return merged


#: The payload of a transaction whose hints name more organizations than one payload can carry: every
#: listener re-checks everything, as after a reconnect (:meth:`LogListener.on_reconnect
#: <umbra.events.listener.LogListener.on_reconnect>`), rather than the transaction sending several.
EVERYTHING = "*"


def first_hint_payload(merged: dict[UUID, list[int]]) -> tuple[str, dict[UUID, list[int]]] | None:
    """Merged hints (:func:`merge_hints`) as one NOTIFY payload, as many organizations as fit, and those left
    over; ``None`` when there is nothing to send.

    The organizations' hints share a payload, separated by ``;``, so a
    transaction that touched several organizations (a sweep, a group
    commit's batch) sends one notification, not one per organization: each
    is a message every listener of the cluster must read.
    """
    if not merged:
        return None
    pieces: list[str] = []
    size = 0
    rest: dict[UUID, list[int]] = {}
    for org, slot in merged.items():
        piece = hint_payload(org, *slot)
        if rest or (pieces and size + 1 + len(piece) > MAX_HINT_PAYLOAD):
            rest[org] = slot
            continue
        size += len(piece) + (1 if pieces else 0)
        pieces.append(piece)
    return ";".join(pieces), rest


def parse_hints(payload: str) -> list[tuple[UUID, int, int]] | None:
    """The hints of one payload (see :func:`first_hint_payload`); ``None`` when any is malformed."""
    try:
        hints = []
        for piece in payload.split(";"):
            org, position, claimable = piece.split(" ")
            hints.append((UUID(hex=org), int(position), int(claimable)))
        return hints
    except ValueError:
        return None


async def ask_recheck(conn: psycopg.AsyncConnection, organization_id: UUID) -> None:
    """Have every parked claim of the organization try again once the transaction commits (:data:`RECHECK_CHANNEL`).

    A long-poll tries again only when work may have come; a revoked node's
    long-poll would otherwise answer "nothing yet" at its deadline, up to a
    minute after the revocation, and its agent carry on as if paired. Tried
    again, its claim is refused 401 at once. The organization's streams read
    again too: one whose API key was revoked ends at once.
    """
    await conn.execute("SELECT pg_notify(%s, %s)", (RECHECK_CHANNEL, organization_id.hex))


async def announce_waiting(conn: psycopg.AsyncConnection, organization_id: UUID) -> None:
    """Say, when the transaction commits, that jobs of the organization began waiting for others
    (:data:`WAITING_CHANNEL`). Only transactions that set jobs aside send it: rare next to the log's hints."""
    await conn.execute("SELECT pg_notify(%s, %s)", (WAITING_CHANNEL, organization_id.hex))


async def publish(
    conn: psycopg.AsyncConnection, hints: Iterable[tuple[UUID, int, int]]
) -> None:
    """Send the transaction's hints, coalesced: one NOTIFY at most (:func:`first_hint_payload`), or
    :data:`EVERYTHING` when they name more organizations than one payload can carry (a sweep across
    every tenant): rare, and cheaper than a notification per 140 organizations for every listener."""
    fitted = first_hint_payload(merge_hints({}, hints))
    if fitted is not None:
        payload, rest = fitted
        await conn.execute("SELECT pg_notify(%s, %s)", (LOG_CHANNEL, EVERYTHING if rest else payload))


__all__ = [
    "LOG_CHANNEL",
    "RECHECK_CHANNEL",
    "WAITING_CHANNEL",
    "announce_waiting",
    "ask_recheck",
    "PendingAppend",
    "RecordedEvent",
    "StoredEvent",
    "append",
    "append_many",
    "count_by_stream",
    "last_by_stream",
    "appending",
    "head_position",
    "EVERYTHING",
    "first_hint_payload",
    "hint_payload",
    "merge_hints",
    "job_stream",
    "node_stream",
    "parse_hints",
    "publish",
    "read_log",
    "read_log_as_stored",
    "read_stream",
    "read_stream_as_stored",
]
