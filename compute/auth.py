"""Bearer-token authentication for API keys and node credentials.

Tokens are ``<kind>_<prefix>_<secret>``. The prefix narrows the lookup; each
candidate row's argon2id hash is verified against the *whole* token, so two
credentials sharing a prefix can never authenticate as each other.

argon2id is slow on purpose (tens of ms): it runs in a worker thread, so a
verification never stalls the event loop serving every other request and
long-poll, and it is too slow to run on every agent request, so
:class:`VerifiedTokenCache` remembers tokens that verified, keyed by a SHA-256
of the token (the token itself is never kept). That is safe because:
a cache hit still requires presenting the full token (a SHA-256 preimage is as
hard as guessing the token); every hit re-checks ``revoked_at`` on the row by
primary key (for claim, renew and complete, inside the command's own batch
transaction: :func:`authenticate`), so a revocation takes
effect on the next request in every server process; and entries expire after
a minute without use. Each use extends its entry: a key or an agent in use
keeps its place, so a stranger sending wrong secrets for its prefix (past
:data:`MAX_FAILED_VERIFICATIONS`, 429 for tokens not cached) never locks out
its holder where it is in use; with a fixed minute it did, from the moment
its entry aged out. Requests presenting the same uncached token at the same
moment (a dashboard opening its streams after a restart, a fleet of agents
sharing one credential) share one verification
(:meth:`VerifiedTokenCache.verify_once`): without it each ran argon2 on its own,
and a few hundred of them took both cores for seconds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator
from uuid import UUID

import anyio
import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from umbra.db import Database, borrowed
from umbra.errors import Forbidden, RateLimited, Unauthenticated
from umbra.security import token_fingerprint, token_prefix, verify_secret

API_KEY_KIND = "uk"
NODE_CREDENTIAL_KIND = "un"

#: Every scope an API key may carry; `create-org` keys get all of them.
API_KEY_SCOPES = ("jobs:write", "jobs:read", "events:read", "nodes:admin")
#: The four scopes of a node credential; a redeemed credential carries all four.
NODE_SCOPES = ("compute:read", "compute:heartbeat", "compute:claim", "compute:complete")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: an API key or a node credential, always within one organization."""

    kind: str  # "api_key" | "node"
    credential_id: UUID
    organization_id: UUID
    scopes: frozenset[str]
    node_id: UUID | None = None

    @property
    def actor(self) -> str:
        return f"node:{self.node_id}" if self.node_id else f"key:{self.credential_id}"

    def require(self, *any_of: str) -> None:
        if not any(scope in self.scopes for scope in any_of):
            raise Forbidden(f"This credential lacks the scope {' or '.join(any_of)}.")


#: Wrong secrets for one prefix, within :data:`FAILURE_WINDOW_SECONDS`, after which this process
#: verifies no more tokens of that prefix until the window has passed.
MAX_FAILED_VERIFICATIONS = 20
FAILURE_WINDOW_SECONDS = 60.0


