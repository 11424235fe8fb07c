"""Node commands and reads: effective views, drain/retire, and going stale.

Reads compute the effective status with the database clock (``umbra_now()``)
from ``node_liveness``; only a stored ``online`` is derived away (see
:mod:`umbra.domain.node_status`). Commands follow the house pattern: lock the
projection row, decide with a pure rule, append, fold, write, publish once.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Awaitable, Callable, Collection, Sequence
from uuid import UUID

import psycopg

from umbra.db import organization_lock_key, service_lock_wait
from umbra.domain.eligibility import NodeView as EligibilityView, is_schedulable
from umbra.domain.heartbeat import Silence
from umbra.domain.node_status import DEFAULT_STALE_SECONDS, effective_status, stored_statuses_for
from umbra.domain.nodes import after_went_offline, check_drain, check_retire, decide_cordon, decide_uncordon
from umbra.errors import NotFound
from umbra.events import store
from umbra.events.types import Device, Event, NodeDraining, NodeRetired, NodeWentOffline
from umbra.projections import nodes as projection
from umbra.projections.nodes import NodeState

from .blocked import RUNNING_TAKING_MEMORY, decode_devices, hold_capacity, reexamine_waiting_jobs, running_jobs, with_running_jobs_read

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeView:
    """A node as readers see it: the folded row plus liveness and effective status."""

    state: NodeState
    #: Effective status: a stale stored ``online`` reads ``offline``.
    status: str
    #: When the node was last heard from (``node_liveness``), None if never.
    last_seen_at: datetime | None
    schedulable: bool
    #: The devices as a claim judges them: each bounded by the node's running jobs
    #: (:func:`umbra.domain.placement.with_running_jobs`), which ``busy`` and ``schedulable`` follow.
    judged_devices: tuple[Device, ...]

    @property
    def id(self) -> UUID:
        return self.state.id

    @property
    def organization_id(self) -> UUID:
        return self.state.organization_id

    @property
    def stored_status(self) -> str:
        return self.state.status

    @property
    def trust_domain(self) -> str:
        return self.state.trust_domain

    @property
    def devices(self) -> tuple[Device, ...]:
        return self.state.devices

    @property
    def resident_models(self) -> frozenset[str]:
        """Slugs resident on any device of the node."""
        return frozenset(m.slug for d in self.state.devices for m in d.resident_models)


def node_not_found(node_id: UUID) -> NotFound:
    return NotFound("node_not_found", f"No node {node_id} in this organization.")


_VIEW = f"""
SELECT {projection.COLUMNS}, l.last_seen_at, umbra_now(), {RUNNING_TAKING_MEMORY}, l.devices::text
FROM nodes n LEFT JOIN node_liveness l ON l.node_id = n.id
WHERE (%(node)s::uuid IS NULL OR n.id = %(node)s) AND (%(org)s::uuid IS NULL OR n.organization_id = %(org)s)
  AND (%(stored)s::text[] IS NULL OR n.status = ANY(%(stored)s::text[]))
ORDER BY n.name, n.id
"""


async def _views(conn: psycopg.AsyncConnection, rows: Sequence[tuple], stale_seconds: int) -> list[NodeView]:
    """The rows of :data:`_VIEW` as views, each node's devices bounded by its running jobs as a claim bounds them,
    so that ``busy`` and ``schedulable`` say what a claim would find (the registry is read only when a running
    job names a model)."""
    read = []
    for row in rows:
        state = projection.from_row(row)
        last_seen_at, now, running, reported = row[projection.WIDTH:]
        if reported is not None:  # as last reported, every beat (migration 0034), not as last folded
            state = dataclasses.replace(state, devices=decode_devices(reported))
        status = effective_status(state.status, last_seen_at, now, stale_seconds=stale_seconds)
        judged = EligibilityView(id=state.id, name=state.name, status=status, trust_domain=state.trust_domain, devices=state.devices,
                                 cordoned=state.cordoned_labels)  # fmt: skip
        read.append((state, status, last_seen_at, judged, running_jobs(running)))
    bounded: dict[UUID, EligibilityView] = {}
    for organization_id in {state.organization_id for state, *_ in read}:
        mine = [(judged, running) for state, _, _, judged, running in read if state.organization_id == organization_id]
        bounded.update((view.id, view) for view in await with_running_jobs_read(conn, organization_id, mine, {}))
    return [
        NodeView(state, status, last_seen_at, is_schedulable(bounded[state.id]), bounded[state.id].devices)
        for state, status, last_seen_at, _, _ in read
    ]


async def load_schedulable_view(
    conn: psycopg.AsyncConnection, organization_id: UUID, *, stale_seconds: int = DEFAULT_STALE_SECONDS,
    statuses: Collection[str] | None = None,
) -> list[NodeView]:
    """Every node of one organization with its effective status, devices and models; with ``statuses``, only
    the nodes whose effective status is one of them.

    All nodes by default, not only schedulable ones: eligibility and ``explain`` need the offline, draining
    and retired ones to say why they were passed over. Nodes are never deleted, so a filter that leaves out
    the retired ones leaves them out of the read too: an effective status follows from the stored one and the
    node's silence (:func:`umbra.domain.node_status.effective_status`), so only the stored statuses that can
    lead to a wanted one are read.
    """
    stored = None if statuses is None else sorted(stored_statuses_for(statuses))
    rows = await (await conn.execute(_VIEW, {"node": None, "org": organization_id, "stored": stored})).fetchall()
    views = await _views(conn, rows, stale_seconds)
    return views if statuses is None else [view for view in views if view.status in statuses]


async def node_view(
    conn: psycopg.AsyncConnection,
    node_id: UUID,
    *,
    organization_id: UUID | None = None,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
) -> NodeView | None:
    """One node, or None; pass ``organization_id`` whenever a caller's tenant is known."""
    row = await (await conn.execute(_VIEW, {"node": node_id, "org": organization_id, "stored": None})).fetchone()
    return None if row is None else (await _views(conn, [row], stale_seconds))[0]


