"""Real agents working jobs while an administrator drains, retires or revokes their nodes.

End to end, with the in-process :class:`~umbra.agent.runner.Agent` (and, where the exit status is the
promise, ``umbra agent`` as a process): what an operator is told in README.md ("Node administration",
the agent's stop rules) and API.md (revocation ends the node's leases at once, uncharged) must be what
the agents and the log show. Every test ends with the views equal to the log (verify) and no job left
running on a node that will never report it.
"""

from __future__ import annotations

import contextlib

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from tests.conftest import LiveServer
from tests.helpers import eventually, until
from tests.integration.test_agent import (
    CPU,
    _node_if,
    event_types,
    job_events,
    job_in,
    pair,
    running_agent,
    server,  # noqa: F401 - the fixture: a live server with a 3 s lease and 1 s heartbeats
    submit,
)
from umbra.agent.client import AgentClient, ServiceError
from umbra.agent.credentials import CredentialFile, StoredCredential
from umbra.agent.handlers import BUILTINS, HandlerRegistry
from umbra.agent.runner import Agent, AgentConfig

pytestmark = pytest.mark.anyio


@pytest.fixture
async def api(server, org):
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {org[1]}"}, timeout=30) as client:
        yield client


# -- helpers -------------------------------------------------------------------------------------------------