class VerifiedTokenCache:
    """Tokens that verified (see the module's docstring), and wrong secrets by prefix.

    Each wrong secret for a prefix that exists costs an argon2 verification: tens of ms of CPU (in a
    worker thread, with no pooled connection held meanwhile: see :func:`authenticate` and
    :func:`authenticated_connection`). Past :data:`MAX_FAILED_VERIFICATIONS` for one
    prefix within the window, further tokens of that prefix that are not already verified are
    refused 429 with ``Retry-After`` before any work. A key whose token is cached goes on as before;
    its uncached holders wait out the window, as a client of a rate-limited API does.
    """

    def __init__(self, ttl_seconds: float = 60.0, max_entries: int = 100_000, *,
                 max_failures: int = MAX_FAILED_VERIFICATIONS, failure_window_seconds: float = FAILURE_WINDOW_SECONDS) -> None:  # fmt: skip
        self._ttl = ttl_seconds
        self._max = max_entries
        #: Fingerprint -> (expiry, principal), least recently used first: with one time limit for all, also the
        #: soonest to expire first, so expired entries and those past ``max_entries`` leave from the front.
        self._entries: OrderedDict[bytes, tuple[float, Principal]] = OrderedDict()
        self._max_failures = max_failures
        self._failure_window = failure_window_seconds
        #: Prefix -> when its wrong secrets were refused, the prefix guessed longest ago first (it leaves first).
        self._failures: OrderedDict[str, list[float]] = OrderedDict()
        self._verifying: dict[bytes, _Verification] = {}  # token fingerprint -> its verification under way
        #: Prefix -> its argon2 verifications under way: each may be one more wrong secret, so they count
        #: against the limit until they end (else requests sent at once all found the count at zero).
        self._checking: dict[str, int] = {}

    def refuse_if_guessed(self, prefix: str) -> None:
        """Raise 429 when ``prefix`` has had too many wrong secrets lately (verifications under way included)."""
        recent = self._recent_failures(prefix)
        if len(recent) + self._checking.get(prefix, 0) >= self._max_failures:
            # Only verifications under way (no wrong secret yet): they end within a verification's time.
            oldest = recent[0] if recent else time.monotonic() - self._failure_window
            retry_after = max(1, int(oldest + self._failure_window - time.monotonic()) + 1)
            raise RateLimited(f"Too many wrong secrets for this key lately; try again in {retry_after} s.", retry_after)

    @contextmanager
    def checking(self, prefix: str) -> Iterator[None]:
        """Refuse (429) or count one verification of ``prefix`` under way, for as long as the block runs."""
        self.refuse_if_guessed(prefix)
        self._checking[prefix] = self._checking.get(prefix, 0) + 1
        try:
            yield
        finally:
            left = self._checking.pop(prefix) - 1
            if left:
                self._checking[prefix] = left

    def note_failure(self, prefix: str) -> None:
        now = time.monotonic()
        self._failures[prefix] = [*self._recent_failures(prefix), now]
        self._failures.move_to_end(prefix)
        # Prefixes not guessed within the window leave, and past max_entries the one guessed longest ago
        # (never all of them: that would reset every prefix's count for a guesser to start again).
        while self._failures:
            oldest, failures = next(iter(self._failures.items()))
            if failures[-1] > now - self._failure_window and len(self._failures) <= self._max:
                break
            del self._failures[oldest]

    def _recent_failures(self, prefix: str) -> list[float]:
        """The prefix's failures within the window (the older ones are dropped; nothing is kept for a
        prefix without any, so tokens of random prefixes cost no memory)."""
        failures = self._failures.get(prefix)
        if not failures:
            return []
        since = time.monotonic() - self._failure_window
        recent = [at for at in failures if at > since]
        if recent:
            self._failures[prefix] = recent
        else:
            del self._failures[prefix]
        return recent

    async def verify_once(self, token: str, verify: Callable[[], Awaitable[Principal]]) -> Principal:
        """``verify()`` the token, or wait for the verification of it already under way and share its answer.

        A wrong secret is refused to every request sharing its verification, and counted once (one
        guess); an error (the database away) fails them all at once, as it would have failed each,
        rather than one after another, each after its own wait for a connection. Only a verification
        cancelled (its client left) decides nothing for the others: the next of them verifies.
        """
        key = token_fingerprint(token)
        while (under_way := self._verifying.get(key)) is not None:
            await under_way.done.wait()
            if under_way.principal is not None:
                return under_way.principal
            if isinstance(under_way.failure, Unauthenticated):
                raise Unauthenticated(under_way.failure.message, under_way.failure.code)
            if under_way.failure is not None:
                raise under_way.failure
        verification = self._verifying[key] = _Verification()
        try:
            verification.principal = await verify()
            return verification.principal
        except Exception as failure:
            verification.failure = failure
            raise
        finally:
            del self._verifying[key]
            verification.done.set()

    def get(self, token: str) -> Principal | None:
        now = time.monotonic()
        self._drop_expired(now)
        key = token_fingerprint(token)
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries[key] = (now + self._ttl, hit[1])  # a minute more from this use
        self._entries.move_to_end(key)
        return hit[1]

    def put(self, token: str, principal: Principal) -> None:
        now = time.monotonic()
        key = token_fingerprint(token)
        self._entries[key] = (now + self._ttl, principal)
        self._entries.move_to_end(key)
        self._drop_expired(now)
        while len(self._entries) > self._max:  # the least recently used, never every entry at once
            self._entries.popitem(last=False)

    def _drop_expired(self, now: float) -> None:
        """Drop the entries past their time limit: a token used once is not kept until the cap."""
        while self._entries and next(iter(self._entries.values()))[0] < now:
            self._entries.popitem(last=False)

    def forget_credential(self, credential_id: UUID) -> None:
        for key, (_, principal) in list(self._entries.items()):
            if principal.credential_id == credential_id:
                self._entries.pop(key, None)


