"""``umbra jobs submit|list|show``, ``cancel ID`` and ``cancel-waiting [--kind K]``: jobs from the shell,
through the API with an API key."""

from __future__ import annotations

import json

import anyio
import psycopg
import pytest

from tests.helpers import bearer, run_umbra

from .queue_support import http_claim, http_pair

pytestmark = pytest.mark.anyio


async def test_the_cli_cancels_one_job_and_every_waiting_job_of_a_kind_leaving_running_work_alone(client, org, live_server):
    """``cancel-waiting --kind render`` cancels the queued render jobs, in submission order, and leaves the
    running render job, the other kind's job and the job already cancelled (by ``cancel ID``) as they are."""
    _, key = org
    _, credential = await http_pair(client, key)

    async def submitted(kind: str) -> dict:
        return (await client.post("/v1/jobs", json={"kind": kind}, headers=bearer(key))).json()

    running = await submitted("render")
    assert (await http_claim(client, credential))["id"] == running["id"]
    waiting = [await submitted("render") for _ in range(3)]
    other = await submitted("encode")

    def umbra(*args: str):
        return run_umbra("jobs", *args, "--server", live_server.url, env={"UMBRA_API_KEY": key})

    one = await anyio.to_thread.run_sync(lambda: umbra("cancel", waiting[0]["id"]))
    assert one.returncode == 0 and one.stdout.split()[:2] == [waiting[0]["id"], "cancelled"], (one.stdout, one.stderr)
    again = await anyio.to_thread.run_sync(lambda: umbra("cancel", waiting[0]["id"]))
    assert again.returncode != 0 and "job_terminal" in again.stderr, (again.stdout, again.stderr)
    every = await anyio.to_thread.run_sync(lambda: umbra("cancel-waiting", "--kind", "render", "--json"))
    assert every.returncode == 0, every.stderr
    assert json.loads(every.stdout) == {"cancelled": [job["id"] for job in waiting[1:]], "refused": []}, every.stdout
    statuses = {job["id"]: (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()["status"]
                for job in [running, *waiting, other]}  # fmt: skip
    assert [statuses[job["id"]] for job in (running, *waiting, other)] == ["running", *["cancelled"] * 3, "queued"]
    plain = await anyio.to_thread.run_sync(lambda: umbra("cancel-waiting"))
    assert plain.returncode == 0 and plain.stdout.splitlines()[-1] == "cancelled 1 of 1 queued or blocked job(s)", plain.stdout


async def test_a_cancel_if_waiting_refuses_a_running_job_and_writes_nothing(client, org, db_url):
    """``?if_waiting=true`` (what ``cancel-waiting`` sends): a job claimed after it was listed is not stopped;
    409 ``job_running``, nothing written. A waiting job is cancelled as without it."""
    _, key = org
    _, credential = await http_pair(client, key)
    running = (await client.post("/v1/jobs", json={"kind": "render"}, headers=bearer(key))).json()
    assert (await http_claim(client, credential))["id"] == running["id"]
    waiting = (await client.post("/v1/jobs", json={"kind": "render"}, headers=bearer(key))).json()
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        before = await (await c.execute("SELECT count(*) FROM events")).fetchone()
    refused = await client.post(f"/v1/jobs/{running['id']}/cancel", params={"if_waiting": "true"}, headers=bearer(key))
    assert (refused.status_code, refused.json()["error"], refused.json()["status"]) == (409, "job_running", "running")
    async with await psycopg.AsyncConnection.connect(db_url) as c:
        assert await (await c.execute("SELECT count(*) FROM events")).fetchone() == before
    cancelled = await client.post(f"/v1/jobs/{waiting['id']}/cancel", params={"if_waiting": "true"}, headers=bearer(key))
    assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")
    bad = await client.post(f"/v1/jobs/{waiting['id']}/cancel", params={"if_waiting": "perhaps"}, headers=bearer(key))
    assert (bad.status_code, bad.json()["field"]) == (422, "if_waiting")


async def test_the_cli_submits_lists_and_shows_jobs(client, org, live_server):
    """``submit`` (one, or ``--count`` as one batch) prints the ids; ``list`` shows them filtered, in submission
    order; ``show`` says where one stands. A payload that is not a JSON object is refused before anything is
    sent."""
    _, key = org

    def umbra(*args: str):
        return run_umbra("jobs", *args, "--server", live_server.url, env={"UMBRA_API_KEY": key})

    one = await anyio.to_thread.run_sync(lambda: umbra("submit", "sleep", "--payload", '{"seconds": 3}', "--priority", "7",
                                                       "--requires", '{"ram_min_mb": 64}'))  # fmt: skip
    assert one.returncode == 0, one.stderr
    [first] = one.stdout.split()
    many = await anyio.to_thread.run_sync(lambda: umbra("submit", "echo", "--count", "3"))
    assert many.returncode == 0 and len(many.stdout.split()) == 3, (many.stdout, many.stderr)
    job = (await client.get(f"/v1/jobs/{first}", headers=bearer(key))).json()
    assert (job["kind"], job["payload"], job["priority"], job["requires"]["ram_min_mb"]) == ("sleep", {"seconds": 3}, 7, 64)
    listed = await anyio.to_thread.run_sync(lambda: umbra("list", "--kind", "echo", "--json"))
    assert [j["id"] for j in json.loads(listed.stdout)] == many.stdout.split(), listed.stdout
    shown = await anyio.to_thread.run_sync(lambda: umbra("show", first))
    assert shown.returncode == 0 and shown.stdout.splitlines()[0].split()[:4] == [first, "sleep", job["status"], "priority"]
    bad = await anyio.to_thread.run_sync(lambda: umbra("submit", "sleep", "--payload", "[1, 2]"))
    assert bad.returncode != 0 and "JSON object" in bad.stderr, bad.stderr
    assert len((await client.get("/v1/jobs", headers=bearer(key))).json()["jobs"]) == 4
