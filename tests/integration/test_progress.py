"""A running job's progress: said by its agent with a renewal (``progress`` on ``POST
/v1/agent/jobs/{id}/renew``), kept in the renewal's event, shown on the Job until the next; a new run
starts without it."""

from __future__ import annotations

import contextlib

import anyio
import httpx
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually
from umbra.agent.client import AgentClient
from umbra.agent.handlers import BUILTINS, HandlerRegistry
from umbra.agent.runner import Agent, AgentConfig

from .queue_support import CPU64, CPU64_JSON, http_claim, http_pair, written

pytestmark = pytest.mark.anyio


async def test_progress_said_with_a_renewal_is_on_the_job_and_in_its_history_until_the_next_run(client, org, db_url):
    """Said, it shows on the Job and in ``job.lease_renewed``; a renewal that says nothing leaves it; a
    requeue and a new claim start the run without it. The views agree with the log throughout."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "render"}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    renew = f"/v1/agent/jobs/{job['id']}/renew"
    said = {"fraction": 0.4, "message": "epoch 4 of 10"}
    answer = await client.post(renew, json={"attempt": held["attempt"], "progress": said}, headers=bearer(credential))
    assert answer.status_code == 200, answer.text
    read = lambda: client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))  # noqa: E731
    assert (await read()).json()["progress"] == said
    assert (await client.post(renew, json={"attempt": held["attempt"]}, headers=bearer(credential))).status_code == 200
    assert (await read()).json()["progress"] == said
    only = {"message": "writing checkpoint"}
    await client.post(renew, json={"attempt": held["attempt"], "progress": only}, headers=bearer(credential))
    assert (await read()).json()["progress"] == only
    await client.post(renew, json={"attempt": held["attempt"], "progress": {}}, headers=bearer(credential))
    assert (await read()).json()["progress"] == only  # an empty object says nothing
    history = (await client.get(f"/v1/jobs/{job['id']}/events", headers=bearer(key))).json()["events"]
    renewals = [e["data"].get("progress") for e in history if e["type"] == "job.lease_renewed"]
    assert renewals == [said, None, only, None]
    failed = await client.post(f"/v1/agent/jobs/{job['id']}/fail", json={"attempt": held["attempt"], "error": "oom"},
                               headers=bearer(credential))  # fmt: skip
    assert failed.json()["status"] == "queued" and failed.json()["progress"] == only  # the last run's last word
    verified = await client.post("/v1/projections/verify", headers=bearer(key))
    assert verified.json() == {"ok": True, "differences": []}, verified.text


async def test_a_new_claim_starts_its_run_without_the_last_runs_progress(client, org):
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "render"}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    await client.post(f"/v1/agent/jobs/{job['id']}/renew", json={"attempt": held["attempt"], "progress": {"fraction": 1}},
                      headers=bearer(credential))  # fmt: skip
    given_back = await client.post(f"/v1/agent/jobs/{job['id']}/release", json={"attempt": held["attempt"]},
                                   headers=bearer(credential))  # fmt: skip
    assert given_back.status_code == 200, given_back.text
    again = await http_claim(client, credential)
    assert (again["id"], again["attempt"], again["progress"]) == (job["id"], held["attempt"] + 1, None)


async def test_progress_not_as_the_contract_says_is_refused_and_writes_nothing(client, org, db_url):
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "render"}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    before = await written(db_url, "jobs WHERE progress IS NOT NULL")
    for bad, field in (({"fraction": 1.5}, "progress.fraction"), ({"fraction": -0.1}, "progress.fraction"),
                       ({"fraction": "half"}, "progress.fraction"), ({"message": "x" * 501}, "progress.message"),
                       ({"percent": 40}, None), ("40%", "progress")):  # fmt: skip
        refused = await client.post(f"/v1/agent/jobs/{job['id']}/renew", json={"attempt": held["attempt"], "progress": bad},
                                    headers=bearer(credential))  # fmt: skip
        assert (refused.status_code, refused.json()["error"]) == (422, "invalid_request"), (bad, refused.text)
        assert field is None or refused.json().get("field") == field, (bad, refused.json())
    assert await written(db_url, "jobs WHERE progress IS NOT NULL") == before


async def _run_one(db_url, key, say, *, client_cls=AgentClient) -> tuple[dict, dict]:
    """A live agent runs one ``train`` job whose handler calls ``say(claim)`` and then waits: the job as shown once
    it shows progress, and as it ends."""
    gate = anyio.Event()

    async def train(claim):
        said = say(claim)
        if said is not None:
            await said
        await gate.wait()
        return {"epochs": 10}

    async with _one_train_job(db_url, key, train, lease_seconds=3, client_cls=client_cls, grace_seconds=5.0) as (client, job):

        async def shows(check):
            shown = (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()
            return shown if check(shown) else None

        running = await eventually(lambda: shows(lambda j: j["progress"]), timeout=10)
        gate.set()
        done = await eventually(lambda: shows(lambda j: j["status"] not in ("queued", "running")), timeout=10)
    return running, done


@contextlib.asynccontextmanager
async def _one_train_job(db_url, key, train, *, lease_seconds: int, client_cls=AgentClient, **config):
    """A live server with a lease of ``lease_seconds``, one ``train`` job, and an agent running ``train`` for it
    (``config``: more of its :class:`AgentConfig`): the API client and the job, while the agent runs; the
    agent is stopped after."""
    with LiveServer(db_url, UMBRA_LEASE_SECONDS=str(lease_seconds)) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            _, credential = await http_pair(client, key, "trainer", [CPU64_JSON])
            job = (await client.post("/v1/jobs", json={"kind": "train"}, headers=bearer(key))).json()
            async with client_cls(server.url, credential) as agent_client, anyio.create_task_group() as tg:
                agent = Agent(agent_client, HandlerRegistry({**BUILTINS, "train": train}), lambda: [CPU64],
                              AgentConfig(agent_version="test-1", claim_wait_seconds=2.0, **config))  # fmt: skip
                await tg.start(agent.run)
                try:
                    yield client, job
                finally:
                    agent.stop()


async def test_a_handler_reports_progress_and_the_job_shows_it_while_it_runs(db_url, org):
    """``claim.report_progress`` from a running handler: the lease's next renewal carries it to the Job."""
    running, done = await _run_one(db_url, org[1], lambda claim: claim.report_progress(0.5, "epoch 5 of 10"))
    assert (running["status"], running["progress"]) == ("running", {"fraction": 0.5, "message": "epoch 5 of 10"})
    assert (done["status"], done["attempt"], done["result"]) == ("complete", 1, {"epochs": 10})


