"""Noisy neighbours across organizations: one organization's load or misbehaviour must not starve another's.

Data isolation is tested elsewhere (``test_tenant_matrix.py``); these tests look at service: claim
latency, long-poll wakes, the group commit and the sweeper, for organization B while organization A
floods or misbehaves. Bounds are generous (seconds): a failure here is starvation or an unbounded
delay, not a few milliseconds.
"""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager

import anyio
import httpx
import msgspec
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from umbra.compute import claims, jobs
from umbra.compute.accounts import create_organization
from umbra.compute.claims import ChildRequest
from umbra.compute.group_commit import GroupCommit, HintNotifier
from umbra.compute.sweeper import SWEEP_BATCH, sweep_once
from umbra.db import connect
from umbra.projections import jobs as queue
from umbra.settings import load_settings

from tests.helpers import bearer, eventually, until
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code

from .queue_support import CPU64, add_node, beat, set_clock, spec, submit

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})


async def claim(conn, org_id, node_id, lease_seconds=30):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=lease_seconds)


async def _children_of_a_container(conn, org_id, node_id, count: int, **child):
    """A container of ``org_id`` split into ``count`` children (claimed by ``node_id``); returns (parent, children)."""
    parent = await submit(conn, org_id, "p")
    got = await claim(conn, org_id, node_id)
    assert got.job_id == parent.id
    kids = await claims.add_children(conn, organization_id=org_id, node_id=node_id, job_id=parent.id,
                                     attempt=got.attempt, children=[msgspec.convert({"kind": "part", **child}, ChildRequest) for _ in range(count)])
    return parent, kids


async def test_many_expired_children_of_a_held_container_do_not_hide_another_organizations_expired_lease(db_url, conn, org):
    """The sweeper recovers organization B's expired lease in the same tick even while organization A
    has more than one sweep batch (500) of expired children whose container another session holds.

    The sweeper leaves children whose ancestor is held elsewhere for a later tick, and pages on past them:
    starting from the first again, a batch of A's left rows at the head of the expiry order hid B's lease
    from every tick for as long as the operator's transaction stayed open."""
    org_a, _ = org
    a = await add_node(conn, org_a, "a", [CPU64])
    # On their last attempt: their lease's end would settle the held container, so the sweeper leaves them.
    parent, kids = await _children_of_a_container(conn, org_a, a, SWEEP_BATCH + 20, max_attempts=1)
    for _ in kids:
        assert await claim(conn, org_a, a, lease_seconds=5) is not None
    org_b, _ = await create_organization(conn, "other")
    b = await add_node(conn, org_b, "b", [CPU64])
    theirs = await submit(conn, org_b, "u")
    assert (await claim(conn, org_b, b, lease_seconds=6)).job_id == theirs.id
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await operator.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (parent.id,))  # left open
        await set_clock(own, 30)
        with anyio.fail_after(15):
            for _ in range(3):  # three ticks: more than enough for one lease
                await sweep_once(own, SETTINGS, reexamine=False)
        row = await queue.load(conn, theirs.id, org_b)
        await operator.rollback()
    assert row.status == "queued", f"B's expired lease was not recovered while A's container was held: {row.status}"


async def test_many_blocked_children_of_a_held_container_do_not_hide_another_organizations_timeout(db_url, conn, org):
    """A job of organization B blocked past the blocked timeout fails (so its parent settles) even
    while organization A has more than one sweep batch of timed-out blocked children whose container
    another session holds."""
    org_a, _ = org
    a = await add_node(conn, org_a, "a", [CPU64])
    parent, kids = await _children_of_a_container(conn, org_a, a, SWEEP_BATCH + 20, requires={"ram_min_mb": 10_000_000})
    assert {k.status for k in kids} == {"blocked"}
    org_b, _ = await create_organization(conn, "other")
    await add_node(conn, org_b, "b", [CPU64])
    await anyio.sleep(0.05)  # B's job blocked after A's children
    theirs = await submit(conn, org_b, "u", requires={"ram_min_mb": 10_000_000})
    assert theirs.status == "blocked"
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await operator.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (parent.id,))  # left open
        await set_clock(own, SETTINGS.blocked_timeout_seconds + 60)
        with anyio.fail_after(15):
            for _ in range(3):
                await sweep_once(own, SETTINGS, reexamine=False)
        row = await queue.load(conn, theirs.id, org_b)
        await operator.rollback()
    assert row.status == "failed", f"B's blocked job did not time out while A's container was held: {row.status}"


