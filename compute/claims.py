"""Claiming and holding jobs: claim, release, renew, complete, fail, decompose.

**Claim.** One transaction. It reads the claiming node (effective status by
the database clock, devices, resident models) and the organization's model
registry, then reads the organization's claimable jobs in (priority, seq) order
*without* locking (:class:`ClaimableScan`), judging each distinct shape (a job
kind and its requirements) once with the pure eligibility rules, and the kinds
the claim names if it names any, reading only rows of shapes the node may take. Among those candidates it locks exactly one with ``FOR UPDATE
SKIP LOCKED``, re-checking in the same statement that the row is still queued
and due, so two claimers never hold the same job and a node never takes a job
of another organization or one it cannot run: eligibility is decided before the
lock, not after the claim.

The scan first lists the organization's distinct queued shapes by
index (a skip scan of ``jobs_by_shape``: one descent per shape), judges them,
and merges the heads of the shapes the node can run, so the cost of a claim
follows the number of shapes, not the depth of the queue or the work in front
that the node cannot run. An organization with more than :data:`MAX_SHAPES`
shapes is first walked in claim order by ``jobs_claimable``: pages of
:data:`SCAN_PAGE` rows, every page after the first excluding (in SQL) the
shapes already found ineligible. Past :data:`WALK_PAGES` pages the shapes are
listed again, up to :data:`MANY_SHAPES`, and read on from there by their
heads; only with more than that does the walk go on, to
:data:`MAX_SCAN_PAGES` pages.

The job's state then changes only through the fold: ``job.claimed`` (attempt
incremented, lease set from the database clock, the placement recorded) is
appended and folded onto the locked row.

**Fencing.** Renew, complete, fail and decompose name the attempt they hold.
Anyone else, or a holder whose job was claimed again, gets 409
``job_not_claimed_by_this_node``; a holder whose job was cancelled gets 409
``job_cancelled``. Either refusal happens before any append.

**Repeats.** A holder that did not hear the answer to its completion,
failure or decomposition sends it again. One the job has already recorded,
from the node that reported it for that attempt, is answered as the first
was and records nothing (``repeats_completion``, ``repeats_failure``,
``repeats_decomposition`` in :mod:`umbra.domain.jobs`). Where the row no
longer names the node (a requeue, a decomposition clear the holder), the
job's stream says who ended that attempt, read only then
(:func:`attempt_ended_by`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, AsyncIterator, Callable, Collection, Mapping, Sequence
from uuid import UUID, uuid4

import msgspec
import psycopg

from umbra import metrics
from umbra.db import uuid_array
from umbra.domain.eligibility import in_service, takes_kind
from umbra.domain.jobs import (
    AGENT_STOPPING, UnchargedEnds, check_holder, decide_failure, decide_give_back, decide_lease_expiry,
    decomposition_repeat_needs_log, failure_repeat_needs_log, repeats_completion, repeats_decomposition, repeats_failure,
)  # fmt: skip
from umbra.domain.models import RegisteredModel
from umbra.domain.node_status import DEFAULT_STALE_SECONDS
from umbra.domain.placement import NO_HOLDERS, ModelHolders, best_placement, defers, passes_over, takes_memory
from umbra.errors import InvalidRequest, NotFound
from umbra.events import store
from umbra.events.types import (
    JobClaimed, JobCompleted, JobDecomposed, JobLeaseExpired, JobLeaseRenewed, JobReleased, JobRequeued, JobRetried, Placement,
    Progress, Requirements,
)  # fmt: skip
from umbra.projections import jobs as queue
from umbra.projections.jobs import Change, JobRow

from .blocked import QUEUED_SHAPES, BlockingJudge, hold_capacity, read_models, read_nodes
from .model_holders import read_model_holders
from .jobs import (
    IdempotencyKey, MaxAttempts, Name, Priority, RequiresRequest, Siblings, ancestors_held_elsewhere, check_document, check_shape_size,
    jobs_by_idempotency_key, lock_idempotency_keys, may_end, publish_new_jobs, record_and_settle, refusing_unstorable,
    submitted_events,
)  # fmt: skip
from .abandoned_claims import ClaimAbandoned, is_abandoned
from .nodes import hold_node_memory, share_claim_guards

log = logging.getLogger(__name__)

#: Candidate rows fetched per page of the ordered scan.
SCAN_PAGE = 100
#: Pages scanned per claim before giving up (the next claim scans afresh).
MAX_SCAN_PAGES = 20
#: Distinct queued shapes (kind and requirements) the first read of a claim lists: with no more, it judges
#: them all and reads only the heads of the eligible ones (see :data:`MANY_SHAPES` for more).
MAX_SHAPES = 64
#: Past :data:`MAX_SHAPES`, a claim walks the queue in claim order for :data:`WALK_PAGES` pages (cheap
#: when work it can run is near the front), then lists the shapes again, up to this many, and reads on
#: from there as with few: the cost follows the number of shapes (a skip-scan step each, some 10 µs), not
#: the rows in front. Walking on instead stepped over every row of every shape the node cannot run, and
#: a node behind 2,000 rows of distinct shapes it cannot run was never answered a job it could. Only
#: past this many shapes does the walk go on, to :data:`MAX_SCAN_PAGES` pages.
MANY_SHAPES = 10_000
WALK_PAGES = 2
#: Rows of one page of many shapes' heads at most, shared out among the eligible shapes.
MANY_SHAPES_PAGE = 1_000
#: Rows per page of the shape scan, shared out among the eligible shapes (at least
#: :data:`MIN_SHAPE_ROWS` each): the more shapes a node can run, the fewer rows of each.
SHAPE_PAGE = 16
MIN_SHAPE_ROWS = 2

#: The first ``limit`` claimable rows after (priority, seq) of each of the given shapes,
#: by ``jobs_by_shape``; the caller merges them (:class:`ClaimableScan`).
_SHAPES_SCAN = """
SELECT j.id, j.priority, j.seq, s.shape{outer} FROM unnest(%(shapes)s::text[]) AS s(shape)
CROSS JOIN LATERAL (
    SELECT id, priority, seq{waited} FROM jobs
    WHERE organization_id = %(org)s AND status = 'queued'
      AND kind = s.shape::jsonb->>0 AND requires = s.shape::jsonb->1
      AND (not_before IS NULL OR not_before <= umbra_now())
      AND (priority, seq) > (%(priority)s, %(seq)s)
    ORDER BY priority, seq
    LIMIT %(limit)s
) j
ORDER BY j.priority, j.seq
"""
#: One page of the organization's claimable jobs in claim order by ``jobs_claimable``,
#: skipping shapes already judged ineligible (the fallback for many shapes).
_CLAIMABLE_SCAN = """
SELECT id, priority, seq, jsonb_build_array(kind, requires)::text{waited} FROM jobs
WHERE organization_id = %(org)s AND status = 'queued'
  AND (not_before IS NULL OR not_before <= umbra_now())
  AND (priority, seq) > (%(priority)s, %(seq)s)
  AND NOT (jsonb_build_array(kind, requires) = ANY(%(skip)s::text[]::jsonb[]))
  AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
