"""What a long-running ``umbra serve`` keeps, and what it gives back, under churn.

Each test drives a LiveServer over HTTP with many organizations, keys, nodes and clients that come and
go, then measures the in-process structures, the pool, the server loop's tasks, file descriptors and
database tables before and after. Sizes and counts only, never times. Secrets are hashed with the cheap
argon2id profile (the same code paths, a smaller cost) so a test can make hundreds of credentials.
"""

from __future__ import annotations

import asyncio
import gc
import os
import uuid
from typing import Any, Awaitable, Callable

import anyio
import httpx
import psycopg
import pytest

from tests.conftest import LiveServer
from tests.helpers import eventually, until
from umbra import metrics, security
from umbra.compute import blocked as blocked_module
from umbra.compute.accounts import _insert_api_key, create_organization
from umbra.security import token_fingerprint

pytestmark = pytest.mark.anyio

ALL_SCOPES = ["jobs:write", "jobs:read", "events:read", "nodes:admin"]


@pytest.fixture
def cheap_hashes(monkeypatch):
    """Cheap even when the suite runs on the real profile."""
    monkeypatch.setattr(security, "PASSWORD_HASHER", security.CHEAP_TEST_PROFILE)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def in_batches(calls: list[Callable[[], Awaitable[Any]]], width: int = 16) -> list[Any]:
    """Run the calls, ``width`` at a time; returns their results in order."""
    out: list[Any] = [None] * len(calls)
    limiter = anyio.CapacityLimiter(width)

    async def one(i: int) -> None:
        async with limiter:
            out[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return out


def server_loop(server: LiveServer) -> asyncio.AbstractEventLoop:
    return server.server.servers[0].get_loop()  # uvicorn's listening socket's loop: the server's


async def on_server(server: LiveServer, make: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``make()`` on the server's own event loop (its pool belongs to it)."""
    loop = server_loop(server)
    return await anyio.to_thread.run_sync(lambda: asyncio.run_coroutine_threadsafe(make(), loop).result(30))


async def server_tasks(server: LiveServer) -> int:
    async def count() -> int:
        return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])

    return await on_server(server, count)


async def pool_stats(server: LiveServer) -> dict[str, int]:
    async def stats() -> dict[str, int]:
        return dict(server.app.state.services.pool.get_stats())

    return await on_server(server, stats)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def settle(server: LiveServer, baseline_tasks: int, slack: int = 3) -> int:
    """The server's task count once it has come back near ``baseline_tasks`` (or after 10 s)."""
    last = await server_tasks(server)
    for _ in range(100):
        if last <= baseline_tasks + slack:
            break
        await anyio.sleep(0.1)
        last = await server_tasks(server)
    return last


async def make_keys(conn, organization_id: uuid.UUID, n: int, scopes=("jobs:read",)) -> list[str]:
    return [await _insert_api_key(conn, organization_id, list(scopes)) for _ in range(n)]


async def pair_nodes(client: httpx.AsyncClient, key: str, n: int, *, tag: str) -> list[tuple[uuid.UUID, str]]:
    """``n`` nodes paired over HTTP, each redeemed from a source address of its own; (node id, credential)."""

    async def pair(i: int) -> tuple[uuid.UUID, str]:
        name = f"{tag}-{i}"
        issued = await client.post("/v1/pairings", json={"name": name}, headers=bearer(key))
        assert issued.status_code == 201, issued.text
        source = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
        redeemed = await client.post("/v1/pairings/redeem", json={"code": issued.json()["code"], "name": name},
                                     headers={"X-Forwarded-For": source})
        assert redeemed.status_code == 201, redeemed.text
        body = redeemed.json()
        return uuid.UUID(body["node_id"]), body["credential"]

    return await in_batches([lambda i=i: pair(i) for i in range(n)], width=8)


async def _open_and_drop_streams(server: LiveServer, keys: list[str], per_key: int) -> None:
    """Open ``per_key`` streams per key, 12 at a time, and drop each (some before their first byte).

    A burst of new keys on a loaded machine may find the pool busy past its wait: such a stream is
    answered 503 (try again) and is opened again, so every one of them is opened once.
    """
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:

        async def one(key: str, i: int) -> None:
            path = "/v1/events/stream" if i % 2 == 0 else "/v1/projections/stream"
            for _ in range(5):
                async with client.stream("GET", path, headers=bearer(key)) as response:
                    if response.status_code == 503:
                        continue
                    assert response.status_code == 200
                    if i % 3 != 2:  # some are dropped before their first byte is read
                        async for _ in response.aiter_raw():
                            break
                    return
            raise AssertionError(f"{path} was answered 503 five times")

        await in_batches([lambda k=k, i=i: one(k, i) for k in keys for i in range(per_key)], width=12)


