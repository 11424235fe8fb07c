"""The reference agent against a live server: pairing, heartbeats, claiming,
renewing, completing, failing, decomposing, being cancelled or revoked, and
answers lost on their way back to it.

The agent runs in-process here (its loop is plain anyio); the signal and
credential-file behaviour of the ``umbra agent`` process is in
``test_agent_process.py``.
"""

from __future__ import annotations

import contextlib
import os
from datetime import datetime, timezone
from typing import Callable

import anyio
import httpx
import psycopg
import pytest

from tests.conftest import LiveServer
from tests.helpers import eventually, until
from umbra.agent.client import AgentClient, ServiceError
from umbra.agent.handlers import BUILTINS, Child, Decompose, HandlerRegistry, RetryableError
from umbra.agent.runner import Agent, AgentConfig
from umbra.events.types import Device

pytestmark = pytest.mark.anyio

CPU = Device(kind="cpu", label="cpu0", ram_total_mb=16384, ram_free_mb=12000, compute_units=8)
GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24000, accelerators=("cuda",))


@pytest.fixture
def server(db_url):
    """A live server with a 3 s lease and 1 s heartbeats, so renewals and status changes happen within a test."""
    env = {"UMBRA_LEASE_SECONDS": "3", "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1", "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2"}
    with LiveServer(db_url, **env) as live:
        yield live


@pytest.fixture
async def api(server, org):
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {org[1]}"}) as client:
        yield client


async def pair(server, api, name: str, devices=(CPU, GPU)) -> dict:
    code = (await api.post("/v1/pairings", json={"name": name})).json()["code"]
    async with AgentClient(server.url) as client:
        return await client.redeem(code=code, name=name, agent_version="test-1", devices=list(devices))


