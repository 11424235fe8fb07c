"""Submitting, cancelling and reading jobs; settling parents.

Every command here is one transaction: load (and lock) what it decides on,
decide events, :func:`umbra.projections.jobs.record` them (append, fold,
write), then publish one hint. A refused command raises before anything is
appended, so it writes nothing.

Submission is all-or-nothing for a batch: every item is validated (the request
struct, then each named project) before the one ``append_many`` statement and
the one multi-row write. Idempotency keys are scoped to the organization: a key
already used returns the job it created (and appends nothing); two submissions
racing on a new key serialise on the key's lock (:func:`lock_idempotency_keys`),
and the second finds the first one's job.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from datetime import datetime, timezone
from decimal import Decimal
from typing import Annotated, Any, Collection, Iterator, Mapping, Sequence
from uuid import UUID

import anyio
import msgspec
import psycopg
from msgspec import Meta

from umbra import jitter, paging
from umbra.compute.accounts import project_exists
from umbra.db import organization_lock_key, service_lock_wait
from umbra.domain.jobs import MAX_DELAY, decide_cancel, dependencies_of, wait_for_time
from umbra.domain.settlement import settle
from umbra.errors import Conflict, InvalidRequest, NotFound
from umbra.events import documents, store
from umbra.events.types import (
    JOB_STATUSES, TERMINAL_JOB_STATUSES, Event, JobBlocked, JobClaimed, JobDecomposed, JobLeaseExpired, JobLeaseRenewed,
    JobReleased, JobReprioritized, JobRequeued, JobRetried, JobSettled, JobSubmitted, JobUnblocked, Requirements,
)  # fmt: skip
from umbra.projections import jobs as queue
from umbra.projections.jobs import Change, JobRow

from .blocked import BlockingJudge

log = logging.getLogger(__name__)

Priority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
Megabytes = Annotated[int, Meta(ge=0, le=2**31 - 1)]
#: Characters a name (a job kind, a model, a trust domain, an accelerator) may have.
NAME_LENGTH = 200
#: A name holds some character other than whitespace: a kind of spaces reads as no kind in every listing,
#: and a model kind or a node's name of spaces is refused likewise.
NOT_BLANK = r"\S"
Name = Annotated[str, Meta(min_length=1, max_length=NAME_LENGTH, pattern=NOT_BLANK)]
#: Job kinds a claim or a heartbeat may name at most.
MAX_NAMED_KINDS = 100
#: The job kinds an agent takes, as a heartbeat reports them (a claim names them in its query).
Kinds = Annotated[list[Name], Meta(max_length=MAX_NAMED_KINDS)]
MaxAttempts = Annotated[int, Meta(ge=1, le=100)]
IdempotencyKey = Annotated[str, Meta(min_length=1, max_length=200)]

#: The most jobs one batch may carry.
MAX_BATCH = 10_000
#: The most jobs one job may depend on.
MAX_DEPENDS_ON = 100
#: A number in ``depends_on`` naming an earlier item of the same request (a batch's item, a decomposition's
#: child): ``0``, the first.
ItemIndex = Annotated[int, Meta(ge=0)]
#: A child's ``depends_on``: earlier children of its decomposition.
Siblings = Annotated[list[ItemIndex], Meta(max_length=MAX_DEPENDS_ON)]


#: Bytes (UTF-8) of the names a job's kind and requirements may hold in all. The kind and the requirements
#: are the key of the queue's index of shapes (``jobs_by_shape``), and PostgreSQL refuses an index entry
#: over about 2.7 kB: a job naming more could never be stored, nor unblocked once it was.
MAX_REQUIRES_NAMED = 1_500


class RequiresRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    vram_min_mb: Megabytes = 0
    ram_min_mb: Megabytes = 0
    models: list[Name] = []
    trust_domains: list[Name] = []
    accelerators: list[Name] = []
    max_runtime_s: Annotated[int, Meta(ge=1)] | None = None
    prefer_node: UUID | None = None

    def __post_init__(self) -> None:
        if (named := self.named_bytes()) > MAX_REQUIRES_NAMED:
            raise ValueError(f"the names in requires (models, trust_domains, accelerators) take {named} bytes "
                             f"in all, the digits of max_runtime_s counted; at most {MAX_REQUIRES_NAMED}")  # fmt: skip

    def named_bytes(self) -> int:
        """Bytes the requirements add to the queue's shape key beyond their fixed-size fields: the names, and the
        digits of ``max_runtime_s``, a number of any size (kept as ``numeric`` in the key's ``jsonb``)."""
        limit = 0 if self.max_runtime_s is None else len(str(self.max_runtime_s))
        return limit + sum(len(name.encode()) for name in (*self.models, *self.trust_domains, *self.accelerators))

    def to_requirements(self) -> Requirements:
        if self == _NO_REQUIREMENTS_REQUEST:
            return _NO_REQUIREMENTS  # most jobs of a batch: one shared (immutable) value
        return Requirements(
            vram_min_mb=self.vram_min_mb,
            ram_min_mb=self.ram_min_mb,
            models=tuple(dict.fromkeys(self.models)),
            trust_domains=tuple(dict.fromkeys(self.trust_domains)),
            accelerators=tuple(dict.fromkeys(self.accelerators)),
            max_runtime_s=self.max_runtime_s,
            prefer_node=self.prefer_node,
        )


_NO_REQUIREMENTS_REQUEST = RequiresRequest()
_NO_REQUIREMENTS = Requirements()


#: Deepest nesting of arrays and objects in a free-form field: a job's payload, a
#: result. msgspec decodes and encodes recursively, within Python's recursion
#: limit (about 1,000 frames, the caller's included). A payload nested just short
#: of it decoded from the request, then failed when it was encoded again from a
#: deeper stack: after the job was written, so every later read of the job, and
#: of its organization's job list, failed.
MAX_JSON_DEPTH = 100
TOO_DEEP = f"JSON may nest arrays and objects at most {MAX_JSON_DEPTH} levels deep."
UNSTORABLE_NUMBER = (f"a number may have at most {documents.NUMERIC_WHOLE_DIGITS} digits before the decimal point "
                     f"and {documents.NUMERIC_FRACTION_DIGITS} after it.")
UNREADABLE_NUMBER = (f"a number with no digits after the decimal point may be at most {documents.INTEGER_CHARACTERS} "
                     "characters long written out, a minus sign counted (1e5000 is 5001 digits).")
#: How a document's refusal from a struct's ``__post_init__`` starts: the field it is about, in backquotes.
DOCUMENT_FIELD = re.compile(r"^`(\w+)`: ")


def number_refusal(number: Decimal) -> str | None:
    """Why a free-form number (read as a ``Decimal``) cannot be kept: ``numeric`` cannot hold it
    (:func:`~umbra.events.documents.storable_number`), or ``jsonb`` would give it back as an integer too long
    to read again (:func:`~umbra.events.documents.readable_number`); None when it can."""
    if not documents.storable_number(number):
        return UNSTORABLE_NUMBER
    if not documents.readable_number(number):
        return UNREADABLE_NUMBER
    return None


def check_document(value: Any, field: str) -> None:
    """Refuse ``value`` (the body's free-form ``field``) when it could not be stored: nested deeper than
    :data:`MAX_JSON_DEPTH`, or holding a number that could not be kept (:func:`number_refusal`: ``1e200000``,
    which ``numeric`` cannot hold, or ``1e5000``, which would not read back).

    Raises ``ValueError`` naming the field (:data:`DOCUMENT_FIELD`), which msgspec
    reports as a validation error of the struct when it comes from its
    ``__post_init__``: the HTTP layer reads the field back from the message
    (``umbra.api.http.read_json``), and in a batch the item's index, so the
    refusal comes before anything is written and says where. Level by level,
    visiting every value once: a flat payload costs one pass over its values
    (about a microsecond), which a 10,000-job batch pays for every job.
    """
    if type(value) is Decimal and (refused := number_refusal(value)):  # a document that is one number
        raise ValueError(f"`{field}`: {refused}")
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 1
    while level:
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"`{field}`: {TOO_DEEP}")
        deeper = []
        for item in level:
            for child in item.values() if type(item) is dict else item:
                if type(child) is dict or type(child) is list:
                    deeper.append(child)
                elif type(child) is Decimal and (refused := number_refusal(child)):
                    raise ValueError(f"`{field}`: {refused}")
        level = deeper
        depth += 1


class JobRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /v1/jobs`` and each item of a batch."""

    kind: Name
    payload: dict[str, Any] = {}
    requires: RequiresRequest = msgspec.field(default_factory=RequiresRequest)
    priority: Priority = 100
    max_attempts: MaxAttempts = 3
    project_id: UUID | None = None
    lang: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    idempotency_key: IdempotencyKey | None = None
    #: Jobs of the organization this one runs after: it waits (``blocked``) until every one completes. In a
    #: batch, a number names an earlier item of the same batch (``0``: the first).
    depends_on: Annotated[list[UUID | ItemIndex], Meta(max_length=MAX_DEPENDS_ON)] = []
    #: Not to run before this moment (RFC 3339, with its offset): until then the job waits, ``blocked``
    #: (:func:`umbra.domain.jobs.wait_for_time`). At most :data:`~umbra.domain.jobs.MAX_DELAY` from now; a
    #: moment already past is recorded and changes nothing.
    not_before: Annotated[datetime, Meta(tz=True)] | None = None

    def __post_init__(self) -> None:
        check_shape_size(self.kind, self.requires)
        if self.payload:
            check_document(self.payload, "payload")
        if self.not_before is not None:
            self.not_before = in_utc(self.not_before, "not_before")


def in_utc(value: datetime, field: str) -> datetime:
    """A time a request body gives (with its offset), in UTC: as the log records times, where the sender's
    offset would otherwise go as sent (``job.submitted``'s ``not_before``, ``node.heartbeat``'s
    ``agent_started_at``).

    For a struct's ``__post_init__``: a time that leaves datetime's years 1 to 9999 in UTC raises
    ``ValueError`` naming the field, which msgspec answers as the body's fault (422); the ``OverflowError``
    it would otherwise be is a server error.
    """
    try:
        return value.astimezone(timezone.utc)
    except OverflowError:
        raise ValueError(f"`{field}`: out of range in UTC") from None


def check_shape_size(kind: str, requires: RequiresRequest) -> None:
    """The kind and the names in requires share one budget (:data:`MAX_REQUIRES_NAMED`): together they key
    ``jobs_by_shape``, so a long kind leaves less room for names."""
    named = len(kind.encode()) + requires.named_bytes()
    if named > MAX_REQUIRES_NAMED:
        raise ValueError(f"the kind and the names in requires (models, trust_domains, accelerators) take {named} "
                         f"bytes in all, the digits of max_runtime_s counted; at most {MAX_REQUIRES_NAMED}")  # fmt: skip


class BatchRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    jobs: Annotated[list[JobRequest], Meta(min_length=1, max_length=MAX_BATCH)]


@contextlib.contextmanager
def refusing_unstorable() -> Iterator[None]:
    """A value PostgreSQL cannot store (U+0000 in text or jsonb; a number past ``numeric``'s range) is the
    command's refusal (422), not a server error.

    Wrap it around the transaction, so the refused command has rolled back. The
    body's own checks (the NUL scan, :func:`check_document`) refuse such values
    before any command runs, naming where they are; this is the net under them,
    and a refusal here stays the command's own (in a report of several results,
    that result's 422). Only these two: any other error of the data is the
    server's to show, not the caller's.
    """
    try:
        yield
    except psycopg.errors.UntranslatableCharacter:
        raise InvalidRequest("Strings may not contain the NUL character (\\u0000).") from None
    except psycopg.errors.NumericValueOutOfRange:
        raise InvalidRequest("A value in the request cannot be stored (a number out of range).") from None


def submitted_events(
    *,
    kind: str,
    payload: dict[str, Any],
    requires: Requirements,
    priority: int,
    max_attempts: int,
    project_id: UUID | None,
    lang: str | None,
    idempotency_key: str | None,
    requested_by: str | None,
    judge: BlockingJudge,
    parent_job_id: UUID | None = None,
    depends_on: tuple[UUID, ...] = (),
    waiting_on: tuple[UUID, ...] = (),
    not_before: datetime | None = None,
    delayed: bool = False,
) -> list[Event]:
    """A new job's first events: submitted, and blocked while it waits for ``waiting_on`` (those of the jobs
    it depends on that have not completed), for its ``not_before`` (``delayed``: that moment is still to
    come), or when nothing could ever run it. A waiting job is judged against the fleet when it is released
    (:mod:`umbra.compute.dependencies`, :mod:`umbra.compute.delayed`), not now; one released by its
    dependencies before its time waits on for it."""
    events: list[Event] = [
        JobSubmitted(
            kind=kind, priority=priority, max_attempts=max_attempts, requires=requires, payload=payload,
            project_id=project_id, lang=lang, parent_job_id=parent_job_id, idempotency_key=idempotency_key,
            requested_by=requested_by, depends_on=depends_on, not_before=not_before,
        )
    ]  # fmt: skip
    if waiting_on:
        events.append(JobBlocked(reason=waiting_reason(len(waiting_on)), waiting_on=waiting_on))
        return events
    if delayed:
        assert not_before is not None
        events.append(wait_for_time(not_before))
        return events
    reason = judge.reason(requires)
    if reason is not None:
        events.append(JobBlocked(reason=reason))
    return events


def waiting_reason(count: int) -> str:
    """The ``blocked_reason`` of a job waiting for ``count`` jobs it depends on."""
    return f"waiting for {count} job{'s' if count != 1 else ''} it depends on to complete"


def new_job_ids(count: int) -> Iterator[UUID]:
    """Random (version 4) ids, as ``uuid4`` makes them, from one read of the system's randomness."""
    raw = os.urandom(16 * count)
    for start in range(0, 16 * count, 16):
        yield UUID(bytes=raw[start : start + 16], version=4)


