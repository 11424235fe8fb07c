"""Node credentials: minted at pairing, revocable, stored only as argon2id hashes.

A node credential carries the four ``compute:*`` scopes and nothing else: it
reaches its own node, its jobs and the model registry, never project content.
Its organization is the node's, never something a request says.

Revocation sets ``revoked_at``; every request re-checks that column, so a
revoked token fails on its next request in every server process: most routes
on a cached hit (:func:`umbra.compute.auth.authenticated_connection`,
:func:`~umbra.compute.auth.authenticate`), the agent's claim, renew and
complete inside their group-commit transaction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

import anyio
import psycopg

from umbra import metrics
from umbra.domain.jobs import NODE_REVOKED_ERROR
from umbra.domain.node_status import DEFAULT_STALE_SECONDS
from umbra.events import store
from umbra.events.types import Event, NodeCredentialRevoked
from umbra.projections import jobs as queue
from umbra.projections.jobs import JobRow
from umbra.projections.nodes import NodeState
from umbra.security import hash_secret, new_token

from .auth import NODE_CREDENTIAL_KIND, NODE_SCOPES
from .claims import end_leases
from .nodes import change_node

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MintedCredential:
    """A fresh token and its hash, made before the transaction that stores it.

    argon2id takes tens of milliseconds; hashing outside the transaction keeps
    row locks (the pairing code's, the node's) short.
    """

    id: UUID
    token: str
    prefix: str
    secret_hash: str
    scopes: tuple[str, ...] = NODE_SCOPES


async def mint_node_credential() -> MintedCredential:
    token, prefix = new_token(NODE_CREDENTIAL_KIND)
    secret_hash = await anyio.to_thread.run_sync(hash_secret, token)
    return MintedCredential(id=uuid4(), token=token, prefix=prefix, secret_hash=secret_hash)


async def store_node_credential(
    conn: psycopg.AsyncConnection, credential: MintedCredential, *, node_id: UUID, organization_id: UUID
) -> None:
    """Insert the credential's hash; the node row must already exist."""
    await conn.execute(
        "INSERT INTO node_credentials (id, node_id, organization_id, prefix, secret_hash, scopes, created_at) "
        "VALUES (%s, %s, %s, %s, %s, %s, umbra_now())",
        (credential.id, node_id, organization_id, credential.prefix, credential.secret_hash, list(credential.scopes)),
    )


_REVOKE = """
UPDATE node_credentials SET revoked_at = umbra_now()
WHERE node_id = %s AND organization_id = %s AND revoked_at IS NULL
RETURNING id
"""


async def revoke_node(
    conn: psycopg.AsyncConnection,
    organization_id: UUID,
    node_id: UUID,
    *,
    actor: str | None = None,
    request_id: str | None = None,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
) -> tuple[NodeState, list[UUID]]:
    """Revoke every live credential of the node, recording one ``node.revoked`` each.

    Returns the node and the revoked credential ids (empty when nothing was
    live: revoking twice records nothing the second time). Nothing can give
    the node a credential again, so it never takes work again and reads
    ``retired`` (:func:`umbra.domain.nodes.after_revoked`): like a retirement,
    the revocation re-examines the jobs waiting for capacity
    (:func:`umbra.compute.nodes.change_node`), and work only this node could
    run is blocked at once instead of left queued looking alive.

    The jobs the node holds can never be reported either (every report is
    refused 401 from now on), so their leases end with the revocation, in its
    transaction, as an expired lease's would (:func:`umbra.compute.claims.end_leases`,
    cause ``node_revoked``): back to the queue, claimable now, that run not
    charged against the job's attempts. Waiting out the lease instead kept
    them from every other node for up to a lease after the administrator had
    said the node was gone. In one transaction with the revocation, both land
    or neither does (a refused or failed revocation changes nothing, and
    sending it again does all of it), and the re-examination of waiting jobs
    sees them: a job only this node could run is blocked, not requeued
    looking alive. The held rows are locked before the node's events are
    appended (a completion holding one commits first, and its job is no
    longer held); the node's claim guard keeps any claim from committing for
    it meanwhile.
    """
    held: list[Any] = []

    async def decide(conn: psycopg.AsyncConnection, state: NodeState) -> list[Event]:
        rows = await (await conn.execute(_REVOKE, (node_id, organization_id))).fetchall()
        if rows:
            held.extend(await (await conn.execute(_HELD_BY_NODE, (organization_id, node_id))).fetchall())
        return [NodeCredentialRevoked(credential_id=cid, by=actor) for cid in sorted(row[0] for row in rows)]

    ended: list[JobRow] = []

    async def end_held_leases(conn: psycopg.AsyncConnection) -> list[tuple[UUID, int, int]]:
        if not held:
            return []
        metadata = {**store.event_metadata(actor, request_id), "causation": f"node:{node_id}"}
        ended.extend(await end_leases(conn, held, delay_seconds=0, node_revoked=True, metadata=metadata))
        return [(row.organization_id, row.position, 1 if row.status == "queued" else 0) for row in ended]

    state, events = await change_node(conn, organization_id, node_id, decide, actor, request_id, then=end_held_leases,
                                       stale_seconds=stale_seconds)
    revoked = [e.credential_id for e in events if isinstance(e, NodeCredentialRevoked)]
    # Back in the queue (not those that had expired, nor those past their free interruptions that failed).
    metrics.count_given_back("node_revoked", sum(row.error == NODE_REVOKED_ERROR and row.status != "failed" for row in ended))
    if revoked:
        await store.ask_recheck(conn, organization_id)  # its parked long-polls are refused now, not at their deadline
    log.info("node credentials revoked", extra={"action": "node_revoked", "node_id": str(node_id), "count": len(revoked),
                                                "leases_ended": len(ended)})  # fmt: skip
    return state, revoked


#: The jobs a node holds (running on its lease; a container a decomposition cleared holds none), locked,
#: and the database clock.
_HELD_BY_NODE = f"""
SELECT {queue.SELECT_LIST}, umbra_now() FROM jobs
WHERE organization_id = %s AND lease_owner = %s AND status = 'running' AND lease_expires_at IS NOT NULL
ORDER BY id
FOR UPDATE
"""