async def test_a_message_the_server_could_not_store_is_made_storable_and_never_costs_the_run(db_url, org):
    """A NUL (PostgreSQL cannot store it) and a lone surrogate (a file name ``os.fsdecode`` made of bytes that
    are not UTF-8; JSON cannot carry it): the renewal once failed (422, or an encoding error in the renewal
    task) and the agent gave the job up, to run again at the next attempt."""
    running, done = await _run_one(db_url, org[1], lambda claim: claim.report_progress(0.5, "read a\x00b, \udcff.bin"))
    assert running["progress"] == {"fraction": 0.5, "message": "read a\ufffdb, \\udcff.bin"}
    assert (done["status"], done["attempt"]) == ("complete", 1)


class RefusedProgress(AgentClient):
    """Sends its first progress as the server will not take it (a server that takes none would refuse it too)."""

    spoiled = False

    async def renew(self, job_id, attempt, *, progress=None):
        if progress is not None and not RefusedProgress.spoiled:
            RefusedProgress.spoiled = True
            progress = {**progress, "fraction": 2}
        return await super().renew(job_id, attempt, progress=progress)


async def test_a_renewal_whose_progress_is_refused_renews_without_it_and_the_job_runs_on(db_url, org):
    """What it said is dropped, not the lease: the job runs on at its attempt, and what it says next shows."""

    async def say(claim):
        claim.report_progress(0.1, "starting")  # sent spoiled: refused
        await anyio.sleep(1.5)  # past the renewal after the refusal
        claim.report_progress(0.2, "going")

    running, done = await _run_one(db_url, org[1], say, client_cls=RefusedProgress)
    assert RefusedProgress.spoiled and running["progress"] == {"fraction": 0.2, "message": "going"}
    assert (done["status"], done["attempt"]) == ("complete", 1), done