class Gate:
    """An async handler that notes each start (job id, attempt, who) and waits for the test to open it."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.started: list[tuple[str, int]] = []
        self.opened = anyio.Event()
        self.returned: list[tuple[str, int]] = []

    async def __call__(self, claim):
        self.started.append((claim.job_id, claim.attempt))
        await self.opened.wait()
        self.returned.append((claim.job_id, claim.attempt))
        return {"by": self.who, "attempt": claim.attempt}


def quick(who: str):
    async def handler(claim):
        return {"by": who, "attempt": claim.attempt}

    return handler


async def verify_clean(api) -> None:
    answer = await api.post("/v1/projections/verify")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["ok"] is True, body["differences"]


async def nothing_left_on(api, node_id: str) -> None:
    """No job is running on ``node_id`` (a node that will never report again)."""
    running = (await api.get("/v1/jobs", params={"status": "running", "limit": 1000})).json()["jobs"]
    held = [j["id"] for j in running if j["lease_owner"] == node_id]
    assert held == [], f"jobs left running on a dead node: {held}"


async def completions(api, job_id: str) -> list[dict]:
    return [e for e in await job_events(api, job_id) if e["type"] == "job.completed"]


async def node(api, node_id: str) -> dict:
    return (await api.get(f"/v1/nodes/{node_id}")).json()


async def run_catching(agent: Agent, sink: list) -> None:
    try:
        await agent.run()
        sink.append("exited")
    except ServiceError as exc:
        sink.append(exc)


@contextlib.asynccontextmanager
async def agent_at_work(server, paired: dict, handlers: dict, ended: list, transport=None, online_in=None, **config):
    """An agent of ``paired``'s node running ``handlers`` beside the block (how its run ended is noted in
    ``ended``); the block and the agent's end within 20 s. With ``online_in`` (an API client), the block
    starts once the node reads online. Yields the agent and the task group it runs in."""
    async with AgentClient(server.url, paired["credential"], transport=transport) as client:
        agent = make_agent(client, handlers, **config)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_catching, agent, ended)
                if online_in is not None:
                    await eventually(lambda: _node_if(online_in, paired["node_id"], "online"))
                yield agent, tg


def make_agent(client: AgentClient, handlers: dict, **config) -> Agent:
    settings = {"agent_version": "test-1", "claim_wait_seconds": 2.0, "grace_seconds": 5.0, **config}
    return Agent(client, HandlerRegistry({**BUILTINS, **handlers}), lambda: [CPU], AgentConfig(**settings))


# -- drain ---------------------------------------------------------------------------------------------------


async def test_a_drain_lets_the_running_job_finish_and_be_reported_and_takes_no_new_job(server, api):
    """README: "a drained node finishes its work and takes no more". The job running at the drain completes
    (its result recorded, attempt 1); its completion (``complete?claim_next=true``, as the agent sends it)
    claims nothing, though a job is queued; the agent stays up and keeps heartbeating (the node reads
    ``draining`` with fresh beats); the queued job, which only that node could run, is never run by it."""
    paired = await pair(server, api, "drain-1", devices=(CPU,))
    gate = Gate("drain-1")
    async with running_agent(server, paired["credential"], {"gate": gate}, devices=(CPU,)) as agent:
        await eventually(lambda: _node_if(api, paired["node_id"], "online"))
        running = await submit(api, "gate")
        await until(lambda: gate.started)
        waiting = await submit(api, "echo", {"left": "behind"})
        assert (await api.post(f"/v1/nodes/{paired['node_id']}/drain")).status_code == 200
        gate.opened.set()
        done = await eventually(lambda: job_in(api, running["id"], "complete", "failed"), timeout=10)
        await until(lambda: len(agent.outcomes) == 1)
        first_beat = (await node(api, paired["node_id"]))["last_heartbeat_at"]
        await anyio.sleep(2.5)  # two heartbeats and a long-poll round later
        drained = await node(api, paired["node_id"])
        assert not agent.stopping, "a drained node's agent is not told to stop"
        assert agent.node_status == "draining"
    assert (done["status"], done["result"], done["attempt"]) == ("complete", {"by": "drain-1", "attempt": 1}, 1)
    assert [o.status for o in agent.outcomes] == ["complete"] and agent.outcomes[0].next_claim is None
    assert drained["status"] == "draining" and drained["last_heartbeat_at"] != first_beat, drained
    left = (await api.get(f"/v1/jobs/{waiting['id']}")).json()
    assert left["status"] in ("queued", "blocked") and left["attempt"] == 0, left
    assert "job.claimed" not in await event_types(api, waiting["id"])
    await verify_clean(api)


async def test_work_queued_behind_a_drain_goes_to_another_agent_and_not_to_the_drained_one(server, api):
    """After a drain answers, the drained agent's long-poll takes nothing: jobs submitted then are all run by
    the other agent, each once."""
    drained = await pair(server, api, "drain-2a", devices=(CPU,))
    other = await pair(server, api, "drain-2b", devices=(CPU,))
    async with running_agent(server, drained["credential"], {"work": quick("a")}, devices=(CPU,)) as agent_a:
        await eventually(lambda: _node_if(api, drained["node_id"], "online"))
        assert (await api.post(f"/v1/nodes/{drained['node_id']}/drain")).status_code == 200
        ids = [(await submit(api, "work"))["id"] for _ in range(4)]
        async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
            done = [await eventually(lambda i=i: job_in(api, i, "complete", "failed"), timeout=15) for i in ids]
        assert agent_a.outcomes == []
    assert [(j["result"], j["placement"]["node_id"]) for j in done] == [({"by": "b", "attempt": 1}, other["node_id"])] * 4
    for i in ids:
        assert len(await completions(api, i)) == 1
    await verify_clean(api)


# -- retire --------------------------------------------------------------------------------------------------


async def test_a_retirement_mid_job_lets_the_job_finish_and_be_reported_then_the_agent_stops_by_itself(server, api):
    """README: "a retired node's agent stops by itself and exits 0"; the running job finishes within the
    grace and is reported (complete, attempt 1, recorded once). The completion claims nothing (the queued
    job stays unclaimed), the agent's ``run`` returns without error, and the node stays ``retired`` (no
    sign-off turns it ``offline``)."""
    paired = await pair(server, api, "retire-1", devices=(CPU,))
    gate = Gate("retire-1")
    ended: list = []
    async with agent_at_work(server, paired, {"gate": gate}, ended, grace_seconds=15, online_in=api) as (agent, tg):
        running = await submit(api, "gate")
        await until(lambda: gate.started)
        waiting = await submit(api, "echo", {"left": "behind"})
        assert (await api.post(f"/v1/nodes/{paired['node_id']}/retire")).status_code == 200
        await until(lambda: agent.stopping, timeout=5)  # told by its next heartbeat
        gate.opened.set()
    assert ended == ["exited"]
    done = (await api.get(f"/v1/jobs/{running['id']}")).json()
    assert (done["status"], done["result"], done["attempt"]) == ("complete", {"by": "retire-1", "attempt": 1}, 1)
    assert len(await completions(api, running["id"])) == 1
    assert [o.status for o in agent.outcomes] == ["complete"]
    assert "job.claimed" not in await event_types(api, waiting["id"])
    assert (await node(api, paired["node_id"]))["status"] == "retired"
    await nothing_left_on(api, paired["node_id"])
    await verify_clean(api)


async def test_a_retired_agents_job_past_the_grace_is_given_back_and_run_by_another_agent(server, api):
    """A job outlasting the grace after a retirement is failed as retryable (README: "past that it is
    cancelled and failed as retryable so another node picks it up"), and another agent runs it to its end;
    the retired agent exits cleanly; nothing is recorded twice."""
    retired = await pair(server, api, "retire-2a", devices=(CPU,))
    other = await pair(server, api, "retire-2b", devices=(CPU,))
    gate = Gate("a")
    ended: list = []
    async with agent_at_work(server, retired, {"work": gate}, ended, grace_seconds=0.5, online_in=api) as (agent, tg):
        job = await submit(api, "work", max_attempts=3)
        await until(lambda: gate.started)
        assert (await api.post(f"/v1/nodes/{retired['node_id']}/retire")).status_code == 200
    assert ended == ["exited"]
    given_back = (await api.get(f"/v1/jobs/{job['id']}")).json()
    assert given_back["status"] == "queued", given_back
    async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
        done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=15)
    assert (done["status"], done["result"]["by"], done["placement"]["node_id"]) == ("complete", "b", other["node_id"])
    assert len(await completions(api, job["id"])) == 1
    await verify_clean(api)


# -- revoke --------------------------------------------------------------------------------------------------


async def test_a_revoked_agents_job_is_run_at_once_by_another_and_its_late_report_is_refused(server, api):
    """API.md: the revoked node's leases end with the revocation (``job.lease_expired``, cause
    ``node_revoked``), the job claimable by another node at once. The revoked agent's handler finishing
    afterwards and reporting is refused (401; nothing recorded) and the agent ends with ``unauthenticated``;
    the job's one ``job.completed`` carries the second run's result; verify is clean."""
    revoked = await pair(server, api, "revoke-1a", devices=(CPU,))
    other = await pair(server, api, "revoke-1b", devices=(CPU,))
    gate_a = Gate("a")
    ended: list = []
    async with agent_at_work(server, revoked, {"work": gate_a}, ended, online_in=api) as (agent, tg):
        job = await submit(api, "work", max_attempts=1)
        await until(lambda: gate_a.started)
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/revoke")).status_code == 200
        requeued = (await api.get(f"/v1/jobs/{job['id']}")).json()
        gate_a.opened.set()  # the revoked agent's handler finishes: its report must be refused
        async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
            done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=5)
    assert requeued["status"] in ("queued", "blocked") and requeued["lease_owner"] is None, requeued  # blocked: no other node
    assert len(ended) == 1 and isinstance(ended[0], ServiceError)
    assert (ended[0].status, ended[0].code) == (401, "unauthenticated")
    assert [o.status for o in agent.outcomes if o.status == "complete"] == []
    assert (done["status"], done["result"], done["error"]) == ("complete", {"by": "b", "attempt": 2}, None), done
    assert done["placement"]["node_id"] == other["node_id"]
    events = await job_events(api, job["id"])
    assert [e["type"] for e in events] == ["job.submitted", "job.claimed", "job.lease_expired", "job.claimed", "job.completed"]
    assert events[2]["data"].get("cause") == "node_revoked"
    assert (await node(api, revoked["node_id"]))["status"] == "retired"
    await nothing_left_on(api, revoked["node_id"])
    await verify_clean(api)


async def test_a_revocation_between_a_completion_and_its_chained_claim_loses_nothing(server, api):
    """``complete?claim_next=true`` completed job 1 and claimed job 2 for the node; the revocation then ends
    job 2's lease at once (uncharged). The revoked agent, running job 2 without knowing, is refused (exit
    401) and records nothing; another agent runs job 2; each job completes once, job 2 with the second run's
    result; job 1's completion names job 2 as its next claim."""
    revoked = await pair(server, api, "chain-1a", devices=(CPU,))
    other = await pair(server, api, "chain-1b", devices=(CPU,))
    first_gate = Gate("a")
    second_gate = Gate("a")
    ended: list = []
    first = await submit(api, "one", priority=1)
    second = await submit(api, "two", priority=2, max_attempts=1)
    async with agent_at_work(server, revoked, {"one": first_gate, "two": second_gate}, ended) as (agent, tg):
        await until(lambda: first_gate.started)
        first_gate.opened.set()
        await until(lambda: second_gate.started)  # claimed by job 1's completion
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/revoke")).status_code == 200
        second_gate.opened.set()
        async with running_agent(server, other["credential"], {"two": quick("b")}, devices=(CPU,)):
            done = await eventually(lambda: job_in(api, second["id"], "complete", "failed"), timeout=5)
    assert len(ended) == 1 and isinstance(ended[0], ServiceError) and ended[0].status == 401
    assert agent.outcomes[0].status == "complete" and agent.outcomes[0].next_claim.job_id == second["id"]
    [completed_first] = await completions(api, first["id"])
    assert (completed_first["data"].get("result") or (await api.get(f"/v1/jobs/{first['id']}")).json()["result"]) \
        == {"by": "a", "attempt": 1}
    assert (done["status"], done["result"]) == ("complete", {"by": "b", "attempt": 2}), done
    assert len(await completions(api, second["id"])) == 1
    types = await event_types(api, second["id"])
    assert types == ["job.submitted", "job.claimed", "job.lease_expired", "job.claimed", "job.completed"], types
    await nothing_left_on(api, revoked["node_id"])
    await verify_clean(api)