# -- claims: A's flooded queue against B's one job ------------------------------------------------------------


async def _flood(conn, org_id, count: int, shapes: int, kind: str = "x") -> None:
    """``count`` queued jobs of ``kind`` in ``shapes`` distinct requirement shapes (RAM floors a CPU64 fits)."""
    for start in range(0, count, 2000):
        batch = [spec(kind, requires={"ram_min_mb": 1000 + (i % shapes)}) for i in range(start, min(count, start + 2000))]
        await jobs.submit(conn, org_id, batch, actor="flood", batch=True)


@asynccontextmanager
async def _group_commit(db_url: str):
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, kwargs={"autocommit": True}, open=False) as pool:
        group = GroupCommit(pool, HintNotifier(pool))
        async with anyio.create_task_group() as tg:
            await tg.start(group.run)
            yield group, tg
            tg.cancel_scope.cancel()


async def test_a_flooded_queue_of_many_shapes_does_not_slow_another_organizations_claim(db_url, conn, org):
    """Organization B's one queued job is claimed promptly (seconds at most) by B's node, alone and
    through the group commit, while organization A has 20,000 queued jobs in 2,000 requirement shapes that
    A's own agents (which take only kind ``echo``) cannot take and keep asking for."""
    org_a, _ = org
    a_nodes = [await add_node(conn, org_a, f"a{i}", [CPU64]) for i in range(8)]
    await _flood(conn, org_a, 20_000, 2_000)
    org_b, _ = await create_organization(conn, "other")
    b = await add_node(conn, org_b, "b", [CPU64])
    started = time.monotonic()
    theirs = await submit(conn, org_b, "echo")
    got = await claim(conn, org_b, b)
    alone = time.monotonic() - started
    assert got is not None and got.job_id == theirs.id
    assert alone < 3, f"B's claim alone took {alone:.2f}s behind A's flooded queue"

    second = await submit(conn, org_b, "echo")
    stop = anyio.Event()
    a_attempts = 0
    async with _group_commit(db_url) as (group, tg):

        async def a_agent(node_id) -> None:
            nonlocal a_attempts
            while not stop.is_set():
                await group.claim(node_id=node_id, organization_id=org_a, lease_seconds=60, stale_seconds=45,
                                  kinds=frozenset({"echo"}))
                a_attempts += 1

        for node_id in a_nodes:
            for _ in range(4):  # 32 agents of A hammering the batches
                tg.start_soon(a_agent, node_id)
        await anyio.sleep(0.5)
        started = time.monotonic()
        with anyio.fail_after(20):
            got = await group.claim(node_id=b, organization_id=org_b, lease_seconds=60, stale_seconds=45)
        batched = time.monotonic() - started
        stop.set()
    assert got is not None and got.job_id == second.id
    assert a_attempts > 0
    assert batched < 3, f"B's claim through the group commit took {batched:.2f}s while A's agents hammered it"


# -- long-polls: A's parked crowd against B's one waiter ------------------------------------------------------


async def _paired(conn, org_id, name: str) -> tuple:
    """``(node_id, credential)`` of a node paired and online with one CPU64."""
    issued = await issue_pairing_code(conn, org_id, name)
    redeemed = await redeem_pairing_code(conn, code=issued.code, name=name, source=f"test:{name}", devices=[CPU64])
    await beat(conn, org_id, redeemed.node_id, [CPU64])
    return redeemed.node_id, redeemed.credential


