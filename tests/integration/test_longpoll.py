"""The long-poll claim through a real HTTP server: wake on submit, no herd, eligibility,
no connection held while waiting, disconnects, listener reconnects."""

from __future__ import annotations

import itertools
import time
import uuid

import anyio
import httpx
import msgspec
import psycopg
import pytest

from tests.conftest import LiveServer
from tests.helpers import until
from umbra.compute.heartbeat import heartbeat
from umbra.compute.jobs import JobRequest, RequiresRequest, submit
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.domain.heartbeat import HeartbeatReport
from umbra.events import store
from umbra.events.types import Device

pytestmark = pytest.mark.anyio

CPU = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=30000)
GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24000, accelerators=("cuda",))
_sources = itertools.count(1)


async def online_node(conn, org_id: uuid.UUID, name: str, devices=(CPU,)) -> tuple[uuid.UUID, str]:
    issued = await issue_pairing_code(conn, org_id, name)
    redeemed = await redeem_pairing_code(
        conn, code=issued.code, name=name, source=f"10.9.{next(_sources)}.1", devices=list(devices)
    )
    await heartbeat(conn, org_id, redeemed.node_id, HeartbeatReport(devices=tuple(devices)), event_interval_seconds=300)
    return redeemed.node_id, redeemed.credential


async def submit_job(conn, org_id: uuid.UUID, **requires) -> uuid.UUID:
    [row], _ = await submit(
        conn, org_id, [JobRequest(kind="echo", requires=RequiresRequest(**requires))], actor="test", batch=False
    )
    return row.id


async def job_status(conn, job_id: uuid.UUID) -> str:
    return (await (await conn.execute("SELECT status FROM jobs WHERE id = %s", (job_id,))).fetchone())[0]


async def claimed_events(conn, job_id: uuid.UUID) -> list[str]:
    return [r.type for r in await store.read_stream(conn, store.job_stream(job_id)) if r.type == "job.claimed"]


def _auth(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


@pytest.fixture
def server(db_url):
    """Safety poll far away (30 s): a fast answer can only come from a notification.
    A pool of 4: twenty parked long-polls could not each be holding a connection."""
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="30", UMBRA_POOL_SIZE="4") as live:
        yield live


async def test_a_parked_long_poll_wakes_on_submit(conn, org, server):
    org_id, _ = org
    _, credential = await online_node(conn, org_id, "box")
    hub = server.app.state.waiters
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        async with anyio.create_task_group() as tg:
            responses: list[httpx.Response] = []

            async def poll():
                responses.append(await client.post("/v1/agent/claim", params={"wait": 30}, headers=_auth(credential)))

            tg.start_soon(poll)
            await until(lambda: hub.waiting(org_id) == 1)
            started = time.monotonic()
            job_id = await submit_job(conn, org_id)
            await until(lambda: responses, timeout=10)
            assert time.monotonic() - started < 5
    [response] = responses
    assert response.status_code == 200
    body = response.json()
    assert body["job"]["id"] == str(job_id) and body["job"]["status"] == "running"
    assert body["placement"]["device_kind"] == "cpu" and body["placement"]["reason"]
    assert body["lease_expires_at"].endswith("Z")
    assert await claimed_events(conn, job_id) == ["job.claimed"]


async def test_timeout_is_204_and_waiting_holds_no_database_connection(conn, org, server):
    org_id, _ = org
    _, credential = await online_node(conn, org_id, "box")
    pool = server.app.state.services.pool
    hub = server.app.state.waiters
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        responses: list[httpx.Response] = []

        async def poll():
            responses.append(await client.post("/v1/agent/claim", params={"wait": 3}, headers=_auth(credential)))

        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(poll)

            def parked_and_pool_idle():
                stats = pool.get_stats()
                return (
                    hub.waiting(org_id) == 20
                    and stats.get("requests_waiting", 0) == 0
                    and stats["pool_available"] == stats["pool_size"]
                )

            # All twenty parked at once on a pool of four, none borrowing a connection.
            await until(parked_and_pool_idle)
            assert pool.get_stats()["pool_size"] <= 4
    assert [r.status_code for r in responses] == [204] * 20
    assert all(r.content == b"" for r in responses)


