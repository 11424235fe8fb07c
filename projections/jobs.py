"""The queue projection: one ``jobs`` row per job, a pure fold of its stream.

:func:`fold` is the only place a job's state changes. Commands call
:func:`record`, which appends their events, folds them onto the current row
and writes the result in the caller's transaction; :func:`rebuild` folds the
whole log with the same function, so the live table and a fresh fold can only
differ if the table was written some other way, which :func:`diff` reports.
Every timestamp the fold sets comes from the event's ``recorded_at`` (the
database clock at append), never from Python's clock, so a rebuild reproduces
the live rows exactly.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from uuid import UUID

import anyio
import anyio.lowlevel
import msgspec
import psycopg

from umbra.db import PreparedStatement
from umbra.domain.jobs import AGENT_STOPPING, STOPPED_ERROR, lease_ended_error
from umbra.events import documents, store
from umbra.events.store import PendingAppend, RecordedEvent, copy_json, copy_text
from umbra.events.types import (
    Event,
    JobBlocked,
    JobCancelled,
    JobClaimed,
    JobCompleted,
    JobDecomposed,
    JobFailed,
    JobLeaseExpired,
    JobLeaseRenewed,
    JobReleased,
    JobRequeued,
    JobReprioritized,
    JobRetried,
    JobSettled,
    JobSubmitted,
    JobUnblocked,
    Placement,
    Progress,
    Requirements,
    Timestamp,
    UnknownEvent,
)

from .long_folds import FOLD_PAGE, long_fold


@dataclass(frozen=True, slots=True)
class JobRow:
    """A ``jobs`` row; field order is column order."""

    id: UUID
    organization_id: UUID
    kind: str
    status: str
    requested_by: str | None
    priority: int
    requires: Requirements
    payload: dict[str, Any]
    project_id: UUID | None
    lang: str | None
    attempt: int
    max_attempts: int
    not_before: datetime | None
    parent_job_id: UUID | None
    idempotency_key: str | None
    lease_owner: UUID | None
    lease_expires_at: datetime | None
    result: Any
    error: str | None
    placement: Placement | None
    blocked_reason: str | None
    blocked_at: datetime | None
    children_total: int
    seq: int
    version: int
    position: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    #: How far the current run is, as its holder last said (a renewal's ``progress``); None until it says.
    progress: Progress | None
    #: Ended while its holder ran it, without the holder's word (cancelled while running, failed past its
    #: ``max_runtime_s``): the handler runs on until its agent hears, and holds its memory till then.
    ended_under_holder: bool
    #: The jobs this one runs after (``JobSubmitted.depends_on``); None: none.
    depends_on: tuple[UUID, ...] | None
    #: Set aside until the jobs it depends on complete (a ``JobBlocked`` with ``waiting_on``); the
    #: sweeper releases it, or fails it when one of them ends otherwise (:mod:`umbra.compute.dependencies`).
    awaiting_dependencies: bool
    #: Set aside until this moment, its ``not_before`` (a ``JobBlocked`` with ``until``); the sweeper releases
    #: it then (:mod:`umbra.compute.delayed`). None for every other job, blocked or not.
    waiting_until: datetime | None


COLUMNS = tuple(f.name for f in fields(JobRow))

_values_of = operator.attrgetter(*COLUMNS)
_slot_setters = [JobRow.__dict__[name].__set__ for name in COLUMNS]
_slot_setter = dict(zip(COLUMNS, _slot_setters))
_column_index = {name: index for index, name in enumerate(COLUMNS)}


def replace(row: JobRow, **changes: Any) -> JobRow:
    """``dataclasses.replace`` for :class:`JobRow`, without re-running ``__init__``.

    The fold copies a row per event; ``dataclasses.replace`` spent most of a
    rebuild's time re-validating 30 fields through the frozen ``__setattr__``.
    Unknown field names still raise (``KeyError``).
    """
    values = list(_values_of(row))
    for name, value in changes.items():
        values[_column_index[name]] = value
    return _build(values)


def positioned(row: JobRow, position: int) -> JobRow:
    """``row`` with its ``position`` set, in place: for a row folded before its event's position was known.

    Only for a row the caller has just folded and shared with nobody
    (:func:`umbra.events.store.append_statement`): the slot is written
    directly, where :func:`replace` would copy the row once more.
    """
    _slot_setter["position"](row, position)
    return row


# -- the fold -------------------------------------------------------------------


def job_id_of(stream: str) -> UUID:
    return UUID(stream.removeprefix("job:"))


def fold(state: JobRow | None, recorded: RecordedEvent, *, job_id: UUID | None = None) -> JobRow:
    """Apply one recorded job event. Pure: the same inputs always give the same row.

    ``job_id`` spares parsing the stream name when the caller already knows it.
    """
    event, at = recorded.event, recorded.recorded_at
    if state is None:
        if not isinstance(event, JobSubmitted):
            raise ValueError(f"{recorded.stream} does not start with job.submitted")
        return _submitted(recorded, event, job_id or job_id_of(recorded.stream))
    if isinstance(event, UnknownEvent):  # a newer writer's: skipped, the stream's version still advances
        return replace(state, version=recorded.version, position=recorded.position, updated_at=at)
    return replace(state, **_apply(state, event, at), version=recorded.version, position=recorded.position, updated_at=at)


def opens_unreadably(recorded: RecordedEvent) -> bool:
    """Whether ``recorded``, the first event of its stream, is one this server cannot read (a newer writer's
    submission: ``job.submitted.v2``, say). Nothing here can start a row from it, so the folds skip the
    whole stream: the job is absent from a rebuild (``verify`` names it) and from ``as_of``, rather than
    every rebuild, verify and ``as_of`` of the organization failing on it."""
    return isinstance(recorded.event, UnknownEvent)


def fold_stream(events: Iterable[RecordedEvent]) -> JobRow | None:
    """One job's events, in stream order, folded from nothing; None when there are none, or when the stream
    opens with what this server cannot read (:func:`opens_unreadably`)."""
    row: JobRow | None = None
    for recorded in events:
        if row is None and opens_unreadably(recorded):
            return None
        row = fold(row, recorded)
    return row


def _submitted(recorded: RecordedEvent, e: JobSubmitted, job_id: UUID) -> JobRow:
    at, position = recorded.recorded_at, recorded.position
    # Positional, in COLUMNS order: once per submitted job, and keywords through the
    # frozen __init__ cost twice as much.
    return _build((
        job_id, recorded.organization_id, e.kind, "queued", e.requested_by, e.priority, e.requires, e.payload,
        e.project_id, e.lang, 0, e.max_attempts, e.not_before, e.parent_job_id, e.idempotency_key, None, None,
        None, None, None, None, None, 0, position, recorded.version, position, at, at, None, None, None, False,
        e.depends_on or None, False, None,
    ))  # fmt: skip


def _straight_line_build() -> Any:
    """``_build(values)``: a row from its values in :data:`COLUMNS` order, through the slots.

    Generated as one straight line of slot stores (as ``dataclasses`` generates
    ``__init__``): a loop over the 30 setters cost a third more, once per
    submitted job.
    """
    args = ", ".join(f"set{i}=_slot_setters[{i}]" for i in range(len(COLUMNS)))
    body = "".join(f"    set{i}(row, values[{i}])\n" for i in range(len(COLUMNS)))
    source = f"def _build(values, new=object.__new__, cls=JobRow, {args}):\n    row = new(cls)\n{body}    return row\n"
    namespace: dict[str, Any] = {"_slot_setters": _slot_setters, "JobRow": JobRow}
    exec(source, namespace)  # noqa: S102 - our own source, built from the column list
    return namespace["_build"]


_build = _straight_line_build()


_RELEASED = {"lease_owner": None, "lease_expires_at": None, "placement": None}


def _apply(s: JobRow, e: Event, at: datetime) -> dict[str, Any]:
    """The columns one event changes."""
    match e:
        case JobClaimed():
            return dict(
                status="running", attempt=e.attempt, lease_owner=e.node_id, lease_expires_at=e.lease_expires_at,
                placement=e.placement, started_at=s.started_at or at, progress=None, ended_under_holder=False,
            )  # fmt: skip
        case JobLeaseRenewed() if e.progress is not None:
            return dict(lease_expires_at=e.lease_expires_at, progress=e.progress)
        case JobLeaseRenewed():  # said nothing of progress: what it last said stands
            return dict(lease_expires_at=e.lease_expires_at)
        case JobCompleted():
            return dict(status="complete", result=e.result, error=None, lease_expires_at=None, finished_at=at)
        case JobFailed():
            return dict(status="failed", error=e.error, lease_expires_at=None, finished_at=at,
                        ended_under_holder=e.reason == "runtime_exceeded", awaiting_dependencies=False)  # fmt: skip
        case JobRequeued():
            return dict(status="queued", error=e.error, not_before=e.not_before, **_RELEASED)
        case JobLeaseExpired() if e.requeued:
            return dict(status="queued", error=lease_ended_error(e), not_before=e.not_before, **_RELEASED)
        case JobLeaseExpired():
            return dict(status="failed", error=lease_ended_error(e), lease_owner=None, lease_expires_at=None,
                           finished_at=at)  # fmt: skip
        case JobReleased(reason=reason):
            # A job a stopping agent gave back says why it is queued again (a claim given back unheard never ran).
            return dict(status="queued", **_RELEASED, **({"error": STOPPED_ERROR} if reason == AGENT_STOPPING else {}))
        case JobBlocked():
            since = s.blocked_at if s.status == "blocked" else at
            return dict(status="blocked", blocked_reason=e.reason, blocked_at=since,
                        awaiting_dependencies=bool(e.waiting_on), waiting_until=e.until, **_RELEASED)  # fmt: skip
        case JobUnblocked():
            return dict(status="queued", blocked_reason=None, blocked_at=None, awaiting_dependencies=False,
                        waiting_until=None)  # fmt: skip
        case JobDecomposed():
            # A container runs on no node: its claim's placement stays in the log, not on the row.
            return dict(status="running", lease_owner=None, lease_expires_at=None, placement=None,
                           children_total=len(e.children))  # fmt: skip
        case JobSettled():
            summary = {"detail": e.detail, "children_total": e.children_total, "children_failed": e.children_failed}
            return dict(status=e.outcome, result=summary, error=e.detail if e.outcome == "partial" else None,
                           finished_at=at)  # fmt: skip
        case JobCancelled():
            # The holder is kept so its next renew/complete learns "cancelled".
            return dict(status="cancelled", lease_expires_at=None, finished_at=at, awaiting_dependencies=False, waiting_until=None,
                        ended_under_holder=s.status == "running" and s.lease_owner is not None)  # fmt: skip
        case JobRetried():
            # Back in its place in the queue; its error stays, the failure it came back from, until a run ends.
            return dict(status="queued", max_attempts=e.max_attempts, result=None, not_before=e.not_before, finished_at=None,
                        blocked_reason=None, blocked_at=None, ended_under_holder=False, awaiting_dependencies=False,
                        waiting_until=None, **_RELEASED)  # fmt: skip
        case JobReprioritized():
            return dict(priority=e.priority)
    raise ValueError(f"not a job event: {type(e).__name__}")


# -- the API's Job object ---------------------------------------------------------


def timestamp(value: datetime | None) -> str | None:
    if value is None:
        return None
    return _timestamp(value)


@functools.lru_cache(maxsize=1024)
def _timestamp(value: datetime) -> str:
    # Cached: a batch's rows share their timestamps (one per transaction).
    return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


@functools.lru_cache(maxsize=1024)
def _requires_json(requires: Requirements) -> dict[str, Any]:
    # Cached per requirement shape (a batch has a handful); callers get a copy.
    out = msgspec.structs.asdict(requires)
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}
    out["prefer_node"] = str(requires.prefer_node) if requires.prefer_node else None
    return out


class JobOut(msgspec.Struct):
    """The API's Job object (API.md), plus ``blocked_reason``, in its field order.

    UUIDs, timestamps and the placement stay objects here and become JSON in msgspec's C
    encoder: a 10,000-job batch response is encoded straight from these, and
    :func:`to_json` gives the same object as plain JSON values. Timestamps are
    UTC, so both write them as RFC 3339 with ``Z``.
    """

    id: UUID
    organization_id: UUID
    kind: str
    status: str
    priority: int
    requires: dict[str, Any]
    payload: Any
    project_id: UUID | None
    lang: str | None
    attempt: int
    max_attempts: int
    not_before: Timestamp | None
    parent_job_id: UUID | None
    idempotency_key: str | None
    requested_by: str | None
    lease_owner: UUID | None
    lease_expires_at: Timestamp | None
    result: Any
    error: str | None
    placement: Placement | None
    blocked_reason: str | None
    created_at: Timestamp
    started_at: Timestamp | None
    finished_at: Timestamp | None
    position: int
    #: An addition: how far the current run is, as its holder last said (``{"fraction"?, "message"?}``).
    progress: Progress | None
    #: An addition: the jobs this one runs after (``[]``: none).
    depends_on: tuple[UUID, ...]


def job_out(row: JobRow) -> JobOut:
    """The API's Job object for a row, ready for the JSON encoder."""
    return JobOut(
        row.id, row.organization_id, row.kind, row.status, row.priority, _requires_json(row.requires), row.payload,
        row.project_id, row.lang, row.attempt, row.max_attempts, _utc(row.not_before), row.parent_job_id,
        row.idempotency_key, row.requested_by, row.lease_owner, _utc(row.lease_expires_at), row.result, row.error,
        row.placement, row.blocked_reason, _utc(row.created_at), _utc(row.started_at),
        _utc(row.finished_at), row.position, row.progress, row.depends_on or (),
    )  # fmt: skip


