"""Claim requests their agents gave up on, remembered in the database by node and request id.

An agent that gives up on a claim request (it timed out, its answer was cut
off, it is stopping) asks for the request's claims back
(``POST /v1/agent/claim/release``), naming its ``X-Request-ID``. The request
itself may still be on its way (a proxy buffering it, a slow network) and
reach the server later, when there was nothing yet to give back: it would
then claim a job nobody hears of, leased until the lease runs out. Behind a
load balancer it may reach another process than the release did, so the
abandonment is a row every process reads, not one process's memory.

The release records the row in a transaction of its own, holding the node's
claim guard exclusively (:func:`umbra.compute.nodes.guard_against_claims`)
until it commits, and every claim shares that guard before it reads the row,
in its own transaction. A claim with that request id then either committed
before the row did, and the release gives back what it took in a second
transaction (:func:`umbra.compute.claims.release_unread_claim`), or reads the
row and claims nothing (:class:`ClaimAbandoned`). The guard is held only for
the row's insert and commit: the nodes that share it (its organization's
nodes share 64 guards) look again 20 ms later, as during any change of a
node, instead of waiting for the give-backs, which may wait for rows other
transactions hold.
"""

from __future__ import annotations

from uuid import UUID

import psycopg

from .nodes import guard_against_claims

#: How long an abandoned request is remembered: past the longest long-poll (60 s) and the slack of any
#: proxy that might deliver it late. The sweeper prunes older rows.
ABANDONED_SECONDS = 300

#: The abandoned ones among the claim requests of a batch (``%(requests)s``, a ``text[]``), as one more
#: column of the batch's read of its claiming nodes (``n``): an index probe per node, no statement of its own.
ABANDONED_COLUMN = ("(SELECT array_agg(a.request_id) FROM abandoned_claim_requests a"
                    " WHERE a.node_id = n.id AND a.request_id = ANY(%(requests)s::text[]))")  # fmt: skip

_RECORD = """
INSERT INTO abandoned_claim_requests (node_id, request_id, abandoned_at) VALUES (%s, %s, umbra_now())
ON CONFLICT (node_id, request_id) DO UPDATE SET abandoned_at = excluded.abandoned_at
"""
_IS_ABANDONED = "SELECT EXISTS (SELECT 1 FROM abandoned_claim_requests WHERE node_id = %s AND request_id = %s)"
#: Rows another transaction holds are left for a later prune: the sweeper runs it, and must not wait.
_PRUNE = """
DELETE FROM abandoned_claim_requests WHERE (node_id, request_id) IN (
    SELECT node_id, request_id FROM abandoned_claim_requests
    WHERE abandoned_at < umbra_now() - make_interval(secs => %s) FOR UPDATE SKIP LOCKED
)"""


class ClaimAbandoned(Exception):
    """The claim's request was given up by its agent before the claim ran: it claims nothing, and its
    long-poll ends (answered 204, to nobody)."""


async def abandon(conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID, request_id: str) -> None:
    """Record that the node's agent gave up on the claim request ``request_id``, in the caller's transaction,
    which should commit at once: it holds the node's claim guard until then.

    A claim of that request that shared the guard first has committed by the
    time this returns; any later one reads the row.
    """
    await guard_against_claims(conn, organization_id, node_id)
    await conn.execute(_RECORD, (node_id, request_id))


async def is_abandoned(conn: psycopg.AsyncConnection, node_id: UUID, request_id: str | None) -> bool:
    """Whether the node's agent gave up on the claim request ``request_id`` (for a claim that shares its
    node's claim guard first, in the same transaction)."""
    if request_id is None:
        return False
    [(found,)] = await (await conn.execute(_IS_ABANDONED, (node_id, request_id))).fetchall()
    return bool(found)


async def prune(conn: psycopg.AsyncConnection) -> int:
    """Forget requests abandoned more than :data:`ABANDONED_SECONDS` ago; returns how many."""
    return (await conn.execute(_PRUNE, (ABANDONED_SECONDS,))).rowcount