@dataclass(eq=False)
class _Verification:
    """One token's verification under way, shared by the requests presenting it meanwhile."""

    done: anyio.Event = field(default_factory=anyio.Event)
    principal: Principal | None = None
    #: What ended it otherwise, shared with the requests waiting for it (None: it was cancelled).
    failure: Exception | None = None


_LOOKUP = {
    API_KEY_KIND: sql.SQL(
        "SELECT id, organization_id, secret_hash, scopes, NULL::uuid FROM api_keys WHERE prefix = %s AND revoked_at IS NULL"
    ),
    NODE_CREDENTIAL_KIND: sql.SQL(
        "SELECT id, organization_id, secret_hash, scopes, node_id FROM node_credentials WHERE prefix = %s AND revoked_at IS NULL"
    ),
}
_STILL_VALID = {
    API_KEY_KIND: "SELECT 1 FROM api_keys WHERE id = %s AND revoked_at IS NULL",
    NODE_CREDENTIAL_KIND: "SELECT 1 FROM node_credentials WHERE id = %s AND revoked_at IS NULL",
}


#: The live ones among some node credentials (for commands that check revocation in their own
#: transaction: the group commit's batches).
LIVE_NODE_CREDENTIALS = "SELECT id FROM node_credentials WHERE id = ANY(%s) AND revoked_at IS NULL"


def revoked() -> Unauthenticated:
    return Unauthenticated("The bearer token has been revoked.")


async def live_node_credentials(conn: psycopg.AsyncConnection, credential_ids: list[UUID]) -> set[UUID]:
    return {row[0] for row in await (await conn.execute(LIVE_NODE_CREDENTIALS, (credential_ids,))).fetchall()}


def _kind(token: str | None) -> str:
    if not token:
        raise Unauthenticated()
    kind = token.split("_", 1)[0]
    if kind not in _LOOKUP or token_prefix(token, kind) is None:
        raise Unauthenticated("The bearer token is malformed or unknown.")
    return kind


async def _still_valid(conn: psycopg.AsyncConnection, cached: Principal, cache: VerifiedTokenCache) -> Principal:
    """A cached principal, once its credential's row says it is not revoked (401 and forgotten otherwise)."""
    if await credential_is_live(conn, cached):
        return cached
    cache.forget_credential(cached.credential_id)
    raise revoked()


async def credential_is_live(conn: psycopg.AsyncConnection, who: Principal) -> bool:
    """Whether ``who``'s credential is still unrevoked, by its row: for a cached token at each request,
    and for a stream, which authenticated once and goes on answering, before each read."""
    kind = NODE_CREDENTIAL_KIND if who.kind == "node" else API_KEY_KIND
    return await (await conn.execute(_STILL_VALID[kind], (who.credential_id,))).fetchone() is not None