def to_json(row: JobRow) -> dict[str, Any]:
    """The API's Job object as plain JSON values (:class:`JobOut`)."""
    out = documents.to_builtins(job_out(row))
    out["placement"] = placement_json(row.placement)  # its tuple as a list, as JSON gives it back
    out["depends_on"] = [str(job_id) for job_id in row.depends_on or ()]
    return out


def _utc(value: datetime | None) -> datetime | None:
    # The server's connections read timestamps in UTC already (umbra.db's pool).
    return value if value is None or value.tzinfo is timezone.utc else _in_utc(value)


@functools.lru_cache(maxsize=1024)
def _in_utc(value: datetime) -> datetime:
    # Cached: a batch's rows share their timestamps (one per transaction).
    return value.astimezone(timezone.utc)


def placement_json(placement: Placement | None) -> dict[str, Any] | None:
    if placement is None:
        return None
    out = msgspec.to_builtins(placement)
    out["would_evict"] = list(placement.would_evict)
    return out


# -- reading and writing rows -----------------------------------------------------

_JSON_COLUMNS = frozenset({"requires", "payload", "result", "placement", "progress"})
SELECT_LIST = ", ".join(f"{c}::text" if c in _JSON_COLUMNS else c for c in COLUMNS)
#: A row's bytes of documents and free text as :data:`SELECT_LIST` reads them, over its columns (to bound a
#: page by them: :func:`umbra.paging.bounded`).
DOCUMENT_BYTES = " + ".join(f"coalesce(octet_length({c}), 0)" for c in (*sorted(_JSON_COLUMNS), "error", "blocked_reason"))
_JSON_TYPES = {"requires": Requirements, "payload": dict[str, Any], "result": Any, "placement": Placement | None,
               "progress": Progress | None}  # fmt: skip