ORDER BY priority, seq
LIMIT %(limit)s
"""
#: The scans' rows as :data:`ScanRow`, or with a fifth column, the seconds each job has waited in the queue
#: since it was submitted or, if later, since it fell due (a retry's back-off, a delayed submission), for
#: model affinity (:func:`defers`). Only a claimer that judges affinity reads it. Not since its row's last
#: change: a job moved to another priority, or unblocked, has waited all along, and started its wait over.
_WAITED = ", extract(epoch FROM umbra_now() - greatest(created_at, not_before))::float8 AS waited"
SHAPES_SCAN = _SHAPES_SCAN.format(outer="", waited="")
SHAPES_SCAN_WAITED = _SHAPES_SCAN.format(outer=", j.waited", waited=_WAITED)
CLAIMABLE_SCAN, CLAIMABLE_SCAN_WAITED = (_CLAIMABLE_SCAN.format(waited=w) for w in ("", _WAITED))
#: The rows among ``ids`` that are still queued and due, in claim order (:func:`lock_queued`).
_QUEUED_AMONG = f"""
SELECT {queue.SELECT_LIST}, umbra_now() FROM jobs
WHERE id = ANY(%(ids)s::uuid[])
  AND (organization_id = %(org)s AND status = 'queued' AND (not_before IS NULL OR not_before <= umbra_now())) IS TRUE