class LoseAnswers(httpx.AsyncBaseTransport):
    """The real transport, except that the answers to the requests ``lose`` picks are read and then lost:
    the server handled the request, the agent gets a transport error (a connection broken after the
    server answered, or a proxy dropping the answer)."""

    def __init__(self, lose: Callable[[httpx.Request], bool], times: int = 1) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.lose = lose
        self.left = times
        self.lost: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if self.left > 0 and self.lose(request):
            self.left -= 1
            await response.aread()
            await response.aclose()
            self.lost.append(str(request.url))
            raise httpx.ReadError("connection reset after the server answered", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@contextlib.asynccontextmanager
async def running_agent(server, credential: str, handlers=None, devices=(CPU, GPU), transport=None, **config):
    registry = HandlerRegistry({**BUILTINS, **(handlers or {})})
    settings = {"agent_version": "test-1", "claim_wait_seconds": 2.0, "grace_seconds": 5.0, **config}
    async with AgentClient(server.url, credential, transport=transport) as client:
        agent = Agent(client, registry, lambda: list(devices), AgentConfig(**settings))
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            yield agent
            agent.stop()


async def submit(api, kind: str, payload=None, **fields) -> dict:
    response = await api.post("/v1/jobs", json={"kind": kind, "payload": payload or {}, **fields})
    assert response.status_code == 201, response.text
    return response.json()


async def job_in(api, job_id: str, *statuses: str) -> dict | None:
    job = (await api.get(f"/v1/jobs/{job_id}")).json()
    return job if job["status"] in statuses else None


async def job_events(api, job_id: str) -> list[dict]:
    return (await api.get(f"/v1/jobs/{job_id}/events")).json()["events"]


async def event_types(api, job_id: str) -> list[str]:
    return [e["type"] for e in await job_events(api, job_id)]


async def test_agent_heartbeats_its_devices_and_start_time_and_goes_online(server, api):
    paired = await pair(server, api, "box-1")
    assert set(paired["scopes"]) >= {"compute:heartbeat", "compute:claim", "compute:complete"}
    async with running_agent(server, paired["credential"]) as agent:
        node = await eventually(lambda: _node_if(api, paired["node_id"], "online"))
        assert agent.node_status == "online"
    assert [d["label"] for d in node["devices"]] == ["cpu0", "gpu0"]
    assert node["agent_version"] == "test-1"
    assert node["kinds"] == ["echo", "sleep"]  # the kinds its claims name: the built-in handlers
    assert datetime.fromisoformat(node["agent_started_at"].replace("Z", "+00:00")) == agent.started_at


async def test_an_agent_that_stops_on_purpose_leaves_its_node_offline_at_once(server, api):
    """Not online for the 45 s until its silence goes stale: the agent signs off as it stops."""
    paired = await pair(server, api, "box-leaving")
    async with running_agent(server, paired["credential"]):
        await eventually(lambda: _node_if(api, paired["node_id"], "online"))
    node = (await api.get(f"/v1/nodes/{paired['node_id']}")).json()
    assert (node["status"], node["stored_status"]) == ("offline", "offline")
    events = (await api.get("/v1/events", params={"limit": 1000})).json()["events"]
    assert [e["type"] for e in events if e["stream"] == f"node:{paired['node_id']}"][-1] == "node.went_offline"


async def _node_if(api, node_id: str, status: str):
    node = (await api.get(f"/v1/nodes/{node_id}")).json()
    return node if node["status"] == status else None


async def test_echo_and_sleep_complete_with_their_results_and_sleep_renews_its_lease(server, api):
    paired = await pair(server, api, "box-2")
    async with running_agent(server, paired["credential"]) as agent:
        echo = await submit(api, "echo", {"text": "hello", "n": [1, 2]})
        slow = await submit(api, "sleep", {"seconds": 2.5})
        done_echo = await eventually(lambda: job_in(api, echo["id"], "complete", "failed"), timeout=15)
        done_sleep = await eventually(lambda: job_in(api, slow["id"], "complete", "failed"), timeout=15)
    assert done_echo["status"] == "complete" and done_echo["result"] == {"text": "hello", "n": [1, 2]}
    assert done_sleep["status"] == "complete" and done_sleep["result"] == {"slept": 2.5}
    assert done_sleep["attempt"] == 1 and done_sleep["placement"]["node_id"] == paired["node_id"]
    history = await event_types(api, slow["id"])
    assert history[:2] == ["job.submitted", "job.claimed"] and history[-1] == "job.completed"
    assert "job.lease_renewed" in history, "a 2.5 s job under a 3 s lease must be renewed"
    assert {o.status for o in agent.outcomes} == {"complete"}


async def test_each_completion_brings_the_next_job_and_the_agent_polls_only_when_none_is_left(server, api):
    paired = await pair(server, api, "box-chain")
    async with running_agent(server, paired["credential"]) as agent:
        await eventually(lambda: _node_if(api, paired["node_id"], "online"))
        batch = await api.post("/v1/jobs/batch", json={"jobs": [{"kind": "echo", "payload": {"n": n}} for n in range(3)]})
        assert batch.status_code == 201, batch.text
        ids = [job["id"] for job in batch.json()["jobs"]]
        done = [await eventually(lambda i=i: job_in(api, i, "complete", "failed"), timeout=15) for i in ids]
        await until(lambda: len(agent.outcomes) == 3)
    assert [(job["status"], job["result"]) for job in done] == [("complete", {"n": n}) for n in range(3)]
    # The first came from the long-poll; each completion claimed the next; the last found nothing left.
    assert [o.job_id for o in agent.outcomes] == ids
    assert [o.next_claim.job_id if o.next_claim else None for o in agent.outcomes] == [ids[1], ids[2], None]
    assert all(o.detail["status"] == "complete" and "next_claim" not in o.detail for o in agent.outcomes)
    claimed = [e for e in (await api.get(f"/v1/jobs/{ids[1]}/events")).json()["events"] if e["type"] == "job.claimed"]
    completed = [e for e in (await api.get(f"/v1/jobs/{ids[0]}/events")).json()["events"] if e["type"] == "job.completed"]
    assert claimed[0]["position"] == completed[0]["position"] + 1  # appended together, in one transaction


async def test_an_agent_with_three_slots_runs_three_jobs_at_once_and_stops_them_all_gracefully(server, api):
    """Stopped while three handlers run, the agent lets each finish and report.

    The stop comes once the agent's own handlers have started, not when the
    server shows the jobs running: a claim committed but not yet received would
    be abandoned by the stop and wait out its lease (the documented limit of a
    lost claim answer), which is not what this test is about.
    """
    paired = await pair(server, api, "box-slots")
    started: list[str] = []

    async def sleep_noting_start(claim):
        started.append(claim.job_id)
        await anyio.sleep(1.5)
        return {"slept": 1.5}

    async with running_agent(server, paired["credential"], {"nap": sleep_noting_start}, concurrency=3) as agent:
        await eventually(lambda: _node_if(api, paired["node_id"], "online"))
        ids = [(await submit(api, "nap"))["id"] for _ in range(3)]

        async def all_running():
            return True if len(started) == 3 and all([await job_in(api, i, "running") for i in ids]) else None

        await eventually(all_running, timeout=10)  # three at once, on one node
        assert sorted(started) == sorted(ids)
        agent.stop()
        with anyio.fail_after(10):
            await until(lambda: len(agent.outcomes) == 3)
    assert sorted(o.job_id for o in agent.outcomes) == sorted(ids) and {o.status for o in agent.outcomes} == {"complete"}
    assert all(o.next_claim is None for o in agent.outcomes)  # stopping: no slot asked for more work


async def test_an_agent_claims_only_the_kinds_it_has_handlers_for(server, api):
    """A job of a kind this agent has no handler for waits, untouched, for an agent that has one.

    In a mixed fleet the first agent to take such a job used to fail it for
    good (a handler-less agent fails it the same way every time).
    """
    paired = await pair(server, api, "box-3")
    async with running_agent(server, paired["credential"]):
        foreign = await submit(api, "transcode", {"file": "a.mp4"}, priority=1)
        mine = await submit(api, "echo", {"n": 1}, priority=2)  # behind the foreign job in claim order
        await eventually(lambda: job_in(api, mine["id"], "complete"), timeout=15)
    assert (await api.get(f"/v1/jobs/{foreign['id']}")).json()["status"] == "queued"
    assert await event_types(api, foreign["id"]) == ["job.submitted"]
    async with running_agent(server, paired["credential"], {"transcode": lambda claim: {"done": claim.payload["file"]}}):
        done = await eventually(lambda: job_in(api, foreign["id"], "complete", "failed"), timeout=15)
    assert done["status"] == "complete" and done["result"] == {"done": "a.mp4"} and done["attempt"] == 1


@pytest.mark.parametrize("extra", [[f"plugin-{i:03d}" for i in range(100)], ["x" * 201], ["渲染" * 90 + f"-{i}" for i in range(40)]],
                         ids=["101 kinds", "a 201-character kind", "too long to name"])  # fmt: skip
async def test_an_agent_with_kinds_the_server_cannot_take_as_named_still_runs_its_jobs(server, api, extra):
    """A claim names at most 100 kinds of 1 to 200 characters (and fits a request line): an agent whose
    handlers exceed that names none and claims every kind, rather than being refused on every claim and beat."""
    from umbra.agent.handlers import echo

    paired = await pair(server, api, "plugins")
    async with running_agent(server, paired["credential"], {kind: echo for kind in extra}):
        node = await eventually(lambda: _node_if(api, paired["node_id"], "online"))
        job = await submit(api, "echo", {"text": "hi"})
        done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=10)
    assert done["status"] == "complete"
    if len(extra) == 1:  # one over-long name is left out; the others are named
        assert node["kinds"] == ["echo", "sleep"]
    else:
        assert node["kinds"] is None  # names none: takes every kind


