"""Explain a job: why it is (not) running, judged exactly as its claim would be.

The fleet and the model registry are read with the claim's own readers
(:func:`umbra.compute.blocked.read_nodes` with the same stale threshold, and
:func:`read_models`; with model affinity, the nodes holding a queued job's models with
:func:`read_model_holders`), and every verdict comes from the claim's pure functions
(:mod:`umbra.domain.explain` over :mod:`umbra.domain.placement`). A blocked
job's reason is judged with :func:`blocking_reason`, the function the queue
stored it with, so the two cannot disagree unless the fleet changed in a way
that has not been re-examined yet, and then the summary says so.

Everything is read in one ``REPEATABLE READ, READ ONLY`` transaction (when the
caller has none open), so the job, the fleet and the queue ahead of the job
are one moment's state. Time comes from the database clock.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Mapping, Sequence
from uuid import UUID

import msgspec
import psycopg
from psycopg.pq import TransactionStatus

from umbra.domain.eligibility import NodeView, blocking_reason, takes_kind
from umbra.domain.explain import DependencyStatus, Explanation, QueueStanding, competing_ahead, left_to_holders, survey
from umbra.domain.explain_text import blocked_summary, delayed_summary, placed_summary, queued_summary, waiting_summary
from umbra.domain.models import RegisteredModel
from umbra.domain.node_status import DEFAULT_STALE_SECONDS
from umbra.errors import NotFound
from umbra.events.types import Requirements
from umbra.projections import jobs as queue
from umbra.projections.jobs import JobRow

from .blocked import read_models, read_nodes
from .claims import uncharged_claims
from .jobs import dependency_statuses_of
from .model_holders import read_model_holders

#: How long a job may stay blocked before the sweeper fails it (the settings default).
DEFAULT_BLOCKED_TIMEOUT_SECONDS = 86_400

_NOW = "SELECT umbra_now()"
#: The job kinds each node's agent takes, as its heartbeat last reported them (NULL: every kind).
_KINDS = "SELECT id, kinds FROM nodes WHERE organization_id = %s AND kinds IS NOT NULL"
#: Due queued jobs ahead of one job in claim order, per shape (kind and requirements).
_AHEAD = """
SELECT kind, requires::text, count(*) FROM jobs
WHERE organization_id = %(org)s AND status = 'queued'
  AND (not_before IS NULL OR not_before <= umbra_now())
  AND (priority, seq) < (%(priority)s, %(seq)s)