async def _candidates(conn: psycopg.AsyncConnection, kind: str, token: str) -> list[Any]:
    return await (await conn.execute(_LOOKUP[kind], (token_prefix(token, kind),))).fetchall()


async def _verify(kind: str, token: str, rows: list[Any], cache: VerifiedTokenCache) -> Principal:
    """The candidate row whose hash the whole token verifies against (argon2id, in a worker thread)."""
    for credential_id, organization_id, secret_hash, scopes, node_id in rows:
        if await anyio.to_thread.run_sync(verify_secret, secret_hash, token):
            principal = Principal(
                kind="node" if kind == NODE_CREDENTIAL_KIND else "api_key",
                credential_id=credential_id,
                organization_id=organization_id,
                scopes=frozenset(scopes),
                node_id=node_id,
            )
            cache.put(token, principal)
            return principal
    if rows:  # a prefix that exists, and a wrong secret: an argon2 verification spent for nothing
        cache.note_failure(token_prefix(token, kind))  # type: ignore[arg-type]
    raise Unauthenticated("The bearer token is malformed or unknown.")


async def authenticate(db: Database, token: str | None, cache: VerifiedTokenCache, *,
                       revocation_deferred: bool = False) -> Principal:  # fmt: skip
    """Resolve a bearer token to a :class:`Principal` or raise 401, holding no pooled connection during argon2.

    Given a pool, a connection is borrowed for each query only: a token not in
    the cache is looked up, and the connection given back before the (slow,
    ~70 ms) argon2 verification. Given a connection (the CLI, tests), every
    query runs on it. ``revocation_deferred``: the request's command re-checks
    revocation in its own transaction (the group commit's batches read every
    command's credential, ``credential_id`` on the command), so a cached token
    needs no query here: on the agent's hot path (claim, renew, complete) that
    is one pooled connection and one round trip less per request, and a
    revocation still takes effect at the credential's next command.
    """
    kind = _kind(token)
    assert token is not None
    cached = cache.get(token)
    if cached is not None:
        if revocation_deferred:
            return cached
        async with borrowed(db) as conn:
            return await _still_valid(conn, cached, cache)
    return await _verify_uncached(db, kind, token, cache)


@asynccontextmanager
async def authenticated_connection(pool: AsyncConnectionPool, token: str | None,
                                   cache: VerifiedTokenCache) -> AsyncIterator[tuple[Principal, psycopg.AsyncConnection]]:  # fmt: skip
    """The token's :class:`Principal` (or 401) and a pooled connection for the caller's queries.

    A cached token's revocation is checked on the connection the caller then
    goes on using: one checkout per request, as on a connection it held all
    along. A token not in the cache is verified as :func:`authenticate` does
    it (its candidates looked up on a borrowed connection, given back
    before argon2), and the caller's connection is taken only once it verified:
    requests whose tokens are being verified hold none of the pool's.
    """
    kind = _kind(token)
    assert token is not None
    cached = cache.get(token)
    verified = await _verify_uncached(pool, kind, token, cache) if cached is None else None
    async with pool.connection() as conn:
        yield (verified or await _still_valid(conn, cached, cache)), conn  # type: ignore[arg-type]


async def _verify_uncached(db: Database, kind: str, token: str, cache: VerifiedTokenCache) -> Principal:
    """A token not in the cache, verified with no pooled connection held during argon2 (429 first if its
    prefix is being guessed)."""
    cache.refuse_if_guessed(token_prefix(token, kind))  # type: ignore[arg-type]

    async def verify() -> Principal:
        async with borrowed(db) as conn:
            rows = await _candidates(conn, kind, token)
        if not rows:  # no such prefix: nothing to verify, nothing counted
            return await _verify(kind, token, rows, cache)
        with cache.checking(token_prefix(token, kind)):  # type: ignore[arg-type]
            return await _verify(kind, token, rows, cache)

    return await cache.verify_once(token, verify)