async def test_an_agent_that_names_no_kinds_replaces_the_kinds_an_earlier_agent_reported(server, api):
    """The node's next agent has too many handlers to name: it claims every kind, and its beats say so
    (an empty list), so the node does not keep the earlier agent's kinds and explain does not blame them."""
    from umbra.agent.handlers import echo

    paired = await pair(server, api, "box-kinds")
    async with running_agent(server, paired["credential"]):
        node = await eventually(lambda: _node_if(api, paired["node_id"], "online"))
    assert node["kinds"] == ["echo", "sleep"]
    async with running_agent(server, paired["credential"], {f"plugin-{i:03d}": echo for i in range(100)}) as agent:
        assert agent.kinds == []
        await eventually(lambda: _node_if(api, paired["node_id"], "online"))
        await agent.heartbeat()
        assert (await api.get(f"/v1/nodes/{paired['node_id']}")).json()["kinds"] is None  # every kind


async def test_handler_exception_fails_the_job_with_its_message(server, api):
    def broken(claim):
        raise ValueError(f"frame {claim.payload['frame']} is corrupt")

    paired = await pair(server, api, "box-4")
    async with running_agent(server, paired["credential"], {"decode": broken}):
        job = await submit(api, "decode", {"frame": 7})
        failed = await eventually(lambda: job_in(api, job["id"], "failed", "complete"), timeout=15)
    assert failed["error"] == "frame 7 is corrupt" and failed["attempt"] == 1


async def test_retryable_handler_error_requeues_with_backoff(server, api):
    async def flaky(claim):
        raise RetryableError("model server busy")

    paired = await pair(server, api, "box-5")
    async with running_agent(server, paired["credential"], {"infer": flaky}) as agent:
        job = await submit(api, "infer", {}, max_attempts=3)
        await eventually(lambda: _has_outcome(agent, "retrying"), timeout=15)
    requeued = (await api.get(f"/v1/jobs/{job['id']}")).json()
    assert requeued["status"] == "queued" and requeued["error"] == "model server busy"
    assert requeued["attempt"] == 1 and requeued["not_before"] is not None
    assert (await event_types(api, job["id"]))[-1] == "job.requeued"


async def _has_outcome(agent: Agent, status: str) -> bool:
    return any(o.status == status for o in agent.outcomes)


async def test_handler_can_decompose_a_job_and_the_parent_settles(server, api):
    async def split(claim):
        return Decompose([Child("echo", {"part": i}) for i in range(3)])

    paired = await pair(server, api, "box-6")
    async with running_agent(server, paired["credential"], {"split": split}):
        parent = await submit(api, "split", {})
        settled = await eventually(lambda: job_in(api, parent["id"], "complete", "partial", "failed"), timeout=20)
    assert settled["status"] == "complete"
    children = (await api.get("/v1/jobs", params={"limit": 50})).json()["jobs"]
    parts = sorted(j["result"]["part"] for j in children if j["parent_job_id"] == parent["id"])
    assert parts == [0, 1, 2]
    assert "job.decomposed" in await event_types(api, parent["id"])


