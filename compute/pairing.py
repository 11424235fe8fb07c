"""Pairing: a six-digit, single-use code for a named node, exchanged for a credential.

Six digits is only defensible because of what surrounds them: the code is
single use, expires (60..1800 s), is bound to a node name, is stored as an
argon2id hash, and redemption is rate-limited per source *before* the code is
looked at. The caller names the source: a client's address, an IPv6 client's
network (it holds a /64 at least, and counted by address it took a fresh
budget with a fresh address for each guess). Wrong, expired and used codes
get one identical answer; a code for another name and a name already taken
are not secret and say so.

A code is found by its hash. Every code is hashed with one salt drawn for
the database (``pairing_salt``, migration 0027), so an attempt costs one
argon2id computation and an index lookup however many codes are waiting. With
a salt per code, each wrong attempt, unauthenticated, cost one computation per
live code of every organization. No two live codes are equal, whatever their
name or organization, so the lookup finds at most one, and a code presented
under another name is recognised as such. The hash carries the profile's
parameters too: processes that issue and redeem codes must share one
(``umbra.security.PASSWORD_HASHER``), and a release that changed it would find
no code issued before it (they expire within half an hour).

Given a pool, the commands borrow a connection for each step that talks to
the database and give it back before every argon2id computation (about 60 ms
here: the code's hash, and the node credential's). Redemption is
unauthenticated: had it held a connection while hashing, ten wrong codes at
once from ten addresses, each within its rate limit, would pin a pool of ten
and stall every submit and report behind them.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Sequence
from uuid import UUID, uuid4

import anyio
import psycopg

from umbra.domain.heartbeat import normalize_devices
from umbra.errors import Conflict, InvalidRequest, RateLimited, Unauthenticated
from umbra.events import store
from umbra.events.types import Device, NodeCreated, NodePaired
from umbra.db import Database, borrowed, service_lock_wait
from umbra.security import hash_secret_salted

from .auth import Principal, credential_is_live, revoked
from .blocked import hold_capacity, reexamine_waiting_jobs
from .credentials import mint_node_credential, store_node_credential
from .nodes import append_node_events, capacity_cause

log = logging.getLogger(__name__)

#: Redemption attempts admitted per source within any window of
#: :data:`WINDOW_SECONDS`. At 20 guesses a quarter-hour the 1,000,000-code
#: space takes about 21 years to walk.
ATTEMPTS_PER_WINDOW = 20
#: The sliding window, on the database clock: the attempts of the last 15
#: minutes, whenever they fell, so this is a rate, not a lifetime total, and no
#: boundary lets a source spend its budget twice in a row.
WINDOW_SECONDS = 15 * 60
TTL_MIN_SECONDS, TTL_MAX_SECONDS, TTL_DEFAULT_SECONDS = 60, 1800, 600
#: How long a code's row is kept once it expired (redeemed or not), for a look
#: at recent pairings; after that :func:`prune` removes it.
RETENTION_SECONDS = 24 * 3600

_CODE = re.compile(r"^[0-9]{6}$")


def _invalid() -> Unauthenticated:
    return Unauthenticated(
        "That pairing code is not valid: it may be mistyped, expired or already used. Ask for a new one.",
        code="pairing_code_invalid",
    )


def _name_taken(name: str) -> Conflict:
    return Conflict(
        "node_name_taken",
        f"A node named {name!r} already exists in this organization, and a node's name stays taken (a retired "
        "node keeps its own); choose another name.",
    )


#: Longest trust domain and locality of a node, in characters: the bounds ``POST /v1/pairings`` decodes with.
TRUST_DOMAIN_MAX_LENGTH, LOCALITY_MAX_LENGTH = 100, 200


def check_node_name(name: str) -> str:
    name = name.strip()
    if not name or len(name) > 200:
        raise InvalidRequest("name must be 1..200 characters.", field="name")
    return name


def check_trust_domain(trust_domain: str) -> str:
    if not 1 <= len(trust_domain) <= TRUST_DOMAIN_MAX_LENGTH:
        raise InvalidRequest(f"trust_domain must be 1..{TRUST_DOMAIN_MAX_LENGTH} characters.", field="trust_domain")
    return trust_domain


def check_locality(locality: str | None) -> str | None:
    if locality is not None and len(locality) > LOCALITY_MAX_LENGTH:
        raise InvalidRequest(f"locality must be at most {LOCALITY_MAX_LENGTH} characters.", field="locality")
    return locality


def check_ttl(ttl_seconds: int) -> int:
    if not TTL_MIN_SECONDS <= ttl_seconds <= TTL_MAX_SECONDS:
        raise InvalidRequest(
            f"ttl_seconds must be between {TTL_MIN_SECONDS} and {TTL_MAX_SECONDS}.", field="ttl_seconds"
        )
    return ttl_seconds


async def require_name_free(conn: psycopg.AsyncConnection, organization_id: UUID, name: str) -> None:
    """Refuse ``name`` when a node of the organization holds it, retired or not: a code issued for it could
    never be redeemed (redemption refuses it with ``node_name_taken``)."""
    name = check_node_name(name)
    if await (await conn.execute(_NAME_HELD, (organization_id, name))).fetchone() is not None:
        raise _name_taken(name)


_NAME_HELD = "SELECT 1 FROM nodes WHERE organization_id = %s AND name = %s"


@dataclass(frozen=True, slots=True)
class IssuedCode:
    id: UUID
    code: str
    node_name: str
    expires_at: datetime


#: One pairing code's digits at a time (their hash): the check that none waits under them, then the insert.
_HOLD_CODE = service_lock_wait("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))")
_LIVE = """
SELECT id, node_name FROM pairing_codes
WHERE code_hash = %s AND redeemed_at IS NULL AND expires_at > umbra_now()
"""
_ISSUE = """
INSERT INTO pairing_codes (id, organization_id, node_name, code_hash, trust_domain, locality, expires_at, created_at)
VALUES (%s, %s, %s, %s, %s, %s, umbra_now() + make_interval(secs => %s), umbra_now())
RETURNING expires_at
"""


async def _salt(conn: psycopg.AsyncConnection) -> bytes:
    """The database's pairing salt: read each time, never cached, so it cannot be stale."""
    return bytes((await (await conn.execute("SELECT salt FROM pairing_salt")).fetchone())[0])


