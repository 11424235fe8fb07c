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
from typing import Any, Collection, Iterable, Mapping, Sequence
from uuid import UUID

import msgspec
import psycopg

from umbra.db import organization_lock_key, uuid_array
from umbra.domain.eligibility import NodeView, blocking_reason
from umbra.domain.models import RegisteredModel
from umbra.domain.placement import HeldJob, takes_memory, with_held_jobs
from umbra.domain.node_status import DEFAULT_STALE_SECONDS, effective_status
from umbra.events import store
from umbra.events.types import Device, JobBlocked, JobUnblocked, Placement, Requirements
from umbra.projections import jobs as queue

log = logging.getLogger(__name__)

_NODES = """
SELECT n.id, n.name, n.status, n.trust_domain, n.devices::text, l.last_seen_at, umbra_now()
FROM nodes n LEFT JOIN node_liveness l ON l.node_id = n.id
WHERE n.organization_id = %s AND (%s::uuid IS NULL OR n.id = %s)
ORDER BY n.name
"""
_devices = msgspec.json.Decoder(tuple[Device, ...])


async def read_nodes(
    conn: psycopg.AsyncConnection,
    organization_id: UUID,
    *,
    node_id: UUID | None = None,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
) -> list[NodeView]:
    """The organization's nodes (or one of them) with their *effective* status, by the database clock."""
    cursor = await conn.execute(_NODES, (organization_id, node_id, node_id))
    return [
        NodeView(
            id=nid,
            name=name,
            status=effective_status(status, last_seen, now, stale_seconds=stale_seconds),
            trust_domain=trust_domain,
            devices=_devices.decode(devices),
        )
        for nid, name, status, trust_domain, devices, last_seen, now in await cursor.fetchall()
    ]


#: The running jobs of the given nodes that take memory, each node's in claim order, and whether each
#: was claimed since the node's devices were last reported (by ``jobs_held_taking_memory``: its
#: predicate is repeated here whole, or the planner cannot use it). A job an older server claimed
#: has no ``claimed_at`` and counts as reported.
_HELD_TAKING_MEMORY = """
SELECT j.lease_owner, j.requires::text, j.placement::text,
       coalesce(j.claimed_at >= n.last_heartbeat_at, n.last_heartbeat_at IS NULL)
FROM jobs j JOIN nodes n ON n.id = j.lease_owner
WHERE j.lease_owner = ANY(%(nodes)s::uuid[]) AND j.status = 'running'
  AND (j.requires ? 'models' OR j.requires ? 'vram_min_mb' OR j.requires ? 'ram_min_mb')
  AND j.placement IS NOT NULL AND NOT j.id = ANY(%(ending)s::uuid[])
ORDER BY j.lease_owner, j.claimed_at NULLS FIRST, j.seq
"""
_requirements = msgspec.json.Decoder(Requirements)
_placement = msgspec.json.Decoder(Placement)


def any_takes_memory(requirements: Iterable[Requirements]) -> bool:
    """Whether any of these jobs takes memory where it runs: only then do the nodes' held jobs matter to a claim."""
    return any(takes_memory(requires) for requires in requirements)


async def with_held_jobs_read(
    conn: psycopg.AsyncConnection, organization_id: UUID, nodes: Sequence[NodeView], models: Mapping[str, RegisteredModel],
    *, ending: Collection[UUID] = (),
) -> list[NodeView]:
    """``nodes`` (of the organization) as a claim must judge them: the jobs each runs that its last report does not
    show take their memory.

    One indexed read for all of them (see
    :func:`umbra.domain.placement.with_held_jobs`). ``ending``: jobs whose
    hold ends in the caller's transaction before its claims (a completion
    that claims the node's next job), which reserve nothing. ``models`` may
    leave out models no queued job names: the registry is read for a held
    job's model it lacks.
    """
    if not nodes:
        return []
    held: dict[UUID, list[HeldJob]] = {}
    cursor = await conn.execute(_HELD_TAKING_MEMORY, {"nodes": uuid_array([n.id for n in nodes]), "ending": uuid_array(list(ending))})
    for node_id, requires, placement, since_report in await cursor.fetchall():
        held.setdefault(node_id, []).append(
            HeldJob(_requirements.decode(requires), _placement.decode(placement), claimed_since_report=since_report)
        )
    if any(slug not in models for jobs in held.values() for job in jobs for slug in job.requires.models):
        models = await read_models(conn, organization_id)
    return [with_held_jobs(node, held[node.id], models) if node.id in held else node for node in nodes]


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


_HOLD_CAPACITY = "SELECT pg_advisory_xact_lock(%s, %s)"
_SHARE_CAPACITY = "SELECT pg_advisory_xact_lock_shared(%s, %s)"


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
        return cls(await read_models(conn, organization_id), await read_nodes(conn, organization_id))

    def reason(self, requires: Requirements) -> str | None:
        if requires not in self._memo:
            self._memo[requires] = blocking_reason(requires, self._models, self._nodes)
        return self._memo[requires]


#: The organization's distinct queued shapes (each the JSON text of ``[kind, requirements]``),
#: at most ``limit``: a skip scan of ``jobs_by_shape`` (each step is one descent to the first
#: entry past the previous shape), so the cost follows the number of shapes, not of jobs. The
#: SQL is a function (migrations/0025, 0029) because it must be planned with sorting disabled.
QUEUED_SHAPES = "SELECT umbra_queued_kind_shapes(%(org)s, %(limit)s)"
#: The distinct requirements among those shapes (jsonb text): blocking judges requirements only.
_QUEUED_REQUIREMENTS = "SELECT DISTINCT (shape::jsonb->1)::text FROM umbra_queued_kind_shapes(%(org)s, %(limit)s) AS shape"
#: Queued (kind, requirements) pairs one re-examination reads at most, for the distinct requirements
#: among them: every kind counts, so the cap is well above any plausible number of shapes (a skip-scan
#: step each: some 10 µs). Requirements found only past it are not judged again.
REEXAMINED_SHAPES = 10_000
_BLOCKED_SHAPES = """
SELECT DISTINCT requires::text, blocked_reason FROM jobs WHERE organization_id = %s AND status = 'blocked'
"""
_WAITING_WITH = f"""
SELECT {queue.SELECT_LIST} FROM jobs
WHERE organization_id = %s AND status = %s AND requires = ANY(%s::text[]::jsonb[])
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
    publish: bool = True,
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
    notifies once.
    """
    metadata = metadata or {"actor": "reexamine"}
    async with conn.transaction():
        blocked_shapes = await (await conn.execute(_BLOCKED_SHAPES, (organization_id,))).fetchall()
        queued_shapes = [text for (text,) in await (await conn.execute(
            _QUEUED_REQUIREMENTS, {"org": organization_id, "limit": REEXAMINED_SHAPES})).fetchall()]  # fmt: skip
        if not blocked_shapes and not queued_shapes:
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