async def test_a_cancelled_job_is_abandoned_and_the_agent_moves_on(server, api):
    paired = await pair(server, api, "box-7")
    async with running_agent(server, paired["credential"]) as agent:
        long = await submit(api, "sleep", {"seconds": 60})
        await eventually(lambda: job_in(api, long["id"], "running"))
        assert (await api.post(f"/v1/jobs/{long['id']}/cancel")).status_code == 200
        await eventually(lambda: _has_outcome(agent, "lost"), timeout=10)
        quick = await submit(api, "echo", {"after": "cancel"})
        await eventually(lambda: job_in(api, quick["id"], "complete"), timeout=10)
    assert (await event_types(api, long["id"]))[-1] == "job.cancelled"
    assert [o.detail for o in agent.outcomes if o.status == "lost"] == ["job_cancelled"]


async def test_a_revoked_credential_stops_the_agent_with_unauthenticated(server, api):
    paired = await pair(server, api, "box-8")

    async def revoke_once_online():
        await eventually(lambda: _node_if(api, paired["node_id"], "online"))
        assert (await api.post(f"/v1/nodes/{paired['node_id']}/revoke")).status_code == 200

    async with AgentClient(server.url, paired["credential"]) as client:
        agent = Agent(client, HandlerRegistry(BUILTINS), lambda: [CPU], AgentConfig(agent_version="t", claim_wait_seconds=1))
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(revoke_once_online)
                with pytest.raises(ServiceError) as refused:
                    await agent.run()
    assert refused.value.code == "unauthenticated" and refused.value.status == 401


async def test_a_heartbeat_the_server_refuses_for_its_devices_stops_the_agent_after_its_job(server, api):
    """Devices the server does not accept (here a label reported twice, 422) are refused however often
    they are sent: the agent stops as for a signal (the running job finishes within the grace and is
    reported, the node signs off) and ends with the server's error, instead of running on unseen."""
    paired = await pair(server, api, "box-refused")
    devices = [CPU]
    started = anyio.Event()

    async def slow(claim):
        started.set()
        await anyio.sleep(2)
        return {"slept": 2}

    refused: list[ServiceError] = []

    async with AgentClient(server.url, paired["credential"]) as client:
        agent = Agent(client, HandlerRegistry({**BUILTINS, "slow": slow}), lambda: list(devices),
                      AgentConfig(agent_version="t", claim_wait_seconds=1, grace_seconds=20))  # fmt: skip

        async def run() -> None:
            try:
                await agent.run()
            except ServiceError as exc:
                refused.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await eventually(lambda: _node_if(api, paired["node_id"], "online"))
                job = await submit(api, "slow")
                await started.wait()
                devices.append(Device(kind="cpu", label=CPU.label, ram_total_mb=8192, ram_free_mb=8000))
    assert [(e.status, e.code) for e in refused] == [(422, "invalid_request")]
    assert "distinct label" in refused[0].message
    assert await job_in(api, job["id"], "complete"), "the running job was finished and reported"
    assert [o.status for o in agent.outcomes] == ["complete"]
    assert await _node_if(api, paired["node_id"], "offline"), "the node signed off"


async def test_retiring_the_node_stops_the_agent(server, api):
    paired = await pair(server, api, "box-9")
    async with AgentClient(server.url, paired["credential"]) as client:
        agent = Agent(client, HandlerRegistry(BUILTINS), lambda: [CPU], AgentConfig(agent_version="t", claim_wait_seconds=1))
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                await eventually(lambda: _node_if(api, paired["node_id"], "online"))
                assert (await api.post(f"/v1/nodes/{paired['node_id']}/retire")).status_code == 200
    assert agent.node_status == "retired" and agent.stopping


async def test_a_job_past_its_max_runtime_is_cancelled_and_failed_for_good(server, api):
    paired = await pair(server, api, "box-10")
    async with running_agent(server, paired["credential"]):
        job = await submit(api, "sleep", {"seconds": 60}, requires={"max_runtime_s": 1}, max_attempts=3)
        failed = await eventually(lambda: job_in(api, job["id"], "failed"), timeout=15)
    assert failed["error"] == "The job exceeded its max_runtime_s." and failed["attempt"] == 1


@pytest.mark.parametrize("refused", ["result", "error"])
async def test_a_report_the_server_refuses_fails_the_job_for_good_instead_of_running_it_again(server, api, refused):
    """A result over the body limit, or a failure message over the field's length, is not left to its lease."""
    paired = await pair(server, api, f"box-refused-{refused}")
    calls: list[int] = []

    async def oversized(claim):
        calls.append(claim.attempt)
        if refused == "result":
            return {"blob": "x" * (1024 * 1024 + 10)}
        raise RuntimeError("E" * 10_001 + "\x00")

    async with running_agent(server, paired["credential"], handlers={"big": oversized}):
        job = await submit(api, "big", max_attempts=2)
        failed = await eventually(lambda: job_in(api, job["id"], "failed"), timeout=15)
    assert calls == [1] and failed["attempt"] == 1
    if refused == "result":
        assert failed["error"] == "The server refused the job's result (payload_too_large); it was not stored."
    else:
        assert failed["error"].startswith("EEEE") and failed["error"].endswith("…") and len(failed["error"]) == 4000