def submitted_event_count(requires: Requirements, judge: BlockingJudge, *, waiting: bool = False) -> int:
    """How many events :func:`submitted_events` gives a job with these requirements (``waiting``: for jobs
    it depends on, or for its time)."""
    return 2 if waiting or judge.reason(requires) is not None else 1


_STATUSES = "SELECT id, status FROM jobs WHERE organization_id = %s AND id = ANY(%s::uuid[])"


async def dependency_statuses_of(conn: psycopg.AsyncConnection, organization_id: UUID, job_ids: Sequence[UUID]) -> dict[UUID, str]:
    """The status of each of ``job_ids``, in their order, that the organization has (``missing`` for one it
    has not; jobs are never deleted, so only a submission meets that, and refuses it)."""
    found = dict(await (await conn.execute(_STATUSES, (organization_id, list(job_ids)))).fetchall())
    return {job_id: found.get(job_id, "missing") for job_id in job_ids}


async def dependency_statuses(
    conn: psycopg.AsyncConnection, organization_id: UUID, specs: Sequence[JobRequest], *, batch: bool,
) -> dict[UUID, str]:
    """The status of every job the specs depend on; refuses a spec naming a job the organization does not
    have (404 ``job_not_found``, another organization's included).

    Read without locks: a job that ends after this read is seen by the sweeper's next look at the waiting
    jobs (:mod:`umbra.compute.dependencies`), which reads every dependency again.
    """
    named = list(dict.fromkeys(job_id for spec in specs for job_id in spec.depends_on if isinstance(job_id, UUID)))
    if not named:
        return {}
    statuses = await dependency_statuses_of(conn, organization_id, named)
    for index, spec in enumerate(specs):
        for job_id in spec.depends_on:
            if isinstance(job_id, UUID) and statuses[job_id] == "missing":
                extra = {"index": index} if batch else {}
                raise NotFound("job_not_found", f"No job {job_id} in this organization to depend on.", **extra)
    return statuses


