"""A claimed job's run against a scripted server: the lease's pace, and answers that pass.

A restarting server, or what stands before it, answers for a moment with a
proxy's page, a rate limit or a page that is not the server's JSON. The agent
waits such answers out, for a claim, a renewal or a report alike, no sooner than
a ``Retry-After`` says: giving up on one would cancel a running handler or throw
its result away, and leave the job to wait out its lease and run again.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Callable

import anyio
import httpx
import pytest

from umbra.agent.client import AgentClient
from umbra.agent.handlers import BUILTINS, HandlerRegistry
from umbra.agent.runner import Agent, AgentConfig
from umbra.events.types import Device

pytestmark = pytest.mark.anyio

NODE = "00000000-0000-0000-0000-000000000001"
CPU = Device(kind="cpu", label="cpu0", ram_total_mb=16384, ram_free_mb=12000, compute_units=8)
JOB = {"id": "00000000-0000-0000-0000-0000000000a1", "kind": "sleep", "payload": {"seconds": 1.5}, "attempt": 1,
       "status": "running", "requires": {}}
JOB_PATH = f"/v1/agent/jobs/{JOB['id']}"
Answer = Callable[[httpx.Request, int], httpx.Response]


def scripted(responses: dict[str, Answer]):
    """A scripted server: ``responses[path](request, n)`` answers the n-th request (from 1) to ``path``; a
    heartbeat is answered online, a sign-off offline, anything else 204. Also returns the paths asked, in order."""
    seen: dict[str, int] = {}
    said: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        seen[path] = seen.get(path, 0) + 1
        said.append(path)
        if path in responses:
            return responses[path](request, seen[path])
        if path == "/v1/agent/heartbeat":
            return httpx.Response(200, json={"node_id": NODE, "status": "online", "heartbeat_interval_seconds": 1})
        if path == "/v1/agent/offline":
            return httpx.Response(200, json={"id": NODE, "status": "offline"})
        return httpx.Response(204)

    return handler, said


def lease(seconds: float = 3.0) -> tuple[dict, dict]:
    """A lease's body and headers, as a claim or a renewal answers them."""
    expires = (datetime.now(timezone.utc) + timedelta(seconds=seconds)).isoformat()
    return {"lease_expires_at": expires, "attempt": 1}, {"Umbra-Lease-Seconds": f"{seconds:.3f}"}


def claim_once(request: httpx.Request, n: int) -> httpx.Response:
    if n > 1:
        return httpx.Response(204)
    body, headers = lease()
    return httpx.Response(200, json={"job": JOB, "placement": {}, **body}, headers=headers)


def renewed(request: httpx.Request, n: int) -> httpx.Response:
    body, headers = lease()
    return httpx.Response(200, json=body, headers=headers)


def completed(request: httpx.Request, n: int) -> httpx.Response:
    body = {**JOB, "status": "complete", "result": {"slept": 1.5}}
    if request.url.params.get("claim_next") == "true":
        body["next_claim"] = None
    return httpx.Response(200, json=body)


def server(**answers: Answer):
    """:func:`scripted` with one job to claim, renewed and completed unless ``answers`` (claim, renew,
    complete) says otherwise."""
    script = {"claim": claim_once, "renew": renewed, "complete": completed, **answers}
    return scripted({"/v1/agent/claim": script["claim"], f"{JOB_PATH}/renew": script["renew"],
                     f"{JOB_PATH}/complete": script["complete"]})


async def run_until_an_outcome(handler) -> Agent:
    """Run an agent against ``handler`` until its first job's outcome (8 s at most), then stop it at once.

    An error out of the agent fails the test with it."""
    settings = AgentConfig(agent_version="t", claim_wait_seconds=0, grace_seconds=5.0,
                           backoff_base_seconds=0.05, backoff_cap_seconds=0.2)  # fmt: skip
    async with AgentClient("http://umbra", "un_0_x", transport=httpx.MockTransport(handler)) as client:
        agent = Agent(client, HandlerRegistry(dict(BUILTINS)), lambda: [CPU], settings)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                with anyio.move_on_after(8):
                    while not agent.outcomes:
                        await anyio.sleep(0.02)
                agent.stop(immediately=True)
    return agent


#: Answers that a request sent again a moment later gets past: a proxy's own 404 page (no error body)
#: and a rate limit with Retry-After.
PASSING_REFUSALS = {
    "proxy-404-page": lambda: httpx.Response(404, text="404 page not found", headers={"content-type": "text/plain"}),
    "429-retry-after": lambda: httpx.Response(429, json={"error": "rate_limited", "message": "try again in 1 s"},
                                              headers={"Retry-After": "1"}),
}