async def test_a_revocation_landing_before_the_chained_completion_refuses_it_and_claims_nothing(server, api):
    """The revocation commits while the handler of job 1 still runs: job 1 is requeued at once (uncharged,
    max_attempts=1 and still runnable), the agent's ``complete?claim_next=true`` is refused 401 and claims
    nothing (job 2 is never claimed by the revoked node), and another agent runs both jobs once each."""
    revoked = await pair(server, api, "chain-2a", devices=(CPU,))
    other = await pair(server, api, "chain-2b", devices=(CPU,))
    gate = Gate("a")
    ended: list = []
    first = await submit(api, "work", {"n": 1}, priority=1, max_attempts=1)
    second = await submit(api, "work", {"n": 2}, priority=2, max_attempts=1)
    async with agent_at_work(server, revoked, {"work": gate}, ended) as (agent, tg):
        await until(lambda: gate.started)
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/revoke")).status_code == 200
        gate.opened.set()
        async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
            done = [await eventually(lambda i=i: job_in(api, i, "complete", "failed"), timeout=8)
                    for i in (first["id"], second["id"])]
    assert len(ended) == 1 and isinstance(ended[0], ServiceError) and ended[0].status == 401
    assert [(j["status"], j["result"]["by"]) for j in done] == [("complete", "b")] * 2, done
    second_claims = [e for e in await job_events(api, second["id"]) if e["type"] == "job.claimed"]
    assert [e["data"]["node_id"] for e in second_claims] == [other["node_id"]]
    assert len(await completions(api, first["id"])) == 1
    await nothing_left_on(api, revoked["node_id"])
    await verify_clean(api)


