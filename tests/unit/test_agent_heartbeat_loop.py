"""The agent's heartbeat loop against a scripted server: its pace, and a server that says no.

The interval the server names applies from the wait after the beat it answers. A server that is away (5xx, 429, a conflict) is waited out with back-off however long it
stays away; a server that refuses the beat for what it says (422 devices it does not accept,
403, 404, 413) stops the agent as a signal would, then with the server's error, instead of
being sent the same beat for as long as the agent runs.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone

import anyio
import httpx
import pytest

from umbra.agent.client import AgentClient, ServiceError
from umbra.agent.handlers import BUILTINS, HandlerRegistry
from umbra.agent.jobrun import backoff_delay
from umbra.agent.runner import Agent, AgentConfig
from umbra.events.types import Device

pytestmark = pytest.mark.anyio

NODE = "00000000-0000-0000-0000-000000000001"
CPU = Device(kind="cpu", label="c0", ram_total_mb=8192, ram_free_mb=8000)
ONLINE = {"node_id": NODE, "status": "online", "heartbeat_interval_seconds": 0.2}


@pytest.fixture
def quiet_agent_logs():
    """One warning per refused beat otherwise: a thousand of them."""
    logger = logging.getLogger("umbra.agent")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def _refusal(status: int, code: str = "refused") -> httpx.Response:
    return httpx.Response(status, json={"error": code, "message": f"HTTP {status}"})


def _agent(client: AgentClient, **config) -> Agent:
    settings = {"agent_version": "t", "claim_wait_seconds": 0, "backoff_base_seconds": 0.01, "backoff_cap_seconds": 0.05,
                **config}
    return Agent(client, HandlerRegistry(dict(BUILTINS)), lambda: [CPU], AgentConfig(**settings))


# -- pace ----------------------------------------------------------------------------------

async def test_the_interval_the_server_names_applies_from_the_first_wait():
    """--heartbeat (here 300 s) is only what the agent uses until the server names its interval: waited
    once, a node the server expects every few seconds would read offline before its second beat."""
    beats: list[float] = []

    async def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/agent/heartbeat":
            beats.append(anyio.current_time())
            return httpx.Response(200, json=ONLINE)
        return httpx.Response(204)

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client, heartbeat_seconds=300.0)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                while len(beats) < 3:
                    await anyio.sleep(0.01)
                agent.stop(immediately=True)
    assert beats[2] - beats[0] < 2.0


# -- a server that is away -----------------------------------------------------------------

@pytest.mark.parametrize("failures", [1, 10, 1024, 1025, 5000, 10**9])
def test_the_back_off_stays_within_its_cap_however_many_failures_in_a_row(failures):
    """``base × 2^(failures−1)`` overflowed a float from the 1025th failure (~3 h of 10 s heartbeats);
    the claim loop and ``umbra events tail --follow`` use the same function."""
    ceiling = 30.0 if failures > 7 else 0.5 * 2 ** (failures - 1)
    assert ceiling / 2 <= backoff_delay(failures, 0.5, 30.0) <= ceiling
    assert 15.0 <= backoff_delay(failures, 1e300, 30.0) <= 30.0, "a product past the float range is the cap"


async def test_the_agent_rides_out_a_long_outage(quiet_agent_logs):
    """Over a thousand refused beats in a row (a database outage of hours at the default heartbeat,
    here with the back-off scaled down to microseconds): the agent keeps trying, and comes online
    when the server is back."""
    beats = 0
    back = anyio.Event()

    async def server(request: httpx.Request) -> httpx.Response:
        nonlocal beats
        if request.url.path == "/v1/agent/heartbeat":
            beats += 1
            if beats <= 1100:
                return _refusal(503, "database_unavailable")
            back.set()
            return httpx.Response(200, json=ONLINE)
        return httpx.Response(204)

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client, heartbeat_seconds=10.0, backoff_base_seconds=1e-5, backoff_cap_seconds=1e-4)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)  # an error out of the heartbeat loop would end this group with it
                await back.wait()
                agent.stop(immediately=True)
    assert beats > 1100 and agent.node_status == "online"


@pytest.mark.parametrize("status", [408, 409, 429, 500, 503])
async def test_a_beat_refused_for_now_is_sent_again_until_it_passes(status, quiet_agent_logs):
    beats = 0

    async def server(request: httpx.Request) -> httpx.Response:
        nonlocal beats
        if request.url.path == "/v1/agent/heartbeat":
            beats += 1
            return _refusal(status) if beats <= 3 else httpx.Response(200, json=ONLINE)
        return httpx.Response(204)

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                while agent.node_status != "online":
                    await anyio.sleep(0.01)
                assert not agent.stopping
                agent.stop(immediately=True)
    assert beats >= 4


# -- a server that refuses what the agent says -----------------------------------------------

@pytest.mark.parametrize("status, code", [(422, "invalid_request"), (400, "bad_request"), (403, "forbidden"),
                                          (404, "node_not_found"), (413, "payload_too_large")])
async def test_a_beat_refused_for_what_it_says_stops_the_agent_with_the_servers_error(status, code, quiet_agent_logs):
    """Sending the same report again would be refused the same way for as long as the agent ran: the
    node never online, the process looking healthy. The agent signs off and ends with the refusal,
    which ``umbra agent`` prints before exiting 1."""
    said: list[str] = []

    async def server(request: httpx.Request) -> httpx.Response:
        said.append(request.url.path)
        if request.url.path == "/v1/agent/heartbeat":
            return _refusal(status, code)
        if request.url.path == "/v1/agent/offline":
            return httpx.Response(200, json={"id": NODE, "status": "offline"})
        return httpx.Response(204)

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client, heartbeat_seconds=1.0)
        with anyio.fail_after(10), pytest.raises(ServiceError) as stopped:
            await agent.run()
    assert (stopped.value.status, stopped.value.code) == (status, code)
    assert said == ["/v1/agent/heartbeat", "/v1/agent/offline"], "one beat, no claim, a sign-off"


@pytest.mark.parametrize("status, code", [(403, "forbidden"), (422, "invalid_request")])
async def test_a_claim_refused_for_what_it_says_stops_the_agent_with_the_servers_error(status, code, quiet_agent_logs):
    """A credential without ``compute:claim``, say: asked again, the claim is refused the same way for as long
    as the agent runs, and the node never gets work. The agent signs off and ends with the refusal; a claim
    refused for now (429, 503) is asked again after the back-off."""
    said: list[str] = []

    async def server(request: httpx.Request) -> httpx.Response:
        said.append(request.url.path)
        if request.url.path == "/v1/agent/heartbeat":
            return httpx.Response(200, json=ONLINE)
        if request.url.path == "/v1/agent/claim":
            return _refusal(status, code)
        if request.url.path == "/v1/agent/offline":
            return httpx.Response(200, json={"id": NODE, "status": "offline"})
        return httpx.Response(204)

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client, heartbeat_seconds=1.0)
        with anyio.fail_after(10), pytest.raises(ServiceError) as stopped:
            await agent.run()
    assert (stopped.value.status, stopped.value.code) == (status, code)
    assert said.count("/v1/agent/claim") == 1 and said[-1] == "/v1/agent/offline"


async def test_a_claim_refused_for_now_is_asked_again(quiet_agent_logs):
    claims = 0

    async def server(request: httpx.Request) -> httpx.Response:
        nonlocal claims
        if request.url.path == "/v1/agent/heartbeat":
            return httpx.Response(200, json=ONLINE)
        if request.url.path == "/v1/agent/claim":
            claims += 1
            return _refusal(429, "rate_limited") if claims % 2 else _refusal(503, "database_unavailable")
        return httpx.Response(200, json={"id": NODE, "status": "offline"})

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client, heartbeat_seconds=1.0)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                while claims < 4:
                    await anyio.sleep(0.01)
                agent.stop(immediately=True)
    assert claims >= 4


async def test_a_job_running_when_the_beat_is_refused_is_finished_within_the_grace_and_reported(quiet_agent_logs):
    """The refusal stops the agent as a signal does: the running job is not abandoned to its lease."""
    said: list[str] = []
    beats = 0
    lease = (datetime.now(timezone.utc) + timedelta(seconds=60)).isoformat()
    job = {"id": "j1", "kind": "sleep", "payload": {"seconds": 1}, "attempt": 1}

    async def server(request: httpx.Request) -> httpx.Response:
        nonlocal beats
        path = request.url.path
        said.append(path)
        if path == "/v1/agent/heartbeat":
            beats += 1
            return httpx.Response(200, json=ONLINE) if beats == 1 else _refusal(422, "invalid_request")
        if path == "/v1/agent/claim":
            if "/v1/agent/jobs/j1/complete" in said or said.count(path) > 1:
                return httpx.Response(204)
            return httpx.Response(200, json={"job": job, "placement": {}, "lease_expires_at": lease})
        if path == "/v1/agent/jobs/j1/complete":
            return httpx.Response(200, json={**job, "status": "complete"})
        if path == "/v1/agent/offline":
            return httpx.Response(200, json={"id": NODE, "status": "offline"})
        return _refusal(404, "not_found")

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client, grace_seconds=10.0)
        with anyio.fail_after(10), pytest.raises(ServiceError) as stopped:
            await agent.run()
    assert stopped.value.code == "invalid_request"
    assert [(o.job_id, o.status) for o in agent.outcomes] == [("j1", "complete")]
    assert said.index("/v1/agent/jobs/j1/complete") < said.index("/v1/agent/offline") == len(said) - 1
    assert said.count("/v1/agent/claim") == 1, "a stopping agent claims nothing more"


@pytest.mark.parametrize("path", ["/v1/agent/heartbeat", "/v1/agent/claim"])
async def test_a_proxys_404_page_during_a_backend_restart_is_waited_out(path, quiet_agent_logs):
    """Only the server's own refusals are final: a 4xx page without its error code (a proxy's 404 while the
    server behind it restarts) is waited out, and the agent comes online / keeps claiming once it is back."""
    hits = 0
    back = anyio.Event()

    async def server(request: httpx.Request) -> httpx.Response:
        nonlocal hits
        if request.url.path == path:
            hits += 1
            if hits <= 2:
                return httpx.Response(404, text="404 page not found", headers={"content-type": "text/plain"})
            back.set()
        if request.url.path == "/v1/agent/heartbeat":
            return httpx.Response(200, json=ONLINE)
        if request.url.path == "/v1/agent/offline":
            return httpx.Response(200, json={"id": NODE, "status": "offline"})
        return httpx.Response(204)

    async with AgentClient("http://umbra", "uk_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client, heartbeat_seconds=1.0)
        error: list[BaseException] = []

        async def run() -> None:
            try:
                await agent.run()
            except Exception as exc:  # noqa: BLE001 - what stopped it, if anything
                error.append(exc)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                with anyio.move_on_after(5):
                    await back.wait()
                stopped_by_itself = agent.stopping
                agent.stop(immediately=True)
    assert not stopped_by_itself and not error, f"the agent stopped for good on a proxy's 404: {error!r}"


async def test_a_claim_whose_answer_was_not_read_is_named_in_a_release_and_a_refused_one_is_not(quiet_agent_logs):
    """Each claim request carries an ``X-Request-ID`` of its own. One whose answer timed out (the server may
    have claimed and answered) is followed by ``POST /v1/agent/claim/release`` naming that id; one refused
    (4xx: nothing claimed) or that never connected is not."""
    sent: list[tuple[str, str]] = []
    answers = iter(["timeout", "refused", "unreachable", "timeout"])

    async def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/agent/heartbeat":
            return httpx.Response(200, json=ONLINE)
        if request.url.path == "/v1/agent/claim":
            request_id = request.headers["X-Request-ID"]
            sent.append(("claim", request_id))
            answer = next(answers, "none")
            if answer == "timeout":
                raise httpx.ReadTimeout("no answer", request=request)
            if answer == "unreachable":
                raise httpx.ConnectError("refused", request=request)
            return _refusal(429, "rate_limited") if answer == "refused" else httpx.Response(204)
        if request.url.path == "/v1/agent/claim/release":
            sent.append(("release", json.loads(request.content)["request_id"]))
            return httpx.Response(200, json={"released": []})
        return httpx.Response(200, json={"id": NODE, "status": "offline"})

    async with AgentClient("http://umbra", "un_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client, heartbeat_seconds=1.0)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                while sum(kind == "claim" for kind, _ in sent) < 5:
                    await anyio.sleep(0.01)
                agent.stop(immediately=True)
    claims = [request_id for kind, request_id in sent if kind == "claim"]
    assert len(set(claims)) == len(claims)  # one id per request
    releases = [request_id for kind, request_id in sent if kind == "release"]
    assert releases == [claims[0], claims[3]]
    assert sent.index(("release", claims[0])) == 1  # at once, before the next claim


@pytest.mark.parametrize("server_knows_give_back", [True, False])
async def test_a_job_past_the_stops_grace_is_given_back_or_failed_as_retryable_by_a_server_that_cannot(
        server_knows_give_back, quiet_agent_logs):  # fmt: skip
    """Past the grace the job is given back (``POST /v1/agent/jobs/{id}/release``: queued at once, not
    charged). A server of an earlier release answers that route 404 ``not_found``: the job is then failed
    as retryable, as that server expects, rather than left to its lease."""
    said: list[str] = []
    lease = (datetime.now(timezone.utc) + timedelta(seconds=60)).isoformat()
    job = {"id": "j1", "kind": "sleep", "payload": {"seconds": 60}, "attempt": 1}
    running = anyio.Event()

    async def server(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        said.append(path)
        if path == "/v1/agent/heartbeat":
            return httpx.Response(200, json=ONLINE)
        if path == "/v1/agent/claim":
            if said.count(path) > 1:
                return httpx.Response(204)
            running.set()
            return httpx.Response(200, json={"job": job, "placement": {}, "lease_expires_at": lease})
        if path == "/v1/agent/jobs/j1/release" and server_knows_give_back:
            return httpx.Response(200, json={**job, "status": "queued"})
        if path == "/v1/agent/jobs/j1/fail":
            assert json.loads(request.content) == {"attempt": 1, "error": "The agent stopped before the job finished.",
                                                   "retry": True}
            return httpx.Response(200, json={**job, "status": "queued"})
        if path == "/v1/agent/offline":
            return httpx.Response(200, json={"id": NODE, "status": "offline"})
        return _refusal(404, "not_found")

    async with AgentClient("http://umbra", "un_0_x", transport=httpx.MockTransport(server)) as client:
        agent = _agent(client, grace_seconds=0.2)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                await running.wait()
                await anyio.sleep(0.1)  # the handler is running
                agent.stop()
    reports = [path for path in said if path.startswith("/v1/agent/jobs/")]
    if server_knows_give_back:
        assert reports == ["/v1/agent/jobs/j1/release"]
        assert [o.status for o in agent.outcomes] == ["released"]
    else:
        assert reports == ["/v1/agent/jobs/j1/release", "/v1/agent/jobs/j1/fail"]
        assert [o.status for o in agent.outcomes] == ["retrying"]