def waiting_on(depends_on: Sequence[UUID], statuses: Mapping[UUID, str], *, index: int | None = None) -> tuple[UUID, ...]:
    """Those of ``depends_on`` not complete yet; refuses (409 ``dependency_failed``) a new job that depends on
    a job which ended otherwise: it would only fail. ``index``: the item's, in a batch."""
    state = dependencies_of(depends_on, statuses)
    if state.ended_otherwise is not None:
        job_id, status = state.ended_otherwise
        extra = {} if index is None else {"index": index}
        raise Conflict("dependency_failed", f"Job {job_id}, which this job would depend on, ended {status}.",
                       dependency=str(job_id), status=status, **extra)  # fmt: skip
    return state.open


_BY_KEYS = f"SELECT {queue.SELECT_LIST} FROM jobs WHERE organization_id = %s AND idempotency_key = ANY(%s)"

#: Advisory lock class of the idempotency-key locks (see ``db.organization_lock_key``).
IDEMPOTENCY_LOCK_CLASS = 0x756D696B
#: Locks per organization the keys are spread over: a transaction takes at most this many, however
#: many keys it names (PostgreSQL's lock table is shared and sized for about 64 locks a connection).
IDEMPOTENCY_LOCKS = 16
_LOCK_KEYS = service_lock_wait(f"SELECT count(pg_advisory_xact_lock({IDEMPOTENCY_LOCK_CLASS}, k)) FROM unnest(%s::int[]) AS k")


async def lock_idempotency_keys(conn: psycopg.AsyncConnection, organization_id: UUID, keys: Sequence[str]) -> None:
    """Hold, to commit, the locks of ``keys``: before a transaction looks them up to decide whether they are new.

    Without them two transactions naming one key both find it unused, and the
    second fails on the unique index at its insert. A retry could fail the
    same way for as long as batches sharing keys keep arriving. With them, the
    second waits for the first to commit and then finds its job. Keys share
    :data:`IDEMPOTENCY_LOCKS` locks per organization, taken in one order
    (sorted), so waits never form a cycle; a batch naming many keys holds
    most of them, and other keyed submissions of its organization wait for
    it to commit.
    """
    if not keys:
        return
    locks = sorted({_lock_of(organization_id, key) for key in keys})
    await conn.execute(_LOCK_KEYS, (locks,))


def _lock_of(organization_id: UUID, key: str) -> int:
    bucket = hashlib.blake2b(key.encode(), digest_size=8).digest()[0] % IDEMPOTENCY_LOCKS
    return organization_lock_key(organization_id, bytes([bucket]))


async def jobs_by_idempotency_key(conn: psycopg.AsyncConnection, organization_id: UUID, keys: Sequence[str]) -> dict[str, JobRow]:
    if not keys:
        return {}
    cursor = await conn.execute(_BY_KEYS, (organization_id, list(keys)))
    return {row.idempotency_key: row for row in map(queue.from_db, await cursor.fetchall())}  # type: ignore[misc]


async def submit(
    conn: psycopg.AsyncConnection, organization_id: UUID, specs: Sequence[JobRequest], *, actor: str | None, batch: bool,
    request_id: str | None = None,
) -> tuple[list[JobRow], int]:
    """Submit jobs; returns the job for each spec (in order) and how many were created.

    ``batch`` adds the failing item's ``index`` to a refusal.
    """
    with refusing_unstorable():
        async with conn.transaction():
            return await _submit(conn, organization_id, specs, actor=actor, batch=batch, request_id=request_id)


