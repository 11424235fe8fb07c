"""``GET /v1/jobs/{id}?wait=S``: a read that waits for the job to end, holding no database connection, and
``umbra jobs wait``: a submitter that wants a result asks once instead of polling."""

from __future__ import annotations

import threading
import time
import uuid

import anyio
import httpx
import pytest

from tests.conftest import LiveServer
from tests.helpers import bearer, eventually, run_umbra, until
from umbra.compute.accounts import create_api_key, create_organization, revoke_api_key

from .queue_support import http_claim, http_complete, http_pair, written
from .test_multiprocess_promises import _key_id

pytestmark = pytest.mark.anyio


async def submitted(client, key: str, kind: str = "echo", **fields) -> dict:
    answer = await client.post("/v1/jobs", json={"kind": kind, **fields}, headers=bearer(key))
    assert answer.status_code == 201, answer.text
    return answer.json()


async def waited(client, key: str, job_id: str, seconds: int, answers: list) -> None:
    """``GET /v1/jobs/{id}?wait=seconds``; appends ``(seconds taken, response)`` to ``answers``."""
    started = time.monotonic()
    answer = await client.get(f"/v1/jobs/{job_id}", params={"wait": seconds}, headers=bearer(key))
    answers.append((time.monotonic() - started, answer))


async def test_a_read_that_waits_answers_when_the_job_completes_with_its_result(client, org):
    """The reader waits while the job is queued and running; the agent's completion answers it at once (well
    before its 30 s), with the completed job and its result."""
    _, key = org
    _, credential = await http_pair(client, key)
    job = await submitted(client, key)
    answers: list = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(waited, client, key, job["id"], 30, answers)
        await anyio.sleep(0.3)
        claimed = await http_claim(client, credential)
        await anyio.sleep(0.3)
        assert not answers, "answered while the job ran"
        done = await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": claimed["attempt"],
                                 "result": {"text": "hello"}}, headers=bearer(credential))  # fmt: skip
        assert done.status_code == 200, done.text
        done_at = time.monotonic()
    [(took, answer)] = answers
    assert answer.status_code == 200, answer.text
    assert (answer.json()["status"], answer.json()["result"]) == ("complete", {"text": "hello"})
    assert took >= 0.6 and time.monotonic() - done_at < 5


async def test_a_read_that_waits_answers_a_failure_a_cancel_and_a_job_already_ended_at_once(client, org):
    """Ended otherwise is ended: a cancel answers the waiting read with the cancelled job; a read of a job
    that already ended does not wait at all."""
    _, key = org
    job = await submitted(client, key)
    answers: list = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(waited, client, key, job["id"], 30, answers)
        await anyio.sleep(0.3)
        assert (await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(key))).status_code == 200
    [(took, answer)] = answers
    assert answer.json()["status"] == "cancelled" and took < 10
    started = time.monotonic()
    again = await client.get(f"/v1/jobs/{job['id']}", params={"wait": 30}, headers=bearer(key))
    assert again.json()["status"] == "cancelled" and time.monotonic() - started < 5


async def test_a_read_that_waits_answers_the_job_as_it_stands_when_its_time_runs_out(client, org):
    """No node: after ``wait`` seconds the answer is the job still waiting (blocked: nothing could run it), 200;
    the client reads its status."""
    _, key = org
    job = await submitted(client, key)
    answers: list = []
    await waited(client, key, job["id"], 1, answers)
    [(took, answer)] = answers
    assert answer.status_code == 200 and answer.json()["status"] == "blocked"
    assert 0.9 <= took < 10