async def test_one_job_many_waiters_exactly_one_claim_and_the_rest_keep_waiting(conn, org, server):
    org_id, _ = org
    credentials = [(await online_node(conn, org_id, f"box-{i}"))[1] for i in range(5)]
    hub = server.app.state.waiters
    responses: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

        async def poll(credential):
            responses.append(await client.post("/v1/agent/claim", params={"wait": 6}, headers=_auth(credential)))

        async with anyio.create_task_group() as tg:
            for credential in credentials:
                tg.start_soon(poll, credential)
            await until(lambda: hub.waiting(org_id) == 5)
            job_id = await submit_job(conn, org_id)
            await until(lambda: len(responses) == 1)
            assert hub.waiting(org_id) == 4  # the others are still parked, not answered
    assert sorted(r.status_code for r in responses) == [200, 204, 204, 204, 204]
    assert await claimed_events(conn, job_id) == ["job.claimed"]


async def test_only_an_eligible_waiter_gets_the_job_even_when_an_ineligible_one_is_older(conn, org, server):
    org_id, _ = org
    _, cpu_only = await online_node(conn, org_id, "cpu-box", devices=(CPU,))
    gpu_node, gpu = await online_node(conn, org_id, "gpu-box", devices=(GPU, CPU))
    hub = server.app.state.waiters
    results: dict[str, httpx.Response] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

        async def poll(name, credential, wait):
            results[name] = await client.post("/v1/agent/claim", params={"wait": wait}, headers=_auth(credential))

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll, "cpu", cpu_only, 5)
            await until(lambda: hub.waiting(org_id) == 1)  # the CPU box is the oldest waiter
            tg.start_soon(poll, "gpu", gpu, 30)
            await until(lambda: hub.waiting(org_id) == 2)
            job_id = await submit_job(conn, org_id, vram_min_mb=16000, accelerators=["cuda"])
            await until(lambda: "gpu" in results, timeout=10)
            assert "cpu" not in results and hub.waiting(org_id) == 1
    assert results["gpu"].status_code == 200
    assert results["gpu"].json()["job"]["id"] == str(job_id)
    assert results["gpu"].json()["placement"]["node_id"] == str(gpu_node)
    assert results["cpu"].status_code == 204