async def _submit(
    conn: psycopg.AsyncConnection, organization_id: UUID, specs: Sequence[JobRequest], *, actor: str | None, batch: bool,
    request_id: str | None,
) -> tuple[list[JobRow], int]:
    checked: set[UUID] = set()
    for index, spec in enumerate(specs):
        if spec.project_id is not None and spec.project_id not in checked:
            if not await project_exists(conn, organization_id, spec.project_id):
                extra = {"index": index} if batch else {}
                raise NotFound("project_not_found", f"No project {spec.project_id} in this organization.", **extra)
            checked.add(spec.project_id)
    dependencies = await dependency_statuses(conn, organization_id, specs, batch=batch)
    delayed = await _delayed(conn, specs, batch=batch)
    keys = list({s.idempotency_key for s in specs if s.idempotency_key})
    await lock_idempotency_keys(conn, organization_id, keys)
    existing = await jobs_by_idempotency_key(conn, organization_id, keys)
    judge: BlockingJudge | None = None
    fresh: list[tuple[JobRequest, Requirements, tuple[UUID, ...], tuple[UUID, ...], bool, UUID]] = []  # the id last
    slots: list[JobRow | int] = []
    new_keys: dict[str, int] = {}
    events = 0
    ids = new_job_ids(len(specs))
    for index, spec in enumerate(specs):
        key = spec.idempotency_key
        if key is not None and key in existing:
            slots.append(existing[key])
            continue
        if key is not None and key in new_keys:
            slots.append(new_keys[key])
            continue
        judge = judge or await BlockingJudge.load(conn, organization_id)
        requires = spec.requires.to_requirements()
        depends_on = _items_named(spec.depends_on, index if batch else None, slots, fresh, dependencies)
        waiting = waiting_on(depends_on, dependencies, index=index if batch else None)
        events += submitted_event_count(requires, judge, waiting=bool(waiting) or index in delayed)
        if key is not None:
            new_keys[key] = len(fresh)
        slots.append(len(fresh))
        fresh.append((spec, requires, depends_on, waiting, index in delayed, next(ids)))

    def changes() -> Iterator[Change]:
        # Built while a large batch's COPY streams (see queue.record); the judge
        # is memoised, so it gives the verdicts counted above.
        assert judge is not None
        for spec, requires, depends_on, waiting, later, job_id in fresh:
            yield Change(job_id, organization_id, None, submitted_events(
                kind=spec.kind, payload=spec.payload, requires=requires, priority=spec.priority,
                max_attempts=spec.max_attempts, project_id=spec.project_id, lang=spec.lang,
                idempotency_key=spec.idempotency_key, requested_by=actor, judge=judge,
                depends_on=depends_on, waiting_on=waiting, not_before=spec.not_before, delayed=later,
            ))  # fmt: skip

    rows = await queue.record(conn, changes(), metadata=store.event_metadata(actor, request_id), events=events) if fresh else []
    if rows:
        await publish_new_jobs(conn, organization_id, rows, max(r.position for r in rows))
    return [rows[slot] if isinstance(slot, int) else slot for slot in slots], len(rows)


async def publish_new_jobs(conn: psycopg.AsyncConnection, organization_id: UUID, new: Sequence[JobRow], position: int) -> None:
    """The notifications of a transaction that wrote new jobs (``position``: the last event it appended).

    The log's hint counts those of them queued, for the parked claims. When
    some were set aside to wait for others, it also says so
    (:func:`~umbra.events.store.announce_waiting`): while no job waits, the
    sweeper's leader looks at waiting jobs only every
    :data:`~umbra.compute.sweeper.IDLE_LOOK_SECONDS`, and without the word a
    dependent submitted in that while would be released up to that long after
    its dependencies end.
    """
    await store.publish(conn, [(organization_id, position, sum(1 for row in new if row.status == "queued"))])
    if any(row.awaiting_dependencies for row in new):
        await store.announce_waiting(conn, organization_id)


async def _delayed(conn: psycopg.AsyncConnection, specs: Sequence[JobRequest], *, batch: bool) -> set[int]:
    """The items whose ``not_before`` is still to come by the database's clock (they wait for it); refuses
    (422, field ``not_before``) one further from now than :data:`~umbra.domain.jobs.MAX_DELAY`, either way:
    more likely a mistaken year than a plan, and a moment in the first days of year 1 with a positive offset
    is one PostgreSQL stores but cannot read back. Reads the clock only when an item has a ``not_before``."""
    if all(spec.not_before is None for spec in specs):
        return set()
    [(now,)] = await (await conn.execute("SELECT umbra_now()")).fetchall()
    later = set()
    for index, spec in enumerate(specs):
        if spec.not_before is None:
            continue
        if abs(spec.not_before - now) > MAX_DELAY:
            extra = {"index": index} if batch else {}
            raise InvalidRequest(f"not_before is more than {MAX_DELAY.days} days from now.", field="not_before", **extra)
        if spec.not_before > now:
            later.add(index)
    return later