async def test_waiting_reads_hold_no_connection_and_each_wakes_for_its_own_job(db_url, org):
    """A server with four pooled connections: 24 reads wait on 24 jobs while other requests are answered; the
    jobs completed one by one each answer their own reader, the others still waiting."""
    _, key = org
    with LiveServer(db_url, UMBRA_POOL_SIZE="4") as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            _, credential = await http_pair(client, key)
            jobs = [await submitted(client, key) for _ in range(24)]
            answers: dict[str, dict] = {}

            async def read(job_id: str) -> None:
                answer = await client.get(f"/v1/jobs/{job_id}", params={"wait": 30}, headers=bearer(key))
                answers[job_id] = answer.json()

            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(read, job["id"])
                await anyio.sleep(0.5)
                with anyio.fail_after(5):  # four connections, 24 parked reads: the pool is free all the same
                    listed = await client.get("/v1/jobs", headers=bearer(key))
                assert listed.status_code == 200 and not answers
                assert await _parked(client, 24)
                for done in range(1, 4):
                    claimed = await http_claim(client, credential)
                    await http_complete(client, credential, claimed)
                    with anyio.fail_after(5):
                        while claimed["id"] not in answers:
                            await anyio.sleep(0.02)
                    assert len(answers) == done and answers[claimed["id"]]["status"] == "complete"
                tg.cancel_scope.cancel()  # the other 21 readers hang up: their waits end with them
            async with httpx.AsyncClient(base_url=live.url, timeout=30) as scraper:
                assert await eventually(lambda: _parked(scraper, 0))


async def _parked(client, count: int) -> bool:
    return f"umbra_job_reads_waiting {float(count)}" in (await client.get("/metrics")).text


async def test_refusals_of_a_waiting_read_are_at_once_and_write_nothing(client, org, conn, db_url):
    """``wait`` outside 0..60 → 422 (``field``: wait); with ``as_of`` → 422 (a past state never changes);
    another organization's job → 404 at once, not after the wait."""
    _, key = org
    job = await submitted(client, key)
    before = await written(db_url)
    for params in ({"wait": 61}, {"wait": -1}, {"wait": "soon"}, {"wait": 5, "as_of": 1}):
        answer = await client.get(f"/v1/jobs/{job['id']}", params=params, headers=bearer(key))
        assert answer.status_code == 422 and answer.json()["field"] == "wait", (params, answer.text)
    _, other_key = await create_organization(conn, "other")
    started = time.monotonic()
    foreign = await client.get(f"/v1/jobs/{job['id']}", params={"wait": 30}, headers=bearer(other_key))
    assert foreign.status_code == 404 and foreign.json()["error"] == "job_not_found"
    assert time.monotonic() - started < 5
    assert await written(db_url) == before


async def test_a_key_revoked_while_its_read_waits_is_refused_the_answer(client, org, conn):
    """The job is read again, by a credential checked again, once it ends: a key revoked meanwhile gets 401,
    not the job."""
    org_id, key = org
    reader = await create_api_key(conn, org_id, ["jobs:read"])
    job = await submitted(client, key)
    answers: list = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(waited, client, reader, job["id"], 30, answers)
        await anyio.sleep(0.3)
        await revoke_api_key(conn, org_id, await _key_id(conn, reader))
        assert (await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(key))).status_code == 200
    [(_, answer)] = answers
    assert answer.status_code == 401, answer.text


async def test_the_cli_waits_for_a_job_and_exits_by_how_it_ended(client, org, live_server):
    """``umbra jobs wait ID``: 0 once it completed (its result shown), 3 once it failed, 124 when ``--timeout``
    passed first (the job shown as it stands), 1 when it cannot tell (no such job), 2 for a bad flag."""
    _, key = org
    _, credential = await http_pair(client, key)

    def umbra(*args: str):
        return run_umbra("jobs", "wait", *args, "--server", live_server.url, env={"UMBRA_API_KEY": key})

    good, bad, idle = [await submitted(client, key, kind) for kind in ("good", "bad", "idle")]
    for job, outcome in ((good, "complete"), (bad, "fail")):
        claimed = await http_claim(client, credential)
        assert claimed["id"] == job["id"]
        body = {"attempt": claimed["attempt"], **({"result": {"n": 7}} if outcome == "complete" else {"error": "no", "retry": False})}
        async with anyio.create_task_group() as tg:
            finished: list = []

            async def wait_in_shell(job_id: str = job["id"]) -> None:
                finished.append(await anyio.to_thread.run_sync(lambda: umbra(job_id)))

            tg.start_soon(wait_in_shell)
            await anyio.sleep(1.0)
            assert not finished
            assert (await client.post(f"/v1/agent/jobs/{job['id']}/{outcome}", json=body,
                                      headers=bearer(credential))).status_code == 200  # fmt: skip
        [shown] = finished
        if outcome == "complete":
            assert shown.returncode == 0 and 'result: {"n":7}' in shown.stdout, (shown.stdout, shown.stderr)
        else:
            assert shown.returncode == 3 and "error: no" in shown.stdout, (shown.stdout, shown.stderr)
    late = await anyio.to_thread.run_sync(lambda: umbra(idle["id"], "--timeout", "1", "--json"))
    assert late.returncode == 124 and "1 of 1 job(s) still open after 1 s (queued)" in late.stderr, late.stderr
    assert '"status": "queued"' in late.stdout or '"status":"queued"' in late.stdout
    refused = await anyio.to_thread.run_sync(lambda: umbra(idle["id"], "--timeout", "-1"))
    assert refused.returncode == 2
    missing = await anyio.to_thread.run_sync(lambda: umbra(str(uuid.uuid4())))
    assert missing.returncode == 1 and "job_not_found" in missing.stderr, (missing.stdout, missing.stderr)