async def test_progress_reaches_the_job_within_progress_seconds_not_at_the_leases_next_renewal(db_url, org):
    """A 60 s lease renews every 20 s; with ``progress_seconds`` 0.5, each thing the handler says reaches the Job
    within a few seconds, with a renewal of its own, and a handler that says nothing more renews no more."""
    key = org[1]
    said_next = anyio.Event()
    gate = anyio.Event()

    async def train(claim):
        claim.report_progress(0.25, "epoch 1 of 4")
        await said_next.wait()
        claim.report_progress(0.5, "epoch 2 of 4")
        await gate.wait()
        return {}

    async with _one_train_job(db_url, key, train, lease_seconds=60, progress_seconds=0.5) as (client, job):

        async def progress() -> dict | None:
            return (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()["progress"]

        assert await eventually(progress, timeout=5) == {"fraction": 0.25, "message": "epoch 1 of 4"}
        said_next.set()
        await eventually(lambda: _said(progress, 0.5), timeout=5)
        await anyio.sleep(2)  # four more looks at what was said: nothing new, nothing sent
        history = (await client.get(f"/v1/jobs/{job['id']}/events", headers=bearer(key))).json()["events"]
        assert [e["type"] for e in history].count("job.lease_renewed") == 2, history
        gate.set()

        async def completed() -> bool:
            return (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()["status"] == "complete"

        await eventually(completed, timeout=10)


async def _said(progress, fraction: float) -> dict | None:
    shown = await progress()
    return shown if shown and shown.get("fraction") == fraction else None


class _Recording(AgentClient):
    """The real client, noting when each renewal was sent and whether it carried progress."""

    calls: list[tuple[float, bool]] = []

    async def renew(self, job_id, attempt, *, progress=None):
        type(self).calls.append((anyio.current_time(), progress is not None))
        return await super().renew(job_id, attempt, progress=progress)


def _reporting_at_every_step(gate: anyio.Event, pause: float):
    """A handler that reports its progress every ``pause`` seconds until ``gate`` is set."""

    async def train(claim):
        step = 0
        while not gate.is_set():
            step += 1
            claim.report_progress(min(1.0, step / 10_000), f"step {step}")
            await anyio.sleep(pause)
        return {}

    return train


async def _until_ended(client, key, job, gate: anyio.Event) -> dict:
    gate.set()

    async def ended():
        shown = (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()
        return shown if shown["status"] not in ("queued", "running") else None

    return await eventually(ended, timeout=15)


async def test_a_handler_reporting_in_a_tight_loop_renews_no_more_often_than_progress_seconds(db_url, org):
    class Calls(_Recording):
        calls = []

    gate = anyio.Event()
    train = _reporting_at_every_step(gate, 0.005)

    async with _one_train_job(db_url, org[1], train, lease_seconds=60, client_cls=Calls, progress_seconds=0.5) as (client, job):
        await anyio.sleep(3.2)
        done = await _until_ended(client, org[1], job, gate)
    times = [t for t, _ in Calls.calls]
    assert 4 <= len(times) <= 8 and min(b - a for a, b in zip(times, times[1:])) >= 0.45, Calls.calls
    assert (done["status"], done["attempt"]) == ("complete", 1)


async def test_a_renewal_refused_with_retry_after_is_sent_again_no_sooner_though_progress_waits(db_url, org):
    """A proxy answers the first renewal (carrying progress) 429 with ``Retry-After: 3``: the progress left unsent
    does not cut the wait short."""
    from umbra.agent.client import ServiceError

    class Throttled(_Recording):
        calls = []

        async def renew(self, job_id, attempt, *, progress=None):
            type(self).calls.append((anyio.current_time(), progress is not None))
            if len(type(self).calls) == 1:
                raise ServiceError(429, "rate_limited", "Too many requests.", retry_after=3.0)
            return await AgentClient.renew(self, job_id, attempt, progress=progress)

    gate = anyio.Event()

    async def train(claim):
        claim.report_progress(0.1, "starting")
        await gate.wait()
        return {}

    async with _one_train_job(db_url, org[1], train, lease_seconds=60, client_cls=Throttled, progress_seconds=0.5) as (client, job):

        async def progress():
            return (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(org[1]))).json()["progress"]

        await eventually(progress, timeout=10)
        done = await _until_ended(client, org[1], job, gate)
    (first, _), (second, _) = Throttled.calls[:2]
    assert second - first >= 2.9 and (done["status"], done["attempt"]) == ("complete", 1)


async def test_a_server_refusing_every_progress_still_has_the_lease_renewed_while_a_handler_reports_at_every_step(db_url, org):
    """Every renewal carrying progress refused (422, as a server that takes none): the one after each goes without
    it, so the 3 s lease holds and the job completes at its first attempt; after a few refusals in a row the run
    sends none."""

    class OlderServer(_Recording):
        calls = []

        async def renew(self, job_id, attempt, *, progress=None):
            return await super().renew(job_id, attempt, progress=None if progress is None else {**progress, "fraction": 2})

    gate = anyio.Event()
    train = _reporting_at_every_step(gate, 0.01)

    async with _one_train_job(db_url, org[1], train, lease_seconds=3, client_cls=OlderServer, progress_seconds=1.0) as (client, job):
        await anyio.sleep(6)
        done = await _until_ended(client, org[1], job, gate)
    assert (done["status"], done["attempt"]) == ("complete", 1), done
    assert sum(1 for _, carried in OlderServer.calls if carried) == 3, OlderServer.calls