async def test_another_organizations_crowd_of_long_polls_and_unusable_wakes_do_not_delay_a_waiters_wake(live_server, conn, org):
    """Organization B's one parked long-poll is answered with B's job within a couple of seconds of
    B's submission, while organization A has 200 parked long-polls (agents taking only ``echo``) and keeps
    submitting jobs of a kind none of them takes, so every one of A's wake tokens walks A's whole crowd."""
    org_a, key_a = org
    org_b, key_b = await create_organization(conn, "other")
    a_nodes = [await _paired(conn, org_a, f"a{i}") for i in range(10)]
    _, b_credential = await _paired(conn, org_b, "b")
    hub = live_server.app.state.waiters
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(base_url=live_server.url, timeout=60, limits=limits) as client:
        # Warm the credentials' cache (argon2 once each), so the crowd parks at once.
        for _, credential in a_nodes + [(None, b_credential)]:
            assert (await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(credential))).status_code == 204
        answers: dict[str, float] = {}
        async with anyio.create_task_group() as tg:

            async def a_poll(credential: str) -> None:
                while True:
                    await client.post("/v1/agent/claim", params={"wait": 30, "kind": "echo"}, headers=bearer(credential))

            for _, credential in a_nodes:
                for _ in range(20):
                    tg.start_soon(a_poll, credential)
            await until(lambda: hub.waiting(org_a) >= 200, timeout=15)

            async def b_poll() -> None:
                got = await client.post("/v1/agent/claim", params={"wait": 30}, headers=bearer(b_credential))
                answers["status"] = got.status_code
                answers["at"] = time.monotonic()

            tg.start_soon(b_poll)
            await until(lambda: hub.waiting(org_b) == 1, timeout=10)

            async def a_noise() -> None:
                while True:
                    posted = await client.post("/v1/jobs/batch", headers=bearer(key_a),
                                               json={"jobs": [{"kind": "x"} for _ in range(50)]})
                    assert posted.status_code in (200, 201), posted.text
                    await anyio.sleep(0.2)

            tg.start_soon(a_noise)
            await anyio.sleep(1.0)  # A's chains are walking
            submitted = time.monotonic()
            posted = await client.post("/v1/jobs", headers=bearer(key_b), json={"kind": "echo"})
            assert posted.status_code == 201, posted.text
            with anyio.move_on_after(15):
                await until(lambda: "at" in answers, timeout=15)
            tg.cancel_scope.cancel()
    assert answers.get("status") == 200, f"B's long-poll was not answered with its job: {answers}"
    waited = answers["at"] - submitted
    assert waited < 3, f"B's parked long-poll took {waited:.2f}s to get B's job behind A's crowd"


# -- live views: A's dashboards against B's requests ----------------------------------------------------------


#: A's open projection streams.
STREAMS = 200


@pytest.fixture
def roomy_server(db_url):
    """A live server letting one organization hold :data:`STREAMS` streams (past the default of 100)."""
    from tests.conftest import LiveServer

    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="0.2", UMBRA_MAX_STREAMS_PER_ORGANIZATION=str(STREAMS)) as server:
        yield server