def _items_named(
    depends_on: Sequence[UUID | int], index: int | None, slots: Sequence[JobRow | int], fresh: Sequence[tuple[Any, ...]],
    statuses: dict[UUID, str],
) -> tuple[UUID, ...]:
    """``depends_on`` as job ids, each once: a number names an earlier item of the batch (``index`` is this
    item's; None: not a batch, where no number is taken), whose status joins ``statuses`` (a new job's
    ``queued``: not complete, so waited for; a job an idempotency key answered, its own)."""
    named: list[UUID] = []
    for item in depends_on:
        if isinstance(item, UUID):
            named.append(item)
            continue
        if index is None:
            raise InvalidRequest("A number in depends_on names an earlier item of the same batch (POST /v1/jobs/batch); "
                                 "here, name jobs by id.", field="depends_on")  # fmt: skip
        if item >= index:
            raise InvalidRequest(f"depends_on names item {item}: only an earlier item of the batch can be depended on.",
                                 field="depends_on", index=index)  # fmt: skip
        slot = slots[item]
        if isinstance(slot, int):
            job_id = fresh[slot][-1]
            statuses[job_id] = "queued"
        else:
            job_id = slot.id
            statuses[job_id] = slot.status
        named.append(job_id)
    return tuple(dict.fromkeys(named))


# -- settlement ---------------------------------------------------------------------

_CHILD_STATUSES = "SELECT status FROM jobs WHERE parent_job_id = %s"


async def settle_parents(
    conn: psycopg.AsyncConnection, finished: Sequence[JobRow], *, metadata: Mapping[str, Any] | None = None
) -> list[JobRow]:
    """Settle the parents of jobs that just ended, in the caller's transaction.

    Called after the children's rows are written, so the child statuses read
    here include them. Parents are locked after their children and in id order
    (the same order every command uses), and a parent that settles may settle
    its own parent in turn. A settlement's metadata names its cause
    (``causation``: the stream of the child whose end settled it), so an
    auditor reading the parent's history can follow it to the child.
    """
    causes: dict[UUID, UUID] = {}
    for r in finished:
        if r.parent_job_id and r.status in TERMINAL_JOB_STATUSES:
            causes.setdefault(r.parent_job_id, r.id)
    pending = sorted(((parent_id, r.organization_id) for r in finished
                      if (parent_id := r.parent_job_id) and causes.get(parent_id) == r.id), key=lambda p: str(p[0]))  # fmt: skip
    settled: list[JobRow] = []
    while pending:
        parent_id, organization_id = pending.pop(0)
        parent = await queue.load(conn, parent_id, organization_id, lock=True)  # type: ignore[arg-type]
        if parent is None or parent.status in TERMINAL_JOB_STATUSES or parent.children_total == 0:
            continue
        statuses = [r[0] for r in await (await conn.execute(_CHILD_STATUSES, (parent_id,))).fetchall()]
        outcome = settle(statuses, expected_children=parent.children_total)
        if outcome is None:
            continue
        event = JobSettled(
            outcome=outcome.outcome, detail=outcome.detail,
            children_total=outcome.children_total, children_failed=outcome.children_failed,
        )  # fmt: skip
        caused = {**(metadata or {}), "causation": store.job_stream(causes[parent_id])}
        [row] = await queue.record(conn, [Change(parent.id, organization_id, parent, [event])], metadata=caused)
        settled.append(row)
        if row.parent_job_id is not None:
            causes[row.parent_job_id] = row.id  # the container that just settled
            pending.append((row.parent_job_id, organization_id))
    return settled


#: Every ancestor (parent, its parent, ...) of the given child jobs, as (child, ancestor): a settlement may
#: climb the whole chain.
_ANCESTORS = """
WITH RECURSIVE up(child, id) AS (
    SELECT c.id, c.parent_job_id FROM jobs c WHERE c.id = ANY(%(children)s::uuid[]) AND c.parent_job_id IS NOT NULL
    UNION
    SELECT up.child, j.parent_job_id FROM jobs j JOIN up ON j.id = up.id WHERE j.parent_job_id IS NOT NULL
)"""
#: The ancestors of jobs a command changes, locked in id order (after the children, as every command does).
_LOCK_ANCESTORS = f"{_ANCESTORS}\nSELECT id FROM jobs WHERE id IN (SELECT id FROM up) ORDER BY id FOR UPDATE"
#: The same, taking only those no other transaction holds now: answers the children one of whose ancestors
#: another transaction holds.
_LOCK_FREE_ANCESTORS = f"""{_ANCESTORS},
free AS (SELECT id FROM jobs WHERE id IN (SELECT id FROM up) ORDER BY id FOR UPDATE SKIP LOCKED)
SELECT DISTINCT up.child FROM up WHERE up.id NOT IN (SELECT id FROM free)"""


async def ancestors_held_elsewhere(conn: psycopg.AsyncConnection, children: Sequence[UUID]) -> set[UUID]:
    """Lock the ancestors of ``children`` that no other transaction holds; returns the children one of whose
    ancestors another transaction holds.

    For the writers that must not wait behind one row (the group commit's batch, the sweeper): a change of
    such a child is left for later, or run alone, since settling its parent would wait for that row after
    the append, holding the log's ordering lock (see :func:`record_and_settle`). The others' ancestors are
    then held, so ``record_and_settle`` waits for none of them.
    """
    if not children:
        return set()
    cur = await conn.execute(_LOCK_FREE_ANCESTORS, {"children": list(children)})
    return {child for (child,) in await cur.fetchall()}


