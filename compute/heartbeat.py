"""Heartbeats: refresh liveness on every beat, record an event only when it matters.

The common beat is one statement: upsert ``node_liveness.last_seen_at`` and
read the node row back. Only when :func:`umbra.domain.heartbeat.decide_heartbeat`
finds something worth recording (see there) does a transaction lock the row,
decide again against the locked state, and append ``node.heartbeat``.

A beat after a silence past the stale threshold that the sweeper has not yet
recorded also appends ``node.went_offline`` before its ``node.heartbeat``
(see :class:`umbra.domain.heartbeat.Silence`): views read the node offline
meanwhile, and the log must say so whenever the sweeper looks.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from uuid import UUID

import msgspec
import psycopg

from umbra.domain.heartbeat import HeartbeatReport, Silence, decide_heartbeat, frees_memory, normalize_devices
from umbra.domain.node_status import DEFAULT_STALE_SECONDS, effective_status
from umbra.events import store
from umbra.projections import nodes as projection

from .auth import live_node_credentials, revoked
from .blocked import decode_devices, hold_capacity, reexamine_waiting_jobs
from .nodes import append_node_events, capacity_cause, guard_against_claims, node_not_found

log = logging.getLogger(__name__)


class _MoreLocks(Exception):
    def __init__(self, guard: bool, capacity: bool) -> None:
        self.guard, self.capacity = guard, capacity


def _changes_devices(decision) -> bool:
    return "devices" in decision.reasons


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    node_id: UUID
    #: Effective status after this beat.
    status: str
    #: Whether a ``node.heartbeat`` event was appended.
    recorded: bool
    #: Whether the device set, resident models or status changed (what could run here).
    changed_capacity: bool


_BEAT = f"""
WITH before AS (SELECT last_seen_at, devices FROM node_liveness WHERE node_id = %(node)s),
seen AS (
    INSERT INTO node_liveness (node_id, last_seen_at, devices, reported_at)
    SELECT id, umbra_now(), %(devices)s::jsonb, CASE WHEN %(devices)s::jsonb IS NULL THEN NULL ELSE umbra_now() END FROM nodes WHERE id = %(node)s AND organization_id = %(org)s
      AND (%(credential)s::uuid IS NULL
           OR EXISTS (SELECT 1 FROM node_credentials WHERE id = %(credential)s::uuid AND revoked_at IS NULL))
    ON CONFLICT (node_id) DO UPDATE SET last_seen_at = EXCLUDED.last_seen_at,
                                        devices = coalesce(EXCLUDED.devices, node_liveness.devices),
                                        reported_at = CASE WHEN EXCLUDED.devices IS NULL THEN node_liveness.reported_at
                                                           ELSE EXCLUDED.last_seen_at END
    RETURNING last_seen_at
)
SELECT {projection.COLUMNS}, seen.last_seen_at, umbra_now(), (SELECT last_seen_at FROM before),
       CASE WHEN %(devices)s::jsonb IS NOT NULL THEN (SELECT devices::text FROM before) END