async def _code_hash(code: str, salt: bytes) -> str:
    """``code``'s stored form: argon2id under the database's pairing salt, off the event loop."""
    return await anyio.to_thread.run_sync(hash_secret_salted, code, salt)


async def issue_pairing_code(
    db: Database,
    organization_id: UUID,
    name: str,
    *,
    trust_domain: str = "local",
    locality: str | None = None,
    ttl_seconds: int = TTL_DEFAULT_SECONDS,
    issuer: Principal | None = None,
) -> IssuedCode:
    """Mint a code for a node named ``name``. The plain code is returned once, never stored.

    ``issuer``, the key asking, is checked again in the transaction that
    stores the code: it may have been revoked while its request's body
    arrived or while the code was hashed, and a code issued then would let a
    node pair after the key's revocation.

    A fresh code never equals another live code, of any name in any
    organization, so a redeemer can never be paired into the wrong tenant by a
    coincidence of six digits. Issuers of the same digits serialise on them (a
    transaction-scoped advisory lock on the hash) between the check and the
    insert.

    The name, trust domain, locality and lifetime are checked here, with the
    bounds the API decodes them with, so the command line refuses what the
    API refuses.
    """
    name = check_node_name(name)
    check_trust_domain(trust_domain)
    check_locality(locality)
    check_ttl(ttl_seconds)
    code_id = uuid4()
    async with borrowed(db) as conn:
        salt = await _salt(conn)
    while True:
        code = f"{secrets.randbelow(1_000_000):06d}"
        code_hash = await _code_hash(code, salt)
        async with borrowed(db) as conn, conn.transaction():
            if issuer is not None and not await credential_is_live(conn, issuer):
                raise revoked()
            await conn.execute(_HOLD_CODE, (code_hash,))
            if await (await conn.execute(_LIVE, (code_hash,))).fetchone() is not None:
                continue  # those digits are waiting for another node: draw again
            row = await (
                await conn.execute(_ISSUE, (code_id, organization_id, name, code_hash, trust_domain, locality, ttl_seconds))
            ).fetchone()
            break
    log.info("pairing code issued", extra={"action": "pairing_code_issued", "pairing_id": str(code_id)})
    return IssuedCode(id=code_id, code=code, node_name=name, expires_at=row[0])