#: Job events after which the job is still open: a change of only these settles no parent.
_KEEP_OPEN = (JobSubmitted, JobClaimed, JobLeaseRenewed, JobRequeued, JobReleased, JobBlocked, JobUnblocked, JobDecomposed,
              JobRetried, JobReprioritized)


def may_end(events: Sequence[Event]) -> bool:
    """Whether a job may have ended after ``events`` (so its parent may settle): any event but those that
    keep it open (:data:`_KEEP_OPEN`, an expired lease that requeues)."""
    return not all(isinstance(e, _KEEP_OPEN) or (isinstance(e, JobLeaseExpired) and e.requeued) for e in events)


async def record_and_settle(
    conn: psycopg.AsyncConnection, changes: Sequence[Change], *, metadata: Mapping[str, Any] | None = None
) -> tuple[list[JobRow], int]:
    """:func:`record`, then settle parents of whatever ended; returns the rows and the last position.

    The ancestors of the changed jobs that may end (:func:`may_end`) are
    locked before the append: the append takes the log's ordering lock until
    commit, and a settlement climbing to an ancestor another transaction
    holds (an operator's open transaction) would otherwise wait for it with
    every other writer of the log waiting behind. A change that keeps its job
    open (a requeue, a renewal) settles nothing and waits for no ancestor.
    """
    children = [c.job_id for c in changes if c.state is not None and c.state.parent_job_id and may_end(c.events)]
    if children:
        await conn.execute(_LOCK_ANCESTORS, {"children": children})
    rows = await queue.record(conn, changes, metadata=metadata)
    settled = await settle_parents(conn, rows, metadata=metadata)
    return rows, max(r.position for r in [*rows, *settled])


# -- cancel ---------------------------------------------------------------------------

_TREE = """
WITH RECURSIVE tree(id, depth) AS (
    SELECT id, 1 FROM jobs WHERE parent_job_id = %(root)s
    UNION ALL
    SELECT j.id, t.depth + 1 FROM jobs j JOIN tree t ON j.parent_job_id = t.id
)"""
_OPEN = "WHERE jobs.status NOT IN ('complete', 'failed', 'cancelled', 'partial')"
_OPEN_DESCENDANTS = f"""{_TREE}
SELECT {queue.SELECT_LIST} FROM jobs JOIN tree USING (id)
{_OPEN}
ORDER BY tree.depth DESC, jobs.id
FOR UPDATE OF jobs
"""
_OPEN_DESCENDANT_IDS = f"{_TREE}\nSELECT jobs.id FROM jobs JOIN tree USING (id)\n{_OPEN}"


async def cancel(conn: psycopg.AsyncConnection, organization_id: UUID, job_id: UUID, *, actor: str | None,
                 request_id: str | None = None, if_waiting: bool = False) -> JobRow:  # fmt: skip
    """Cancel a job: queued or blocked ends at once; running ends and its holder learns on next renew/complete.
    ``if_waiting``: a running job is refused instead (``decide_cancel``), judged under the row's lock.

    Cancelling a container cancels its open descendants too (they are locked
    first, deepest first, so the child-before-parent lock order holds).

    A decomposition that commits while the descendants are being locked adds
    children this transaction did not see: it holds the job (or a descendant)
    locked until it commits, so they show once that lock is granted. Then the
    tree is read again, and if it grew, the locks are given back and the
    cancel starts over: locking the new children after their parent would
    break the lock order.

    Another transaction may hold some of the tree's rows and ask for others
    in another order (several blocked jobs re-examined by id, an operator's
    own transaction; a group commit's batch skips rows held elsewhere, so it
    never waits on the tree's). PostgreSQL then ends one of the two with a
    deadlock; when that is the cancel, it is given back its locks and starts
    over (a few times, after a short random pause), rather than answer 500
    for an ordinary cancel.
    """
    deadlocks = 0
    while True:
        try:
            async with conn.transaction():
                row = await queue.load(conn, job_id, organization_id)
                if row is None:
                    raise NotFound("job_not_found", f"No job {job_id}.")
                decide_cancel(status=row.status, by=actor, if_waiting=if_waiting)  # refuse early, before taking locks
                descendants = [queue.from_db(r) for r in await (await conn.execute(_OPEN_DESCENDANTS, {"root": job_id})).fetchall()]
                row = await queue.load(conn, job_id, organization_id, lock=True)
                assert row is not None
                if await _open_descendant_ids(conn, job_id) <= {d.id for d in descendants}:
                    return await _cancel_locked(conn, organization_id, row, descendants, actor, request_id, if_waiting)
        except psycopg.errors.DeadlockDetected:
            deadlocks += 1
            if deadlocks > DEADLOCK_RETRIES:
                raise
            log.info("cancel deadlocked; starting over", extra={"action": "cancel_deadlock", "job_id": str(job_id)})
            await anyio.sleep(jitter.uniform(0.005, 0.05) * deadlocks)


#: How many times a cancel starts over after a deadlock before it gives up (:func:`cancel`).
DEADLOCK_RETRIES = 5


