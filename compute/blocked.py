"""Blocked jobs: work no registered device of the organization could ever run.

A job like that is ``blocked`` with a reason naming the shortfall instead of
sitting in the queue looking alive. "Could ever run" is judged against every
node that may take new work in future (not draining or retired) as if it were
online and idle: device totals and capabilities, not the memory free this
second (see :func:`umbra.domain.eligibility.blocking_reason`). An organization
with no such node blocks everything, and its first pairing unblocks it.

:func:`reexamine_waiting_jobs` judges again the jobs waiting to run when
capacity changed: a blocked job something could now run returns to the queue,
and a queued job nothing could ever run any more is blocked. The second
matters as much as the first: a retired node, a device gone from a heartbeat
or a model whose floor was raised can leave queued work that no device will
ever take, and a child job queued like that would hold its parent open for
ever, where a blocked one fails after the blocked timeout and lets its parent
settle. Call it, inside the transaction that changed them, wherever node,
device or model state changes: pairing, drain and retirement, a heartbeat
whose devices changed, a model registry update. It is cheap when nothing is
waiting (two index probes), and otherwise reads one row per distinct
requirement shape before it judges any job.

This module also reads the organization's fleet (nodes, their devices and
effective status) and model registry in the shape eligibility needs; the claim
path uses the same readers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Collection, Mapping, Sequence
from uuid import UUID

import msgspec
import psycopg

from umbra.db import organization_lock_key, service_lock_wait
from umbra.domain.eligibility import NodeView, blocking_reason
from umbra.domain.models import RegisteredModel
from umbra.domain.placement import RunningJob, with_running_jobs
from umbra.domain.node_status import DEFAULT_STALE_SECONDS, effective_status
from umbra.events import store
from umbra.events.types import Device, JobBlocked, JobUnblocked, Placement, Requirements
from umbra.projections import jobs as queue

log = logging.getLogger(__name__)

#: A node's running jobs that take memory, as JSON ``[[id, requires, placement], ...]`` in
#: submission order (``seq``; NULL: none), by ``jobs_held_taking_memory``, whose predicate is repeated here whole, or the
#: planner cannot use it. A column of the nodes' reads that judge claims (``n`` is the node's row).
#:
#: With them, the jobs that ended there under their holder since the node last reported its devices (cancelled
#: while they ran, failed past their ``max_runtime_s``: ``jobs_ended_under_holder_taking_memory``, migration
#: 0040): such a job's handler runs on until its agent hears of it at its next renewal, and its memory with it.
#: The node's next report shows what it still holds.
RUNNING_TAKING_MEMORY = """(
    SELECT json_agg(json_build_array(j.id, j.requires, j.placement) ORDER BY j.seq)::text FROM (
        SELECT id, requires, placement, seq FROM jobs
        WHERE lease_owner = n.id AND status = 'running'
          AND (requires ? 'models' OR requires ? 'vram_min_mb' OR requires ? 'ram_min_mb')
          AND placement IS NOT NULL
        UNION ALL
        SELECT id, requires, placement, seq FROM jobs
        WHERE lease_owner = n.id AND ended_under_holder AND placement IS NOT NULL
          AND (requires ? 'models' OR requires ? 'vram_min_mb' OR requires ? 'ram_min_mb')
          AND finished_at > (SELECT coalesce(reported_at, last_seen_at) FROM node_liveness WHERE node_id = n.id)
    ) j
)"""
#: A node's devices as it last reported them (``node_liveness.devices``, every beat), else as last folded:
#: a move of free memory within the heartbeat's tolerance records no event. ``n`` is the node's row and ``l``
#: its liveness row.
LATEST_DEVICES = "coalesce(l.devices, n.devices)::text"
#: A node's cordoned devices, ``{label: reason}`` (``n`` is the node's row): eligibility reads the labels,
#: the set of the mapping's keys (``{}`` for nearly every node; no subquery per node to list them).
CORDONED = "n.cordoned"
#: What a node's reads return for :func:`node_as_read` (``n`` the node's row, ``l`` its liveness row).
NODE_COLUMNS = f"n.id, n.name, n.status, n.trust_domain, {LATEST_DEVICES}, l.last_seen_at, umbra_now(), {CORDONED}"
_NODES = f"""
SELECT {NODE_COLUMNS}, {{running}}
FROM nodes n LEFT JOIN node_liveness l ON l.node_id = n.id
WHERE n.organization_id = %s AND (%s::uuid IS NULL OR n.id = %s) AND (%s OR n.status NOT IN ('draining', 'retired'))
ORDER BY n.name
"""
_NODES_AS_REPORTED = _NODES.format(running="NULL")
_NODES_AS_CLAIMS_FIND_THEM = _NODES.format(running=RUNNING_TAKING_MEMORY)
#: The organization's nodes in service (not draining, not retired), as reported, by index ``nodes_accepting``
#: (migrations/0052), whose predicate it names whole: :data:`_NODES`, whose ``%s OR`` a generic plan cannot
#: resolve, read every node the organization ever paired.
_ACCEPTING_NODES_AS_REPORTED = f"""
SELECT {NODE_COLUMNS}, NULL
FROM nodes n LEFT JOIN node_liveness l ON l.node_id = n.id
WHERE n.organization_id = %s AND n.status NOT IN ('draining', 'retired')
ORDER BY n.name
"""
#: A JSON device set (a node row's, a report's) as the structs eligibility judges.
decode_devices = msgspec.json.Decoder(tuple[Device, ...]).decode
_running = msgspec.json.Decoder(list[tuple[UUID, Requirements, Placement]])


def node_as_read(node_id: UUID, name: str, status: str, trust_domain: str, devices: str, last_seen_at: datetime | None,
                 now: datetime, cordoned: Collection[str], *, stale_seconds: int) -> NodeView:  # fmt: skip
    """A node as eligibility judges it, from the columns of :data:`NODE_COLUMNS`: its effective status by the
    database clock (``now``), its devices as last reported, the labels of its cordoned devices."""
    return NodeView(id=node_id, name=name, status=effective_status(status, last_seen_at, now, stale_seconds=stale_seconds),
                    trust_domain=trust_domain, devices=decode_devices(devices), cordoned=frozenset(cordoned))  # fmt: skip


def running_jobs(column: str | None, ending: Collection[UUID] = ()) -> list[RunningJob]:
    """The :data:`RUNNING_TAKING_MEMORY` column, less ``ending``: jobs whose hold ends in the reader's
    transaction before its claims (a completion that claims the node's next job)."""
    if column is None:
        return []
    return [RunningJob(requires, placement) for job_id, requires, placement in _running.decode(column) if job_id not in ending]


async def with_running_jobs_read(
    conn: psycopg.AsyncConnection, organization_id: UUID, nodes: Sequence[tuple[NodeView, list[RunningJob]]],
    models: Mapping[str, RegisteredModel],
) -> list[NodeView]:
    """Each node bounded by its running jobs (:func:`umbra.domain.placement.with_running_jobs`).

    ``models`` may leave out models no queued job names (a claim reads the
    registry only when one does): it is read for a running job's model it
    lacks.
    """
    if any(slug not in models for _, running in nodes for job in running for slug in job.requires.models):
        models = await read_models(conn, organization_id)
    return [with_running_jobs(node, running, models) for node, running in nodes]


async def read_nodes(
    conn: psycopg.AsyncConnection,
    organization_id: UUID,
    *,
    node_id: UUID | None = None,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
    models: Mapping[str, RegisteredModel] | None = None,
    accepting_only: bool = False,
) -> list[NodeView]:
    """The organization's nodes (or one of them) with their *effective* status, by the database clock.

    With ``models`` (the registry, or the part of it a claim read), as a claim
    judges them: each bounded by the jobs it runs
    (:func:`with_running_jobs_read`). Without, as reported: blocking judges
    device totals, and a running job changes none. ``accepting_only``: not
    the draining and retired nodes, which no blocking judgement counts: nodes
    are never deleted, and an organization whose nodes come and go (autoscaled
    machines) would otherwise have every submission read every node it ever
    paired.
    """
    if accepting_only and node_id is None and models is None:
        cursor = await conn.execute(_ACCEPTING_NODES_AS_REPORTED, (organization_id,))
    else:
        query = _NODES_AS_REPORTED if models is None else _NODES_AS_CLAIMS_FIND_THEM
        cursor = await conn.execute(query, (organization_id, node_id, node_id, not accepting_only))
    nodes = [(node_as_read(*row[:-1], stale_seconds=stale_seconds), running_jobs(row[-1])) for row in await cursor.fetchall()]
    if models is None:
        return [node for node, _ in nodes]
    return await with_running_jobs_read(conn, organization_id, nodes, models)


async def read_models(conn: psycopg.AsyncConnection, organization_id: UUID) -> dict[str, RegisteredModel]:
    """The organization's model registry keyed by slug."""
    from .models import load_models  # imported here: compute.models re-examines blocked jobs through this module

    return await load_models(conn, organization_id)


#: Advisory lock class of an organization's capacity lock (see ``db.organization_lock_key``).
CAPACITY_LOCK_CLASS = 0x756D6361


async def hold_capacity(conn: psycopg.AsyncConnection, organization_id: UUID, *, exclusive: bool) -> None:
    """Order judgements of what the organization's fleet could run against changes to it, until commit.

    A submission judges from one read of the nodes and the registry whether
    anything could ever run its job, and blocks it if not; a change of what
    could run (a pairing, a heartbeat that changes devices, a drain or
    retirement, a registry update) re-examines the waiting jobs from a read of
    its own. When each reads before the other commits, a job is left blocked
    that something can now run (or queued that nothing can), with a false
    reason, until the sweeper's next look. So every judgement shares this lock
    (:meth:`BlockingJudge.load` takes it) and every change takes it alone
    before it writes anything: a judgement then sees each change that has
    answered, and a change's re-examination sees each job judged before it.
    A change takes it before its append (the log's ordering lock, which a
    submission holding this one waits for) and before any job's row; a
    decomposition, before its parent's row.
    """
    key = organization_lock_key(organization_id, b"capacity")
    await conn.execute(_HOLD_CAPACITY if exclusive else _SHARE_CAPACITY, (CAPACITY_LOCK_CLASS, key))


async def try_share_capacity(conn: psycopg.AsyncConnection, organization_id: UUID) -> bool:
    """Share the capacity lock (see :func:`hold_capacity`) if no change holds it now; never waits."""
    key = organization_lock_key(organization_id, b"capacity")
    [(held,)] = await (await conn.execute(_TRY_SHARE_CAPACITY, (CAPACITY_LOCK_CLASS, key))).fetchall()
    return bool(held)


_HOLD_CAPACITY = service_lock_wait("SELECT pg_advisory_xact_lock(%s, %s)")
_TRY_SHARE_CAPACITY = "SELECT pg_try_advisory_xact_lock_shared(%s, %s)"
_SHARE_CAPACITY = service_lock_wait("SELECT pg_advisory_xact_lock_shared(%s, %s)")


class BlockingJudge:
    """``blocking_reason`` over one snapshot of the fleet, memoised per requirement shape.

    A batch of 10,000 jobs usually has a handful of distinct requirements; each
    is judged once.
    """

    def __init__(self, models: Mapping[str, RegisteredModel], nodes: Sequence[NodeView]) -> None:
        self._models = models
        self._nodes = nodes
        self._memo: dict[Requirements, str | None] = {}

    @classmethod
    async def load(cls, conn: psycopg.AsyncConnection, organization_id: UUID) -> "BlockingJudge":
        """The fleet as it stands once no change of it is in flight (see :func:`hold_capacity`)."""
        await hold_capacity(conn, organization_id, exclusive=False)
        return cls(await read_models(conn, organization_id), await read_nodes(conn, organization_id, accepting_only=True))

    def reason(self, requires: Requirements) -> str | None:
        if requires not in self._memo:
            self._memo[requires] = blocking_reason(requires, self._models, self._nodes)
        return self._memo[requires]


#: The organization's distinct queued shapes (each the JSON text of ``[kind, requirements]``),
#: at most ``limit``: a skip scan of ``jobs_by_shape`` (each step is one descent to the first
#: entry past the previous shape), so the cost follows the number of shapes, not of jobs. The
#: SQL is a function (migrations/0025, 0029, 0031) because it must be planned with sorting disabled.
QUEUED_SHAPES = "SELECT umbra_queued_kind_shapes(%(org)s, %(limit)s)"
#: The distinct requirements among those shapes (jsonb text): blocking judges requirements only.
_QUEUED_REQUIREMENTS = "SELECT DISTINCT (shape::jsonb->1)::text FROM umbra_queued_kind_shapes(%(org)s, %(limit)s) AS shape"
#: Queued (kind, requirements) pairs one re-examination reads at most, for the distinct requirements
#: among them: every kind counts, so the cap is well above any plausible number of shapes (a skip-scan
#: step each: some 10 µs). Requirements found only past it are not judged again.
REEXAMINED_SHAPES = 10_000
_BLOCKED_SHAPES = """
SELECT DISTINCT requires::text, blocked_reason FROM jobs WHERE organization_id = %s AND status = 'blocked'
  AND NOT awaiting_dependencies AND waiting_until IS NULL
"""
_WAITING_WITH = f"""
SELECT {queue.SELECT_LIST} FROM jobs
WHERE organization_id = %s AND status = %s AND requires = ANY(%s::text[]::jsonb[]) AND NOT awaiting_dependencies
  AND waiting_until IS NULL
ORDER BY seq FOR UPDATE SKIP LOCKED
"""
_requirements = msgspec.json.Decoder(Requirements)


@dataclass(frozen=True, slots=True)
class Reexamined:
    unblocked: int = 0
    blocked: int = 0
    #: The log hint for what was written (see ``publish``), empty if nothing was.
    hints: tuple[tuple[UUID, int, int], ...] = ()


async def reexamine_waiting_jobs(
    conn: psycopg.AsyncConnection, organization_id: UUID, *, metadata: Mapping[str, Any] | None = None,
    publish: bool = True, wait: bool = True,
) -> Reexamined:
    """Unblock the organization's blocked jobs some device could now run; block its queued jobs none could.

    Runs in the caller's transaction (as a savepoint when one is open). Each
    distinct requirement shape among the waiting jobs is judged once, and only
    the jobs whose verdict changed are locked and written, so a heartbeat that
    changes nothing for them costs two small reads and the judgement. A job
    still blocked whose shortfall changed gets its new reason, keeping the
    time it was first blocked. Jobs another transaction holds (a claim in
    flight, say) are left for the next re-examination. ``publish=False``: the
    caller sends the returned ``hints`` with its own, so its transaction
    notifies once. ``wait=False`` (the sweeper's second look): while a change
    of the fleet holds the organization's capacity lock, nothing is looked at
    (the change re-examines when it commits) instead of waiting for it.
    """
    metadata = metadata or {"actor": "reexamine"}
    async with conn.transaction():
        blocked_shapes = await (await conn.execute(_BLOCKED_SHAPES, (organization_id,))).fetchall()
        queued_shapes = [text for (text,) in await (await conn.execute(
            _QUEUED_REQUIREMENTS, {"org": organization_id, "limit": REEXAMINED_SHAPES})).fetchall()]  # fmt: skip
        if not blocked_shapes and not queued_shapes:
            return Reexamined()
        if not wait and not await try_share_capacity(conn, organization_id):
            return Reexamined()
        judge = await BlockingJudge.load(conn, organization_id)
        verdicts = {text: judge.reason(_requirements.decode(text))
                    for text in {text for text, _ in blocked_shapes} | set(queued_shapes)}  # fmt: skip
        to_unblock = sorted({text for text, reason in blocked_shapes if verdicts[text] != reason})
        to_block = sorted(text for text in queued_shapes if verdicts[text] is not None)
        changes: list[queue.Change] = []
        unblocked = blocked = 0
        for status, shapes in (("blocked", to_unblock), ("queued", to_block)):
            if not shapes:
                continue
            for record in await (await conn.execute(_WAITING_WITH, (organization_id, status, shapes))).fetchall():
                row = queue.from_db(record)
                reason = judge.reason(row.requires)
                if reason is None:
                    changes.append(queue.Change(row.id, organization_id, row, [JobUnblocked()]))
                    unblocked += 1
                elif reason != row.blocked_reason:
                    changes.append(queue.Change(row.id, organization_id, row, [JobBlocked(reason=reason)]))
                    blocked += status == "queued"
        if not changes:
            return Reexamined()
        written = await queue.record(conn, changes, metadata=metadata)
        hints = ((organization_id, max(r.position for r in written), unblocked),)
        if publish:
            await store.publish(conn, hints)
    if unblocked or blocked:
        log.info("waiting jobs re-examined", extra={"action": "jobs_reexamined", "organization_id": str(organization_id),
                                                   "unblocked": unblocked, "blocked": blocked})  # fmt: skip
    return Reexamined(unblocked=unblocked, blocked=blocked, hints=hints)