_CHARGE = """
INSERT INTO pairing_attempt_times AS p (source, attempted_at) VALUES (%(source)s, ARRAY[umbra_now()])
ON CONFLICT (source) DO UPDATE SET (attempted_at, refused) = (
    SELECT CASE WHEN count(*) >= %(budget)s THEN coalesce(array_agg(at ORDER BY at), '{}')
                ELSE coalesce(array_agg(at ORDER BY at), '{}') || umbra_now() END,
           count(*) >= %(budget)s
    FROM unnest(p.attempted_at) at WHERE at > umbra_now() - make_interval(secs => %(window)s)
)
RETURNING refused,
          greatest(1, ceil(extract(epoch FROM attempted_at[1] + make_interval(secs => %(window)s) - umbra_now())))::int
"""


async def charge_attempt(conn: psycopg.AsyncConnection, source: str) -> None:
    """Count one redemption attempt from ``source``; raise 429 past the budget.

    Must run as its own committed statement (``conn`` in autocommit, outside a
    transaction) *before* the code is checked, so a failing redemption still
    counts and a right code past the budget is refused like a wrong one. A
    refused attempt is not counted: the budget caps the guesses that reach a
    code, and ``Retry-After`` is then exactly when the oldest admitted attempt
    leaves the window and the next is admitted.
    """
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise RuntimeError("charge_attempt must commit on its own; call it outside a transaction")
    params = {"source": source, "budget": ATTEMPTS_PER_WINDOW, "window": WINDOW_SECONDS}
    refused, retry_after = await (await conn.execute(_CHARGE, params)).fetchone()
    if refused:
        log.warning("pairing rate limit reached", extra={"action": "pairing_rate_limited", "source": source})
        raise RateLimited(f"Too many pairing attempts from this address (an IPv6 one: from its network); try again "
                          f"in {retry_after} s.", retry_after=retry_after)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Redemption:
    node_id: UUID
    organization_id: UUID
    credential: str
    scopes: tuple[str, ...]


_SPEND = """
UPDATE pairing_codes SET redeemed_at = umbra_now()
WHERE id = %s AND redeemed_at IS NULL AND expires_at > umbra_now()
RETURNING organization_id, node_name, trust_domain, locality
"""


async def _find_code(conn: psycopg.AsyncConnection, code_hash: str, name: str) -> UUID:
    """The live code hashed as ``code_hash``, issued for ``name``; raise the right refusal otherwise."""
    found = await (await conn.execute(_LIVE, (code_hash,))).fetchone()
    if found is None:
        raise _invalid()
    code_id, node_name = found
    if node_name != name:
        # The issued name is not repeated: whoever redeems unauthenticated would
        # learn, with a guessed live code, the one name it still lacked.
        raise Conflict(
            "pairing_name_mismatch",
            f"This code was issued for a node of another name, not {name!r}; "
            "redeem it under the name it was issued for, or ask for a code for this one.",
        )
    return code_id