@pytest.mark.parametrize("refusal", sorted(PASSING_REFUSALS))
async def test_a_renewal_refused_for_a_moment_does_not_abandon_the_running_job(refusal):
    """The renewal is sent again, and the handler (hours of GPU work, it may be) runs on and its result is
    reported: only the server's own final refusal says the job is no longer this node's."""
    renewals: list[int] = []

    def renew(request: httpx.Request, n: int) -> httpx.Response:
        renewals.append(n)
        return PASSING_REFUSALS[refusal]() if n == 1 else renewed(request, n)

    handler, said = server(renew=renew)
    agent = await run_until_an_outcome(handler)
    assert renewals and renewals[0] == 1, said
    assert [o.status for o in agent.outcomes] == ["complete"], (agent.outcomes, said)


@pytest.mark.parametrize("refusal", sorted(PASSING_REFUSALS))
async def test_a_completion_refused_for_a_moment_is_sent_again_not_thrown_away(refusal):
    """The computed result is sent again while the lease could still hold, and the server answers the
    repeat as it would have answered the first."""

    def complete(request: httpx.Request, n: int) -> httpx.Response:
        return PASSING_REFUSALS[refusal]() if n == 1 else completed(request, n)

    handler, said = server(complete=complete)
    agent = await run_until_an_outcome(handler)
    assert [o.status for o in agent.outcomes] == ["complete"], (agent.outcomes, said)
    assert said.count(f"{JOB_PATH}/complete") == 2


async def test_renewals_follow_the_lease_the_server_says_not_the_clocks():
    """The claim's ``Umbra-Lease-Seconds`` (1.2 s) sets the renewal pace, though ``lease_expires_at`` and the
    answer's ``Date`` would say an hour: a 2 s job is renewed about every 0.4 s."""
    renewals: list[float] = []
    hour = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()

    def claim(request: httpx.Request, n: int) -> httpx.Response:
        if n > 1:
            return httpx.Response(204)
        job = {**JOB, "payload": {"seconds": 2}}
        return httpx.Response(200, json={"job": job, "placement": {}, "lease_expires_at": hour},
                              headers={"Umbra-Lease-Seconds": "1.200"})  # fmt: skip

    def renew(request: httpx.Request, n: int) -> httpx.Response:
        renewals.append(anyio.current_time())
        return httpx.Response(200, json={"lease_expires_at": hour, "attempt": 1}, headers={"Umbra-Lease-Seconds": "1.200"})

    handler, said = server(claim=claim, renew=renew)
    agent = await run_until_an_outcome(handler)
    assert [o.status for o in agent.outcomes] == ["complete"], said
    assert 3 <= len(renewals) <= 6, renewals
    assert max(b - a for a, b in zip(renewals, renewals[1:])) < 0.6


async def test_a_claim_answered_503_with_retry_after_is_asked_again_no_sooner():
    """``Retry-After: 2`` on a 503 ``database_unavailable`` holds the next claim back two seconds, longer than
    the agent's own back-off would; the agent then claims and runs the job."""
    claims: list[float] = []

    def claim(request: httpx.Request, n: int) -> httpx.Response:
        claims.append(anyio.current_time())
        if n == 1:
            return httpx.Response(503, json={"error": "database_unavailable", "message": "again"},
                                  headers={"Retry-After": "2"})  # fmt: skip
        return claim_once(request, n - 1)

    handler, said = server(claim=claim)
    agent = await run_until_an_outcome(handler)
    assert len(claims) >= 2 and claims[1] - claims[0] >= 1.95, claims
    assert [o.status for o in agent.outcomes] == ["complete"], said


UNREADABLE = {
    "html-page": lambda: httpx.Response(200, text="<html><body>Down for maintenance</body></html>",
                                        headers={"content-type": "text/html"}),
    "json-without-the-job": lambda: httpx.Response(200, json={"status": "ok"}),
}


@pytest.mark.parametrize("answer", sorted(UNREADABLE))
async def test_a_claim_answer_the_agent_cannot_read_is_waited_out_not_fatal(answer):
    """A claim answered 200 with what is not the server's claim (a load balancer's maintenance page while the
    server behind it restarts) is waited out as a transport error is: the agent claims again and runs the
    job, instead of ending with its node going stale and its running jobs left to their leases."""

    def claim(request: httpx.Request, n: int) -> httpx.Response:
        return UNREADABLE[answer]() if n == 1 else claim_once(request, n - 1)

    handler, said = server(claim=claim)
    agent = await run_until_an_outcome(handler)
    assert said.count("/v1/agent/claim") >= 2
    assert [o.status for o in agent.outcomes] == ["complete"], said