async def append_node_events(
    conn: psycopg.AsyncConnection,
    state: NodeState | None,
    events: Sequence[Event],
    *,
    node_id: UUID,
    organization_id: UUID,
    actor: str | None = None,
    request_id: str | None = None,
) -> tuple[NodeState, list[store.RecordedEvent]]:
    """Append to ``node:<id>`` at the state's version, fold, and write the row.

    The caller owns the transaction (and holds the row lock when ``state``
    came from ``load(..., for_update=True)``) and publishes once at the end.
    """
    metadata = store.event_metadata(actor, request_id)
    recorded = await store.append(
        conn,
        store.node_stream(node_id),
        state.version if state else 0,
        events,
        organization_id=organization_id,
        metadata=metadata,
    )
    for item in recorded:
        state = projection.fold(state, item)
    assert state is not None
    await projection.write(conn, state)
    return state, recorded


# -- the claim guard -----------------------------------------------------------------------

#: Advisory lock class of the claim guards (see ``db.organization_lock_key``).
CLAIM_GUARD_CLASS = 0x756D6E67
#: Node guards per organization: nodes share them by id, so a batch of many claimers holds at most
#: this many (and its organizations' own) however many nodes it serves: PostgreSQL's lock table is
#: shared and sized for about 64 locks a connection.
NODE_GUARDS = 64

#: Of the guard keys ``keys`` (the claiming nodes' and their organizations'), those this transaction
#: now shares, never waiting.
SHARE_CLAIM_GUARDS = f"""
SELECT coalesce(array_agg(k), '{{}}') FROM unnest(%(keys)s::int[]) AS k
WHERE pg_try_advisory_xact_lock_shared({CLAIM_GUARD_CLASS}, k)
"""


def guard_key(organization_id: UUID, node_id: UUID | None = None) -> int:
    """The key of a node's claim guard (one of its organization's :data:`NODE_GUARDS`), or of the organization's."""
    return organization_lock_key(organization_id, b"organization" if node_id is None else bytes([node_id.int % NODE_GUARDS]))


_HOLD_GUARD = service_lock_wait("SELECT pg_advisory_xact_lock(%s, %s)")


async def guard_against_claims(conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID | None = None) -> None:
    """Hold a claim guard to commit: the node's, or (with no node) every claim of the organization's.

    Once this returns, no claim it guards commits until this transaction has.

    A claim reads its node (online? which devices?) and its organization's
    model registry at the start of its transaction and commits later. A
    drain, retirement or revocation that committed in between would answer
    200, and then a job would be leased to a node that takes no new work or
    cannot report it (it waited out the lease); after a heartbeat that
    reported a device gone, or a registry update that raised a model's floor,
    the claim would place work where it no longer fits. So those changes take
    the guard (the node's; the organization's for the registry) exclusively
    before they read anything, and every claim shares its node's and its
    organization's before reading them and holds them to commit
    (:data:`SHARE_CLAIM_GUARDS`, in a statement of its own: a statement's
    snapshot is taken when it starts). A claim then either commits before the
    change answers, or reads what the change left. Claims only try: one whose
    guard is taken claims nothing this time and its long-poll goes on, so a
    slow change never stalls a batch of other nodes' commands. The guard is an
    advisory lock, kept in memory: locking the node's row ``FOR SHARE``
    instead would write that row at every claim.
    """
    await conn.execute(_HOLD_GUARD, (CLAIM_GUARD_CLASS, guard_key(organization_id, node_id)))