_decoders = {name: documents.decoder(t) for name, t in _JSON_TYPES.items()}
_decoder_at = [(COLUMNS.index(name), decoder) for name, decoder in _decoders.items()]
_WIDTH = len(COLUMNS)
_DEPENDS_ON = COLUMNS.index("depends_on")
_encoder = documents.encoder


def from_db(record: Sequence[Any]) -> JobRow:
    """A row selected with :data:`SELECT_LIST` (extra trailing columns are ignored).

    Built positionally through the slots (:func:`_build`): the group commit
    reads every held and claimed row this way, and keywords through the
    frozen ``__init__`` took twice as long.
    """
    values = list(record[:_WIDTH])
    for index, decoder in _decoder_at:
        raw = values[index]
        try:
            values[index] = None if raw is None else decoder.decode(raw)
        except msgspec.ValidationError:  # an earlier release's number jsonb writes out too long for the decoder
            values[index] = documents.decode_stored(decoder, raw)
    if (depends_on := values[_DEPENDS_ON]) is not None:  # a list from the driver, a tuple as the fold has it
        values[_DEPENDS_ON] = tuple(depends_on)
    return _build(values)


_SQL_TYPES = {
    "id": "uuid", "organization_id": "uuid", "project_id": "uuid", "parent_job_id": "uuid", "lease_owner": "uuid",
    "priority": "int", "attempt": "int", "max_attempts": "int", "children_total": "int", "version": "int",
    "seq": "bigint", "position": "bigint", "not_before": "timestamptz", "lease_expires_at": "timestamptz",
    "blocked_at": "timestamptz", "created_at": "timestamptz", "updated_at": "timestamptz",
    "started_at": "timestamptz", "finished_at": "timestamptz",
    "requires": "jsonb", "payload": "jsonb", "result": "jsonb", "placement": "jsonb", "progress": "jsonb",
    "ended_under_holder": "boolean", "depends_on": "uuid[]", "awaiting_dependencies": "boolean",
    "waiting_until": "timestamptz",
}  # fmt: skip
#: Rows travel as one JSON document (msgspec encodes 10,000 rows in milliseconds;
#: psycopg's per-element array dumping took most of a batch submit's time).
_UPSERT = (
    f"INSERT INTO jobs ({', '.join(COLUMNS)}) SELECT {', '.join(COLUMNS)} FROM jsonb_to_recordset(%(rows)s::jsonb) AS r("
    + ", ".join(f"{c} {_SQL_TYPES.get(c, 'text')}" for c in COLUMNS)
    + ") ON CONFLICT (id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in COLUMNS if c not in ("id", "organization_id", "seq", "created_at"))
)