async def _claim_parked_across(client, hub, org_id, credential: str, change) -> tuple[httpx.Response, float]:
    """Park ``credential``'s long-poll (20 s), let its first look find nothing, run ``change()``; returns its
    answer and how long after the change it came."""
    answers: list[httpx.Response] = []

    async def poll() -> None:
        answers.append(await client.post("/v1/agent/claim", params={"wait": 20}, headers=_auth(credential)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(poll)
        await until(lambda: hub.waiting(org_id) == 1)
        await anyio.sleep(0.3)  # its first look found nothing it can run
        assert not answers
        await change()
        started = time.monotonic()
        await until(lambda: answers, timeout=15)
        elapsed = time.monotonic() - started
    [answer] = answers
    return answer, elapsed


async def _report(client, credential: str, *devices: Device) -> None:
    beat = await client.post("/v1/agent/heartbeat", json={"devices": msgspec.to_builtins(devices), "agent_version": "1"},
                             headers=_auth(credential))  # fmt: skip
    assert beat.status_code == 200, beat.text


@pytest.mark.parametrize("unblocked_by", ["registry_update", "heartbeat_adding_a_device"])
async def test_a_parked_long_poll_takes_a_job_as_soon_as_a_change_unblocks_it(conn, org, server, unblocked_by):
    """A blocked job made runnable by a registry update (its model registered) or by a heartbeat that adds a
    capable device is unblocked in that change's transaction and wakes a parked long-poll at once (the
    safety poll is 30 s away), which claims it with a placement on the device that made it runnable."""
    org_id, key = org
    by_registry = unblocked_by == "registry_update"
    _, credential = await online_node(conn, org_id, "box", devices=(GPU,) if by_registry else (CPU,))
    requires = {"models": ["llama"]} if by_registry else {"accelerators": ["cuda"], "vram_min_mb": 8000}
    job_id = await submit_job(conn, org_id, **requires)
    assert await job_status(conn, job_id) == "blocked"
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

        async def unblock() -> None:
            if by_registry:
                put = await client.put("/v1/models/llama", json={"vram_min_mb": 8000}, headers=_auth(key))
                assert put.status_code == 200, put.text
            else:
                await _report(client, credential, CPU, GPU)

        answer, elapsed = await _claim_parked_across(client, server.app.state.waiters, org_id, credential, unblock)
    assert answer.status_code == 200, answer.status_code
    assert answer.json()["job"]["id"] == str(job_id) and elapsed < 5
    assert answer.json()["placement"]["device_id"] == "gpu0"
    types = [e.type for e in await store.read_stream(conn, store.job_stream(job_id))]
    assert types == ["job.submitted", "job.blocked", "job.unblocked", "job.claimed"]


@pytest.mark.parametrize("recorded", [True, False], ids=["beat_recorded", "beat_within_the_memory_spacing"])
async def test_a_heartbeat_that_frees_memory_wakes_the_parked_node_it_made_eligible(conn, org, server, recorded):
    """A claim answers as soon as a job its node is eligible for is queued, and that includes a job already
    queued that the node becomes eligible for: one too big for its GPU's free VRAM (held by another process;
    not blocked, as the card's total fits it) fits once the node's heartbeat reports the VRAM free again, and
    that beat wakes the node's parked long-poll at once, not at the safety poll (30 s here). So it does when
    the beat is recorded (here it also names the agent's version for the first time) and when, a move of
    free memory alone soon after a recorded beat, it is not (MEMORY_EVENT_SPACING_SECONDS)."""
    org_id, _ = org
    squeezed = msgspec.structs.replace(GPU, vram_free_mb=4000)
    node_id, credential = await online_node(conn, org_id, "box", devices=(squeezed,))
    job_id = await submit_job(conn, org_id, vram_min_mb=16000)
    assert await job_status(conn, job_id) == "queued"
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        if not recorded:
            await _report(client, credential, squeezed)  # records the agent's version: the next beat's only news is memory
        beats = await _heartbeat_events(conn, node_id)
        answer, elapsed = await _claim_parked_across(client, server.app.state.waiters, org_id, credential,
                                                     lambda: _report(client, credential, GPU))  # fmt: skip
    assert answer.status_code == 200 and elapsed < 15, (answer.status_code, round(elapsed, 1))  # not woken, it ends 204 at 20 s
    assert answer.json()["job"]["id"] == str(job_id)
    assert await _heartbeat_events(conn, node_id) == beats + (1 if recorded else 0)


async def _heartbeat_events(conn, node_id) -> int:
    return sum(r.type == "node.heartbeat" for r in await store.read_stream(conn, store.node_stream(node_id)))


async def test_a_client_that_disconnects_while_waiting_claims_nothing(conn, org, server):
    org_id, _ = org
    _, credential = await online_node(conn, org_id, "box")
    hub = server.app.state.waiters
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        scope = anyio.CancelScope()

        async def poll_then_hang_up():
            with scope:
                await client.post("/v1/agent/claim", params={"wait": 30}, headers=_auth(credential))

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll_then_hang_up)
            await until(lambda: hub.waiting(org_id) == 1)
            scope.cancel()
    await until(lambda: hub.waiting(org_id) == 0)  # the server noticed and left
    job_id = await submit_job(conn, org_id)
    assert await job_status(conn, job_id) == "queued"
    assert await claimed_events(conn, job_id) == []


@pytest.mark.parametrize("most", [1, 3])
async def test_a_claim_that_races_a_disconnect_is_released_at_once(db_url, conn, org, most):
    """Driven in-process through ASGI so the race is exact: the client is gone
    before the (shielded) claim attempt commits. A claim of several jobs gives back each."""
    from umbra.api.app import create_app
    from umbra.settings import load_settings

    org_id, _ = org
    _, credential = await online_node(conn, org_id, "box")
    job_id, *more = [await submit_job(conn, org_id) for _ in range(most)]
    app = create_app(load_settings({"UMBRA_DATABASE_URL": db_url}), db_url)
    sent: list[dict] = []
    # The request arrives whole (no body), and then the client is gone.
    arrived = iter([{"type": "http.request", "body": b"", "more_body": False}])

    async def receive():
        return next(arrived, {"type": "http.disconnect"})

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/agent/claim", "raw_path": b"/v1/agent/claim",
        "query_string": f"wait=30&max={most}".encode(), "root_path": "", "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 80), "headers": [(b"authorization", f"Bearer {credential}".encode()), (b"host", b"test")],
    }  # fmt: skip
    async with app.router.lifespan_context(app):
        await app(scope, receive, send)
    assert sent[0]["status"] == 204
    for each in (job_id, *more):
        types = [r.type for r in await store.read_stream(conn, store.job_stream(each))]
        assert types[-2:] == ["job.claimed", "job.released"]
        assert await job_status(conn, each) == "queued"