async def test_a_job_that_runs_out_of_time_during_a_stops_grace_fails_for_good(server, api):
    paired = await pair(server, api, "box-runtime-grace")
    started = anyio.Event()

    async def slow(claim):
        started.set()
        await anyio.sleep(60)

    async with running_agent(server, paired["credential"], handlers={"slow": slow}, grace_seconds=30.0) as agent:
        job = await submit(api, "slow", requires={"max_runtime_s": 2}, max_attempts=3)
        with anyio.fail_after(15):
            await started.wait()  # running on the agent, not only claimed: the claim's answer has arrived
        agent.stop()  # the grace (30 s) outlasts the runtime limit (2 s): the limit is what ends it
        failed = await eventually(lambda: job_in(api, job["id"], "failed"), timeout=15)
    assert failed["error"] == "The job exceeded its max_runtime_s." and failed["attempt"] == 1


async def test_a_plain_handler_cancelled_with_its_job_keeps_its_slot_until_it_returns(server, api):
    """A thread cannot be cancelled: a one-slot agent takes no other job while it still runs."""
    import threading
    import time

    paired = await pair(server, api, "box-thread")
    release = threading.Event()
    running: list[str] = []

    def blocking(claim):
        running.append(claim.job_id)
        release.wait(20)
        running.remove(claim.job_id)
        return {"done": True}

    def quick(claim):
        return {"alone": running == []}

    async with running_agent(server, paired["credential"], handlers={"blocking": blocking, "quick": quick}) as agent:
        first = await submit(api, "blocking")
        async def blocking_started():
            return running == [first["id"]]

        await eventually(blocking_started)
        assert (await api.post(f"/v1/jobs/{first['id']}/cancel")).status_code == 200
        await eventually(lambda: _has_outcome(agent, "lost"), timeout=10)
        second = await submit(api, "quick")
        await anyio.sleep(2.5)  # long enough for a free slot to claim and finish it
        assert (await job_in(api, second["id"], "queued")) is not None, "the slot waited for the thread"
        started = time.monotonic()
        release.set()
        done = await eventually(lambda: job_in(api, second["id"], "complete"), timeout=10)
    assert done["result"] == {"alone": True} and time.monotonic() - started < 10


async def test_an_idle_slot_with_a_zero_wait_polls_about_once_a_second(server, api):
    paired = await pair(server, api, "box-zero-wait")
    requests: list[str] = []

    async def count(request):
        if request.url.path == "/v1/agent/claim":
            requests.append(request.url.path)

    async with AgentClient(server.url, paired["credential"]) as client:
        client._http.event_hooks["request"].append(count)
        agent = Agent(client, HandlerRegistry(BUILTINS), lambda: [CPU], AgentConfig(agent_version="t", claim_wait_seconds=0))
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            await eventually(lambda: _node_if(api, paired["node_id"], "online"))
            before = len(requests)
            await anyio.sleep(3)
            polled = len(requests) - before
            agent.stop()
    assert 2 <= polled <= 5, polled


@pytest.mark.parametrize("verb", ["drain", "retire"])
async def test_a_drained_or_retired_nodes_beat_and_claim_are_not_refused(server, api, verb):
    """Draining and retirement are answered, not refused: no 4xx the agent would take as final."""
    paired = await pair(server, api, f"box-{verb}", devices=(CPU,))
    async with AgentClient(server.url, paired["credential"]) as node:
        await node.heartbeat(devices=[CPU], agent_version="t", agent_started_at=datetime.now(timezone.utc))
        await api.post("/v1/jobs", json={"kind": "echo", "payload": {}})
        assert (await api.post(f"/v1/nodes/{paired['node_id']}/{verb}")).status_code == 200
        answer = await node.heartbeat(devices=[CPU], agent_version="t",
                                      agent_started_at=datetime.now(timezone.utc))
        assert answer["status"] == {"drain": "draining", "retire": "retired"}[verb]
        assert await node.claim(0) is None


async def test_a_completion_whose_answer_was_lost_is_sent_again_and_answered_as_the_first(server, api):
    """The server recorded the completion; the agent, not hearing so, sends it again and is answered 200
    as the first time: the job is complete with the handler's result, its history holds one
    ``job.completed``, and the agent counts the job complete (not lost, not unreported)."""
    paired = await pair(server, api, "box-resend")
    transport = LoseAnswers(lambda request: request.url.path.endswith("/complete"))
    async with running_agent(server, paired["credential"], transport=transport) as agent:
        job = await submit(api, "echo", {"frame": 7})
        done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=15)
        await until(lambda: bool(agent.outcomes), timeout=10)
    assert transport.lost
    assert done["status"] == "complete" and done["result"] == {"frame": 7} and done["attempt"] == 1
    assert (await event_types(api, job["id"])).count("job.completed") == 1
    assert [(o.job_id, o.status) for o in agent.outcomes] == [(job["id"], "complete")]


