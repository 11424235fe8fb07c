"""No pooled connection is held while a bearer token is verified with argon2id.

An uncached token costs an argon2id verification (~70 ms of CPU in a worker
thread). Were a pooled connection held meanwhile, a handful of requests with
not-yet-verified tokens (dashboards and CLIs after a restart, or wrong secrets
for a real key's prefix) would hold the whole pool, and every agent batch and
every other request would wait for them. Here the verification of chosen
tokens is held open (a gate in ``verify_secret``) while a pool of two serves
more such requests than it has connections, and requests on a cached token
still go through at once.
"""

from __future__ import annotations

import threading
import time

import anyio
import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from umbra.compute import auth
from umbra.compute.accounts import create_api_key
from umbra.security import token_prefix, verify_secret
from tests.conftest import LiveServer
from tests.helpers import bearer, until

pytestmark = pytest.mark.anyio

#: The server's pool: the settings' smallest.
POOL_SIZE = 2
#: How long the gate holds a verification at most, so a failing test still ends.
GATE_SECONDS = 20.0


class VerificationGate:
    """``verify_secret`` holding the tokens in ``held`` until :meth:`open` (the others verify as usual)."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.inside = 0
        self._lock = threading.Lock()
        self._open = threading.Event()

    def __call__(self, stored_hash: str, secret: str) -> bool:
        if secret in self.held:
            with self._lock:
                self.inside += 1
            self._open.wait(GATE_SECONDS)
        return verify_secret(stored_hash, secret)

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()


def wrong_secret(token: str) -> str:
    """``token``'s kind and (real) prefix with another secret: a verification that fails."""
    kind, prefix, secret = token.split("_", 2)
    return f"{kind}_{prefix}_{'A' * len(secret)}"


async def test_requests_in_argon2_hold_no_pooled_connection(db_url, conn, org, monkeypatch):
    org_id, cached_key = org
    fresh_jobs_reader = await create_api_key(conn, org_id, ["jobs:read"])
    fresh_events_reader = await create_api_key(conn, org_id, ["events:read"])
    admin = await create_api_key(conn, org_id, ["nodes:admin"])
    gate = VerificationGate()
    monkeypatch.setattr(auth, "verify_secret", gate)

    with LiveServer(db_url, UMBRA_POOL_SIZE=str(POOL_SIZE)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.get("/v1/jobs", headers=bearer(cached_key))).status_code == 200  # now cached
            # Three requests in argon2 at once, on a pool of two: a list, a stream, a wrong secret.
            stalled = {
                "list": ("/v1/jobs", fresh_jobs_reader),
                "stream": ("/v1/events/stream", fresh_events_reader),
                "wrong secret": ("/v1/nodes", wrong_secret(admin)),
            }
            gate.held.update(token for _, token in stalled.values())
            statuses: dict[str, int] = {}

            async def stalled_request(name: str, path: str, token: str) -> None:
                async with client.stream("GET", path, headers=bearer(token)) as answer:
                    statuses[name] = answer.status_code  # a stream's headers, then it is closed

            try:
                async with anyio.create_task_group() as tg:
                    for name, (path, token) in stalled.items():
                        tg.start_soon(stalled_request, name, path, token)
                    # As many in argon2 as the pool has connections (were they holding them, nothing else could run).
                    await until(lambda: gate.inside >= POOL_SIZE, timeout=8)
                    for path in ("/v1/jobs", "/v1/nodes", "/v1/projections/queue"):
                        with anyio.move_on_after(3) as waited:
                            answer = await client.get(path, headers=bearer(cached_key))
                        assert not waited.cancelled_caught, f"GET {path} on a cached token waited for other tokens' argon2"
                        assert answer.status_code == 200, answer.text
                    # More requests in argon2 at once than the pool has connections.
                    await until(lambda: gate.inside == len(stalled), timeout=8)
                    assert not gate.is_open  # all of them are still in argon2
                    gate.open()
            finally:
                gate.open()
            assert statuses == {"list": 200, "stream": 200, "wrong secret": 401}
            # Verified now: served from the cache, as the first key is.
            assert (await client.get("/v1/jobs", headers=bearer(fresh_jobs_reader))).status_code == 200


async def test_a_request_on_a_cached_token_takes_one_pooled_connection(db_url, org):
    _, key = org
    with LiveServer(db_url) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200  # now cached
            pool = server.app.state.services.pool
            before = pool.get_stats()["requests_num"]
            for path in ("/v1/jobs", "/v1/nodes", "/v1/events", "/v1/models") * 5:
                assert (await client.get(path, headers=bearer(key))).status_code == 200
            # One checkout each, revocation checked on the connection the route then uses (a little
            # room for a background task's checkout).
            assert pool.get_stats()["requests_num"] - before <= 20 + 2