async def test_an_agent_with_three_slots_revoked_mid_way_gives_every_job_back_uncharged(server, api):
    """Three jobs running at once on one agent (``--concurrency 3``), each on its last attempt: the revocation
    ends the three leases at once (``node_revoked``, uncharged); the agent exits 401 and records nothing
    for them (its handlers' late reports and its give-backs refused); another agent runs all three, each
    completing once with the second run's result."""
    revoked = await pair(server, api, "slots-a", devices=(CPU,))
    other = await pair(server, api, "slots-b", devices=(CPU,))
    gate = Gate("a")
    ended: list = []
    async with agent_at_work(server, revoked, {"work": gate}, ended, concurrency=3, online_in=api) as (agent, tg):
        ids = [(await submit(api, "work", {"n": n}, max_attempts=1))["id"] for n in range(3)]
        await until(lambda: len(gate.started) == 3)
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/revoke")).status_code == 200
        states = [(await api.get(f"/v1/jobs/{i}")).json()["status"] for i in ids]
        gate.opened.set()
        async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
            done = [await eventually(lambda i=i: job_in(api, i, "complete", "failed"), timeout=8) for i in ids]
    assert states == ["queued"] * 3
    assert len(ended) == 1 and isinstance(ended[0], ServiceError) and ended[0].status == 401
    assert [o.status for o in agent.outcomes if o.status not in ("lost", "unreported")] == []
    assert [(j["status"], j["result"]) for j in done] == [("complete", {"by": "b", "attempt": 2})] * 3
    for i in ids:
        types = await event_types(api, i)
        assert types == ["job.submitted", "job.claimed", "job.lease_expired", "job.claimed", "job.completed"], types
    await nothing_left_on(api, revoked["node_id"])
    await verify_clean(api)


async def test_a_drain_then_a_revoke_gives_the_running_job_to_another_agent(server, api):
    """Drained while a job runs (the job would have finished there), then revoked: the lease ends at once
    (``node_revoked``), the agent exits 401, another agent runs the job; one completion, the second run's."""
    revoked = await pair(server, api, "dr-a", devices=(CPU,))
    other = await pair(server, api, "dr-b", devices=(CPU,))
    gate = Gate("a")
    ended: list = []
    async with agent_at_work(server, revoked, {"work": gate}, ended, online_in=api) as (agent, tg):
        job = await submit(api, "work", max_attempts=1)
        await until(lambda: gate.started)
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/drain")).status_code == 200
        await eventually(lambda: _node_if(api, revoked["node_id"], "draining"))
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/revoke")).status_code == 200
        gate.opened.set()
        async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
            done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=8)
    assert len(ended) == 1 and isinstance(ended[0], ServiceError) and ended[0].status == 401
    assert (done["status"], done["result"]) == ("complete", {"by": "b", "attempt": 2}), done
    events = await job_events(api, job["id"])
    assert [e["data"].get("cause") for e in events if e["type"] == "job.lease_expired"] == ["node_revoked"]
    assert len(await completions(api, job["id"])) == 1
    assert (await node(api, revoked["node_id"]))["status"] == "retired"
    await nothing_left_on(api, revoked["node_id"])
    await verify_clean(api)


async def test_a_drained_agent_that_stops_leaves_its_node_draining_not_offline(server, api):
    """API.md (``/v1/agent/offline``): "``draining`` and ``retired`` stay". A drained agent stopped by its
    operator signs off, and the node still reads ``draining`` (intent, never derived away)."""
    paired = await pair(server, api, "drain-stop", devices=(CPU,))
    async with running_agent(server, paired["credential"], devices=(CPU,)) as agent:
        await eventually(lambda: _node_if(api, paired["node_id"], "online"))
        assert (await api.post(f"/v1/nodes/{paired['node_id']}/drain")).status_code == 200
        await until(lambda: agent.node_status == "draining", timeout=5)
    after = await node(api, paired["node_id"])
    assert (after["status"], after["stored_status"]) == ("draining", "draining"), after
    await verify_clean(api)