def upsert_params(rows: Sequence[JobRow]) -> dict[str, str]:
    return {"rows": _encoder.encode(rows).decode()}


async def write_rows(conn: psycopg.AsyncConnection, rows: Sequence[JobRow]) -> None:
    """Upsert rows in one statement (a batch of 10,000 is still one round trip)."""
    if rows:
        await conn.execute(_UPSERT, upsert_params(rows))


#: The columns a job's events change after its submission (what :func:`_apply` sets, and the
#: version, position and time of the last event). The others are written once, at submission,
#: and a transition's write leaves them alone, a large payload's out-of-line value included.
#: ``tests/unit/test_jobs_fold.py`` folds every event type and checks that nothing else moves.
TRANSITION_COLUMNS = (
    "status", "priority", "attempt", "max_attempts", "not_before", "lease_owner", "lease_expires_at", "result", "error", "placement",
    "blocked_reason", "blocked_at", "children_total", "version", "position", "updated_at", "started_at", "finished_at",
    "progress", "ended_under_holder", "awaiting_dependencies", "waiting_until",
)  # fmt: skip
#: Sent for each row: the position is not, it is read from the log (below).
_TRANSITION_KEYS = ("id", *(c for c in TRANSITION_COLUMNS if c != "position"))
_transition_values = operator.attrgetter(*_TRANSITION_KEYS)