async def test_a_claim_whose_client_left_before_it_was_read_claims_nothing(db_url, conn, org):
    """The route reads its (empty) body before it runs: a client already gone then is answered 499 at once."""
    from umbra.api.app import create_app
    from umbra.settings import load_settings

    org_id, _ = org
    _, credential = await online_node(conn, org_id, "box")
    job_id = await submit_job(conn, org_id)
    app = create_app(load_settings({"UMBRA_DATABASE_URL": db_url}), db_url)
    sent: list[dict] = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/agent/claim", "raw_path": b"/v1/agent/claim",
        "query_string": b"wait=30", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80),
        "headers": [(b"authorization", f"Bearer {credential}".encode()), (b"host", b"test")],
    }  # fmt: skip
    async with app.router.lifespan_context(app):
        with anyio.fail_after(10):
            await app(scope, receive, send)
    assert sent[0]["status"] == 499
    assert await claimed_events(conn, job_id) == [] and await job_status(conn, job_id) == "queued"


async def test_a_completion_whose_agent_hung_up_releases_the_job_it_claimed_next(db_url, conn, org):
    """The chained claim (``complete?claim_next=true``) of an agent that left while its batch ran is
    given back at once, as a long-poll's is; the completion itself stands."""
    import json

    from umbra.api.app import create_app
    from umbra.compute import claims
    from umbra.settings import load_settings

    org_id, _ = org
    node_id, credential = await online_node(conn, org_id, "box")
    held = await submit_job(conn, org_id)
    await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60)
    following = await submit_job(conn, org_id)
    app = create_app(load_settings({"UMBRA_DATABASE_URL": db_url}), db_url)
    body = json.dumps({"attempt": 1, "result": {"done": True}}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}  # hung up once the body was sent

    async def send(message):
        sent.append(message)

    path = f"/v1/agent/jobs/{held}/complete"
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"claim_next=true", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80),
        "headers": [(b"authorization", f"Bearer {credential}".encode()), (b"host", b"test"),
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    async with app.router.lifespan_context(app):
        await app(scope, receive, send)
    assert sent[0]["status"] == 200
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["next_claim"] is None
    assert await job_status(conn, held) == "complete"
    types = [r.type for r in await store.read_stream(conn, store.job_stream(following))]
    assert types == ["job.submitted", "job.claimed", "job.released"]
    assert await job_status(conn, following) == "queued"


async def test_a_long_poll_kept_out_by_a_committing_change_of_its_node_claims_once_it_commits(db_url, conn, org, server):
    """The change holding the node's claim guard sends no notification when it commits (a heartbeat
    that changes nothing a job could see, say): the long-poll looks again by itself, long before the
    safety poll (30 s here)."""
    from umbra.compute.nodes import guard_against_claims

    org_id, _ = org
    node_id, credential = await online_node(conn, org_id, "box")
    job_id = await submit_job(conn, org_id)
    hub = server.app.state.waiters
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin, \
            httpx.AsyncClient(base_url=server.url, timeout=60) as client:  # fmt: skip
        responses: list[httpx.Response] = []
        async with anyio.create_task_group() as tg:
            async with admin.transaction():
                await guard_against_claims(admin, org_id, node_id)  # a change of the node, not committed yet

                async def poll():
                    responses.append(await client.post("/v1/agent/claim", params={"wait": 20}, headers=_auth(credential)))

                tg.start_soon(poll)
                await until(lambda: hub.waiting(org_id) == 1)
                await anyio.sleep(0.3)
                assert not responses and await job_status(conn, job_id) == "queued"
            released = time.monotonic()
            await until(lambda: responses, timeout=15)
            assert time.monotonic() - released < 5
    [response] = responses
    assert response.status_code == 200 and response.json()["job"]["id"] == str(job_id)


async def test_waiters_are_still_woken_after_the_listener_reconnects(conn, org, server):
    org_id, _ = org
    _, credential = await online_node(conn, org_id, "box")
    listener = server.app.state.services.listener
    hub = server.app.state.waiters
    await conn.execute("SELECT pg_terminate_backend(%s)", (listener.backend_pid,))
    await until(lambda: listener.reconnects >= 1 and listener.connected.is_set())
    responses: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

        async def poll():
            responses.append(await client.post("/v1/agent/claim", params={"wait": 30}, headers=_auth(credential)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            await until(lambda: hub.waiting(org_id) == 1)
            started = time.monotonic()
            job_id = await submit_job(conn, org_id)
            await until(lambda: responses, timeout=10)
            assert time.monotonic() - started < 5
    assert responses[0].status_code == 200 and responses[0].json()["job"]["id"] == str(job_id)


async def test_refusals(conn, org, server):
    org_id, api_key = org
    _, credential = await online_node(conn, org_id, "box")
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        too_long = await client.post("/v1/agent/claim", params={"wait": 61}, headers=_auth(credential))
        negative = await client.post("/v1/agent/claim", params={"wait": -1}, headers=_auth(credential))
        words = await client.post("/v1/agent/claim", params={"wait": "soon"}, headers=_auth(credential))
        anonymous = await client.post("/v1/agent/claim", params={"wait": 0})
        with_api_key = await client.post("/v1/agent/claim", params={"wait": 0}, headers=_auth(api_key))
        immediate = await client.post("/v1/agent/claim", params={"wait": 0}, headers=_auth(credential))
    for response in (too_long, negative, words):
        assert response.status_code == 422
        assert response.json()["error"] == "invalid_request" and response.json()["field"] == "wait"
    assert anonymous.status_code == 401
    assert with_api_key.status_code == 403
    assert immediate.status_code == 204


async def test_the_safety_poll_finds_work_whose_notification_was_lost(conn, org, db_url):
    """Jobs committed with no NOTIFY at all: the once-per-process safety poll finds them."""
    from umbra.events.types import JobSubmitted
    from umbra.projections import jobs as queue

    org_id, _ = org
    credentials = [(await online_node(conn, org_id, f"box-{i}"))[1] for i in range(2)]
    with LiveServer(db_url, UMBRA_POLL_FALLBACK_SECONDS="0.3") as live:
        hub = live.app.state.waiters
        responses: list[httpx.Response] = []
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:

            async def poll(credential):
                responses.append(await client.post("/v1/agent/claim", params={"wait": 20}, headers=_auth(credential)))

            async with anyio.create_task_group() as tg:
                for credential in credentials:
                    tg.start_soon(poll, credential)
                await until(lambda: hub.waiting(org_id) == 2)
                async with conn.transaction():  # appended and folded, never published
                    await queue.record(
                        conn,
                        [queue.Change(uuid.uuid4(), org_id, None, [JobSubmitted(kind="quiet", priority=100, max_attempts=3)])
                         for _ in range(2)],
                    )
                await until(lambda: len(responses) == 2, timeout=10)
    assert [r.status_code for r in responses] == [200, 200]
    assert {r.json()["job"]["kind"] for r in responses} == {"quiet"}