async def test_a_completion_sent_again_runs_the_job_its_lost_answer_had_claimed(server, api):
    """``complete?claim_next=true`` completed A and claimed B for this node in the same transaction, and its
    answer was lost. The agent sends the completion again the same way, and the server answers it with the
    claim it already made: the agent runs B at once, instead of B waiting out its lease on a node that
    does not know of it (and, on its last attempt, failing without ever having run)."""
    paired = await pair(server, api, "box-lost-answer")
    first = await submit(api, "echo", {"n": "A"}, priority=1)
    second = await submit(api, "echo", {"n": "B"}, priority=2, max_attempts=1)
    transport = LoseAnswers(lambda request: request.url.path.endswith(f"/{first['id']}/complete")
                            and request.url.params.get("claim_next") == "true")  # fmt: skip
    async with running_agent(server, paired["credential"], transport=transport):
        done_a = await eventually(lambda: job_in(api, first["id"], "complete", "failed"), timeout=15)
        done_b = await eventually(lambda: job_in(api, second["id"], "complete", "failed"), timeout=20)
    assert transport.lost, "the first completion's answer was lost"
    assert done_a["status"] == "complete" and done_a["result"] == {"n": "A"}
    assert (done_b["status"], done_b["result"], done_b["error"]) == ("complete", {"n": "B"}, None), done_b


async def test_a_claim_whose_answer_was_lost_is_given_back_at_once_and_run_uncharged(server, api):
    """The server claimed the job and answered; the answer was cut off on its way. The agent never heard of
    the job, so it gives back what that claim request took (``POST /v1/agent/claim/release``, naming the
    ``X-Request-ID`` it sent): ``job.released`` (``answer_unread``), uncharged, and its next long-poll takes
    the job. A job allowed one attempt runs, instead of waiting out its lease and failing for it."""
    paired = await pair(server, api, "box-lost-claim")
    job = await submit(api, "echo", {"n": 1}, max_attempts=1)
    transport = LoseAnswers(lambda request: request.url.path == "/v1/agent/claim")
    async with running_agent(server, paired["credential"], transport=transport):
        done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=15)
    assert transport.lost
    assert (done["status"], done["result"], done["attempt"]) == ("complete", {"n": 1}, 2), done
    events = await job_events(api, job["id"])
    assert [(e["type"], e["data"].get("reason")) for e in events] == [
        ("job.submitted", None), ("job.claimed", None), ("job.released", "answer_unread"), ("job.claimed", None),
        ("job.completed", None)]
    assert events[1]["metadata"]["request_id"] != events[3]["metadata"]["request_id"]  # one id per claim request


async def test_a_completion_given_up_on_gives_back_the_job_its_lost_answer_claimed(server, api):
    """``complete?claim_next=true`` for A completes A and claims B; every answer to it (the first and each
    repeat) is lost, so the agent gives up on the report. Every attempt carried the same ``X-Request-ID``, and
    the agent gives back what that request claimed: B, allowed one attempt, goes back to the queue
    (``answer_unread``, uncharged) and runs, instead of waiting out a lease nobody renews and failing unrun."""
    paired = await pair(server, api, "box-given-up")
    first = await submit(api, "echo", {"n": "A"}, priority=1)
    second = await submit(api, "echo", {"n": "B"}, priority=2, max_attempts=1)
    transport = LoseAnswers(lambda request: request.url.path.endswith(f"/{first['id']}/complete"), times=100)
    async with running_agent(server, paired["credential"], transport=transport) as agent:
        done_b = await eventually(lambda: job_in(api, second["id"], "complete", "failed"), timeout=25)
    assert len(transport.lost) > 1, "the completion was sent again and its answers lost"
    assert [o.status for o in agent.outcomes if o.job_id == first["id"]] == ["unreported"]
    assert (await api.get(f"/v1/jobs/{first['id']}")).json()["status"] == "complete"
    assert (done_b["status"], done_b["result"], done_b["error"]) == ("complete", {"n": "B"}, None), done_b
    released = [e for e in await job_events(api, second["id"]) if e["type"] == "job.released"]
    assert [e["data"]["reason"] for e in released] == ["answer_unread"]