def _transition_value(index: int, column: str) -> str:
    """The SQL for one column of a row sent as a JSON array (JSON null is SQL NULL, as for every column)."""
    kind = _SQL_TYPES.get(column, "text")
    if kind == "jsonb":
        return f"nullif(r.v->{index}, 'null')"
    return f"r.v->>{index}" if kind == "text" else f"(r.v->>{index})::{kind}"


#: Each row travels as a JSON array in :data:`_TRANSITION_KEYS` order: as objects, the keys made
#: up 40 % of the document that psycopg quotes and PostgreSQL parses (0.62 against 0.55 ms of
#: PostgreSQL's time for 150 rows). Each row's position is that of its last event (the one at its
#: version), read from the log in the same transaction: a caller may then fold its events, and send
#: this write, before the append has told it their positions (:func:`umbra.events.store.append_statement`).
#: A row whose event is not in the log gets no position, which ``jobs.position NOT NULL`` refuses:
#: the write fails rather than leave the row behind.
_TRANSITION = (
    "UPDATE jobs SET "
    + ", ".join(f"{c} = {_transition_value(i, c)}" for i, c in enumerate(_TRANSITION_KEYS) if c != "id")
    + ", position = (SELECT e.position FROM events e WHERE e.stream = 'job:' || (r.v->>0)"
    + f" AND e.version = {_transition_value(_TRANSITION_KEYS.index('version'), 'version')})"
    + " FROM jsonb_array_elements(%(rows)s::jsonb) AS r(v) WHERE jobs.id = (r.v->>0)::uuid"
)  # fmt: skip
#: The transitions' write for :func:`umbra.db.commit_with` (with :func:`transition_params`).
TRANSITIONS = PreparedStatement("umbra_jobs_transitions", _TRANSITION)


def transition_params(rows: Sequence[JobRow]) -> dict[str, str]:
    """The rows' changing columns; for a row whose event is appended in the same transaction, before this write runs."""
    return {"rows": _encoder.encode([_transition_values(row) for row in rows]).decode()}


async def write_transitions(conn: psycopg.AsyncConnection, rows: Sequence[JobRow]) -> None:
    """Write rows that already exist, changed by events after their submission: only :data:`TRANSITION_COLUMNS`.

    An agent's claim or completion used to rewrite the whole row, its payload
    and requirements included. For 150 rows: 3.35 against 3.75 ms with tiny
    payloads, 3.65 against 8.96 ms with 4 KB payloads (the payload was
    encoded, parsed and stored out of line again at every transition).
    """
    if rows:
        await conn.execute(_TRANSITION, transition_params(rows))


_COPY = f"COPY jobs ({', '.join(COLUMNS)}) FROM STDIN"
_NULL = "\\N"