async def share_claim_guards(conn: psycopg.AsyncConnection, node_id: UUID, organization_id: UUID) -> bool:
    """Share the node's and its organization's claim guards to commit; False if a change holds either."""
    keys = [guard_key(organization_id, node_id), guard_key(organization_id)]
    [(shared,)] = await (await conn.execute(SHARE_CLAIM_GUARDS, {"keys": sorted(set(keys))})).fetchall()
    return set(keys) <= set(shared)


#: Advisory lock class of a node's memory lock (see ``db.organization_lock_key``).
NODE_MEMORY_CLASS = 0x756D6D6D


def node_memory_key(organization_id: UUID, node_id: UUID) -> int:
    """The key of a node's memory lock: one per node (see :func:`hold_node_memory`)."""
    return organization_lock_key(organization_id, b"memory" + node_id.bytes)


#: The group commit's form of :func:`hold_node_memory`: takes, of the nodes' locks, those free now and
#: never waits (a batch serves many agents); returns the ids of the nodes whose lock it took.
TRY_NODE_MEMORY = (
    "SELECT coalesce(array_agg(x.id), '{}') FROM unnest(%(ids)s::uuid[], %(keys)s::int[]) AS x(id, key)"
    f" WHERE pg_try_advisory_xact_lock({NODE_MEMORY_CLASS}, x.key)"
)


_HOLD_NODE_MEMORY = service_lock_wait(f"SELECT pg_advisory_xact_lock({NODE_MEMORY_CLASS}, %s)")


async def hold_node_memory(conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID) -> None:
    """Hold the node's memory lock to commit; take it before reading the node's running jobs.

    A claim that places a job that takes memory judges the node's running jobs
    as committed (:func:`umbra.domain.placement.with_running_jobs`). Two such
    claims for one node in transactions that overlap (an agent's slots whose
    claims land in the group commit's two batches, two server processes) would
    each miss the other's job and could fill one card twice. Holding this lock,
    a claim reads what the claim before it committed. Claims of jobs that take
    no memory never take it.
    """
    await conn.execute(_HOLD_NODE_MEMORY, (node_memory_key(organization_id, node_id),))


def capacity_cause(node_id: UUID | None, request_id: str | None) -> dict[str, str]:
    """Metadata for blocked-job re-examination caused by a node or registry change."""
    cause = {"actor": "reexamine", "causation": f"node:{node_id}" if node_id else "models"}
    if request_id:
        cause["request_id"] = request_id
    return cause


async def change_node(
    conn: psycopg.AsyncConnection,
    organization_id: UUID,
    node_id: UUID,
    decide: Callable[[psycopg.AsyncConnection, NodeState], Awaitable[list[Event]]],
    actor: str | None,
    request_id: str | None,
    then: Callable[[psycopg.AsyncConnection], Awaitable[list[tuple[UUID, int, int]]]] | None = None,
    *,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
) -> tuple[NodeState, list[Event]]:
    """An administrator's change of what a node may take (drain, retire, revoke, a device's cordon).

    Takes the node's claim guard and the organization's capacity lock before
    anything is read, so no claim commits for the node after this answers and
    no judgement of "could anything ever run this job" misses it. ``decide``
    returns the events to append (none: nothing changes, nothing is recorded);
    it may lock the rows ``then`` changes (before the append: see
    :func:`umbra.compute.jobs.record_and_settle`). ``then``, when the node's
    events are appended, makes the change's other changes in the same
    transaction and returns their hints. Waiting jobs are then re-examined: a
    node that stops taking work changes what blocked jobs could ever run on,
    and so their reasons.
    """
    async with conn.transaction():
        await guard_against_claims(conn, organization_id, node_id)
        await hold_capacity(conn, organization_id, exclusive=True)
        state = await projection.load(conn, node_id, organization_id=organization_id, for_update=True)
        if state is None:
            raise node_not_found(node_id)
        events = await decide(conn, state)
        if not events:
            return state, []
        spell = await _unrecorded_spell(conn, state, events, stale_seconds)
        if spell is not None:  # time took the node offline, not this change: the sweeper's actor, as a beat records it
            state, _ = await append_node_events(conn, state, [spell], node_id=node_id, organization_id=organization_id,
                                                actor="sweeper", request_id=request_id)  # fmt: skip
        state, recorded = await append_node_events(
            conn, state, events, node_id=node_id, organization_id=organization_id, actor=actor, request_id=request_id
        )
        hints = await then(conn) if then is not None else []
        reexamined = await reexamine_waiting_jobs(conn, organization_id, metadata=capacity_cause(node_id, request_id),
                                                  publish=False)  # fmt: skip
        await store.publish(conn, [(organization_id, recorded[-1].position, 0), *hints, *reexamined.hints])
    log.info("node changed", extra={"action": recorded[-1].type, "node_id": str(node_id)})
    return state, events