GROUP BY kind, requires
"""
_CHILDREN = """
SELECT count(*), count(*) FILTER (WHERE status IN ('complete', 'failed', 'cancelled', 'partial'))
FROM jobs WHERE organization_id = %s AND parent_job_id = %s
"""
_requirements = msgspec.json.Decoder(Requirements)


async def explain(
    conn: psycopg.AsyncConnection,
    organization_id: UUID,
    job_id: UUID,
    *,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
    blocked_timeout_seconds: int = DEFAULT_BLOCKED_TIMEOUT_SECONDS,
    affinity_seconds: int = 0,
) -> Explanation:
    """Explain one job of the organization; another organization's job is ``job_not_found``.

    ``affinity_seconds``: the server's model affinity, under which a queued job may be left to the nodes
    that hold its models for a while (the summary says so)."""
    outermost = conn.info.transaction_status == TransactionStatus.IDLE
    async with conn.transaction():
        if outermost:
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        row = await queue.load(conn, job_id, organization_id)
        if row is None:
            raise NotFound("job_not_found", f"No job {job_id}.")
        now: datetime = (await (await conn.execute(_NOW)).fetchone())[0]  # type: ignore[index]
        if row.status in ("queued", "blocked"):
            models = await read_models(conn, organization_id)
            nodes = await read_nodes(conn, organization_id, stale_seconds=stale_seconds, models=models)  # as a claim finds them
            return await _waiting(conn, row, nodes, models, now, blocked_timeout_seconds, affinity_seconds, stale_seconds)
        return await _placed(conn, row, await read_nodes(conn, organization_id, stale_seconds=stale_seconds), now)


async def _waiting(
    conn: psycopg.AsyncConnection,
    row: JobRow,
    nodes: Sequence[NodeView],
    models: Mapping[str, RegisteredModel],
    now: datetime,
    blocked_timeout_seconds: int,
    affinity_seconds: int,
    stale_seconds: int,
) -> Explanation:
    eligible, ineligible = survey(nodes, row.requires, models)
    if row.awaiting_dependencies and row.depends_on:
        statuses = list((await dependency_statuses_of(conn, row.organization_id, row.depends_on)).items())
        not_due = row.not_before.astimezone(timezone.utc) if row.not_before and row.not_before > now else None
        return Explanation(
            job_id=row.id, status=row.status, eligible=eligible, ineligible=ineligible,
            summary=waiting_summary(statuses, not_due=not_due), not_before=not_due,
            dependencies=[DependencyStatus(job_id=job_id, status=status) for job_id, status in statuses],
        )  # fmt: skip
    if row.status == "blocked" and row.waiting_until is not None:
        return Explanation(
            job_id=row.id, status=row.status, eligible=eligible, ineligible=ineligible,
            summary=delayed_summary(not_before=row.waiting_until, now=now, eligible=len(eligible)),
            not_before=row.waiting_until.astimezone(timezone.utc),
        )  # fmt: skip
    if row.status == "blocked":
        current = blocking_reason(row.requires, models, nodes)
        fails_at = row.blocked_at + timedelta(seconds=blocked_timeout_seconds) if row.blocked_at else None
        return Explanation(
            job_id=row.id, status=row.status, eligible=eligible, ineligible=ineligible,
            summary=blocked_summary(stored=row.blocked_reason, current=current, fails_at=fails_at),
            blocked_reason=current,
        )  # fmt: skip
    kinds_taken = {node_id: kinds for node_id, kinds in await (await conn.execute(_KINDS, (row.organization_id,))).fetchall()}
    # The nodes that would claim this job: they could run it and their agents take its kind.
    able = {e.node_id for e in eligible if takes_kind(kinds_taken.get(e.node_id), row.kind)}
    params = {"org": row.organization_id, "priority": row.priority, "seq": row.seq}
    shapes = [(k, _requirements.decode(r), n) for k, r, n in await (await conn.execute(_AHEAD, params)).fetchall()]
    ahead = competing_ahead(shapes, [node for node in nodes if node.id in able], models, kinds_taken)
    due_in = max(0.0, (row.not_before - now).total_seconds()) if row.not_before else 0.0
    # As the claims measure a job's wait: from its submission or, if later, from when it fell due.
    waited = (now - max(row.created_at, row.not_before or row.created_at)).total_seconds()
    # The nodes holding its models as the claims read them (only when one may be left to them).
    slugs = row.requires.models if affinity_seconds > 0 and waited < affinity_seconds else ()
    holders = await read_model_holders(conn, row.organization_id, slugs, models, stale_seconds=stale_seconds)
    left_to, left_for = left_to_holders([e for e in eligible if e.node_id in able], row.requires, waited_seconds=waited,
                                        affinity_seconds=affinity_seconds, holders=holders, kind=row.kind)  # fmt: skip
    standing = QueueStanding(due_in_seconds=due_in, ahead=ahead, left_to=left_to, left_for_seconds=left_for)
    summary = queued_summary(
        eligible, ineligible, nodes=nodes, requires=row.requires, models=models, standing=standing,
        not_before=row.not_before, kind=row.kind, kinds_taken=kinds_taken,
    )  # fmt: skip
    not_before = row.not_before.astimezone(timezone.utc) if row.not_before and due_in > 0 else None
    return Explanation(job_id=row.id, status=row.status, eligible=eligible, ineligible=ineligible, summary=summary,
                       ahead=ahead, not_before=not_before)  # fmt: skip


async def _placed(conn: psycopg.AsyncConnection, row: JobRow, nodes: Sequence[NodeView], now: datetime) -> Explanation:
    names = {node.id: node.name for node in nodes}
    node_name = names.get(row.placement.node_id) if row.placement else None
    children = None
    if row.children_total:
        cursor = await conn.execute(_CHILDREN, (row.organization_id, row.id))
        total, finished = await cursor.fetchone()  # type: ignore[misc]
        children = (max(total, row.children_total), finished)
    lease_left = None
    if row.status == "running" and row.lease_expires_at:
        lease_left = (row.lease_expires_at - now).total_seconds()
    ends = (await uncharged_claims(conn, [row.id])).get(row.id) if row.attempt else None
    uncharged = ends.count(row.max_attempts) if ends else 0
    summary = placed_summary(
        status=row.status, placement=row.placement, node_name=node_name, attempt=row.attempt,
        max_attempts=row.max_attempts, lease_seconds_left=lease_left, error=row.error, result=row.result,
        children=children, uncharged=uncharged,
    )  # fmt: skip
    return Explanation(job_id=row.id, status=row.status, eligible=[], ineligible=[], summary=summary,
                       placement=row.placement, placement_node_name=node_name)  # fmt: skip