async def test_a_revocation_during_a_retirements_grace_gives_the_job_back_at_once(server, api):
    """Retired while a job runs (the agent stops, letting the job finish within a long grace), then revoked:
    the lease ends at once (``node_revoked``, uncharged), the stopping agent's next request is refused and it
    ends with ``unauthenticated``, and another agent runs the job; one completion, the second run's."""
    revoked = await pair(server, api, "rr-a", devices=(CPU,))
    other = await pair(server, api, "rr-b", devices=(CPU,))
    gate = Gate("a")
    ended: list = []
    async with agent_at_work(server, revoked, {"work": gate}, ended, grace_seconds=30, online_in=api) as (agent, tg):
        job = await submit(api, "work", max_attempts=1)
        await until(lambda: gate.started)
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/retire")).status_code == 200
        await until(lambda: agent.stopping, timeout=5)
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/revoke")).status_code == 200
        async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
            done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=8)
        gate.opened.set()
    assert len(ended) == 1 and isinstance(ended[0], ServiceError) and ended[0].status == 401, ended
    assert (done["status"], done["result"]) == ("complete", {"by": "b", "attempt": 2}), done
    assert len(await completions(api, job["id"])) == 1
    await nothing_left_on(api, revoked["node_id"])
    await verify_clean(api)


async def test_a_revocation_after_a_lost_chained_completion_answer_loses_neither_job(server, api):
    """``complete?claim_next=true`` completes job 1 and claims job 2; its answer is lost on the way. Before the
    agent's resend, the node is revoked: the resend is refused 401 (job 1 stays complete with its one
    result), job 2's lease ends at once and another agent runs it; nothing is recorded twice."""
    from tests.integration.test_agent import LoseAnswers

    revoked = await pair(server, api, "lost-a", devices=(CPU,))
    other = await pair(server, api, "lost-b", devices=(CPU,))
    first = await submit(api, "work", {"n": 1}, priority=1)
    second = await submit(api, "work", {"n": 2}, priority=2, max_attempts=1)
    hold = anyio.Event()

    class LoseThenWait(LoseAnswers):
        async def handle_async_request(self, request):
            lost_before = len(self.lost)
            try:
                return await super().handle_async_request(request)
            finally:
                if len(self.lost) > lost_before:
                    await hold.wait()  # the resend waits for the revocation

    transport = LoseThenWait(lambda r: r.url.path.endswith(f"/{first['id']}/complete"))
    ended: list = []
    async with agent_at_work(server, revoked, {"work": quick("a")}, ended, transport=transport) as (agent, tg):
        await until(lambda: transport.lost)
        claimed = await eventually(lambda: job_in(api, second["id"], "running"))
        assert claimed["lease_owner"] == revoked["node_id"]
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/revoke")).status_code == 200
        hold.set()
        async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
            done = await eventually(lambda: job_in(api, second["id"], "complete", "failed"), timeout=8)
    assert len(ended) == 1 and isinstance(ended[0], ServiceError) and ended[0].status == 401, ended
    first_now = (await api.get(f"/v1/jobs/{first['id']}")).json()
    assert (first_now["status"], first_now["result"]) == ("complete", {"by": "a", "attempt": 1})
    assert len(await completions(api, first["id"])) == 1
    assert (done["status"], done["result"]) == ("complete", {"by": "b", "attempt": 2}), done
    assert len(await completions(api, second["id"])) == 1
    await nothing_left_on(api, revoked["node_id"])
    await verify_clean(api)


# -- ``umbra agent`` processes --------------------------------------------------------------------------------