async def _open_descendant_ids(conn: psycopg.AsyncConnection, job_id: UUID) -> set[UUID]:
    return {r[0] for r in await (await conn.execute(_OPEN_DESCENDANT_IDS, {"root": job_id})).fetchall()}


async def _cancel_locked(conn: psycopg.AsyncConnection, organization_id: UUID, row: JobRow, descendants: list[JobRow],
                         actor: str | None, request_id: str | None, if_waiting: bool) -> JobRow:  # fmt: skip
    changes = [Change(row.id, organization_id, row, [decide_cancel(status=row.status, by=actor, if_waiting=if_waiting)])]
    changes += [
        Change(d.id, organization_id, d, [decide_cancel(status=d.status, by=actor, reason="parent_cancelled")])
        for d in descendants
    ]
    rows, position = await record_and_settle(conn, changes, metadata=store.event_metadata(actor, request_id))
    await store.publish(conn, [(organization_id, position, 0)])
    return rows[0]


# -- reads ------------------------------------------------------------------------------

_CLAIMED_BY = "SELECT EXISTS (SELECT 1 FROM events WHERE stream = %s AND type = 'job.claimed' AND data->>'node_id' = %s)"


async def ever_held(conn: psycopg.AsyncConnection, job_id: UUID, node_id: UUID | None) -> bool:
    """Whether ``node_id`` ever claimed the job: its ``job.claimed`` events say so for good.

    The row's ``lease_owner`` is only the current holder: the fold clears it
    when the job is requeued, released or its lease expires, and a node may
    still read a job it held, e.g. to learn what became of a failure it
    reported. The look-up stays within the job's own stream (indexed by
    stream and version).
    """
    if node_id is None:
        return False
    found = await (await conn.execute(_CLAIMED_BY, (store.job_stream(job_id), str(node_id)))).fetchone()
    return bool(found and found[0])

_LIST = paging.bounded(f"""
SELECT {queue.SELECT_LIST} FROM jobs
WHERE organization_id = %(org)s AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s))
  AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s)) AND seq > %(after)s
ORDER BY seq LIMIT %(limit)s
""", sizes=queue.DOCUMENT_BYTES, order="seq")
#: The statuses a job leaves (index ``jobs_open_by_seq``'s, migrations/0052).
OPEN_JOB_STATUSES = frozenset(JOB_STATUSES) - TERMINAL_JOB_STATUSES
#: A page of jobs of open statuses only: ``jobs_open_by_seq``, whose predicate it repeats whole (a generic plan,
#: a pooled connection's prepared statement's, cannot prove it from ``status = ANY(%s)``), holds only the open
#: jobs, where ``jobs_org_seq`` holds every job the organization ever had, terminal ones for ever.
_LIST_OPEN = paging.bounded(f"""
SELECT {queue.SELECT_LIST} FROM jobs
WHERE organization_id = %(org)s AND status IN ('queued', 'running', 'blocked') AND status = ANY(%(statuses)s)
  AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s)) AND seq > %(after)s
ORDER BY seq LIMIT %(limit)s
""", sizes=queue.DOCUMENT_BYTES, order="seq")


async def get_job(
    conn: psycopg.AsyncConnection, organization_id: UUID, job_id: UUID, *, as_of: int | None = None
) -> JobRow:
    """The job now, or as it stood after log position ``as_of`` (a fold of its events up to there)."""
    if as_of is None:
        row = await queue.load(conn, job_id, organization_id)
    else:
        events = await store.read_stream(conn, store.job_stream(job_id), up_to_position=as_of)
        ours = bool(events) and events[0].organization_id == organization_id
        row = queue.fold_stream(events) if ours else None
        if row is None and ours:
            # It existed then: its history opens with what a newer release wrote (``job.submitted.v2``).
            raise NotFound("job_not_found", f"Job {job_id}'s history opens with {events[0].type}, which a newer "
                           "release wrote and this server cannot fold; its events are readable at "
                           f"/v1/jobs/{job_id}/events.")  # fmt: skip
    if row is None:
        raise NotFound("job_not_found", f"No job {job_id}" + (f" at position {as_of}." if as_of is not None else "."))
    return row


async def list_jobs(
    conn: psycopg.AsyncConnection, organization_id: UUID, *, statuses: list[str] | None, limit: int, after: int,
    kinds: Collection[str] | None = None,
) -> tuple[list[JobRow], int | None]:
    """A page in submission order (of ``statuses`` and ``kinds``, if given), cut short past
    :data:`umbra.paging.PAGE_BYTES`; the cursor is the last job's ``seq`` (None at the end)."""
    named = None if kinds is None else sorted(kinds)
    query = _LIST_OPEN if statuses is not None and OPEN_JOB_STATUSES.issuperset(statuses) else _LIST
    read = await (await conn.execute(query, {"org": organization_id, "statuses": statuses, "kinds": named, "after": after,
                                             "limit": limit, "page_bytes": paging.PAGE_BYTES})).fetchall()  # fmt: skip
    rows = [queue.from_db(r) for r in read]
    return rows, (rows[-1].seq if len(rows) == limit or paging.cut_short(read) else None)