async def test_a_revoked_cached_token_is_refused_before_the_route_reads(db_url, conn, org):
    """The cached path still re-checks revocation on its connection: 401, not the route's 404."""
    org_id, _ = org
    key = await create_api_key(conn, org_id, ["jobs:read"])
    with LiveServer(db_url) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200  # now cached
            await conn.execute("UPDATE api_keys SET revoked_at = now() WHERE prefix = %s", (token_prefix(key, "uk"),))
            answer = await client.get("/v1/jobs/not-a-uuid/explain", headers=bearer(key))
            assert answer.status_code == 401 and answer.json()["error"] == "unauthenticated"
            assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 401


async def test_requests_presenting_one_uncached_token_at_once_share_one_verification(db_url, conn, org, monkeypatch):
    """Thirty requests with the same not-yet-verified key at once (a dashboard's streams after a restart)
    run argon2 once between them, and all are answered by it; thirty with the same wrong secret are all
    refused by one verification, counted as one wrong guess. One argon2 run each took both cores for
    seconds when hundreds arrived together."""
    org_id, _ = org
    fresh = await create_api_key(conn, org_id, ["jobs:read"])
    wrong = wrong_secret(await create_api_key(conn, org_id, ["jobs:read"]))
    gate = VerificationGate()
    gate.held.update({fresh, wrong})
    monkeypatch.setattr(auth, "verify_secret", gate)

    with LiveServer(db_url) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for token, expected in ((fresh, 200), (wrong, 401)):
                statuses: list[int] = []

                async def request() -> None:
                    statuses.append((await client.get("/v1/jobs", headers=bearer(token))).status_code)

                before = gate.inside
                try:
                    async with anyio.create_task_group() as tg:
                        for _ in range(30):
                            tg.start_soon(request)
                        await until(lambda: gate.inside > before, timeout=8)
                        await anyio.sleep(0.5)  # the others arrive meanwhile, and wait for it
                        assert gate.inside == before + 1, "a second argon2 run for a token being verified"
                        gate.open()
                finally:
                    gate.open()
                assert statuses == [expected] * 30
                gate.close()
            # Thirty wrong guesses would pass the 20 a prefix may have in a minute: the next one would be 429.
            gate.open()
            assert (await client.get("/v1/jobs", headers=bearer(wrong))).status_code == 401


async def test_requests_sharing_a_verification_fail_together_when_the_database_is_away(db_url, conn, org):
    """Requests presenting one uncached token while the pool cannot give a connection (the database away,
    the pool exhausted) all fail after one pool wait (here 0.5 s), together. Were each waiter to try on its
    own once the one before it failed, the k-th would fail after k pool waits: with the service's 5 s,
    a hundred agents sharing a credential during an outage would wait up to 500 s."""
    org_id, _ = org
    token = await create_api_key(conn, org_id, ["jobs:read"])
    cache = auth.VerifiedTokenCache()
    pool = AsyncConnectionPool(db_url, min_size=1, max_size=1, timeout=0.5, open=False)
    await pool.open(wait=True)
    took: list[float] = []
    try:
        async with pool.connection():  # the pool's only connection is busy: every borrow times out
            started = time.monotonic()

            async def request() -> None:
                with pytest.raises(psycopg.OperationalError):
                    await auth.authenticate(pool, token, cache)
                took.append(time.monotonic() - started)

            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(request)
    finally:
        await pool.close()
    assert max(took) < 1.2, f"requests failed after {sorted(round(t, 2) for t in took)} s: one pool wait each, in turn"


async def test_a_cancelled_first_verification_leaves_the_others_to_verify(db_url, conn, org):
    """The first request (its client gone) is cancelled while it waits for a connection; the two requests
    that waited for its verification are answered by one verification of their own."""
    org_id, _ = org
    token = await create_api_key(conn, org_id, ["jobs:read"])
    cache = auth.VerifiedTokenCache()
    pool = AsyncConnectionPool(db_url, min_size=1, max_size=1, timeout=10, open=False)
    await pool.open(wait=True)
    answers: list = []
    try:
        busy = await pool.getconn()
        async with anyio.create_task_group() as tg:
            first = anyio.CancelScope()

            async def first_request() -> None:
                with first:
                    await auth.authenticate(pool, token, cache)

            async def waiter() -> None:
                answers.append(await auth.authenticate(pool, token, cache))

            tg.start_soon(first_request)
            await anyio.sleep(0.2)
            tg.start_soon(waiter)
            tg.start_soon(waiter)
            await anyio.sleep(0.2)
            first.cancel()
            await anyio.sleep(0.1)
            await pool.putconn(busy)
    finally:
        await pool.close()
    assert len(answers) == 2 and answers[0] == answers[1] and answers[0].organization_id == org_id