async def test_streams_opened_and_dropped_by_many_organizations_give_everything_back(db_url, conn, cheap_hashes):
    """360 event and projection streams of 60 organizations, opened and dropped (some before their first
    byte): their places, the open-streams gauges, the pool's connections, the server's tasks and the
    process's file descriptors all come back to where they were."""
    keys = [(await create_organization(conn, f"org-{i}"))[1] for i in range(60)]
    with LiveServer(db_url) as server:
        watch = server.app.state.log_watch
        gauges = {name: metrics.SSE_STREAMS.labels(stream=name) for name in ("events", "projections")}
        before_gauges = {name: g._value.get() for name, g in gauges.items()}
        await _open_and_drop_streams(server, keys[:2], 1)  # warm up: threads, pool connections
        await until(lambda: not watch._open)
        tasks_before, fds_before = await server_tasks(server), open_fds()
        stats_before = await pool_stats(server)
        await _open_and_drop_streams(server, keys, 6)
        await until(lambda: not watch._open, timeout=15)
        tasks_after = await settle(server, tasks_before)
        stats_after = await pool_stats(server)
        gc.collect()
        gauge_values = {name: g._value.get() for name, g in gauges.items()}
        fds_after = open_fds()
    assert watch._open == {}
    assert tasks_after <= tasks_before + 3, (tasks_before, tasks_after)
    assert gauge_values == before_gauges, (before_gauges, gauge_values)
    assert stats_after.get("returns_bad", 0) == stats_before.get("returns_bad", 0), (stats_before, stats_after)
    assert stats_after.get("connections_lost", 0) == stats_before.get("connections_lost", 0), (stats_before, stats_after)
    assert stats_after["pool_size"] <= server.settings.pool_size
    # A file descriptor for each connection the pool grew by (up to its size), a few for the runtime's own.
    grown = stats_after.get("pool_size", 0) - stats_before.get("pool_size", 0)
    assert fds_after <= fds_before + max(grown, 0) + 5, (fds_before, fds_after, grown)


async def test_log_watch_forgets_organizations_whose_streams_all_closed(db_url, conn, cheap_hashes):
    """``LogWatch`` keeps a wake-up signal per organization with a stream open; once its last stream ends the
    signal goes too, rather than waiting for a hint of that organization (or a reconnect, or ``*``): an
    organization that watched once and went quiet holds nothing for the life of the process."""
    keys = [(await create_organization(conn, f"org-{i}"))[1] for i in range(80)]
    with LiveServer(db_url) as server:
        watch = server.app.state.log_watch
        await _open_and_drop_streams(server, keys, 1)
        await until(lambda: not watch._open, timeout=15)
        await anyio.sleep(1.0)
        kept = len(watch._signals)
    assert kept <= 5, f"{kept} organizations with no stream open still hold a signal in LogWatch._signals"


def _observations(histogram, outcome: str) -> float:
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_count") and sample.labels.get("outcome") == outcome:
                return sample.value
    return 0.0