def _copy_line(r: JobRow, memo: dict[Any, str]) -> str:
    """One row in COPY text format, columns in :data:`COLUMNS` order.

    ``memo`` caches texts a batch's rows share: timestamps (keyed by the
    datetime), the organization (by its UUID) and requirement shapes (by the
    object's id; the rows keep them alive). Written out column by column, with
    the usual NULLs inline: this runs once per submitted job.
    """
    N = _NULL
    org = memo.get(r.organization_id) or memo.setdefault(r.organization_id, str(r.organization_id))
    requires = memo.get(id(r.requires)) or memo.setdefault(id(r.requires), copy_json(_encoder.encode(r.requires)))
    return (
        f"{r.id}\t{org}\t{copy_text(r.kind)}\t{r.status}\t"
        f"{N if r.requested_by is None else copy_text(r.requested_by)}\t{r.priority}\t"
        f"{requires}\t{copy_json(_encoder.encode(r.payload))}\t"
        f"{N if r.project_id is None else r.project_id}\t{N if r.lang is None else copy_text(r.lang)}\t"
        f"{r.attempt}\t{r.max_attempts}\t{N if r.not_before is None else _at(r.not_before, memo)}\t"
        f"{N if r.parent_job_id is None else r.parent_job_id}\t"
        f"{N if r.idempotency_key is None else copy_text(r.idempotency_key)}\t"
        f"{N if r.lease_owner is None else r.lease_owner}\t"
        f"{N if r.lease_expires_at is None else _at(r.lease_expires_at, memo)}\t"
        f"{N if r.result is None else copy_json(_encoder.encode(r.result))}\t{N if r.error is None else copy_text(r.error)}\t"
        f"{N if r.placement is None else copy_json(_encoder.encode(r.placement))}\t"
        f"{N if r.blocked_reason is None else copy_text(r.blocked_reason)}\t"
        f"{N if r.blocked_at is None else _at(r.blocked_at, memo)}\t"
        f"{r.children_total}\t{r.seq}\t{r.version}\t{r.position}\t{_at(r.created_at, memo)}\t{_at(r.updated_at, memo)}\t"
        f"{N if r.started_at is None else _at(r.started_at, memo)}\t{N if r.finished_at is None else _at(r.finished_at, memo)}\t"
        f"{N if r.progress is None else copy_json(_encoder.encode(r.progress))}\t{'t' if r.ended_under_holder else 'f'}\t"
        f"{N if r.depends_on is None else _uuid_array(r.depends_on)}\t{'t' if r.awaiting_dependencies else 'f'}\t"
        f"{N if r.waiting_until is None else _at(r.waiting_until, memo)}\n"
    )


def _uuid_array(ids: Sequence[UUID]) -> str:
    """A ``uuid[]`` in COPY text format (a UUID's text needs no quoting)."""
    return "{" + ",".join(map(str, ids)) + "}"


def _at(value: datetime, memo: dict[Any, str]) -> str:
    text = memo.get(value)
    if text is None:
        text = memo[value] = value.isoformat()
    return text


#: Rows per chunk handed to COPY: PostgreSQL inserts one chunk while the next is built.
_COPY_CHUNK = 2000


async def insert_rows(conn: psycopg.AsyncConnection, rows: Sequence[JobRow]) -> None:
    """Insert rows of new jobs by COPY: no conflict to arbitrate, no JSON document to unpack.

    Three round trips instead of one, so :func:`record` uses it for large batches only.
    """
    if not rows:
        return
    memo: dict[Any, str] = {}
    async with conn.cursor().copy(_COPY) as copy:
        for start in range(0, len(rows), _COPY_CHUNK):
            await copy.write("".join([_copy_line(r, memo) for r in rows[start : start + _COPY_CHUNK]]))


_LOAD = f"SELECT {SELECT_LIST} FROM jobs WHERE id = %s AND organization_id = %s"


async def load(conn: psycopg.AsyncConnection, job_id: UUID, organization_id: UUID, *, lock: bool = False) -> JobRow | None:
    """One job of one organization (another organization's is simply absent)."""
    cursor = await conn.execute(_LOAD + (" FOR UPDATE" if lock else ""), (job_id, organization_id))
    record = await cursor.fetchone()
    return from_db(record) if record else None


class Change(msgspec.Struct, frozen=True):
    """Events to append to one job's stream; ``state`` is its current row (None when new)."""

    job_id: UUID
    organization_id: UUID
    state: JobRow | None
    events: Sequence[Event]