async def test_the_cli_waits_for_several_jobs_until_the_last_ends(client, org, live_server):
    """``umbra jobs wait A B C`` (what ``$(umbra jobs submit ... --count 3)`` gives it): it returns once all
    three completed, whatever order they end in, a line each; one of them still open at ``--timeout``: 124."""
    _, key = org
    _, credential = await http_pair(client, key)
    many = [await submitted(client, key, "many") for _ in range(3)]
    finished: list = []

    async def wait_in_shell(*args: str) -> None:
        finished.append(await anyio.to_thread.run_sync(lambda: run_umbra(
            "jobs", "wait", *args, "--server", live_server.url, env={"UMBRA_API_KEY": key})))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_in_shell, *(job["id"] for job in many))
        claimed = [await http_claim(client, credential) for _ in many]
        for job in reversed(claimed):  # the last first: the run waits on the first all the while
            await anyio.sleep(0.5)
            assert not finished
            await http_complete(client, credential, job)
    [shown] = finished
    assert shown.returncode == 0, (shown.stdout, shown.stderr)
    assert [line.split()[:2] for line in shown.stdout.splitlines()] == [[job["id"], "complete"] for job in many]
    open_ = await submitted(client, key, "many")
    await wait_in_shell(many[0]["id"], open_["id"], "--timeout", "1")
    assert finished[-1].returncode == 124 and "1 of 2 job(s) still open after 1 s (queued)" in finished[-1].stderr



async def test_the_cli_with_fail_fast_returns_at_the_first_failure_showing_the_others_as_they_stand(client, org, live_server):
    """``umbra jobs wait A B --fail-fast``: B fails while A still runs: it exits 3 at once (the jobs are waited
    for together, not A first), A shown running, B failed; without the flag it would wait for A too."""
    _, key = org
    _, credential = await http_pair(client, key)
    a, b = [await submitted(client, key, "pair") for _ in range(2)]
    running, failing = [await http_claim(client, credential) for _ in range(2)]
    assert (running["id"], failing["id"]) == (a["id"], b["id"])
    finished: list = []

    async def wait_in_shell(*args: str) -> None:
        finished.append(await anyio.to_thread.run_sync(lambda: run_umbra(
            "jobs", "wait", a["id"], b["id"], *args, "--server", live_server.url, env={"UMBRA_API_KEY": key})))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_in_shell, "--fail-fast")
        tg.start_soon(wait_in_shell, "--timeout", "4")
        await anyio.sleep(1.0)
        assert not finished
        answer = await client.post(f"/v1/agent/jobs/{b['id']}/fail", json={"attempt": failing["attempt"], "error": "no",
                                   "retry": False}, headers=bearer(credential))  # fmt: skip
        assert answer.status_code == 200, answer.text
        await until(lambda: finished, timeout=3)
        [fast] = finished
        assert fast.returncode == 3, (fast.stdout, fast.stderr)
        assert [line.split()[:2] for line in fast.stdout.splitlines()] == [[a["id"], "running"], [b["id"], "failed"]]
    patient = finished[1]  # waited on for A until its timeout: B's failure still decides the exit
    assert patient.returncode == 3 and [line.split()[1] for line in patient.stdout.splitlines()] == ["running", "failed"]