async def test_abandoned_and_timed_out_long_polls_and_revoked_agents_leave_nothing(db_url, conn, org, cheap_hashes):
    with LiveServer(db_url, UMBRA_TRUSTED_PROXIES="127.0.0.1") as server:
        hub = server.app.state.waiters
        cache = server.app.state.services.token_cache
        waiting_gauge = metrics.LONG_POLLS_WAITING._value.get()
        gone_before = _observations(metrics.CLAIM_WAIT, "client_gone")
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as admin:
            nodes = await pair_nodes(admin, org[1], 40, tag="lp")
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            beat = [lambda c=c: client.post("/v1/agent/heartbeat", json={}, headers=bearer(c)) for _, c in nodes]
            assert {a.status_code for a in await in_batches(beat)} == {200}
            await in_batches([lambda c=c: client.post("/v1/agent/claim?wait=0", headers=bearer(c)) for _, c in nodes[:4]])
        await until(lambda: hub.waiting() == 0)
        tasks_before, fds_before = await server_tasks(server), open_fds()
        stats_before = await pool_stats(server)

        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=200)) as client:

            async def rounds(credential: str) -> None:
                for r in range(3):
                    with anyio.move_on_after(0.3):  # abandoned: the client hangs up mid-wait
                        await client.post("/v1/agent/claim?wait=30", headers=bearer(credential))
                    answer = await client.post("/v1/agent/claim?wait=1", headers=bearer(credential))  # times out
                    assert answer.status_code == 204
                    answer = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
                    assert answer.status_code == 204

            await in_batches([lambda c=c: rounds(c) for _, c in nodes], width=40)
        await until(lambda: hub.waiting() == 0 and not hub._waiters, timeout=15)
        tasks_after = await settle(server, tasks_before)
        stats_after = await pool_stats(server)
        fds_after = open_fds()
        assert metrics.LONG_POLLS_WAITING._value.get() == waiting_gauge
        gone = _observations(metrics.CLAIM_WAIT, "client_gone") - gone_before
        assert gone >= 60, f"only {gone} long-polls were seen abandoned"  # the churn did what it says

        # The agents go away: revoked, their cache entries go with them.
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as admin:
            revoke = [lambda n=n: admin.post(f"/v1/nodes/{n}/revoke", headers=bearer(org[1])) for n, _ in nodes]
            assert {a.status_code for a in await in_batches(revoke)} == {200}
            claim = [lambda c=c: admin.post("/v1/agent/claim?wait=0", headers=bearer(c)) for _, c in nodes]
            assert {a.status_code for a in await in_batches(claim)} == {401}
        still_cached = [c for _, c in nodes if token_fingerprint(c) in cache._entries]
    assert tasks_after <= tasks_before + 3, (tasks_before, tasks_after)
    assert stats_after.get("returns_bad", 0) == stats_before.get("returns_bad", 0), (stats_before, stats_after)
    assert stats_after.get("connections_lost", 0) == stats_before.get("connections_lost", 0), (stats_before, stats_after)
    assert stats_after["pool_size"] <= server.settings.pool_size
    # A file descriptor for each connection the pool grew by (up to its size), a few for the runtime's own.
    grown = stats_after.get("pool_size", 0) - stats_before.get("pool_size", 0)
    assert fds_after <= fds_before + max(grown, 0) + 5, (fds_before, fds_after, grown)
    assert len(still_cached) <= 0, f"{len(still_cached)} revoked credentials still cached"


async def test_a_submission_reads_only_the_nodes_that_could_still_run_it(db_url, conn, org, cheap_hashes, monkeypatch):
    """Nodes that come and go (autoscaled, re-imaged, replaced) are retired or revoked, never deleted. A
    submission's blocking judgement (``BlockingJudge.load`` -> ``read_nodes``) reads only the nodes that
    may take work, so the work per job does not grow with every node the organization ever paired."""
    read: list[tuple[int, int]] = []
    real = blocked_module.read_nodes

    async def counting(*args, **kwargs):
        nodes = await real(*args, **kwargs)
        if kwargs.get("node_id") is None:
            read.append((len(nodes), sum(n.status != "retired" for n in nodes)))
        return nodes

    monkeypatch.setattr(blocked_module, "read_nodes", counting)
    with LiveServer(db_url, UMBRA_TRUSTED_PROXIES="127.0.0.1") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            gone = await pair_nodes(client, org[1], 60, tag="gone")
            revoke = [lambda n=n: client.post(f"/v1/nodes/{n}/revoke", headers=bearer(org[1])) for n, _ in gone]
            assert {a.status_code for a in await in_batches(revoke)} == {200}
            await pair_nodes(client, org[1], 2, tag="live")
            read.clear()
            answer = await client.post("/v1/jobs", json={"kind": "echo", "payload": {}}, headers=bearer(org[1]))
            assert answer.status_code == 201, answer.text
    assert read, "the submission judged no fleet"
    total, not_retired = read[-1]
    assert total <= not_retired + 5, (f"one submission read {total} nodes, {total - not_retired} of them retired "
                                      f"for good: the fleet read grows with every node ever paired")


def _series(text: str, name: str) -> set[str]:
    return {line.split(" ")[0] for line in text.splitlines() if line.startswith(name + "{")}


