"""``umbra jobs submit|list|show``, ``cancel ID`` and ``cancel-waiting [--kind K]``: jobs from the shell,
through the API with an API key."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal

import anyio
import pytest

from tests.helpers import bearer, eventually, run_umbra
from umbra.events import documents

from .queue_support import http_claim, http_pair, written

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
    before = await written(db_url)
    refused = await client.post(f"/v1/jobs/{running['id']}/cancel", params={"if_waiting": "true"}, headers=bearer(key))
    assert (refused.status_code, refused.json()["error"], refused.json()["status"]) == (409, "job_running", "running")
    assert await written(db_url) == before
    cancelled = await client.post(f"/v1/jobs/{waiting['id']}/cancel", params={"if_waiting": "true"}, headers=bearer(key))
    assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")
    for value in ("perhaps", ""):  # left blank, the safety catch is not taken as off
        bad = await client.post(f"/v1/jobs/{running['id']}/cancel", params={"if_waiting": value}, headers=bearer(key))
        assert (bad.status_code, bad.json()["field"]) == (422, "if_waiting"), value
    assert (await client.get(f"/v1/jobs/{running['id']}", headers=bearer(key))).json()["status"] == "running"


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


async def test_numbers_travel_exactly_batches_fit_a_body_and_arguments_are_checked_first(client, org, live_server):
    """A payload's numbers go as written, digits and range (as the service keeps them); ``--count`` past what
    one body holds goes as several batches; a count or limit out of range is refused by the parser (exit 2),
    and a refusal's message reaches the terminal escaped."""
    _, key = org

    def umbra(*args: str):
        return run_umbra("jobs", *args, "--server", live_server.url, env={"UMBRA_API_KEY": key})

    exact = await anyio.to_thread.run_sync(lambda: umbra("submit", "echo", "--payload", '{"x": 0.10000000000000000000000001, "y": 1e400}'))
    assert exact.returncode == 0, exact.stderr
    payload = documents.decode((await client.get(f"/v1/jobs/{exact.stdout.strip()}", headers=bearer(key))).content)["payload"]
    assert payload == {"x": Decimal("0.10000000000000000000000001"), "y": Decimal("1e400")}, payload
    many = await anyio.to_thread.run_sync(lambda: umbra("submit", "echo", "--count", "6000", "--payload",
                                                        '{"text": "' + "x" * 300 + '"}'))  # fmt: skip
    assert many.returncode == 0 and len(set(many.stdout.split())) == 6000, many.stderr  # 2 MB: three bodies
    for args in (("submit", "echo", "--count", "0"), ("list", "--limit", "0")):
        refused = await anyio.to_thread.run_sync(lambda: umbra(*args))
        assert refused.returncode == 2, (args, refused.stderr)
    escaped = await anyio.to_thread.run_sync(lambda: umbra("list", "--status", "\x1b]0;owned\x07queued"))
    assert escaped.returncode == 1 and "\x1b" not in escaped.stderr and "\\x1b" in escaped.stderr, escaped.stderr


async def test_show_prints_a_result_with_exact_numbers_and_unicode(client, org, live_server):
    _, key = org
    _, credential = await http_pair(client, key)
    job = (await client.post("/v1/jobs", json={"kind": "caption"}, headers=bearer(key))).json()
    held = await http_claim(client, credential)
    result = {"caption": "café ✓ 日本語", "score": 0.5}
    done = await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": held["attempt"], "result": result},
                             headers=bearer(credential))  # fmt: skip
    assert done.status_code == 200, done.text
    shown = await anyio.to_thread.run_sync(lambda: run_umbra("jobs", "show", job["id"], "--server", live_server.url,
                                                             env={"UMBRA_API_KEY": key}))  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    [line] = [line for line in shown.stdout.splitlines() if line.startswith("result: ")]
    assert json.loads(line.removeprefix("result: ")) == result and "café ✓ 日本語" in line, shown.stdout


async def test_the_cli_submits_a_job_that_runs_after_others_and_shows_what_it_waits_for(client, org, live_server):
    """``submit --depends-on A --depends-on B`` (with ``--count``, each job of the batch waits for both):
    blocked, waiting; ``show`` names its dependencies and why it waits; a dependency of no job is refused with
    the API's message, nothing submitted."""
    _, key = org

    def umbra(*args: str):
        return run_umbra("jobs", *args, "--server", live_server.url, env={"UMBRA_API_KEY": key})

    first, second = (await anyio.to_thread.run_sync(lambda: umbra("submit", "prepare", "--count", "2"))).stdout.split()
    after = await anyio.to_thread.run_sync(lambda: umbra("submit", "train", "--depends-on", first, "--depends-on", second,
                                                         "--count", "2"))  # fmt: skip
    assert after.returncode == 0, after.stderr
    for job_id in after.stdout.split():
        job = (await client.get(f"/v1/jobs/{job_id}", headers=bearer(key))).json()
        assert (job["status"], job["depends_on"]) == ("blocked", [first, second])
    shown = (await anyio.to_thread.run_sync(lambda: umbra("show", after.stdout.split()[0]))).stdout
    assert f"depends on: {first}, {second}" in shown and "waiting for 2 jobs it depends on" in shown, shown
    refused = await anyio.to_thread.run_sync(lambda: umbra("submit", "train", "--depends-on", str(uuid.uuid4())))
    assert refused.returncode == 1 and "to depend on" in refused.stderr, refused.stderr
    malformed = await anyio.to_thread.run_sync(lambda: umbra("submit", "train", "--depends-on", "step-1"))
    assert malformed.returncode == 2 and "not a UUID" in malformed.stderr, malformed.stderr
    assert len((await client.get("/v1/jobs", headers=bearer(key))).json()["jobs"]) == 4


async def test_retry_failed_brings_back_a_pipeline_its_first_step_failed_in_order(client, org, live_server):
    """``prepare`` fails for good, so the server's sweeper fails ``train`` (``dependency_failed``).
    ``retry-failed`` lists in submission order, so it retries ``prepare`` first and ``train`` then waits for
    it again (a dependent retried while its dependency stayed failed would be refused)."""
    _, key = org
    _, credential = await http_pair(client, key)
    prepare = (await client.post("/v1/jobs", json={"kind": "prepare"}, headers=bearer(key))).json()
    train = (await client.post("/v1/jobs", json={"kind": "train", "depends_on": [prepare["id"]]}, headers=bearer(key))).json()
    claimed = await http_claim(client, credential)
    failed = await client.post(f"/v1/agent/jobs/{prepare['id']}/fail", headers=bearer(credential),
                               json={"attempt": claimed["attempt"], "error": "disk full", "retry": False})  # fmt: skip
    assert failed.json()["status"] == "failed", failed.text

    async def status(job: dict) -> str:
        return (await client.get(f"/v1/jobs/{job['id']}", headers=bearer(key))).json()["status"]

    async def train_failed() -> bool:
        return await status(train) == "failed"

    await eventually(train_failed, timeout=10)
    retried = await anyio.to_thread.run_sync(lambda: run_umbra("jobs", "retry-failed", "--server", live_server.url,
                                                               env={"UMBRA_API_KEY": key}))  # fmt: skip
    assert retried.returncode == 0, retried.stderr
    shown = (await client.get(f"/v1/jobs/{train['id']}", headers=bearer(key))).json()
    assert (await status(prepare), shown["status"], shown["blocked_reason"]) == (
        "queued", "blocked", "waiting for 1 job it depends on to complete")