async def test_waiting_for_more_jobs_than_it_waits_for_at_once_waits_for_each(client, org, live_server, monkeypatch):
    """``wait_for_all`` with two waits at a time and five jobs: each is waited for in its turn and all are
    returned in the order given, a job named twice once waited for; an unknown job is raised as it is."""
    from umbra import cli_jobs
    from umbra.agent.client import ServiceError

    monkeypatch.setattr(cli_jobs, "WAITS_AT_ONCE", 2)
    _, key = org
    _, credential = await http_pair(client, key)
    jobs = [await submitted(client, key, "five") for _ in range(5)]
    async with httpx.AsyncClient(base_url=live_server.url, headers=bearer(key), timeout=30) as reader:
        async with anyio.create_task_group() as tg:
            got: list = []

            async def wait() -> None:
                got.append(await cli_jobs.wait_for_all(reader, [j["id"] for j in jobs] + [jobs[0]["id"]], 20))

            tg.start_soon(wait)
            for _ in jobs:
                await http_complete(client, credential, await http_claim(client, credential))
        [ended] = got
        assert [(j["id"], j["status"]) for j in ended] == [(j["id"], "complete") for j in jobs + [jobs[0]]]
        with pytest.raises(ServiceError) as refused:
            await cli_jobs.wait_for_all(reader, [jobs[0]["id"], str(uuid.uuid4())], 5)
        assert refused.value.status == 404


async def test_with_more_jobs_than_reads_at_once_each_is_asked_about_at_once_and_the_deadline_holds(
    client, org, live_server, monkeypatch
):
    """Two reads waiting at a time: an unknown job named last is told at once (404), not once a wait ends; a
    cancelled job named last stops ``fail_fast`` at once; seven open jobs (one named twice) with 1.5 s for all
    are answered at about 1.5 s, as they stand, in the order given; no read stays parked on the server."""
    from umbra import cli_jobs
    from umbra.agent.client import ServiceError

    monkeypatch.setattr(cli_jobs, "WAITS_AT_ONCE", 2)
    _, key = org
    jobs = [await submitted(client, key) for _ in range(7)]
    ids = [job["id"] for job in jobs]
    async with httpx.AsyncClient(base_url=live_server.url, headers=bearer(key), timeout=30) as reader:
        started = time.monotonic()
        with pytest.raises(ServiceError) as refused:
            await cli_jobs.wait_for_all(reader, [*ids[:3], str(uuid.uuid4())], 6)
        assert refused.value.status == 404 and time.monotonic() - started < 2
        assert (await client.post(f"/v1/jobs/{ids[6]}/cancel", headers=bearer(key))).status_code == 200
        started = time.monotonic()
        got = await cli_jobs.wait_for_all(reader, ids[4:], 6, fail_fast=True)
        assert [j["status"] for j in got] == ["blocked", "blocked", "cancelled"] and time.monotonic() - started < 2
        started = time.monotonic()
        got = await cli_jobs.wait_for_all(reader, [*ids[:6], ids[3]], 1.5)
        took = time.monotonic() - started
    assert [j["id"] for j in got] == [*ids[:6], ids[3]] and {j["status"] for j in got} == {"blocked"}
    assert 1.5 <= took < 2.5, took
    assert await eventually(lambda: _waits(live_server, 0), timeout=5)