async def test_metric_label_sets_stay_bounded_under_arbitrary_paths_methods_and_tenants(db_url, conn, cheap_hashes):
    keys = [(await create_organization(conn, f"m-{i}"))[1] for i in range(20)]
    with LiveServer(db_url) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await client.get("/healthz")
            before = (await client.get("/metrics")).text
            calls = []
            for i in range(600):
                method = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "PROPFIND", "PURGE", "SEARCH"][i % 10]
                path = [f"/nope/{uuid.uuid4().hex}", f"/v1/jobs/{uuid.uuid4()}", f"/v1/nodes/{uuid.uuid4()}/drain",
                        f"/v1/models/{uuid.uuid4().hex}", f"/v1/jobs/{uuid.uuid4().hex}%0A"][i % 5]
                calls.append(lambda m=method, p=path, k=keys[i % 20]: client.request(m, p, headers=bearer(k)))
            await in_batches(calls, width=16)
            # Methods httptools does not know are refused before the application.
            for odd in ("FOO", "X" * 40, "BREW"):
                try:
                    await client.request(odd, "/healthz")
                except httpx.HTTPError:
                    pass
            after = (await client.get("/metrics")).text
    new = _series(after, "umbra_http_requests_total") - _series(before, "umbra_http_requests_total")
    assert len(new) <= 60, f"{len(new)} new request series for 600 distinct paths: {sorted(new)[:10]}"
    assert len(_series(after, "umbra_sse_streams")) <= 4


async def test_credentials_revoked_elsewhere_leave_the_cache_on_the_agents_next_refusal(db_url, conn, org, cheap_hashes):
    """A revocation made by another process (``umbra admin revoke``, another server) is found by the batch of
    the agent's next claim, renewal or completion (``revocation_deferred``): refused 401, and its cached
    token is forgotten then, rather than kept (and its time limit extended) by each refused retry."""
    from umbra.compute import credentials

    with LiveServer(db_url, UMBRA_TRUSTED_PROXIES="127.0.0.1") as server:
        cache = server.app.state.services.token_cache
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            nodes = await pair_nodes(client, org[1], 20, tag="rv")
            cache._ttl = 1.5
            claim = [lambda c=c: client.post("/v1/agent/claim?wait=0", headers=bearer(c)) for _, c in nodes]
            assert {a.status_code for a in await in_batches(claim)} == {204}
            for node_id, _ in nodes:  # as `umbra admin revoke` does it: on the database, not through this server
                await credentials.revoke_node(conn, org[0], node_id, actor="cli")
            for _ in range(8):  # the agents retry, well past the ttl, refused each time
                assert {a.status_code for a in await in_batches(claim)} == {401}
                await anyio.sleep(0.2)
        kept = [c for _, c in nodes if token_fingerprint(c) in cache._entries]
    assert not kept, f"{len(kept)} of {len(nodes)} revoked credentials are still cached, refreshed by their refusals"


async def test_a_stopped_server_closes_every_connection_it_opened_even_when_psycopg_yields_on_the_way_out(
    db_url, conn, monkeypatch
):
    """Stopping cancels the background tasks; the listener's and the sweeper's own connections are closed
    then, not left open for the garbage collector to find.

    psycopg gives the event loop a turn in a connection's exit even with nothing to roll back, once it
    has not for 5 ms (a loaded machine); a task being cancelled is cancelled again there, and ``async with
    conn`` skipped its close: a few listener connections in a thousand stops under load, seen as
    ``ResourceWarning: ... was deleted while still open``. At 0 ms psycopg always yields there.
    """
    import psycopg.waiting

    from umbra.api.app import create_app
    from umbra.settings import load_settings

    monkeypatch.setattr(psycopg.waiting, "MAX_BUSY_TIME", 0.0)
    opened: list[psycopg.AsyncConnection] = []
    connect = psycopg.AsyncConnection.connect.__func__

    async def recording(cls, *args, **kwargs):
        made = await connect(cls, *args, **kwargs)
        opened.append(made)
        return made

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", classmethod(recording))

    async def sweeper_leads() -> bool:
        cursor = await conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                                    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")
        return (await cursor.fetchone())[0] > 0

    for _ in range(3):
        app = create_app(load_settings({"UMBRA_DATABASE_URL": db_url}), db_url)
        async with app.router.lifespan_context(app):
            assert app.state.services.listener.connected.is_set()
            await eventually(sweeper_leads)
        left_open = [repr(made) for made in opened if not made.closed]
        assert not left_open, left_open
    assert len(opened) >= 3 * 2  # each start: at least the listener's and the sweeper's