async def _raw_stream(port: int, path: str, key: str, opened: list) -> None:
    """A client that holds ``path`` open and discards what it is sent (raw socket: next to no client CPU)."""
    async with await anyio.connect_tcp("127.0.0.1", port) as sock:
        await sock.send(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
        first = await sock.receive(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:600]
        opened.append(1)
        while True:
            await sock.receive(1 << 20)


async def test_another_organizations_many_live_views_do_not_starve_requests_of_the_pool(roomy_server, conn, org):
    """Organization B's ordinary request (read its own job, normally milliseconds) is answered within two
    seconds, never 503, while organization A, with 5,000 open jobs, holds 200 projection streams open and
    keeps its log moving. Each of A's log moves makes every one of A's streams re-read and re-send the
    whole queue view (counts over all of A's jobs, 200 listed). With each read on one of the pool's 10
    connections, B's request queued for a connection behind hundreds of A's reads, for seconds; the
    streams' reads now hold a quarter of the pool at most (``Services.stream_reads``)."""
    org_a, key_a = org
    await add_node(conn, org_a, "a", [CPU64])
    await _flood(conn, org_a, 5_000, 10)
    org_b, key_b = await create_organization(conn, "other")
    mine = await submit(conn, org_b, "echo")
    pool = roomy_server.app.state.services.pool
    worst = 0.0
    statuses: list[int] = []
    opened: list = []
    most_waiting = 0
    async with httpx.AsyncClient(base_url=roomy_server.url, timeout=60) as client:
        async with anyio.create_task_group() as tg:
            assert (await client.get("/v1/jobs?limit=1", headers=bearer(key_a))).status_code == 200  # the key verified
            for _ in range(STREAMS):
                tg.start_soon(_raw_stream, roomy_server.port, "/v1/projections/stream", key_a, opened)
            await until(lambda: len(opened) >= STREAMS, timeout=30)

            async def a_noise() -> None:
                while True:
                    posted = await client.post("/v1/jobs", headers=bearer(key_a), json={"kind": "x"})
                    assert posted.status_code == 201, posted.text
                    await anyio.sleep(0.05)

            async def watch_pool() -> None:
                nonlocal most_waiting
                while True:
                    most_waiting = max(most_waiting, pool.get_stats().get("requests_waiting", 0))
                    await anyio.sleep(0.05)

            tg.start_soon(a_noise)
            tg.start_soon(watch_pool)
            await anyio.sleep(1.0)
            for _ in range(4):
                started = time.monotonic()
                got = await client.get(f"/v1/jobs/{mine.id}", headers=bearer(key_b))
                worst = max(worst, time.monotonic() - started)
                statuses.append(got.status_code)
                await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
    assert set(statuses) == {200}, f"B's reads were refused while A's dashboards read: {statuses}"
    # What B's request waits for is a pooled connection: none is ever queued for while A's streams read (it
    # was 292 at once, and B waited 4 s); the time is a second, generous, check.
    assert most_waiting == 0, f"{most_waiting} requests waited for the pool at once while A's {STREAMS} streams re-read"
    assert worst < 2, f"B's read of its own job took {worst:.2f}s while A's {STREAMS} streams re-read"


async def test_one_organization_holds_at_most_its_share_of_streams_and_another_still_opens_its_own(db_url, conn, org):
    """Past ``UMBRA_MAX_STREAMS_PER_ORGANIZATION`` (3 here) open streams, organization A's next one, of either
    kind, is refused 429 (``rate_limited``, ``Retry-After``) before it holds anything; B opens its own; once
    one of A's ends, A may open one again. Streams whose clients left at once give their place back, and cost
    no pooled connection."""
    from tests.conftest import LiveServer

    org_a, key_a = org
    _, key_b = await create_organization(conn, "other")
    with LiveServer(db_url, UMBRA_MAX_STREAMS_PER_ORGANIZATION="3") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for _ in range(10):  # opened and dropped at once: each gives its place back once the server sees it
                async with client.stream("GET", "/v1/events/stream", headers=bearer(key_a)) as dropped:
                    assert dropped.status_code == 200, (await dropped.aread())[:300]
            await until(lambda: server.app.state.log_watch.open_streams(org_a) == 0, timeout=10)
            # A read the client left in the middle of was finished, not cancelled mid-query (which closes
            # the connection): no pooled connection was lost to the dropped streams.
            assert server.app.state.services.pool.get_stats().get("returns_bad", 0) == 0
            async with anyio.create_task_group() as tg:
                held: list = []
                scopes = []
                for path in ("/v1/events/stream", "/v1/projections/stream", "/v1/events/stream"):
                    scope = anyio.CancelScope()
                    scopes.append(scope)

                    async def hold(path=path, scope=scope) -> None:
                        with scope:
                            await _raw_stream(server.port, path, key_a, held)

                    tg.start_soon(hold)
                await until(lambda: len(held) == 3, timeout=10)
                for path in ("/v1/events/stream", "/v1/projections/stream"):
                    refused = await client.get(path, headers=bearer(key_a))
                    assert refused.status_code == 429, refused.text[:300]
                    assert refused.json()["error"] == "rate_limited" and int(refused.headers["Retry-After"]) > 0
                async with client.stream("GET", "/v1/events/stream", headers=bearer(key_b)) as theirs:
                    assert theirs.status_code == 200
                scopes[0].cancel()
                await eventually(lambda: _opens(client, key_a), timeout=10)
                tg.cancel_scope.cancel()


async def test_a_stream_ended_by_its_keys_revocation_gives_its_place_back(db_url, conn, org):
    """Cap 1: a key's stream ends when the key is revoked (its last message the 401); another key of the
    same organization then opens one. A refused (429) stream took no place; a 422 took none either."""
    from uuid import UUID

    from tests.conftest import LiveServer
    from umbra.compute import auth
    from umbra.compute.accounts import create_api_key, list_api_keys, revoke_api_key

    org_id, _ = org
    other = await create_api_key(conn, org_id, ["events:read"])
    doomed = await create_api_key(conn, org_id, ["events:read"])
    with LiveServer(db_url, UMBRA_MAX_STREAMS_PER_ORGANIZATION="1") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            bad = await client.get("/v1/events/stream", params={"after": "-1"}, headers=bearer(other))
            assert bad.status_code == 422
            async with client.stream("GET", "/v1/events/stream", headers=bearer(doomed)) as stream:
                assert stream.status_code == 200
                refused = await client.get("/v1/events/stream", headers=bearer(other))
                assert refused.status_code == 429
                [doomed_id] = [k["id"] for k in await list_api_keys(conn, org_id)
                               if k["prefix"] == auth.token_prefix(doomed, auth.API_KEY_KIND)]
                await revoke_api_key(conn, org_id, UUID(str(doomed_id)))
                with anyio.fail_after(10):
                    async for line in stream.aiter_lines():
                        if line.startswith("event: error"):
                            break

            async def opens() -> bool:
                async with client.stream("GET", "/v1/events/stream", headers=bearer(other)) as answer:
                    return answer.status_code == 200

            assert await eventually(opens, timeout=10)


async def _opens(client: httpx.AsyncClient, key: str) -> bool:
    async with client.stream("GET", "/v1/events/stream", headers=bearer(key)) as answer:
        return answer.status_code == 200


# -- the waiter hub: whose tokens wake whom ---------------------------------------------------------------------


async def test_wake_tokens_of_one_organization_never_reach_another_organizations_waiters():
    """A hint for organization A wakes only A's waiters (however many of A's fail to use it), and a
    hint for B reaches B's one waiter at once even with thousands of A's waiters parked."""
    from umbra.api.longpoll import WaiterHub

    hub = WaiterHub(poll_seconds=60)
    org_a, org_b = uuid.uuid4(), uuid.uuid4()
    attempts = {org_a: 0, org_b: 0}
    b_answer: list = []

    def attempt_of(org_id):
        async def attempt():
            attempts[org_id] += 1
            return None  # nothing this waiter can take: the token is passed on

        return attempt

    async with anyio.create_task_group() as tg:
        for _ in range(2000):
            tg.start_soon(lambda: hub.wait_for(org_a, attempt_of(org_a), timeout=30))

        b_has_work = anyio.Event()

        async def b_attempt():
            attempts[org_b] += 1
            return "job" if b_has_work.is_set() else None

        async def b_wait():
            b_answer.append(await hub.wait_for(org_b, b_attempt, timeout=30))

        tg.start_soon(b_wait)
        await until(lambda: hub.waiting(org_a) == 2000 and hub.waiting(org_b) == 1)
        assert attempts[org_b] == 1  # its first look, on arrival
        for position in range(20):
            hub.on_hint(org_a, position, 5)  # A's jobs that none of A's waiters can take
        await until(lambda: attempts[org_a] >= 2000 * 2)
        for _ in range(50):
            await anyio.sleep(0)
        assert attempts[org_b] == 1, "A's wake tokens were spent on B's waiter"
        b_has_work.set()
        started = time.monotonic()
        hub.on_hint(org_b, 100, 1)
        await until(lambda: b_answer, timeout=5)
        assert time.monotonic() - started < 1
        tg.cancel_scope.cancel()
    assert b_answer == ["job"]


async def test_another_organizations_huge_log_does_not_slow_reading_ones_own_from_the_start(live_server, conn, org):
    """Organization B reads its whole (small) log with ``GET /v1/events?after=0`` promptly while
    organization A's events outnumber B's by tens of thousands, written both before and after B's."""
    org_a, _ = org
    org_b, key_b = await create_organization(conn, "other")
    await _flood(conn, org_a, 15_000, 3, kind="echo")
    ours = [await submit(conn, org_b, "echo") for _ in range(3)]
    await _flood(conn, org_a, 15_000, 3, kind="echo")
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        started = time.monotonic()
        got = await client.get("/v1/events", params={"after": 0}, headers=bearer(key_b))
        took = time.monotonic() - started
    assert got.status_code == 200, got.text
    events = got.json()["events"]
    assert {e["stream"].split(":", 1)[1] for e in events if e["stream"].startswith("job:")} == {str(j.id) for j in ours}
    assert took < 2, f"B's read of its own log took {took:.2f}s behind A's"


async def test_the_sweepers_second_look_at_another_organizations_many_waiting_jobs_stays_short(conn, org):
    """A sweeper tick that re-examines waiting jobs (every 30 s) finishes within a few seconds even
    when organization A has 20,000 blocked jobs in 2,000 shapes, so B's expired lease in the next tick is not
    held up behind it."""
    org_a, _ = org
    await add_node(conn, org_a, "a", [CPU64])
    for start in range(0, 20_000, 2000):
        await jobs.submit(conn, org_a, [spec("x", requires={"ram_min_mb": 10_000_000 + (i % 2000)})
                                        for i in range(start, start + 2000)], actor="flood", batch=True)  # fmt: skip
    org_b, _ = await create_organization(conn, "other")
    b = await add_node(conn, org_b, "b", [CPU64])
    theirs = await submit(conn, org_b, "u")
    assert (await claim(conn, org_b, b, lease_seconds=5)).job_id == theirs.id
    await set_clock(conn, 30)
    started = time.monotonic()
    report = await sweep_once(conn, SETTINGS, reexamine=True)
    took = time.monotonic() - started
    assert report.leases_requeued == 1
    assert (await queue.load(conn, theirs.id, org_b)).status == "queued"
    assert took < 5, f"a sweeper tick with A's 20,000 blocked jobs took {took:.2f}s"


async def test_one_organizations_verifies_at_once_do_not_take_the_pool_from_another(live_server, conn, org, monkeypatch):
    """A verify holds a pooled connection for as long as it rebuilds (seconds on a large organization: 13 s
    for 100,000 jobs, ``docs/PERFORMANCE.md``). Organization A's admin sending ten at once held every
    connection of the pool, and organization B's read of its own job waited for one (503 past 5 s). One
    verify of an organization runs at a time in a process; the next is refused 429 (``rate_limited``,
    ``Retry-After``) while it runs, holding nothing, and B is answered at once."""
    from umbra.api import projections as projection_routes

    async def slow_verify(conn, organization_id):
        await conn.execute("SELECT 1")
        await anyio.sleep(3)  # a large organization's rebuild, on its connection
        return []

    monkeypatch.setattr(projection_routes, "verify", slow_verify)
    org_a, key_a = org
    org_b, key_b = await create_organization(conn, "other")
    mine = await submit(conn, org_b, "echo")
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
        assert (await client.get("/v1/jobs?limit=1", headers=bearer(key_a))).status_code == 200  # the key verified
        assert (await client.get(f"/v1/jobs/{mine.id}", headers=bearer(key_b))).status_code == 200

        async def verify_a() -> None:
            got = await client.post("/v1/projections/verify", headers=bearer(key_a))
            if got.status_code == 429:
                assert got.json()["error"] == "rate_limited" and int(got.headers["Retry-After"]) > 0, got.text
            statuses.append(got.status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(live_server.settings.pool_size + 2):
                tg.start_soon(verify_a)
            await anyio.sleep(0.5)
            started = time.monotonic()
            got = await client.get(f"/v1/jobs/{mine.id}", headers=bearer(key_b))
            took = time.monotonic() - started
    assert got.status_code == 200, got.text
    assert took < 2, f"B's read of its own job took {took:.2f}s while A's verifies ran (each holding one for 3 s)"
    assert sorted(statuses) == [200] + [429] * (live_server.settings.pool_size + 1), statuses