async def test_reads_that_do_not_wait_take_turns_too_so_many_jobs_keep_to_the_deadline(client, org, live_server, monkeypatch):
    """Two reads at a time: nine open jobs with 1.5 s for all are looked at two at a time beside the two reads
    that wait (their first look, and the look at the deadline of those that found no turn), never all at once.
    A thousand jobs looked at all at once queued a thousand requests on the client's pool (its hand-out is
    quadratic in the queue): ``umbra jobs wait --timeout 3`` answered after 35-45 s, or gave up on a pool timeout
    (exit 1)."""
    from umbra import cli_jobs

    monkeypatch.setattr(cli_jobs, "WAITS_AT_ONCE", 2)
    _, key = org
    ids = [(await submitted(client, key))["id"] for _ in range(9)]
    in_flight, most = [0], [0]

    async def sent(_request) -> None:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])

    async def answered(_response) -> None:
        in_flight[0] -= 1

    async with httpx.AsyncClient(base_url=live_server.url, headers=bearer(key), timeout=30,
                                 event_hooks={"request": [sent], "response": [answered]}) as reader:  # fmt: skip
        started = time.monotonic()
        got = await cli_jobs.wait_for_all(reader, ids, 1.5)
        took = time.monotonic() - started
    assert [j["id"] for j in got] == ids and {j["status"] for j in got} == {"blocked"}
    assert most[0] <= 4, most[0]
    assert 1.5 <= took < 4, took  # the deadline kept (its last looks take turns too); all at once, it was not


class StoppingServer(LiveServer):
    """A live server run by ``umbra serve``'s own :class:`umbra.api.server.Server`, which answers parked requests
    when it begins to stop (a plain uvicorn server waits for them), on ``port`` if given (a restart)."""

    def __init__(self, db_url: str, port: int | None = None) -> None:
        super().__init__(db_url)
        from umbra.api.server import Server, config

        if port is not None:
            self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.server = Server(config(self.app, host="127.0.0.1", port=self.port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)


async def test_the_cli_waits_through_a_server_restart_and_reports_how_the_job_ended(db_url, org):
    """The server stops while ``umbra jobs wait`` waits: its read is answered at once (the job still queued),
    the CLI finds no server and asks again, backing off, until one answers on the same address; the job
    cancelled there, it exits 3, not 1 (which would say it could not tell)."""
    _, key = org
    first = StoppingServer(db_url).__enter__()
    async with httpx.AsyncClient(base_url=first.url, timeout=30) as client:
        job = await submitted(client, key)
    finished: list = []

    async def wait_in_shell() -> None:
        finished.append(await anyio.to_thread.run_sync(
            lambda: run_umbra("jobs", "wait", job["id"], "--server", first.url, env={"UMBRA_API_KEY": key})))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_in_shell)
        assert await eventually(lambda: _waits(first, 1), timeout=20)
        stopped_at = time.monotonic()
        first.server.should_exit = True
        await anyio.to_thread.run_sync(first.thread.join, 15)
        assert not first.thread.is_alive() and time.monotonic() - stopped_at < 10
        await anyio.sleep(1.0)  # nothing answers on its address meanwhile
        with StoppingServer(db_url, port=first.port) as second:
            assert await eventually(lambda: _waits(second, 1), timeout=20)
            async with httpx.AsyncClient(base_url=second.url, timeout=30) as client:
                assert (await client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(key))).status_code == 200
            with anyio.fail_after(15):
                while not finished:
                    await anyio.sleep(0.05)
    [shown] = finished
    assert shown.returncode == 3 and "cancelled" in shown.stdout, (shown.returncode, shown.stdout, shown.stderr)


async def _waits(server: LiveServer, count: int) -> bool:
    return server.app.state.job_waits.waiting() == count


async def test_waiting_in_the_shell_keeps_to_a_timeout_under_a_second_and_never_asks_in_a_loop(client, org):
    """``--timeout 0.3`` answers after 0.3 s, not after the whole second a ``wait`` asks for at least; a server
    that answers at once with the job still open (one without ``?wait=``) is asked about once a second, not
    thousands of times."""
    from umbra.cli_jobs import wait_for_end

    _, key = org
    job = await submitted(client, key)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=str(client.base_url), headers=bearer(key), timeout=30) as shell:
        shown = await wait_for_end(shell, job["id"], 0.3)
    assert shown["status"] == "blocked" and 0.3 <= time.monotonic() - started < 0.8
    asked: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        return httpx.Response(200, json={"id": job["id"], "status": "queued"})

    async with httpx.AsyncClient(base_url="http://umbra.test", transport=httpx.MockTransport(answer)) as shell:
        shown = await wait_for_end(shell, job["id"], 2.5)
    assert shown["status"] == "queued" and 2 <= len(asked) <= 5, len(asked)