async def record(
    conn: psycopg.AsyncConnection,
    changes: Iterable[Change],
    *,
    metadata: Mapping[str, Any] | None = None,
    events: int | None = None,
) -> list[JobRow]:
    """Append, fold and write: the body of every job command, in the caller's transaction.

    Returns the new rows in the order of ``changes``. All appends are one
    statement (or one COPY) and all row writes another, however many jobs change.

    The rows' counts by status follow in ``job_counts`` (triggers on ``jobs``, migrations/0050), written
    after the append here as every row is: the append's ordering lock, held to commit, is what keeps one
    counter row per organization and status from being a point of contention.

    ``events``, when given, is how many events ``changes`` carry in all;
    ``changes`` may then be a generator of new jobs, which a large batch
    consumes while its COPY streams (see :func:`store.appending`).
    """
    taken: list[Change] = []

    def pending() -> Iterator[PendingAppend]:
        for c in changes:
            taken.append(c)
            yield PendingAppend(store.job_stream(c.job_id), c.state.version if c.state else 0, c.events, c.organization_id,
                                metadata)  # fmt: skip

    rows: list[JobRow] = []
    new: list[JobRow] = []
    changed: list[JobRow] = []
    # Fold while a large append is still being inserted (see store.appending).
    async with store.appending(conn, pending(), events=events) as recorded:
        offset = 0
        for change in taken:
            state = change.state
            for event_record in recorded[offset : offset + len(change.events)]:
                state = fold(state, event_record, job_id=change.job_id)
            offset += len(change.events)
            assert state is not None
            rows.append(state)
            (changed if change.state is not None else new).append(state)
    if len(new) >= store.COPY_MIN_EVENTS:
        # A change without a state starts its stream at version 1, which the
        # append just proved new: its row cannot exist yet and needs no upsert.
        await insert_rows(conn, new)
    else:
        await write_rows(conn, new)
    await write_transitions(conn, changed)
    return rows


# -- rebuild and verification -------------------------------------------------------

_LIVE = f"SELECT {SELECT_LIST} FROM jobs WHERE %s::uuid IS NULL OR organization_id = %s ORDER BY seq"


async def live(conn: psycopg.AsyncConnection, organization_id: UUID | None = None) -> dict[UUID, JobRow]:
    """The stored rows. Made into values a page at a time (:mod:`.long_folds`), the event loop served between
    pages: at once, 100,000 rows held a server's loop for 1.5 s (its long-polls, and its transactions that
    hold a lock, which PostgreSQL ends after ``umbra.db.LOCK_HOLDER_IDLE_SECONDS``)."""
    cursor = await conn.execute(_LIVE, (organization_id, organization_id))
    rows: dict[UUID, JobRow] = {}
    with long_fold() as set_aside:
        while chunk := await cursor.fetchmany(FOLD_PAGE):
            rows.update((row.id, row) for row in map(from_db, chunk))
            set_aside()
            await anyio.lowlevel.checkpoint()
    return rows


async def rebuild(
    conn: psycopg.AsyncConnection, organization_id: UUID | None = None, *, page: int = FOLD_PAGE
) -> dict[UUID, JobRow]:
    """Fold every job stream in the log from nothing; nothing is written."""
    rows: dict[UUID, JobRow] = {}
    ids: dict[str, UUID] = {}  # a stream's id, parsed once
    unreadable: set[UUID] = set()  # streams opened by a newer writer's submission (:func:`opens_unreadably`)
    after = 0
    with long_fold() as set_aside:
        while True:
            events = await store.read_log(conn, after=after, limit=page, organization_id=organization_id)
            for event_record in events:
                stream = event_record.stream
                if stream.startswith("job:"):
                    job_id = ids.get(stream) or ids.setdefault(stream, job_id_of(stream))
                    state = rows.get(job_id)
                    if state is None and (job_id in unreadable or opens_unreadably(event_record)):
                        unreadable.add(job_id)
                        continue
                    rows[job_id] = fold(state, event_record, job_id=job_id)
            if len(events) < page:
                return rows
            after = events[-1].position
            del events  # not set aside: the page's events are garbage once folded
            set_aside()


_canonical = documents.canonical_encoder


def same_value(a: Any, b: Any) -> bool:
    """Whether a rebuilt column and a live one hold the same value, JSON types included.

    Python holds ``True == 1`` and ``1 == 1.0``, within lists and objects too: a row some other writer
    changed from ``{"approved": true}`` to ``{"approved": 1}`` passed as equal, and ``verify``, which exists
    to catch such rows, said the views matched the log. Documents are compared by their canonical encoding.
    """
    if type(a) in (int, str, UUID, datetime) or a is None or type(a) is not type(b):
        return type(a) is type(b) and a == b
    return a == b and _canonical.encode(a) == _canonical.encode(b)