class HoldClaimAnswers(httpx.AsyncBaseTransport):
    """The real transport, except that a claim's answer, once the server sent it, is held back until the
    request is cancelled: the agent is stopped while the answer is on its way."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.answer_arrived = anyio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path == "/v1/agent/claim" and response.status_code == 200:
            await response.aread()
            self.answer_arrived.set()
            await anyio.sleep_forever()
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_stop_while_a_claims_answer_is_on_its_way_gives_the_claim_back(server, api):
    """A stop cancels the parked long-poll; the server had already claimed a job and sent it. The agent gives
    back what that request took before it signs off: the job is queued at once (``answer_unread``, uncharged)
    and another agent runs it, rather than the job waiting out a lease on a node that never ran it."""
    first = await pair(server, api, "box-stopping")
    other = await pair(server, api, "box-after")
    transport = HoldClaimAnswers()
    async with running_agent(server, first["credential"], transport=transport) as agent:
        job = await submit(api, "echo", {"n": 2}, max_attempts=1)
        with anyio.fail_after(10):
            await transport.answer_arrived.wait()
        agent.stop()
    given_back = (await api.get(f"/v1/jobs/{job['id']}")).json()
    assert (given_back["status"], given_back["lease_owner"], given_back["attempt"]) == ("queued", None, 1), given_back
    assert agent.outcomes == []
    assert [(e["type"], e["data"].get("reason")) for e in await job_events(api, job["id"])][-1] == (
        "job.released", "answer_unread")
    async with running_agent(server, other["credential"]):
        done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=15)
    assert (done["status"], done["placement"]["node_id"]) == ("complete", other["node_id"])


class HoldCompletionAnswers(httpx.AsyncBaseTransport):
    """The real transport, except that the first completion's answer that names a next claim is held back
    until ``release`` is set: the agent is stopped while that answer is on its way."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.answer_arrived = anyio.Event()
        self.release = anyio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        held = request.url.path.endswith("/complete") and request.url.params.get("claim_next") == "true"
        if held and not self.answer_arrived.is_set():
            await response.aread()
            if b'"next_claim":{' in response.content:
                self.answer_arrived.set()
                await self.release.wait()
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class CountClaims(httpx.AsyncBaseTransport):
    """The real transport, counting the claim requests sent."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.claims = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.claims += request.url.path == "/v1/agent/claim"
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_stopping_agent_of_more_slots_than_the_servers_burst_gives_back_every_parked_claim(server, api, db_url):
    """Each parked long-poll a stop cancels is given back by its request id (its answer may have been on its
    way). The server takes 20 such give-backs of a node at once and 5 a second after that
    (``umbra.api.rates``): the ones refused ``rate_limited`` are sent again after their ``Retry-After``,
    not dropped, so none of those requests can leave a job leased to an agent that never heard of it."""
    paired = await pair(server, api, "box-many-slots")
    transport = CountClaims()
    slots = 32
    async with running_agent(server, paired["credential"], transport=transport, concurrency=slots,
                             claim_wait_seconds=30) as agent:  # fmt: skip
        await until(lambda: transport.claims >= slots, timeout=15)
        with anyio.fail_after(30):
            agent.stop()
    async with await psycopg.AsyncConnection.connect(db_url) as conn:
        given_back = (await (await conn.execute("SELECT count(*) FROM abandoned_claim_requests WHERE node_id = %s",
                                                (paired["node_id"],))).fetchone())[0]  # fmt: skip
    assert given_back == slots


async def test_a_next_job_that_arrives_after_a_stop_is_given_back_unstarted(server, api):
    """A completion that claimed the node's next job answers after the agent began stopping: the next job is
    not started (to be cut off at the end of the grace) but given back at once, unheard (``answer_unread``,
    not charged: a job allowed one run still completes), and another agent runs it."""
    first = await pair(server, api, "box-finishing")
    other = await pair(server, api, "box-next")
    transport = HoldCompletionAnswers()
    started: list[str] = []

    async def noted(claim):
        started.append(claim.job_id)
        return {"n": claim.payload["n"]}

    async with running_agent(server, first["credential"], {"noted": noted}, transport=transport) as agent:
        batch = await api.post("/v1/jobs/batch", json={"jobs": [{"kind": "noted", "payload": {"n": n}, "max_attempts": 1}
                                                                for n in range(2)]})  # fmt: skip
        done, following = (job["id"] for job in batch.json()["jobs"])
        with anyio.fail_after(10):
            await transport.answer_arrived.wait()
        agent.stop()
        transport.release.set()
    assert started == [done], started
    assert (await api.get(f"/v1/jobs/{done}")).json()["status"] == "complete"
    back = (await api.get(f"/v1/jobs/{following}")).json()
    assert (back["status"], back["lease_owner"], back["attempt"]) == ("queued", None, 1), back
    assert [(e["type"], e["data"].get("reason")) for e in await job_events(api, following)][-1] == ("job.released", "answer_unread")
    async with running_agent(server, other["credential"], {"noted": noted}):
        ran = await eventually(lambda: job_in(api, following, "complete", "failed"), timeout=15)
    assert (ran["status"], ran["attempt"], ran["placement"]["node_id"]) == ("complete", 2, other["node_id"])


async def test_a_handler_error_naming_a_file_that_is_not_utf8_fails_the_job_and_the_agent_runs_on(server, api):
    """A message holding a lone surrogate (a file name ``os.fsdecode`` made of bytes that are not UTF-8)
    cannot be sent as JSON as it is: it is made storable, as a NUL is, and the job fails with it. Ending the
    agent instead would leave the job to its lease, to run and end the next agent that takes it."""
    name = os.fsdecode(b"clip-\xff.mp4")  # "clip-\udcff.mp4"

    def broken(claim):
        raise RuntimeError(f"cannot open {name}")

    paired = await pair(server, api, "box-surrogate")
    async with running_agent(server, paired["credential"], {"decode": broken}):
        job = await submit(api, "decode", max_attempts=1)
        failed = await eventually(lambda: job_in(api, job["id"], "failed", "complete"), timeout=15)
        after = await submit(api, "echo", {"still": "here"})
        await eventually(lambda: job_in(api, after["id"], "complete"), timeout=10)
    assert failed["status"] == "failed" and failed["error"] == "cannot open clip-\\udcff.mp4", failed


async def test_a_result_json_cannot_carry_fails_the_job_for_good_saying_why_and_the_agent_goes_on(server, api):
    """A handler returning what JSON cannot carry (an arbitrary object) fails its job for good on its first
    attempt, with a message naming the result (a rerun would return the same), and the agent runs the next job."""

    class Frame:
        pass

    calls: list[int] = []

    async def opaque(claim):
        calls.append(claim.attempt)
        return {"frame": Frame()}

    paired = await pair(server, api, "box-opaque")
    async with running_agent(server, paired["credential"], {"opaque": opaque}):
        job = await submit(api, "opaque", max_attempts=3)
        failed = await eventually(lambda: job_in(api, job["id"], "failed", "complete"), timeout=15)
        after = await submit(api, "echo", {"next": 1})
        await eventually(lambda: job_in(api, after["id"], "complete"), timeout=10)
    assert failed["status"] == "failed" and calls == [1] and failed["attempt"] == 1
    assert failed["error"].startswith("The handler's result cannot be sent as JSON"), failed["error"]


async def test_an_agent_with_n_slots_never_runs_more_than_n_jobs_at_once(server, api):
    """Two slots, five jobs queued: at most two handlers run at any moment (a completion claims one next job,
    never more), and every job completes on its first attempt."""
    running = 0
    most = 0

    async def nap(claim):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await anyio.sleep(0.6)
        finally:
            running -= 1
        return {"n": claim.payload["n"]}

    paired = await pair(server, api, "box-two-slots")
    batch = await api.post("/v1/jobs/batch", json={"jobs": [{"kind": "nap", "payload": {"n": n}} for n in range(5)]})
    ids = [job["id"] for job in batch.json()["jobs"]]
    async with running_agent(server, paired["credential"], {"nap": nap}, concurrency=2):
        done = [await eventually(lambda i=i: job_in(api, i, "complete", "failed"), timeout=20) for i in ids]
    assert most == 2, most
    assert [(j["status"], j["attempt"], j["result"]) for j in done] == [("complete", 1, {"n": n}) for n in range(5)]


async def test_a_job_given_back_at_a_stop_is_soon_run_by_another_agent(server, api):
    """Past the stop's grace the running job is given back (``job.released``, ``agent_stopping``): queued
    at once with no back-off and not charged, so even a job allowed a single attempt runs on another node
    within seconds rather than failing or waiting out a lease; the stopping agent's node signs off."""
    first = await pair(server, api, "box-stopping")
    other = await pair(server, api, "box-taking-over")
    started = anyio.Event()

    async def long(claim):
        if claim.attempt == 1:
            started.set()
            await anyio.sleep(60)
        return {"attempt": claim.attempt}

    async with running_agent(server, first["credential"], {"long": long}, grace_seconds=0.5) as agent:
        job = await submit(api, "long", max_attempts=1)
        with anyio.fail_after(10):
            await started.wait()
        agent.stop()
        given_back = await eventually(lambda: job_in(api, job["id"], "queued", "failed"), timeout=10)
    assert [o.status for o in agent.outcomes] == ["released"]
    events = (await api.get(f"/v1/jobs/{job['id']}/events")).json()["events"]
    assert [(e["type"], e["data"].get("reason")) for e in events][-1] == ("job.released", "agent_stopping")
    assert given_back["status"] == "queued" and given_back["error"] == "The agent stopped before the job finished."
    assert given_back["attempt"] == 1 and given_back["not_before"] is None  # queued at once, not charged
    assert (await api.get(f"/v1/nodes/{first['node_id']}")).json()["status"] == "offline"
    async with running_agent(server, other["credential"], {"long": long}):
        done = await eventually(lambda: job_in(api, job["id"], "complete", "failed"), timeout=15)
    assert done["status"] == "complete" and done["result"] == {"attempt": 2}
    assert done["placement"]["node_id"] == other["node_id"]