ROOT = Path(__file__).resolve().parents[2]
DEVICE = json.dumps({"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 8000})


async def _credential_file(server, api, tmp_path, name: str):
    code = (await api.post("/v1/pairings", json={"name": name})).json()["code"]
    async with AgentClient(server.url) as client:
        answer = await client.redeem(code=code, name=name, agent_version="t", devices=[CPU])
    store = CredentialFile(tmp_path / f"{name}.json")
    store.save(StoredCredential(server=server.url, node_id=answer["node_id"], name=name, credential=answer["credential"]))
    return store.path, answer["node_id"]


async def _run_process(credential_file, *extra: str):
    command = [sys.executable, "-m", "umbra.cli", "agent", "--claim-wait", "2", "--device", DEVICE,
               "--credential-file", str(credential_file), *extra]
    return await anyio.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=dict(os.environ))


async def _drain_into(stream, sink: list) -> None:
    async for chunk in stream:
        sink.append(chunk)


@pytest.mark.parametrize("verb", ["retire", "revoke"])
async def test_umbra_agent_exits_0_on_retire_and_1_on_revoke_with_its_job_accounted_for(server, api, tmp_path, verb):
    """README: "a retired node's agent stops by itself and exits 0" (its running ``sleep`` job finished and
    reported once); "a revoked agent's next request is refused ... and it exits 1 with ``unauthenticated``"
    (its job requeued at once, never completed by it). Either way nothing is left running on the node."""
    credential_file, node_id = await _credential_file(server, api, tmp_path, f"proc-{verb}")
    err: list[bytes] = []
    process = await _run_process(credential_file, "--grace", "20")
    try:
        async with process, anyio.create_task_group() as tg:
            tg.start_soon(_drain_into, process.stderr, err)
            tg.start_soon(_drain_into, process.stdout, [])
            await eventually(lambda: _node_if(api, node_id, "online"), timeout=15)
            job = await submit(api, "sleep", {"seconds": 2})
            await eventually(lambda: job_in(api, job["id"], "running"), timeout=10)
            await until(lambda: job["id"] in b"".join(err).decode(), timeout=5)
            assert (await api.post(f"/v1/nodes/{node_id}/{verb}")).status_code == 200
            if verb == "revoke":
                requeued = (await api.get(f"/v1/jobs/{job['id']}")).json()
            with anyio.fail_after(15):
                status = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
    text = b"".join(err).decode()
    if verb == "retire":
        assert status == 0, text[-1500:]
        done = (await api.get(f"/v1/jobs/{job['id']}")).json()
        assert (done["status"], done["result"]) == ("complete", {"slept": 2})
        assert (await node(api, node_id))["status"] == "retired"
    else:
        assert status == 1, text[-1500:]
        assert "unauthenticated" in text
        assert requeued["status"] in ("queued", "blocked") and requeued["lease_owner"] is None, requeued  # blocked: no other node
        assert "job.completed" not in await event_types(api, job["id"])
    await nothing_left_on(api, node_id)
    await verify_clean(api)


async def test_umbra_agent_revoked_while_a_plain_handler_blocks_exits_1_at_once_and_another_runs_the_job(server, api, tmp_path):
    """A plain (thread) handler cannot be cancelled: revoked mid-run, ``umbra agent`` must still exit 1 with
    ``unauthenticated`` promptly (not when the 60 s thread returns), and another agent runs the job at once;
    one completion, the second run's."""
    (tmp_path / "blocking_handlers.py").write_text(
        "import time\n\ndef block(claim):\n    time.sleep(60)\n    return {'by': 'a'}\n"
    )
    credential_file, node_id = await _credential_file(server, api, tmp_path, "proc-plain")
    other = await pair(server, api, "proc-plain-b", devices=(CPU,))
    err: list[bytes] = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "umbra.cli", "agent", "--claim-wait", "2", "--device", DEVICE,
               "--credential-file", str(credential_file), "--handler", "block=blocking_handlers:block"]
    process = await anyio.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    try:
        async with process, anyio.create_task_group() as tg:
            tg.start_soon(_drain_into, process.stderr, err)
            tg.start_soon(_drain_into, process.stdout, [])
            await eventually(lambda: _node_if(api, node_id, "online"), timeout=15)
            job = await submit(api, "block", max_attempts=1)
            await eventually(lambda: job_in(api, job["id"], "running"), timeout=10)
            await until(lambda: job["id"] in b"".join(err).decode(), timeout=5)
            assert (await api.post(f"/v1/nodes/{node_id}/revoke")).status_code == 200
            with anyio.fail_after(12):
                status = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
    text = b"".join(err).decode()
    assert status == 1 and "unauthenticated" in text, text[-1500:]
    async with running_agent(server, other["credential"], {"block": quick("b")}, devices=(CPU,)):
        done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=8)
    assert (done["status"], done["result"]) == ("complete", {"by": "b", "attempt": 2}), done
    assert len(await completions(api, job["id"])) == 1
    await nothing_left_on(api, node_id)
    await verify_clean(api)


async def test_a_two_slot_agent_revoked_with_one_job_running_and_one_slot_parked_exits_at_once(server, api):
    """One slot runs a job, the other is parked in a long-poll: the revocation refuses the parked poll at
    once, the agent ends with ``unauthenticated`` without waiting for the handler, the running job is
    requeued (uncharged) and run once by another agent; a job submitted afterwards is never claimed by the
    revoked node."""
    revoked = await pair(server, api, "park-a", devices=(CPU,))
    other = await pair(server, api, "park-b", devices=(CPU,))
    gate = Gate("a")
    ended: list = []
    async with agent_at_work(server, revoked, {"work": gate}, ended, concurrency=2, claim_wait_seconds=20, online_in=api) as (agent, tg):
        job = await submit(api, "work", max_attempts=1)
        await until(lambda: gate.started)
        await anyio.sleep(0.5)  # the second slot parks
        assert (await api.post(f"/v1/nodes/{revoked['node_id']}/revoke")).status_code == 200
        with anyio.fail_after(4):
            await until(lambda: ended, timeout=4)
        later = await submit(api, "work")
        async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
            done = [await eventually(lambda i=i: job_in(api, i, "complete", "failed"), timeout=8)
                    for i in (job["id"], later["id"])]
        gate.opened.set()
    assert isinstance(ended[0], ServiceError) and ended[0].status == 401, ended
    assert [(j["status"], j["result"]["by"]) for j in done] == [("complete", "b")] * 2
    assert [len(await completions(api, j["id"])) for j in done] == [1, 1]
    await nothing_left_on(api, revoked["node_id"])
    await verify_clean(api)