def diff(rebuilt: Mapping[UUID, JobRow], current: Mapping[UUID, JobRow]) -> list[dict[str, Any]]:
    """Differences between a rebuild and the live rows, column by column."""
    out: list[dict[str, Any]] = []
    for job_id in sorted(set(rebuilt) | set(current), key=str):
        out += row_differences(job_id, rebuilt.get(job_id), current.get(job_id))
    return out


def row_differences(job_id: UUID, a: JobRow | None, b: JobRow | None) -> list[dict[str, Any]]:
    """One job's differences between its rebuilt row ``a`` and its live row ``b`` (None: absent on that side)."""
    if a is None or b is None:
        return [{"view": "queue", "id": str(job_id), "field": None, "rebuilt": a is not None, "live": b is not None}]
    return [{"view": "queue", "id": str(job_id), "field": name, "rebuilt": repr(getattr(a, name)), "live": repr(getattr(b, name))}
            for name in COLUMNS if not same_value(getattr(a, name), getattr(b, name))]  # fmt: skip


_LIVE_BY_ID = f"SELECT {SELECT_LIST} FROM jobs{{organization}} ORDER BY id"


async def live_by_id(conn: psycopg.AsyncConnection, organization_id: UUID | None = None, *,
                     page: int = FOLD_PAGE) -> AsyncIterator[JobRow]:  # fmt: skip
    """The stored rows in id order, read a page at a time through a server-side cursor (inside a transaction)."""
    query = _LIVE_BY_ID.format(organization="" if organization_id is None else " WHERE organization_id = %s")
    async with conn.cursor(name="umbra_live_jobs") as cursor:
        await cursor.execute(query, () if organization_id is None else (organization_id,))
        while chunk := await cursor.fetchmany(page):
            for row in map(from_db, chunk):
                yield row


async def rebuild_by_id(conn: psycopg.AsyncConnection, organization_id: UUID | None = None, *,
                        page: int = FOLD_PAGE) -> AsyncIterator[JobRow]:  # fmt: skip
    """What :func:`rebuild` folds, a row at a time in id order: each stream's events gathered, folded whole
    (:func:`fold_stream`: a stream opened unreadably is skipped, as :func:`rebuild` skips it), given, dropped."""
    stream: list[RecordedEvent] = []
    async for events in store.read_job_streams(conn, organization_id=organization_id, page=page):
        for event_record in events:
            if stream and event_record.stream != stream[0].stream:
                if (row := fold_stream(stream)) is not None:
                    yield row
                stream = []
            stream.append(event_record)
        del events
    if stream and (row := fold_stream(stream)) is not None:
        yield row


async def compare(conn: psycopg.AsyncConnection, organization_id: UUID | None = None, *,
                  page: int = FOLD_PAGE) -> list[dict[str, Any]]:  # fmt: skip
    """``diff(await rebuild(...), await live(...))``, the same list in the same order, holding about a page of
    each side at a time rather than every row of the organization. Both sides are read in job id order (the
    order ``diff`` reports in) and compared window by window: a window ends at the lower of the two sides'
    last ids read, below which neither side has more to give. Call inside one transaction, as ``verify`` does."""
    out: list[dict[str, Any]] = []
    async with contextlib.aclosing(rebuild_by_id(conn, organization_id, page=page)) as rebuilt, \
            contextlib.aclosing(live_by_id(conn, organization_id, page=page)) as current:  # fmt: skip
        sides = [(rebuilt, [], [await anext(rebuilt, None)]), (current, [], [await anext(current, None)])]
        with long_fold() as set_aside:
            while any(ahead[0] is not None for _, _, ahead in sides):
                for rows, held, ahead in sides:
                    while ahead[0] is not None and len(held) < page:
                        held.append(ahead[0])
                        ahead[0] = await anext(rows, None)
                # Rows above the end stay for the next window: the other side may have theirs still to come.
                ends = [held[-1].id for _, held, ahead in sides if ahead[0] is not None and held]
                end = min(ends) if ends else None
                windows = []
                for _, held, _ in sides:
                    cut = len(held) if end is None else next((n for n, row in enumerate(held) if row.id > end), len(held))
                    windows.append({row.id: row for row in held[:cut]})
                    del held[:cut]
                set_aside()
                out += diff(*windows)
                del windows
                await anyio.lowlevel.checkpoint()
    return out