FROM nodes n, seen
WHERE n.id = %(node)s
"""


async def heartbeat(
    conn: psycopg.AsyncConnection,
    organization_id: UUID,
    node_id: UUID,
    report: HeartbeatReport,
    *,
    event_interval_seconds: int,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
    request_id: str | None = None,
    credential_id: UUID | None = None,
) -> HeartbeatResult:
    """Record one beat from the node's own credential (``organization_id`` is the node's).

    ``credential_id``: the credential the beat authenticated with, before its body was read. A
    revocation that committed since refuses the beat 401 with nothing written (the liveness write
    is conditional on the credential, in the same statement), rather than record it after the
    revocation and answer ``retired`` (its agent would take that for a retirement and exit 0). One
    that commits after that first statement is seen under the row's lock, before any event.
    """
    # The devices as reported, kept at every beat (migration 0034): a move of free memory within the tolerance
    # records no event, and claims judge these.
    reported = None if report.devices is None else normalize_devices(report.devices)
    devices = None if reported is None else msgspec.json.encode(reported).decode()
    row = await (await conn.execute(_BEAT, {"node": node_id, "org": organization_id, "credential": credential_id,
                                            "devices": devices})).fetchone()  # fmt: skip
    if row is None:  # nothing written: no such node, or (asked only then) a credential revoked since it authenticated
        if credential_id is not None and not await live_node_credentials(conn, [credential_id]):
            raise revoked()
        raise node_not_found(node_id)
    state, (last_seen_at, now, before, reported_before) = projection.from_row(row), row[projection.WIDTH:]
    # The silence this beat ends, judged against the row read with it (one snapshot): if views read the node
    # offline meanwhile and the log does not say so yet, the beat records the spell (see Silence).
    silence = Silence(before, last_seen_at, stale_seconds, state.version)
    decision = decide_heartbeat(state, report, now, event_interval_seconds=event_interval_seconds, silence=silence)
    # After a silence, the sweeper may be marking this node offline right now, from a read made before
    # this beat: the stored status read here may already be out of date. Look again under the row's lock.
    back_from_silence = before is None or (now - before).total_seconds() > stale_seconds
    # Memory freed since the last report, recorded or not (see MEMORY_EVENT_SPACING_SECONDS): a claim parked
    # because nothing fitted looks again now.
    freed = reported_before is not None and frees_memory(decode_devices(reported_before), reported)
    if decision.event is None and not back_from_silence:
        if freed:
            await _wake_for_freed_memory(conn, organization_id)
        return HeartbeatResult(node_id, effective_status(state.status, last_seen_at, now, stale_seconds=stale_seconds), False, False)
    # Locks by what the beat changes, decided from the read above and checked again under the row's lock:
    # the claim guard when placements change (see nodes.guard_against_claims), the organization's capacity
    # lock when the device set does (the only change a job's "could anything ever run it" depends on).
    guard, capacity = decision.changes_capacity, _changes_devices(decision)
    while True:
        try:
            state, decision, now = await _record(conn, organization_id, node_id, report, guard=guard, capacity=capacity,
                                                 event_interval_seconds=event_interval_seconds, request_id=request_id,
                                                 credential_id=credential_id, silence=silence, freed=freed)  # fmt: skip
            break
        except _MoreLocks as more:  # the locked row says the beat changes more than the first read did
            guard, capacity = guard or more.guard, capacity or more.capacity
    if decision.event is not None:
        log.debug("heartbeat recorded", extra={"action": "heartbeat_recorded", "node_id": str(node_id), "reasons": ",".join(decision.reasons)})
    status = effective_status(state.status, last_seen_at, now, stale_seconds=stale_seconds)
    return HeartbeatResult(node_id, status, decision.event is not None, decision.changes_capacity)


_ANY_QUEUED = "SELECT EXISTS (SELECT 1 FROM jobs WHERE organization_id = %s AND status = 'queued')"


async def _queued_hint(conn: psycopg.AsyncConnection, organization_id: UUID) -> int:
    """The claimable count of a beat's hint when it changes what the node could run (memory freed, a model
    loaded, devices): 1 while jobs are queued, so a parked claim looks again now. A job that did not fit the
    memory the node last reported is not blocked (the device's total fits it): no other event says it fits now,
    and the node's long-poll waited for the safety poll."""
    return 1 if (await (await conn.execute(_ANY_QUEUED, (organization_id,))).fetchone())[0] else 0


_WENT_OFFLINE_SINCE = "SELECT EXISTS (SELECT 1 FROM events WHERE stream = %s AND version > %s AND type = 'node.went_offline')"


async def _went_offline_since(conn: psycopg.AsyncConnection, node_id: UUID, version: int) -> bool:
    """Whether a ``node.went_offline`` (the sweeper's, a sign-off's, another change's) was appended to the node's
    stream after ``version``."""
    return (await (await conn.execute(_WENT_OFFLINE_SINCE, (store.node_stream(node_id), version))).fetchone())[0]


async def _wake_for_freed_memory(conn: psycopg.AsyncConnection, organization_id: UUID) -> None:
    """The hint of a beat that freed memory and records no event (so it names no position): sent only while
    jobs are queued, as a NOTIFY is read by every listener of the cluster."""
    if await _queued_hint(conn, organization_id):
        await store.publish(conn, [(organization_id, 0, 1)])


async def _refuse_if_revoked(conn: psycopg.AsyncConnection, state, credential_id: UUID | None) -> None:
    """Under the row's lock: a revocation makes the node retired, and then only the beat's own credential tells."""
    if credential_id is not None and state.status == "retired" and not await live_node_credentials(conn, [credential_id]):
        raise revoked()


async def _record(conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID, report: HeartbeatReport, *,
                  guard: bool, capacity: bool, event_interval_seconds: int, request_id: str | None,
                  credential_id: UUID | None, silence: Silence, freed: bool):  # fmt: skip
    """Decide again under the node's row lock and record the beat; returns (state, decision, now).

    Raises :class:`_MoreLocks` (nothing written) when the locked row calls for
    a lock not taken: they are taken before the row's, so the caller starts over.

    ``freed``: the beat frees memory since the last report (:func:`~umbra.domain.heartbeat.frees_memory`), and
    its hint wakes a parked claim whatever the decision's reasons.

    An unrecorded offline spell is judged again here: under the row's lock,
    a sweeper that recorded it since, or another beat that ended the same
    silence, has moved the node's version, and the spell is not recorded twice.
    """
    async with conn.transaction():
        if guard:  # a claim must not place work on devices this beat says are gone
            await guard_against_claims(conn, organization_id, node_id)
        if capacity:
            await hold_capacity(conn, organization_id, exclusive=True)
        locked = await projection.load(conn, node_id, organization_id=organization_id, for_update=True)
        assert locked is not None
        await _refuse_if_revoked(conn, locked, credential_id)  # the revocation may have committed since the first read
        if locked.version != silence.version and not await _went_offline_since(conn, node_id, silence.version):
            # The node's events since the first read (an operator's cordon, say) answered for no silence: the
            # spell views showed is still the log's to record.
            silence = dataclasses.replace(silence, version=locked.version)
        now = (await (await conn.execute("SELECT umbra_now()")).fetchone())[0]
        decision = decide_heartbeat(locked, report, now, event_interval_seconds=event_interval_seconds, silence=silence)
        if (decision.changes_capacity and not guard) or (_changes_devices(decision) and not capacity):
            raise _MoreLocks(decision.changes_capacity, _changes_devices(decision))
        if decision.event is None:
            if freed:  # sent when the transaction commits
                await _wake_for_freed_memory(conn, organization_id)
            return locked, decision, now
        state = locked
        if decision.went_offline is not None:  # time took the node offline, not the node: the sweeper's actor
            state, _ = await append_node_events(conn, state, [decision.went_offline], node_id=node_id,
                                                organization_id=organization_id, actor="sweeper",
                                                request_id=request_id)  # fmt: skip
        state, recorded = await append_node_events(conn, state, [decision.event], node_id=node_id,
                                                   organization_id=organization_id, actor=f"node:{node_id}",
                                                   request_id=request_id)  # fmt: skip
        room = await _queued_hint(conn, organization_id) if decision.changes_capacity or freed else 0
        hints = [(organization_id, recorded[-1].position, room)]
        if _changes_devices(decision):
            reexamined = await reexamine_waiting_jobs(conn, organization_id, publish=False,
                                                      metadata=capacity_cause(node_id, request_id))  # fmt: skip
            hints.extend(reexamined.hints)
        await store.publish(conn, hints)
        return state, decision, now