_SILENCE = "SELECT (SELECT last_seen_at FROM node_liveness WHERE node_id = %s), umbra_now()"


async def _unrecorded_spell(conn: psycopg.AsyncConnection, state: NodeState, events: Sequence[Event],
                            stale_seconds: int) -> NodeWentOffline | None:  # fmt: skip
    """The ``node.went_offline`` the views' ``offline`` reading calls for and the log lacks, when an operator's
    change lands on a stored ``online`` node silent past the threshold, recorded first (as a beat after such
    a silence records it: :class:`umbra.domain.heartbeat.Silence`). Otherwise a drain, retirement or
    revocation left the node no longer stored ``online``, which no sweep looks at again, and any change moved
    the node's version, so a beat ending that silence meanwhile took the spell as already answered for: the
    log never explained the ``offline`` a view showed. A sign-off records its own."""
    if state.status != "online" or any(isinstance(e, NodeWentOffline) for e in events):
        return None
    last_seen_at, now = await (await conn.execute(_SILENCE, (state.id,))).fetchone()
    return Silence(last_seen_at, now, stale_seconds, state.version).unrecorded_spell(state)


def _one_event(event: Event, check: Callable[[str], bool]):
    async def decide(conn: psycopg.AsyncConnection, state: NodeState) -> list[Event]:
        return [event] if check(state.status) else []

    return decide


async def drain_node(
    conn: psycopg.AsyncConnection,
    organization_id: UUID,
    node_id: UUID,
    *,
    actor: str | None = None,
    request_id: str | None = None,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
) -> NodeState:
    """Finish current work, take no new. Idempotent; a retired node answers ``node_retired``."""
    state, _ = await change_node(conn, organization_id, node_id, _one_event(NodeDraining(by=actor), check_drain), actor, request_id,
                                 stale_seconds=stale_seconds)
    return state


async def retire_node(
    conn: psycopg.AsyncConnection,
    organization_id: UUID,
    node_id: UUID,
    *,
    actor: str | None = None,
    request_id: str | None = None,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
) -> NodeState:
    """Take the node out of service for good. Idempotent."""
    state, _ = await change_node(conn, organization_id, node_id, _one_event(NodeRetired(by=actor), check_retire), actor, request_id,
                                 stale_seconds=stale_seconds)
    return state


async def cordon_device(conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID, device: str, *,
                        reason: str | None = None, actor: str | None = None, request_id: str | None = None,
                        stale_seconds: int = DEFAULT_STALE_SECONDS) -> NodeState:  # fmt: skip
    """Take one of the node's devices out of service (:func:`umbra.domain.nodes.decide_cordon`). Through
    :func:`change_node`: no claim for the node commits after this answers, and waiting jobs only that device
    could run are blocked."""

    async def decide(conn: psycopg.AsyncConnection, state: NodeState) -> list[Event]:
        return decide_cordon(stored=state.status, labels={d.label for d in state.devices}, cordoned=dict(state.cordoned),
                             device=device, reason=reason, by=actor)  # fmt: skip

    state, _ = await change_node(conn, organization_id, node_id, decide, actor, request_id, stale_seconds=stale_seconds)
    return state


async def uncordon_device(conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID, device: str, *,
                          actor: str | None = None, request_id: str | None = None,
                          stale_seconds: int = DEFAULT_STALE_SECONDS) -> NodeState:  # fmt: skip
    """Put a cordoned device back in service; the jobs it alone could run are unblocked."""

    async def decide(conn: psycopg.AsyncConnection, state: NodeState) -> list[Event]:
        return decide_uncordon(labels={d.label for d in state.devices}, cordoned=dict(state.cordoned), device=device, by=actor)

    async def wake(conn: psycopg.AsyncConnection) -> list[tuple[UUID, int, int]]:
        # A device back in service may take queued work no other device has taken: a parked long-poll of the
        # node (or another, the token passing on) looks again, rather than at the safety poll.
        return [(organization_id, 0, 1)]

    state, _ = await change_node(conn, organization_id, node_id, decide, actor, request_id, then=wake,
                                 stale_seconds=stale_seconds)
    return state