async def redeem_pairing_code(
    db: Database,
    *,
    code: str,
    name: str,
    source: str,
    agent_version: str | None = None,
    devices: Sequence[Device] = (),
    transport: str | None = None,
    request_id: str | None = None,
) -> Redemption:
    """Exchange a code for a new ``provisioning`` node and its credential.

    Order: charge the attempt (committed), hash the code, find it, mint the
    credential, then one transaction that spends the code with a conditional
    UPDATE (``redeemed_at IS NULL``) and creates the node. The two hashes run
    with no connection borrowed from a pool, and only a code that was found
    pays for the second. Two redeemers of one code serialise on that row: the
    second finds it spent and gets the ordinary invalid answer, and a failure
    after spending rolls the spend back with the node, so no orphan remains.
    """
    async with borrowed(db) as conn:
        await charge_attempt(conn, source)
        salt = await _salt(conn)
    name = check_node_name(name)
    code = code.strip()
    if not _CODE.match(code):
        raise _invalid()
    code_hash = await _code_hash(code, salt)
    async with borrowed(db) as conn:
        code_id = await _find_code(conn, code_hash, name)
    credential = await mint_node_credential()
    try:
        async with borrowed(db) as conn, conn.transaction():
            spent = await (await conn.execute(_SPEND, (code_id,))).fetchone()
            if spent is None:
                raise _invalid()
            organization_id, node_name, trust_domain, locality = spent
            await hold_capacity(conn, organization_id, exclusive=True)
            taken = await (await conn.execute(_NAME_HELD, (organization_id, node_name))).fetchone()
            if taken is not None:
                raise _name_taken(node_name)
            node_id = uuid4()
            events = [
                NodeCreated(name=node_name, trust_domain=trust_domain, locality=locality, transport=transport),
                NodePaired(credential_id=credential.id, agent_version=agent_version, devices=normalize_devices(devices)),
            ]
            state, recorded = await append_node_events(
                conn,
                None,
                events,
                node_id=node_id,
                organization_id=organization_id,
                actor=f"pairing:{code_id}",
                request_id=request_id,
            )
            await store_node_credential(conn, credential, node_id=node_id, organization_id=organization_id)
            reexamined = await reexamine_waiting_jobs(conn, organization_id, metadata=capacity_cause(node_id, request_id),
                                                      publish=False)  # fmt: skip
            await store.publish(conn, [(organization_id, recorded[-1].position, 0), *reexamined.hints])
    except psycopg.errors.UniqueViolation as exc:
        if exc.diag.constraint_name == "nodes_name_per_org":
            raise _name_taken(name) from None
        raise
    log.info("node paired", extra={"action": "node_paired", "node_id": str(node_id), "pairing_id": str(code_id)})
    return Redemption(node_id=node_id, organization_id=organization_id, credential=credential.token, scopes=credential.scopes)


#: Rows another transaction holds are left for a later prune: the sweeper runs it, and must not wait.
_PRUNE_CODES = """
DELETE FROM pairing_codes WHERE id IN (
    SELECT id FROM pairing_codes WHERE expires_at < umbra_now() - make_interval(secs => %s) FOR UPDATE SKIP LOCKED
)"""
_PRUNE_ATTEMPTS = """
DELETE FROM pairing_attempt_times WHERE source IN (
    SELECT source FROM pairing_attempt_times
    WHERE attempted_at[cardinality(attempted_at)] + make_interval(secs => %s) <= umbra_now()
    FOR UPDATE SKIP LOCKED
)"""


async def prune(conn: psycopg.AsyncConnection) -> int:
    """Delete pairing codes past their retention and sources with no attempt left in the window; returns the rows deleted.

    Neither is an event: a pairing is recorded in the log by the node's own
    events (``node.created``, ``node.paired``). A source whose attempts all
    left the window no longer limits anyone; its next attempt would trim them
    anyway, but sources that never come back would stay forever.
    """
    codes = await conn.execute(_PRUNE_CODES, (RETENTION_SECONDS,))
    attempts = await conn.execute(_PRUNE_ATTEMPTS, (WINDOW_SECONDS,))
    return codes.rowcount + attempts.rowcount