ORDER BY priority, seq
"""
_LOCK_QUEUED = f"{_QUEUED_AMONG}FOR UPDATE SKIP LOCKED"
_LOCK_ONE = f"{_QUEUED_AMONG}LIMIT 1\nFOR UPDATE SKIP LOCKED"


async def lock_queued(conn: psycopg.AsyncConnection, organization_id: UUID, ids: Sequence[UUID], *,
                      first_only: bool = False) -> list[Any]:  # fmt: skip
    """Lock those of ``ids`` (candidates a scan has just read) that are still queued and due and nobody else holds.

    Returns their rows (``queue.SELECT_LIST`` and the database clock) in claim
    order; only the first with ``first_only``. The id list must be the only
    way the planner can find them, whatever it believes of the queue's size:

    * Written plainly, the organization and status conditions let it walk
      ``jobs_claimable`` and filter the whole queue by the list, which a
      planner without statistics of the queue (a table never analysed, or
      grown since) believes cheapest: 4 ms per call at 30,000 queued jobs,
      against 0.25 ms by the primary key. Under ``IS TRUE`` they are a filter
      it can neither search an index by nor match to a partial index.
    * A plan made once and cached (a prepared statement's generic plan) while
      the queue was empty reads it whole: a sequential scan is the cheapest
      way to read an empty table. So the values are written into the
      statement (psycopg's client-side binding): it is planned for each call,
      by the table's current size, for about 0.1 ms.
    """
    cursor = psycopg.AsyncClientCursor(conn)
    await cursor.execute(_LOCK_ONE if first_only else _LOCK_QUEUED, {"ids": uuid_array(ids), "org": organization_id})
    return await cursor.fetchall()


#: The first claimable rows of one shape that nobody else holds, locked, in claim order:
#: the shape's rows are walked by ``jobs_by_shape`` and locked as they come (``FOR UPDATE SKIP
#: LOCKED``, the lock re-checking queued and due), until ``count`` are held or the shape has no more.
#: Rows are locked only as the outer ``LIMIT`` pulls them. Both the shape and the inner limit are
#: written for the planner: with the shape as a plain constant, or the inner limit as a parameter,
#: the generic plan walked ``jobs_claimable`` through all the work in front that other shapes hold
#: (250 ms a claim at 1,000,000 queued, half of it GPU work ahead of the CPU shape).
_LOCK_FIRST_OF_SHAPE = f"""
SELECT j.* FROM unnest(%(shapes)s::text[]) AS s(shape)
CROSS JOIN LATERAL (
    SELECT {queue.SELECT_LIST}, umbra_now() FROM jobs
    WHERE organization_id = %(org)s AND status = 'queued'
      AND kind = s.shape::jsonb->>0 AND requires = s.shape::jsonb->1
      AND (not_before IS NULL OR not_before <= umbra_now())
    ORDER BY priority, seq
    LIMIT {SCAN_PAGE}
    FOR UPDATE SKIP LOCKED
) j
LIMIT %(count)s
"""
_LOCK_BY_ID = f"SELECT {queue.SELECT_LIST}, umbra_now() FROM jobs WHERE id = %s AND organization_id = %s FOR UPDATE"

_FIRST = (-(2**31), 0)

#: A claimable row as the scans return it: id, priority, seq, shape (:func:`decode_shape`), and with
#: ``waited`` (:class:`ClaimableScan`) the seconds it has waited in the queue.
ScanRow = tuple[Any, ...]

_shape = msgspec.json.Decoder(tuple[str, Requirements])


@functools.lru_cache(maxsize=4096)
def decode_shape(shape: str) -> tuple[str, Requirements]:
    """A queue shape's job kind and requirements.

    The scans name a shape by the JSON text of ``[kind, requirements]``
    (migrations/0029): one string, so it is a dictionary key and an element of
    a ``text[]`` parameter, and SQL splits it again. Claimers judge the
    requirements (eligibility and placement) and the kind (the kinds a claim
    names, when it names any) of each shape once; the decoded shape is cached (both are immutable), for
    the group commit asks for it per claimer and page.
    """
    return _shape.decode(shape)


def shapes_take_memory(shapes: Sequence[str], kinds: frozenset[str] | None = None) -> bool:
    """Whether a job of one of the queued ``shapes`` that a claim taking ``kinds`` may take takes memory where
    it runs (more than :data:`MAX_SHAPES` are not all listed: then one may)."""
    if len(shapes) > MAX_SHAPES:
        return True
    return any(takes_memory(requires) and takes_kind(kinds, kind) for kind, requires in map(decode_shape, shapes))


def models_to_load(shapes: Sequence[str], would_load: Callable[[str], bool]) -> list[str]:
    """The models named by the queued ``shapes`` that a claimer would load (``would_load``: placed where they
    are not resident): who else holds them decides whether model affinity passes their jobs over."""
    return sorted({slug for shape in shapes if decode_shape(shape)[1].models and would_load(shape)
                   for slug in decode_shape(shape)[1].models})  # fmt: skip


async def model_holders(conn: psycopg.AsyncConnection, organization_id: UUID, shapes: Sequence[str],
                        placements_of: Callable[[str], Collection[Placement | None]], models: Mapping[str, RegisteredModel], *,
                        affinity_seconds: int, stale_seconds: int) -> ModelHolders:  # fmt: skip
    """The nodes a claim leaves jobs to (:func:`passed_over`): with model affinity, those holding a model the
    claimers (``placements_of``: their placements of a shape) would load for a queued shape; read only then."""
    if not affinity_seconds:
        return NO_HOLDERS

    def would_load(shape: str) -> bool:
        return any(placed is not None and not placed.resident for placed in placements_of(shape))

    slugs = models_to_load(shapes[:MAX_SHAPES], would_load)
    return await read_model_holders(conn, organization_id, slugs, models, stale_seconds=stale_seconds)


def passed_over(row: ScanRow, placement: Placement | None, node_id: UUID, holders: ModelHolders,
                affinity_seconds: int) -> float | None:  # fmt: skip
    """For a row of a scan that read the rows' waits: the seconds for which ``node_id`` leaves it to a node that
    holds its models (:func:`umbra.domain.placement.passes_over`), or ``None`` when it may take it now."""
    if placement is None or len(row) < 5:
        return None
    kind, requires = decode_shape(row[3])
    return passes_over(requires, placement, node_id=node_id, waited_seconds=row[4], affinity_seconds=affinity_seconds,
                       holders=holders, kind=kind)  # fmt: skip


async def queued_shapes(conn: psycopg.AsyncConnection, organization_id: UUID) -> psycopg.AsyncCursor[Any]:
    """Start reading the organization's queued shapes (one more than :data:`MAX_SHAPES` at most)."""
    return await conn.execute(QUEUED_SHAPES, {"org": organization_id, "limit": MAX_SHAPES + 1})


async def models_for_shapes(conn: psycopg.AsyncConnection, organization_id: UUID, shapes: Sequence[str]) -> Mapping[str, RegisteredModel]:
    """The organization's model registry, read only when one of the queued ``shapes`` names a model.

    Eligibility and placement consult the registry only for the models a job
    names (``requires.models``), so a claim over jobs that name none needs no
    registry: on the agent path that is one statement less per claim
    transaction. More than :data:`MAX_SHAPES` shapes are not all listed, so
    then the registry is read.
    """
    if len(shapes) <= MAX_SHAPES and not any(decode_shape(shape)[1].models for shape in shapes):
        return {}
    return await read_models(conn, organization_id)


class ClaimableScan:
    """An organization's claimable (queued, due) jobs in claim order, only of shapes ``runnable`` accepts.

    ``runnable`` is asked once per shape (a job kind and its requirements:
    :func:`decode_shape`). The single claim asks whether its node can run the
    shape and its claim takes the kind, the group commit whether any of its
    waiting claimers can; each caches its placements. Pages come in
    (priority, seq) order and hold only accepted shapes' rows; a caller goes
    to the next page only when every row it wanted was locked by others.

    With at most :data:`MAX_SHAPES` queued shapes, all are judged up front and
    each page merges the heads of the accepted shapes (``per_shape`` rows each,
    by default :data:`SHAPE_PAGE` shared among them): a page ends at the earliest point where a shape could have more rows,
    so the merge is exactly claim order. With more, the first pages walk
    ``jobs_claimable`` in claim order, judging shapes as they appear; a claimer
    that reads past :data:`WALK_PAGES` of them has the shapes listed again (up
    to :data:`MANY_SHAPES`, ``per_shape`` bounded so a page holds about
    :data:`MANY_SHAPES_PAGE` rows) and reads on from there by shape heads.
    """

    def __init__(self, conn: psycopg.AsyncConnection, organization_id: UUID, shapes: Sequence[str],
                 runnable: Callable[[str], bool], *, per_shape: int | None = None,
                 kinds: Collection[str] | None = None, waited: bool = False) -> None:  # fmt: skip
        self._conn = conn
        #: Rows carry the seconds they have waited (a fifth column), for model affinity.
        self._waited = waited
        self._org = organization_id
        self._shapes = shapes
        self._runnable = runnable
        self._per_shape = per_shape
        #: The only kinds any claimer of this scan takes (None: every kind). ``runnable`` judges them too;
        #: the ordered walk also skips other kinds in SQL, so their rows never fill its bounded pages.
        self._kinds = None if kinds is None else sorted(kinds)
        self._accepted: list[str] | None = None
        #: Known after the first page: the organization has no queued job that is due.
        self.nothing_due = not shapes

    def _judged(self) -> list[str]:
        """The queued shapes ``runnable`` accepts, each judged once (only when all are listed)."""
        if self._accepted is None:
            self._accepted = [shape for shape in self._shapes if self._runnable(shape)]
        return self._accepted

    def only_shape(self) -> str | None:
        """The one queued shape the claimer can run, when it can run exactly one (of at most :data:`MAX_SHAPES`).

        Then the claim order among the rows it may take is that shape's own
        (priority, seq) order, and :func:`lock_first_of_shape` finds and locks
        the first one in a single statement instead of reading a page and then
        locking. Claims that find nothing that way go through :meth:`pages`,
        which also says whether anything was due at all.
        """
        if not self._shapes or len(self._shapes) > MAX_SHAPES:
            return None
        accepted = self._judged()
        return accepted[0] if len(accepted) == 1 else None

    async def pages(self) -> AsyncIterator[list[ScanRow]]:
        if not self._shapes:
            return
        after, listed_again = _FIRST, False
        if len(self._shapes) > MAX_SHAPES:
            walk = _Walk()
            async for page in self._ordered_pages(walk, WALK_PAGES):
                yield page
            if walk.ended:
                return
            shapes = [shape for (shape,) in await (await self._conn.execute(
                QUEUED_SHAPES, {"org": self._org, "limit": MANY_SHAPES + 1})).fetchall()]  # fmt: skip
            if len(shapes) > MANY_SHAPES:
                async for page in self._ordered_pages(walk, MAX_SCAN_PAGES - WALK_PAGES):
                    yield page
                return
            self._shapes, self._accepted = shapes, [shape for shape in shapes if walk.judge(shape, self._runnable)]
            after, listed_again = walk.after, True
        accepted = self._judged()
        every_shape = not listed_again and len(accepted) == len(self._shapes)
        per_shape = self._per_shape or max(MIN_SHAPE_ROWS, SHAPE_PAGE // max(1, len(accepted)))
        if listed_again:
            per_shape = min(per_shape, max(MIN_SHAPE_ROWS, MANY_SHAPES_PAGE // max(1, len(accepted))))
        for scanned in range(MAX_SCAN_PAGES):
            if not accepted:
                return
            params = {"org": self._org, "shapes": accepted, "priority": after[0], "seq": after[1], "limit": per_shape}
            rows: list[ScanRow] = await (await self._conn.execute(SHAPES_SCAN_WAITED if self._waited else SHAPES_SCAN, params)).fetchall()
            page, accepted = _merged_page(rows, per_shape)
            if not scanned and not rows and every_shape:
                self.nothing_due = True
            if page:
                # With the rows' waits read (model affinity), every row read is offered: the heads of the shapes
                # past the cut too, so a job whose models a node holds is found however many loads of its
                # priority are queued ahead of it (its claimer ranks by priority first: the rows not read, all
                # past the cut, cannot outrank it). Those not taken are read again with the next page.
                yield rows if self._waited else page
                after = (page[-1][1], page[-1][2])

    async def _ordered_pages(self, walk: _Walk, pages: int) -> AsyncIterator[list[ScanRow]]:
        """Up to ``pages`` more pages of the walk in claim order, from where ``walk`` stands."""
        for _ in range(pages):
            params = {"org": self._org, "priority": walk.after[0], "seq": walk.after[1], "skip": walk.skip,
                      "limit": SCAN_PAGE, "kinds": self._kinds}  # fmt: skip
            rows: list[ScanRow] = await (await self._conn.execute(CLAIMABLE_SCAN_WAITED if self._waited else CLAIMABLE_SCAN, params)).fetchall()
            if walk.after == _FIRST and not rows and self._kinds is None:
                self.nothing_due = True
            page = [row for row in rows if walk.judge(row[3], self._runnable)]
            if len(rows) < SCAN_PAGE:
                walk.ended = True
            else:
                walk.after = (rows[-1][1], rows[-1][2])
            if page:
                yield page
            if walk.ended:
                return


@dataclass
class _Walk:
    """Where a walk of the queue in claim order stands: past ``after``, each shape met judged once, the
    ones the claimer cannot run skipped in SQL from the next page on; ``ended`` once the queue's end is read."""

    after: tuple[int, int] = _FIRST
    judged: dict[str, bool] = field(default_factory=dict)
    skip: list[str] = field(default_factory=list)
    ended: bool = False

    def judge(self, shape: str, runnable: Callable[[str], bool]) -> bool:
        if shape not in self.judged:
            self.judged[shape] = runnable(shape)
            if not self.judged[shape]:
                self.skip.append(shape)
        return self.judged[shape]


async def lock_first_of_shape(conn: psycopg.AsyncConnection, organization_id: UUID, shape: str, *,
                              count: int = 1) -> list[Any]:  # fmt: skip
    """The first ``count`` claimable (queued, due, not held by another claimer) rows of ``shape``, locked.

    Fewer when the shape has fewer that nobody else holds (the caller then
    reads on page by page, which also says whether anything was due). Each
    row comes with the database clock as its last column, as every locking
    read here.
    """
    params = {"org": organization_id, "shapes": [shape], "count": min(count, SCAN_PAGE)}
    return await (await conn.execute(_LOCK_FIRST_OF_SHAPE, params, binary=True)).fetchall()


def _merged_page(rows: list[ScanRow], per_shape: int) -> tuple[list[ScanRow], list[str]]:
    """The claim-order prefix of merged shape heads that no unread row can precede, and the shapes to read on.

    ``rows`` holds up to ``per_shape`` rows of each shape, in (priority, seq)
    order. A shape that returned fewer has no more; one that returned all of
    them may continue after its last row, so the page stops at the earliest
    such last row. The next page reads the shapes that may continue and those
    with rows past the cut.
    """
    counts: dict[str, int] = {}
    last: dict[str, tuple[int, int]] = {}
    for _id, priority, seq, shape, *_ in rows:
        counts[shape] = counts.get(shape, 0) + 1
        last[shape] = (priority, seq)
    full = [shape for shape, count in counts.items() if count >= per_shape]
    if not full:
        return rows, []
    cut = min(last[shape] for shape in full)
    page = [row for row in rows if (row[1], row[2]) <= cut]
    return page, list(dict.fromkeys([*full, *(row[3] for row in rows[len(page):])]))


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """A claimed job: the API's claim response plus what a caller needs to release it.

    Holds the claimed row and its placement; the API objects are built when
    asked for (``job``: the Job object, ``placement``: the Placement object,
    ``lease_expires_at``: RFC 3339 UTC), by the request that answers with
    them. The group commit's batch worker, which every agent's claim waits
    for, only records what was claimed.
    """

    row: JobRow
    placed: Placement
    #: The server's monotonic clock (``time.monotonic``) no later than the claim's own time, from which the
    #: lease was granted: the lease left when the answer is sent is measured from it (:func:`lease_left`).
    #: ``None``: not known, and the whole lease granted is said.
    asked_at: float | None = None

    @property
    def job_id(self) -> UUID:
        return self.row.id

    @property
    def attempt(self) -> int:
        return self.row.attempt

    @property
    def job(self) -> dict[str, Any]:
        return queue.to_json(self.row)

    @property
    def placement(self) -> dict[str, Any]:
        return queue.placement_json(self.placed) or {}

    @property
    def lease_expires_at(self) -> str:
        return queue.timestamp(self.row.lease_expires_at) or ""

    def to_json(self) -> dict[str, Any]:
        """The claim response, for the JSON encoder (the Job as a :class:`~umbra.projections.jobs.JobOut`)."""
        return {"job": queue.job_out(self.row), "placement": self.placed, "lease_expires_at": self.lease_expires_at}


def lease_left(row: JobRow, asked_at: float | None) -> float | None:
    """Seconds of the holder's lease left now, at least: the lease granted at its claim or renewal (the row's
    last change), less the time since ``asked_at`` (the server's monotonic clock, no later than that change;
    ``None``: the whole lease granted). ``None`` when the job holds no lease. The claims one answer carries
    were made in one transaction, from one ``asked_at``: the first says it for all.

    Neither the database's clock nor the app server's is read against the other: ``lease_expires_at`` less
    the ``Date`` of the answer told an agent nothing true when the two disagreed, and an agent whose server's
    clock ran behind the database's renewed after its lease had run out (``umbra.agent.client.lease_left``).
    """
    if row.lease_expires_at is None:
        return None
    granted = (row.lease_expires_at - row.updated_at).total_seconds()
    spent = 0.0 if asked_at is None else time.monotonic() - asked_at
    return round(max(0.0, granted - spent), 3)


async def claim(
    conn: psycopg.AsyncConnection,
    *,
    node_id: UUID,
    organization_id: UUID,
    lease_seconds: int,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
    request_id: str | None = None,
    kinds: frozenset[str] | None = None,
    affinity_seconds: int = 0,
) -> ClaimResult | None:
    """Claim the first queued job of the organization this node is eligible for, or ``None``.

    With ``kinds``, only a job of one of those kinds: an agent names the kinds
    it has handlers for, and the others wait for an agent that has them. With
    ``affinity_seconds``, in the order :func:`claim_rank` gives (model affinity). Raises
    :class:`~umbra.compute.abandoned_claims.ClaimAbandoned` when the node's agent gave up on
    ``request_id`` before it ran."""
    async with conn.transaction():
        if not await share_claim_guards(conn, node_id, organization_id):
            return None  # the node or the registry is being changed: read them once that has committed
        if await is_abandoned(conn, node_id, request_id):
            raise ClaimAbandoned(request_id)
        shapes = [shape for (shape,) in await (await queued_shapes(conn, organization_id)).fetchall()]
        models = await models_for_shapes(conn, organization_id, shapes)
        if shapes_take_memory(shapes, kinds):
            await hold_node_memory(conn, organization_id, node_id)  # then its running jobs are read as the last claim left them
        nodes = await read_nodes(conn, organization_id, node_id=node_id, stale_seconds=stale_seconds, models=models)
        if not nodes or nodes[0].status != "online" or not in_service(nodes[0]):
            return None
        node = nodes[0]
        judged: dict[str, Placement | None] = {}

        def runnable(shape: str) -> bool:
            kind, requires = decode_shape(shape)
            judged[shape] = best_placement(node, requires, models) if takes_kind(kinds, kind) else None
            return judged[shape] is not None

        def placement_of(shape: str) -> Placement | None:
            return judged[shape] if shape in judged or runnable(shape) else None

        scan = ClaimableScan(conn, organization_id, shapes, runnable, kinds=kinds, waited=affinity_seconds > 0)
        holders = await model_holders(conn, organization_id, shapes, lambda shape: (placement_of(shape),), models,
                                      affinity_seconds=affinity_seconds, stale_seconds=stale_seconds)  # fmt: skip
        only = scan.only_shape()
        if only is not None and not holders.any and (locked := await lock_first_of_shape(conn, organization_id, only)):
            return await _take(conn, locked[0], node_id, judged[only], lease_seconds, request_id)  # type: ignore[arg-type]
        async for page in scan.pages():
            if holders.any:  # the jobs this node leaves to one that holds their models (model affinity across nodes)
                page = [row for row in page if passed_over(row, judged.get(row[3]), node_id, holders, affinity_seconds) is None]
            shape_of = {row[0]: row[3] for row in page}
            for ids in _in_rank(page, claim_rank(page, affinity_seconds)(judged.get)) if affinity_seconds else [list(shape_of)]:
                locked = next(iter(await lock_queued(conn, organization_id, ids, first_only=True)), None)
                if locked is not None:
                    placement = judged[shape_of[locked[0]]]
                    assert placement is not None
                    return await _take(conn, locked, node_id, placement, lease_seconds, request_id)
        return None


def claim_rank(page: Sequence[ScanRow], affinity_seconds: int) -> Callable[[Callable[[str], Placement | None]], Callable[[UUID], tuple]]:
    """The order in which a claimer takes a page's rows, given its placement of each shape: a sort key.

    Claim order, (priority, seq), except with model affinity (``affinity_seconds``
    above 0, the page read with ``waited``): within a priority, the jobs the
    claimer's node would pass over for now (:func:`umbra.domain.placement.defers`)
    come after the others, each group in queue order.
    """
    rows = {row[0]: (index, row) for index, row in enumerate(page)}

    def for_claimer(placement_of: Callable[[str], Placement | None]) -> Callable[[UUID], tuple]:
        def key(job_id: UUID) -> tuple:
            index, row = rows[job_id]
            placed = placement_of(row[3])
            later = (affinity_seconds > 0 and placed is not None and len(row) > 4
                     and defers(decode_shape(row[3])[1], placed, waited_seconds=row[4], affinity_seconds=affinity_seconds))  # fmt: skip
            return (row[1], later, index)

        return key

    return for_claimer


def _in_rank(page: Sequence[ScanRow], key: Callable[[UUID], tuple]) -> list[list[UUID]]:
    """The page's ids in groups of equal priority and deferral, in ``key`` order: each group is locked in queue
    order by :func:`lock_queued`, the first group with a free row winning."""
    ranked = sorted((row[0] for row in page), key=key)
    return [list(group) for _, group in itertools.groupby(ranked, key=lambda job_id: key(job_id)[:2])]


async def _take(
    conn: psycopg.AsyncConnection, locked: Sequence[Any], node_id: UUID, placement: Placement, lease_seconds: int,
    request_id: str | None,
) -> ClaimResult:
    row, now = queue.from_db(locked), locked[-1]
    event = JobClaimed(
        attempt=row.attempt + 1, node_id=node_id, placement=placement,
        lease_expires_at=now + timedelta(seconds=lease_seconds),
    )  # fmt: skip
    [claimed] = await queue.record(conn, [Change(row.id, row.organization_id, row, [event])], metadata=node_metadata(node_id, request_id))
    await store.publish(conn, [(row.organization_id, claimed.position, 0)])
    log.debug("job claimed", extra={"action": "job_claimed", "job_id": str(row.id), "node_id": str(node_id)})
    return ClaimResult(claimed, placement)


def frees_room(held: JobRow) -> int:
    """The claimable count of the hint of a report that ends ``held``'s run: 1 when it took memory where it
    ran. A claim parked because the next job did not fit that node looks again now, as after a heartbeat
    that frees memory; without it the node's long-poll waited for its safety poll with the card idle.
    A job that took no memory changes what no node can run: 0, and no claim is tried for it."""
    return int(takes_memory(held.requires))


def node_metadata(node_id: UUID, request_id: str | None) -> dict[str, str]:
    """The metadata of an event a node's request caused."""
    return store.event_metadata(f"node:{node_id}", request_id)


_LOCK_FOR_RELEASE = f"SELECT {queue.SELECT_LIST} FROM jobs WHERE id = %s FOR UPDATE"


async def release(conn: psycopg.AsyncConnection, job_id: UUID, node_id: UUID, attempt: int, *,
                  request_id: str | None = None, claimed_at: datetime | None = None,
                  reason: str = "client_gone") -> bool:  # fmt: skip
    """Give a just-claimed job back to the queue (``job.released``); False if this node no longer holds it.

    For a claim its agent never heard of: a long-poll whose client went away
    before it received its claim (``client_gone``), or the next job of a
    completion whose answer was lost and which its agent sent again without
    asking for one (``not_asked_again``: it is stopping). The
    attempt stays counted: it is the fencing token and never goes back. The
    claim is not charged against ``max_attempts`` (:func:`uncharged_claims`): it never
    ran. The release itself never fails the job.
    """
    async with conn.transaction():
        record = await (await conn.execute(_LOCK_FOR_RELEASE, (job_id,))).fetchone()
        if record is None:
            return False
        row = queue.from_db(record)
        if row.status != "running" or row.lease_owner != node_id or row.attempt != attempt:
            return False
        if claimed_at is not None and row.updated_at != claimed_at:
            return False  # not that claim: the same node took the job again at that attempt, elsewhere
        [released] = await queue.record(
            conn, [Change(row.id, row.organization_id, row, [JobReleased(attempt=attempt, reason=reason)])],
            metadata=node_metadata(node_id, request_id),
        )
        await store.publish(conn, [(row.organization_id, released.position, 1)])
    metrics.count_given_back(reason)
    return True


#: The jobs a claim request of the node took (named by its request id, which the claim's event records)
#: that stand as that claim left them: still leased to the node, the claim their stream's last event.
_CLAIMED_BY_REQUEST = """
SELECT j.id, j.attempt, j.updated_at FROM jobs j
CROSS JOIN LATERAL (
    SELECT e.type, e.metadata FROM events e WHERE e.stream = 'job:' || j.id::text ORDER BY e.version DESC LIMIT 1
) AS last
WHERE j.organization_id = %(organization)s AND j.lease_owner = %(node)s AND j.status = 'running'
  AND j.lease_expires_at IS NOT NULL AND last.type = 'job.claimed' AND last.metadata ->> 'request_id' = %(claim_request)s
ORDER BY j.seq
"""


async def release_unread_claim(conn: psycopg.AsyncConnection, *, organization_id: UUID, node_id: UUID, claim_request_id: str,
                               request_id: str | None = None) -> list[UUID]:  # fmt: skip
    """Give back what a claim request of this node took, when its agent never read the answer.

    The agent gave up on the request (it is stopping, or the answer was cut
    off or timed out) after the server may have committed the claim and sent
    it: the server cannot tell an answer sent from an answer read, only the
    agent can. Each job that claim took and that stands untouched since is
    released (``job.released``, ``reason: answer_unread``, never charged: it
    never ran) and claimable by another node at once, instead of waiting out a
    lease no agent will renew. Returns the released jobs' ids, in submission order.

    Run once the request's abandonment has committed
    (:func:`umbra.compute.abandoned_claims.abandon`): no claim of it can
    commit after that, so every one it made is found here.
    """
    cursor = await conn.execute(_CLAIMED_BY_REQUEST, {"organization": organization_id, "node": node_id,
                                                      "claim_request": claim_request_id})  # fmt: skip
    released = []
    for job_id, attempt, claimed_at in await cursor.fetchall():
        if await release(conn, job_id, node_id, attempt, request_id=request_id, claimed_at=claimed_at, reason="answer_unread"):
            released.append(job_id)
    return released


def _tag(event_type: type[Any]) -> str:
    return event_type.__struct_config__.tag


#: The claim ends :class:`UnchargedEnds` counts: every claim given back (``job.released``), those of them a
#: stopping agent gave back after starting them, and leases ended by the holding node's revocation.
_UNCHARGED_CLAIM_ENDS = ((_tag(JobReleased), {}), (_tag(JobReleased), {"reason": AGENT_STOPPING}),
                         (_tag(JobLeaseExpired), {"cause": "node_revoked"}))  # fmt: skip


async def uncharged_claims(conn: psycopg.AsyncConnection, job_ids: Sequence[UUID]) -> dict[UUID, UnchargedEnds]:
    """Each job's claims that ended through no doing of its own (:class:`UnchargedEnds`).

    Read from the log, by each job's stream, only where a failure, an ended
    lease or a give-back has to judge whether attempts remain: rare next to
    claims, so the queue's rows carry no counter for it. A retried job's ends
    are counted from its last retry on, with those before as the retry froze
    them. Jobs with none are left out.
    """
    streams = [store.job_stream(job_id) for job_id in job_ids]
    retries = await store.last_by_stream(conn, streams, _tag(JobRetried))
    counted = await store.count_by_stream(conn, streams, _UNCHARGED_CLAIM_ENDS,
                                          after={stream: retry.version for stream, retry in retries.items()})  # fmt: skip
    ends = {}
    for stream in streams:
        retry = retries[stream].event if stream in retries else None
        released, stopping, revoked = counted.get(stream, (0, 0, 0))
        if retry is not None or stream in counted:
            ends[queue.job_id_of(stream)] = UnchargedEnds(
                unheard=released - stopping, interrupted=stopping + revoked,
                retried_at=retry.attempt if isinstance(retry, JobRetried) else 0,
                uncharged_before=retry.uncharged if isinstance(retry, JobRetried) else 0,
            )  # fmt: skip
    return ends


async def end_leases(
    conn: psycopg.AsyncConnection, records: Sequence[Any], *, delay_seconds: int, node_revoked: bool,
    metadata: Mapping[str, Any], leave_held: bool = False,
) -> list[JobRow]:
    """End the leases of held jobs no holder will report: ``job.lease_expired`` each, parents settled.

    ``records`` are the jobs' rows, locked, each followed by the database
    clock. Each goes back to the queue, claimable ``delay_seconds`` from now,
    or fails when its attempts are spent (:func:`decide_lease_expiry`).
    ``node_revoked``: their node's credentials were revoked; a lease that had
    not run out yet then ends with that cause (not charged), one that had
    ends as the sweeper would have ended it (charged): which of the two came
    first must not change what the job is charged. The caller publishes.

    ``leave_held`` (the sweeper, which must not wait behind one row): a job
    whose end would settle an ancestor another transaction holds (an
    operator's open transaction) is left for later, and not returned; one
    whose lease end requeues it settles nothing and ends now.
    """
    uncharged = await uncharged_claims(conn, [record[0] for record in records])
    changes = []
    for record in records:
        row, now = queue.from_db(record), record[-1]
        revoked_first = node_revoked and row.lease_expires_at is not None and row.lease_expires_at >= now
        event = decide_lease_expiry(attempt=row.attempt, max_attempts=row.max_attempts, node_id=row.lease_owner, now=now,
                                    delay_seconds=delay_seconds, ends=uncharged.get(row.id, UnchargedEnds()),
                                    cause="node_revoked" if revoked_first else "expired")  # fmt: skip
        changes.append(Change(row.id, row.organization_id, row, [event]))
    if leave_held:
        held = await ancestors_held_elsewhere(conn, [c.job_id for c in changes if c.state.parent_job_id and may_end(c.events)])
        changes = [c for c in changes if c.job_id not in held]
    if not changes:
        return []
    rows, _ = await record_and_settle(conn, changes, metadata=metadata)
    return rows


async def _locked(conn: psycopg.AsyncConnection, organization_id: UUID, job_id: UUID) -> tuple[JobRow, datetime]:
    """The job's row, locked, and the database clock; another organization's job is not found."""
    record = await (await conn.execute(_LOCK_BY_ID, (job_id, organization_id))).fetchone()
    if record is None:
        raise NotFound("job_not_found", f"No job {job_id}.")
    return queue.from_db(record), record[-1]


def _check_holder(row: JobRow, node_id: UUID, attempt: int) -> None:
    check_holder(status=row.status, lease_owner=row.lease_owner, attempt=row.attempt, node_id=node_id, claimed_attempt=attempt)


async def _held(
    conn: psycopg.AsyncConnection, organization_id: UUID, job_id: UUID, node_id: UUID, attempt: int, *,
    repeated_completion_ok: bool = False,
) -> tuple[JobRow, datetime]:
    """The job's row, locked, once this node holds it at ``attempt`` (refused otherwise); with
    ``repeated_completion_ok``, also the row of a job this holder already completed at that attempt."""
    row, now = await _locked(conn, organization_id, job_id)
    if not (repeated_completion_ok and repeats_completion(status=row.status, lease_owner=row.lease_owner, attempt=row.attempt,
                                                          node_id=node_id, claimed_attempt=attempt)):  # fmt: skip
        _check_holder(row, node_id, attempt)
    return row, now


async def attempt_ended_by(conn: psycopg.AsyncConnection, job_id: UUID, attempt: int, ending: type[Any]) -> tuple[UUID | None, Any]:
    """The node whose claim at ``attempt`` ended in an ``ending`` event, and that event; ``(None, None)`` if it did not.

    For a report sent again where the row no longer names the node that sent
    the first (``job.requeued`` and ``job.decomposed`` clear the holder). The
    claim's event names the node; the report was fenced by that claim, so it
    was that node's. Only the job's claims and reports of that type are read
    (one per attempt at most, never its renewals), and only for a request the
    row alone would refuse.
    """
    recorded = await store.read_stream(conn, store.job_stream(job_id), types=[_tag(JobClaimed), _tag(ending)])
    # A newer writer's event this server cannot read (an UnknownEvent) names no attempt it can trust: passed over.
    found = [r.event for r in recorded if getattr(r.event, "attempt", None) == attempt]
    claimed = next((e for e in found if isinstance(e, JobClaimed)), None)
    ended = next((e for e in found if isinstance(e, ending)), None)
    if claimed is None or ended is None:
        return None, None
    return claimed.node_id, ended


async def renew(
    conn: psycopg.AsyncConnection, *, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int, lease_seconds: int,
    request_id: str | None = None, progress: Progress | None = None,
) -> JobRow:
    """Extend the holder's lease to ``now + lease_seconds`` (database clock), recording ``progress`` if given."""
    async with conn.transaction():
        row, now = await _held(conn, organization_id, job_id, node_id, attempt)
        event = JobLeaseRenewed(attempt=attempt, lease_expires_at=now + timedelta(seconds=lease_seconds), progress=progress)
        [renewed] = await queue.record(conn, [Change(row.id, organization_id, row, [event])],
                                       metadata=node_metadata(node_id, request_id))  # fmt: skip
        await store.publish(conn, [(organization_id, renewed.position, 0)])
    return renewed


async def complete(
    conn: psycopg.AsyncConnection, *, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int, result: Any,
    request_id: str | None = None,
) -> JobRow:
    """The holder finished: the job completes and, if it was the last open child, its parent settles."""
    row, _ = await record_completion(conn, organization_id=organization_id, node_id=node_id, job_id=job_id,
                                     attempt=attempt, result=result, request_id=request_id)  # fmt: skip
    return row


async def record_completion(
    conn: psycopg.AsyncConnection, *, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int, result: Any,
    request_id: str | None = None,
) -> tuple[JobRow, bool]:
    """:func:`complete`, and whether this call recorded it: ``False`` for a completion sent again, answered
    with the first result (see :func:`umbra.domain.jobs.repeats_completion`), which must claim nothing more."""
    with refusing_unstorable():
        async with conn.transaction():
            row, _ = await _held(conn, organization_id, job_id, node_id, attempt, repeated_completion_ok=True)
            if row.status == "complete":  # a repeat: the first result stands
                return row, False
            changes = [Change(row.id, organization_id, row, [JobCompleted(attempt=attempt, result=result)])]
            [done], position = await record_and_settle(conn, changes, metadata=node_metadata(node_id, request_id))
            await store.publish(conn, [(organization_id, position, frees_room(row))])
        return done, True


_CLAIMED_WITH = f"""
SELECT {queue.SELECT_LIST}, umbra_now() FROM jobs
WHERE (id, organization_id, updated_at) = (
        SELECT (metadata->>'next_claim')::uuid, organization_id, recorded_at FROM events
        WHERE stream = %(stream)s AND type = 'job.completed')
  AND status = 'running' AND lease_owner = %(node)s
"""


async def claimed_with(conn: psycopg.AsyncConnection, completed: JobRow, node_id: UUID) -> ClaimResult | None:
    """The claim made in the same transaction as ``completed``'s completion (``complete?claim_next``), while
    it stands untouched: the job still runs under ``node_id`` and has not changed since (its row's last
    change is that transaction's). ``None`` when the completion chained no claim, or the claim has ended.

    For a completion sent again because its answer was lost: that answer named this job, which is
    leased to the node, and the agent never heard of it. Answering it again lets the agent run it; a
    new claim would leave it to wait out its lease, an attempt spent, and fail it for good when that
    was its last. The completion's event names it (``next_claim`` in its metadata).
    """
    cur = await conn.execute(_CLAIMED_WITH, {"stream": store.job_stream(completed.id), "node": node_id})
    record = await cur.fetchone()
    if record is None:
        return None
    return _claimed_earlier(record)


def _claimed_earlier(record: Sequence[Any]) -> ClaimResult | None:
    """A claim made by an earlier request, read with the database's clock (the last column): its lease was
    granted that long before now."""
    row, now = queue.from_db(record), record[-1]
    if row.placement is None:
        return None
    return ClaimResult(row, row.placement, asked_at=time.monotonic() - (now - row.updated_at).total_seconds())


_CLAIMED_WITH_REPORT = f"""
SELECT {queue.SELECT_LIST}, umbra_now() FROM (
    SELECT metadata->'next_claims' AS claimed, organization_id AS made_in, recorded_at AS made_at FROM events
    WHERE stream = ANY(%(streams)s) AND type = 'job.completed' AND metadata ? 'next_claims'
) report
CROSS JOIN LATERAL jsonb_array_elements_text(report.claimed) WITH ORDINALITY AS taken(claim_id, ord)
JOIN jobs ON jobs.id = taken.claim_id::uuid AND jobs.organization_id = report.made_in AND jobs.updated_at = report.made_at
WHERE jobs.status = 'running' AND jobs.lease_owner = %(node)s
ORDER BY report.made_at, taken.ord
"""


async def claimed_with_report(conn: psycopg.AsyncConnection, repeated: Sequence[JobRow], node_id: UUID) -> list[ClaimResult]:
    """The jobs claimed with a report of several results (``POST /v1/agent/complete?claim_next=N``) whose
    completions ``repeated`` repeat, in claim order, those still leased to ``node_id`` untouched since.

    :func:`claimed_with` for a report: its first recorded completion's event names the jobs its claim
    took (``next_claims``), and a job whose row has changed since that transaction (renewed, released,
    expired, cancelled) is not answered again.
    """
    streams = [store.job_stream(row.id) for row in repeated]
    cur = await conn.execute(_CLAIMED_WITH_REPORT, {"streams": streams, "node": node_id})
    return [claim for claim in map(_claimed_earlier, await cur.fetchall()) if claim is not None]


async def fail(
    conn: psycopg.AsyncConnection,
    *,
    organization_id: UUID,
    node_id: UUID,
    job_id: UUID,
    attempt: int,
    error: str,
    retry: bool,
    request_id: str | None = None,
) -> JobRow:
    """A retryable failure requeues with backoff while attempts remain; otherwise the job fails.

    A failure this node already reported for ``attempt``, sent again, is
    answered with the job as it stands and records nothing (the first
    outcome stands: see :func:`umbra.domain.jobs.repeats_failure`).
    """
    with refusing_unstorable():
        async with conn.transaction():
            row, now = await _locked(conn, organization_id, job_id)
            if await _repeats_failure(conn, row, node_id, attempt):
                return row
            _check_holder(row, node_id, attempt)
            ends = (await uncharged_claims(conn, [job_id])).get(job_id, UnchargedEnds()) if retry else UnchargedEnds()
            event = decide_failure(attempt=attempt, max_attempts=row.max_attempts, error=error, retry=retry, now=now,
                                   ends=ends)  # fmt: skip
            [failed], position = await record_and_settle(conn, [Change(row.id, organization_id, row, [event])],
                                                         metadata=node_metadata(node_id, request_id))  # fmt: skip
            await store.publish(conn, [(organization_id, position, frees_room(row))])
    return failed


async def give_back(
    conn: psycopg.AsyncConnection, *, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int,
    request_id: str | None = None,
) -> JobRow:
    """A stopping agent gives back a job it could not finish within its grace (:func:`decide_give_back`):
    back to the queue at once, in its place, not charged while its interruptions are fewer than its
    ``max_attempts``.

    Sent again (its answer lost), it is answered with the job as it stands and
    records nothing, as a repeated failure is.
    """
    async with conn.transaction():
        row, now = await _locked(conn, organization_id, job_id)
        if await _repeats_give_back(conn, row, node_id, attempt):
            return row
        _check_holder(row, node_id, attempt)
        ends = (await uncharged_claims(conn, [job_id])).get(job_id, UnchargedEnds())
        event = decide_give_back(attempt=attempt, max_attempts=row.max_attempts, now=now, ends=ends)
        [given_back], position = await record_and_settle(conn, [Change(row.id, organization_id, row, [event])],
                                                         metadata=node_metadata(node_id, request_id))  # fmt: skip
        await store.publish(conn, [(organization_id, position, int(isinstance(event, JobReleased)))])
    if isinstance(event, JobReleased):  # back in the queue at once (not charged with a back-off, nor failed)
        metrics.count_given_back(AGENT_STOPPING)
    log.info("job given back", extra={"action": "job_given_back", "job_id": str(job_id), "node_id": str(node_id),
                                      "status": given_back.status})  # fmt: skip
    return given_back


async def _repeats_give_back(conn: psycopg.AsyncConnection, row: JobRow, node_id: UUID, attempt: int) -> bool:
    """Whether this give-back repeats one this node made of ``attempt``: released then (the log says by
    whom), or charged as a failure past the job's free interruptions (:func:`_repeats_failure`)."""
    if row.attempt == attempt and row.status in ("queued", "blocked"):
        released_by, released = await attempt_ended_by(conn, row.id, attempt, JobReleased)
        if released_by == node_id and released.reason == AGENT_STOPPING:
            return True
    return await _repeats_failure(conn, row, node_id, attempt)


async def _repeats_failure(conn: psycopg.AsyncConnection, row: JobRow, node_id: UUID, attempt: int) -> bool:
    """Whether this failure is a repeat; the log is read only when the row leaves it open (a requeued job)."""
    requeued_by = None
    if failure_repeat_needs_log(status=row.status, attempt=row.attempt, claimed_attempt=attempt):
        requeued_by, _ = await attempt_ended_by(conn, row.id, attempt, JobRequeued)
    return repeats_failure(status=row.status, lease_owner=row.lease_owner, attempt=row.attempt, node_id=node_id,
                           claimed_attempt=attempt, requeued_by=requeued_by, ended_under_holder=row.ended_under_holder)  # fmt: skip


class ChildRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One child of ``POST /v1/agent/jobs/{id}/children``; priority defaults to the parent's."""

    kind: Name
    payload: dict[str, Any] = {}
    requires: RequiresRequest = msgspec.field(default_factory=RequiresRequest)
    priority: Priority | None = None
    max_attempts: MaxAttempts = 3
    idempotency_key: IdempotencyKey | None = None
    #: Earlier children of the same request this one runs after (``0``: the first): it waits (``blocked``)
    #: until each completes, and fails if one does not. Siblings only: a node names no other job.
    depends_on: Siblings = []

    def __post_init__(self) -> None:
        check_shape_size(self.kind, self.requires)
        if self.payload:
            check_document(self.payload, "payload")


async def add_children(
    conn: psycopg.AsyncConnection,
    *,
    organization_id: UUID,
    node_id: UUID,
    job_id: UUID,
    attempt: int,
    children: Sequence[ChildRequest],
    request_id: str | None = None,
) -> list[JobRow]:
    """Decompose a held job: children are ordinary jobs; the parent becomes a container.

    Children inherit the parent's organization, project and lang, and its
    priority unless they give one. The parent is released and stays
    ``running`` (never claimable) until its children settle it.

    A decomposition this node already made at ``attempt``, sent again, is
    answered with those children as they stand, in the same order, and makes
    nothing, whatever it lists (see
    :func:`umbra.domain.jobs.repeats_decomposition`): it is recognised before
    its idempotency keys are looked up, which the first one took.
    """
    check_children(children)
    with refusing_unstorable():
        return await _add_children(conn, organization_id, node_id, job_id, attempt, children, request_id)


async def _add_children(
    conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int,
    children: Sequence[ChildRequest], request_id: str | None,
) -> list[JobRow]:  # fmt: skip
    keys = [c.idempotency_key for c in children if c.idempotency_key]
    async with conn.transaction():
        await lock_idempotency_keys(conn, organization_id, keys)  # before any row lock, as a submission takes them
        # Before the parent's row too: waiting for a change of the fleet with the row locked would hold up
        # every batch that renews or completes the job.
        await hold_capacity(conn, organization_id, exclusive=False)
        parent, _ = await _locked(conn, organization_id, job_id)
        made = await _repeated_children(conn, parent, node_id, attempt)
        if made is not None:
            return made
        _check_holder(parent, node_id, attempt)
        taken = await jobs_by_idempotency_key(conn, organization_id, keys)
        for index, child in enumerate(children):
            key = child.idempotency_key
            if key is not None and key in taken:
                # Not naming the job: a node reads only jobs it has held, and the id would be one it may not.
                raise InvalidRequest(f"children[{index}].idempotency_key is already used in this organization.",
                                     field=f"children[{index}].idempotency_key", index=index)  # fmt: skip
        judge = await BlockingJudge.load(conn, organization_id)
        actor = f"node:{node_id}"
        ids = [uuid4() for _ in children]
        child_changes = []
        for index, (c, child_id) in enumerate(zip(children, ids)):
            siblings = tuple(dict.fromkeys(ids[sibling] for sibling in c.depends_on))  # earlier ones (check_children)
            child_changes.append(Change(child_id, organization_id, None, submitted_events(
                kind=c.kind, payload=c.payload, requires=c.requires.to_requirements(),
                priority=parent.priority if c.priority is None else c.priority, max_attempts=c.max_attempts,
                project_id=parent.project_id, lang=parent.lang, idempotency_key=c.idempotency_key,
                requested_by=actor, judge=judge, parent_job_id=parent.id, depends_on=siblings, waiting_on=siblings,
            )))  # fmt: skip
        decomposed = JobDecomposed(attempt=attempt, children=tuple(c.job_id for c in child_changes))
        rows = await queue.record(conn, [Change(parent.id, organization_id, parent, [decomposed]), *child_changes],
                                  metadata=store.event_metadata(actor, request_id))  # fmt: skip
        await publish_new_jobs(conn, organization_id, rows[1:], max(r.position for r in rows))
    return rows[1:]


def check_children(children: Sequence[ChildRequest]) -> None:
    """Refuse (422) a decomposition no job could make, before the job is looked up (the body before the
    object its path names: a well-formed id of no job, or of another node's, with such a body is 422 too):
    no child, a child depending on itself or a later child, two children naming one idempotency key."""
    if not children:
        raise InvalidRequest("children must name at least one child.", field="children")
    for index, child in enumerate(children):
        for sibling in child.depends_on:
            if sibling >= index:
                raise InvalidRequest(f"children[{index}].depends_on names child {sibling}: only an earlier child of "
                                     "the same request can be depended on.", field=f"children[{index}].depends_on",
                                     index=index)  # fmt: skip
    keys = [c.idempotency_key for c in children if c.idempotency_key]
    if len(set(keys)) != len(keys):
        raise InvalidRequest("children repeat an idempotency_key.", field="children")


_CHILDREN = f"SELECT {queue.SELECT_LIST} FROM jobs WHERE id = ANY(%s) AND organization_id = %s"


async def _repeated_children(conn: psycopg.AsyncConnection, parent: JobRow, node_id: UUID, attempt: int) -> list[JobRow] | None:
    """The children of a decomposition sent again, as they stand, in the order of the first; ``None`` if it is no repeat.

    The log is read only for a job split at that attempt (its row names no holder since).
    """
    if not decomposition_repeat_needs_log(status=parent.status, attempt=parent.attempt, children_total=parent.children_total,
                                          claimed_attempt=attempt):  # fmt: skip
        return None
    decomposed_by, decomposed = await attempt_ended_by(conn, parent.id, attempt, JobDecomposed)
    if not repeats_decomposition(status=parent.status, attempt=parent.attempt, children_total=parent.children_total,
                                 node_id=node_id, claimed_attempt=attempt, decomposed_by=decomposed_by):  # fmt: skip
        return None
    children = list(decomposed.children)
    rows = {row.id: row for row in map(queue.from_db, await (await conn.execute(
        _CHILDREN, (children, parent.organization_id))).fetchall())}  # fmt: skip
    return [rows[child] for child in children]