async def test_cli_drain_then_revoke_hands_the_job_to_a_waiting_agent_long_before_its_lease_and_verify_is_clean(
        db_url, org, cli):
    """Under a 30 s lease, with ``umbra admin drain`` then ``umbra admin revoke`` from the shell: the job the
    revoked agent was running is taken by the other agent, already waiting, within a few seconds (not after
    the lease), with the queued job's error saying the node was revoked meanwhile; the revoked agent ends
    with ``unauthenticated``; one completion, the second run's; ``umbra verify --json`` is clean."""
    env = {"UMBRA_LEASE_SECONDS": "30", "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1", "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2"}
    org_id, key = org
    with LiveServer(db_url, **env) as server:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as api:
            revoked = await pair(server, api, "cli-a", devices=(CPU,))
            other = await pair(server, api, "cli-b", devices=(CPU,))
            gate = Gate("a")
            ended: list = []
            async with agent_at_work(server, revoked, {"work": gate}, ended, online_in=api) as (agent, tg):
                job = await submit(api, "work", max_attempts=1)
                await until(lambda: gate.started)
                async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
                    await eventually(lambda: _node_if(api, other["node_id"], "online"))
                    status, _, err = await cli("admin", "drain", "--org", str(org_id), revoked["node_id"])
                    assert status == 0, err
                    status, _, err = await cli("admin", "revoke", "--org", str(org_id), revoked["node_id"])
                    assert status == 0, err
                    began = anyio.current_time()
                    done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=10)
                    took = anyio.current_time() - began
                gate.opened.set()
            assert took < 8, f"the job waited {took:.1f}s: as long as a lease"
            assert isinstance(ended[0], ServiceError) and ended[0].code == "unauthenticated", ended
            assert (done["status"], done["result"]) == ("complete", {"by": "b", "attempt": 2}), done
            events = await job_events(api, job["id"])
            ended_lease = [e for e in events if e["type"] == "job.lease_expired"]
            assert [e["data"].get("cause") for e in ended_lease] == ["node_revoked"]
            assert len(await completions(api, job["id"])) == 1
            await nothing_left_on(api, revoked["node_id"])
    status, out, err = await cli("verify", "--json")
    assert status == 0 and json.loads(out) == {"ok": True, "differences": []}, (out, err)


async def test_a_revoked_agents_late_decomposition_makes_no_children_and_the_job_runs_once_elsewhere(db_url, org):
    """Under a 30 s lease (no renewal comes between), the revoked agent's handler returns children after the
    revocation: the report is refused 401 (the agent counts it unreported, ends with ``unauthenticated``),
    no child job exists, and another agent runs the job itself to its one completion."""
    from umbra.agent.handlers import Child, Decompose

    env = {"UMBRA_LEASE_SECONDS": "30", "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1", "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2"}
    with LiveServer(db_url, **env) as server:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {org[1]}"}, timeout=30) as api:
            revoked = await pair(server, api, "dec-a", devices=(CPU,))
            other = await pair(server, api, "dec-b", devices=(CPU,))
            opened = anyio.Event()
            started: list[str] = []

            async def split(claim):
                started.append(claim.job_id)
                await opened.wait()
                return Decompose([Child(kind="echo", payload={"part": n}) for n in range(3)])

            ended: list = []
            async with agent_at_work(server, revoked, {"work": split}, ended, online_in=api) as (agent, tg):
                job = await submit(api, "work", max_attempts=1)
                await until(lambda: started)
                assert (await api.post(f"/v1/nodes/{revoked['node_id']}/revoke")).status_code == 200
                opened.set()
                await until(lambda: ended, timeout=5)
            assert isinstance(ended[0], ServiceError) and ended[0].code == "unauthenticated", ended
            assert [(o.status, o.detail) for o in agent.outcomes] == [("unreported", "unauthenticated")]
            listed = (await api.get("/v1/jobs", params={"limit": 1000})).json()["jobs"]
            assert [j["id"] for j in listed] == [job["id"]], "children made by a revoked node's report"
            async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
                done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=8)
            assert (done["status"], done["result"]) == ("complete", {"by": "b", "attempt": 2}), done
            assert "job.decomposed" not in await event_types(api, job["id"])
            await nothing_left_on(api, revoked["node_id"])
            await verify_clean(api)