async def sign_off(
    conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID, *, request_id: str | None = None
) -> NodeState:
    """The node's agent is stopping on purpose: the node reads ``offline`` now.

    Otherwise it read ``online`` until its silence passed the stale threshold
    (45 s by default): dashboards showed a stopped machine as available, and
    work only it could run looked as if it would start any moment. Recorded as
    the sweeper records a silent node, ``node.went_offline``, here by the node
    itself (its actor), through :func:`change_node`, so no claim for it commits
    after this answers and the waiting jobs are re-examined. Only a stored
    ``online`` changes (an administrator's ``draining`` or ``retired`` stays);
    the node's next heartbeat brings it back online.
    """
    async def decide(conn: psycopg.AsyncConnection, state: NodeState) -> list[Event]:
        if after_went_offline(state.status) == state.status:
            return []
        seen = await (await conn.execute(_LAST_SEEN, (node_id,))).fetchone()
        return [NodeWentOffline(last_seen_at=seen[0] if seen else None)]

    state, _ = await change_node(conn, organization_id, node_id, decide, f"node:{node_id}", request_id)
    return state


_LAST_SEEN = "SELECT last_seen_at FROM node_liveness WHERE node_id = %s"


_STALE = f"""
SELECT {projection.COLUMNS}, l.last_seen_at
FROM nodes n LEFT JOIN node_liveness l ON l.node_id = n.id
WHERE n.status = 'online'
  AND (l.last_seen_at IS NULL OR l.last_seen_at < umbra_now() - make_interval(secs => %(stale)s))
  AND (%(after)s::uuid IS NULL OR n.id > %(after)s::uuid)
ORDER BY n.id
LIMIT %(limit)s
FOR UPDATE OF n SKIP LOCKED
"""


_BEAT_SINCE = """
SELECT node_id FROM node_liveness
WHERE node_id = ANY(%s) AND last_seen_at >= umbra_now() - make_interval(secs => %s)
"""


async def mark_stale_page(
    conn: psycopg.AsyncConnection, *, stale_seconds: int = DEFAULT_STALE_SECONDS, limit: int = 500,
    after: UUID | None = None,
) -> tuple[list[UUID], UUID | None]:
    """Record ``node.went_offline`` for stored-``online`` nodes silent past the threshold.

    Readers already see such nodes as offline (effective status); this makes
    the log say so too. Rows another transaction holds (a heartbeat promoting
    the node, an administrator draining it) are skipped and looked at on the
    next sweep. A beat is not a lock of the node's row: one that commits while
    this runs is caught by a second read of liveness, and one that commits
    after it looks at the stored status again under the row's lock (see
    :func:`umbra.compute.heartbeat.heartbeat`). Looks at ``limit`` nodes at most,
    by id after ``after``; returns the ids marked, and where the next page
    starts (None after a short page: the pass is done). A page goes by the
    nodes read, not those marked: a beat that saved one of a full page ended
    the pass there, and other organizations' silent nodes waited a tick.
    """
    async with conn.transaction():
        rows = await (await conn.execute(_STALE, {"stale": stale_seconds, "limit": limit, "after": after})).fetchall()
        next_page = rows[-1][0] if len(rows) == limit else None
        if rows:
            # A beat that committed after the read above (its liveness was not locked) saved the node.
            beat = {r[0] for r in await (await conn.execute(_BEAT_SINCE, ([row[0] for row in rows], stale_seconds))).fetchall()}
            rows = [row for row in rows if row[0] not in beat]
        if not rows:
            return [], next_page
        states = [projection.from_row(row) for row in rows]
        batch = [
            store.PendingAppend(
                store.node_stream(s.id),
                s.version,
                [NodeWentOffline(last_seen_at=row[projection.WIDTH])],
                s.organization_id,
                {"actor": "sweeper"},
            )
            for s, row in zip(states, rows)
        ]
        recorded = await store.append_many(conn, batch)
        for state, item in zip(states, recorded):
            await projection.write(conn, projection.fold(state, item))
        await store.publish(conn, [(r.organization_id, r.position, 0) for r in recorded])
    marked = [s.id for s in states]
    for state in states:
        log.info("node went silent: marked offline", extra={"action": "node.went_offline", "node_id": str(state.id),
                                                            "organization_id": str(state.organization_id)})  # fmt: skip
    return marked, next_page