async def test_restarting_a_drained_or_retired_agent_does_not_put_its_node_back_to_work(server, api):
    """README: "Draining and retiring are for good ... there is no undrain". An agent restarted on a drained
    node heartbeats, reads ``draining`` and takes none of the queued work; one restarted on a retired node
    stops by itself at its first heartbeat (no error) and the node stays ``retired``."""
    drained = await pair(server, api, "again-drained", devices=(CPU,))
    retired = await pair(server, api, "again-retired", devices=(CPU,))
    for paired in (drained, retired):
        async with running_agent(server, paired["credential"], devices=(CPU,)):
            await eventually(lambda p=paired: _node_if(api, p["node_id"], "online"))
    assert (await api.post(f"/v1/nodes/{drained['node_id']}/drain")).status_code == 200
    assert (await api.post(f"/v1/nodes/{retired['node_id']}/retire")).status_code == 200
    job = await submit(api, "echo", {"waiting": True})
    async with running_agent(server, drained["credential"], devices=(CPU,)) as agent:
        await until(lambda: agent.node_status is not None, timeout=5)
        await anyio.sleep(2.5)
        assert agent.node_status == "draining" and not agent.stopping and agent.outcomes == []
    assert "job.claimed" not in await event_types(api, job["id"])
    assert (await node(api, drained["node_id"]))["status"] == "draining"
    ended: list = []
    async with AgentClient(server.url, retired["credential"]) as client:
        agent = make_agent(client, {})
        with anyio.fail_after(10):
            await run_catching(agent, ended)
    assert ended == ["exited"] and agent.node_status == "retired" and agent.outcomes == []
    assert (await node(api, retired["node_id"]))["status"] == "retired"
    assert "job.claimed" not in await event_types(api, job["id"])
    await verify_clean(api)


async def test_a_job_claimed_by_a_lost_chained_answer_is_not_failed_unrun_when_the_node_is_retired(server, api):
    """``complete?claim_next=true`` completed job 1 and claimed job 2; the answer was lost; before the resend
    the node is retired (the agent is stopping), so the resend asks for no next job. The server gives job 2
    back (``job.released``, not charged): it had stayed leased to the retired node, and with
    ``max_attempts=1`` failed by lease expiry without ever having run. An operator retiring a node expects
    its work finished or given back."""
    from tests.integration.test_agent import LoseAnswers

    retired = await pair(server, api, "lost-retire-a", devices=(CPU,))
    other = await pair(server, api, "lost-retire-b", devices=(CPU,))
    first = await submit(api, "work", {"n": 1}, priority=1)
    second = await submit(api, "work", {"n": 2}, priority=2, max_attempts=1)
    ran: list[str] = []

    async def work(claim):
        ran.append(claim.job_id)
        return {"by": "a", "attempt": claim.attempt}

    holder: list[Agent] = []

    class LoseThenWaitForStop(LoseAnswers):
        async def handle_async_request(self, request):
            if self.lost and request.url.path.endswith(f"/{first['id']}/complete") and not holder[0].stopping:
                # the resends fail to connect (nothing sent) until the agent knows of the retirement
                raise httpx.ConnectError("unreachable for a moment", request=request)
            return await super().handle_async_request(request)

    transport = LoseThenWaitForStop(lambda r: r.url.path.endswith(f"/{first['id']}/complete"))
    ended: list = []
    async with agent_at_work(server, retired, {"work": work}, ended, transport=transport, grace_seconds=10, backoff_base_seconds=0.2, backoff_cap_seconds=0.4) as (agent, tg):
        holder.append(agent)
        await until(lambda: transport.lost)
        assert (await api.post(f"/v1/nodes/{retired['node_id']}/retire")).status_code == 200
        await until(lambda: agent.stopping, timeout=5)
    assert ended == ["exited"]
    assert (await api.get(f"/v1/jobs/{first['id']}")).json()["status"] == "complete"
    async with running_agent(server, other["credential"], {"work": quick("b")}, devices=(CPU,)):
        done = await eventually(lambda: job_in(api, second["id"], "complete", "failed"), timeout=10)
    await verify_clean(api)
    assert done["status"] == "complete", (done["status"], done["error"], done["attempt"], ran)


async def test_a_drained_nodes_changing_heartbeats_never_unblock_work_it_will_not_take(server, api):
    """A job only a drained node could run is blocked (no job waits looking alive), and the drained agent's
    heartbeats, even ones that change its devices (memory freed, a device added), do not turn it back to
    ``queued``; ``explain`` names the drain."""
    from datetime import datetime, timezone

    from umbra.events.types import Device

    paired = await pair(server, api, "drain-beats", devices=(CPU,))
    started = datetime.now(timezone.utc)
    async with AgentClient(server.url, paired["credential"]) as agent:
        await agent.heartbeat(devices=[CPU], agent_version="t", agent_started_at=started)
        assert (await api.post(f"/v1/nodes/{paired['node_id']}/drain")).status_code == 200
        job = await submit(api, "echo", {"x": 1})
        assert (await api.get(f"/v1/jobs/{job['id']}")).json()["status"] == "blocked"
        bigger = Device(kind="cpu", label="cpu0", ram_total_mb=65536, ram_free_mb=60000, compute_units=8)
        extra = Device(kind="cpu", label="cpu1", ram_total_mb=8192, ram_free_mb=8000)
        for devices in ([bigger], [bigger, extra], [CPU]):
            answer = await agent.heartbeat(devices=devices, agent_version="t", agent_started_at=started)
            assert answer["status"] == "draining"
            assert (await api.get(f"/v1/jobs/{job['id']}")).json()["status"] == "blocked"
            assert await agent.claim(0) is None
    explained = (await api.get(f"/v1/jobs/{job['id']}/explain")).json()
    assert {i["reason"] for i in explained["ineligible"]} == {"node_draining"}, explained
    await verify_clean(api)
