"""``umbra events tail|replay`` over HTTP and ``umbra verify`` on the database."""

from __future__ import annotations

import json
import os
import uuid
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from tests.conftest import free_port
from tests.helpers import eventually
from umbra.cli import main

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
CPU = {"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 8000}


@pytest.fixture
def cli(db_url, monkeypatch, capsys):
    monkeypatch.setenv("UMBRA_DATABASE_URL", db_url)
    monkeypatch.delenv("UMBRA_API_KEY", raising=False)

    async def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = await anyio.to_thread.run_sync(main, list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture
async def api(live_server, org):
    async with httpx.AsyncClient(base_url=live_server.url, headers={"Authorization": f"Bearer {org[1]}"}) as client:
        yield client


async def submit(api, kind: str = "echo", **payload) -> dict:
    response = await api.post("/v1/jobs", json={"kind": kind, "payload": payload})
    assert response.status_code == 201, response.text
    return response.json()


async def test_tail_prints_the_organizations_events_in_commit_order(cli, api, live_server, org):
    ids = [(await submit(api, n=i))["id"] for i in range(3)]
    status, out, err = await cli("events", "tail", "--server", live_server.url, "--api-key", org[1], "--json")
    assert status == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    assert events == (await api.get("/v1/events", params={"limit": 1000})).json()["events"]
    submitted = [e["stream"] for e in events if e["type"] == "job.submitted"]
    assert submitted == [f"job:{i}" for i in ids]
    positions = [e["position"] for e in events]
    assert positions == sorted(set(positions))

    status, out, _ = await cli("events", "tail", "--server", live_server.url, "--api-key", org[1], "--after", str(positions[0]))
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == len(events) - 1
    assert lines[0].split()[0] == str(positions[1]) and events[1]["type"] in lines[0] and events[1]["stream"] in lines[0]


async def test_tail_reads_the_key_from_the_environment_and_refuses_a_bad_one(cli, api, live_server, org, monkeypatch):
    await submit(api)
    monkeypatch.setenv("UMBRA_API_KEY", org[1])
    status, out, _ = await cli("events", "tail", "--server", live_server.url)
    assert status == 0 and "job.submitted" in out
    status, _, err = await cli("events", "tail", "--server", live_server.url, "--api-key", "uk_0123456789_nope")
    assert status == 1 and err.startswith("umbra: unauthenticated:") and err.count("\n") == 1
    monkeypatch.delenv("UMBRA_API_KEY")
    status, _, err = await cli("events", "tail", "--server", live_server.url)
    assert status == 1 and "UMBRA_API_KEY" in err


async def test_tail_follow_streams_new_events_as_they_commit(api, live_server, org):
    first = await submit(api, n=1)
    command = [sys.executable, "-m", "umbra.cli", "events", "tail", "--follow", "--json",
               "--server", live_server.url, "--api-key", org[1]]
    seen: list[dict] = []
    async with await anyio.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT) as process:
        async def read() -> None:
            buffered = b""
            async for chunk in process.stdout:
                buffered += chunk
                *lines, buffered = buffered.split(b"\n")
                seen.extend(json.loads(line) for line in lines if line)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await eventually(lambda: _streams(seen, first["id"]))
            second = await submit(api, n=2)
            await eventually(lambda: _streams(seen, second["id"]))
            process.terminate()
    submitted = [e["stream"] for e in seen if e["type"] == "job.submitted"]
    assert submitted == [f"job:{first['id']}", f"job:{second['id']}"]
    positions = [e["position"] for e in seen]
    assert positions == sorted(set(positions)), "in commit order, each event once"


async def _streams(seen: list[dict], job_id: str) -> bool:
    return any(e["stream"] == f"job:{job_id}" for e in seen)


async def _run_job_to_completion(api, live_server) -> tuple[dict, int]:
    """Submit an echo job and take it through claim and complete as a node would."""
    code = (await api.post("/v1/pairings", json={"name": "replayer"})).json()["code"]
    async with httpx.AsyncClient(base_url=live_server.url) as anonymous:
        credential = (await anonymous.post("/v1/pairings/redeem", json={"code": code, "name": "replayer", "devices": [CPU]})).json()["credential"]
    job = await submit(api, text="hi")
    async with httpx.AsyncClient(base_url=live_server.url, headers={"Authorization": f"Bearer {credential}"}) as node:
        assert (await node.post("/v1/agent/heartbeat", json={"devices": [CPU]})).status_code == 200
        claimed = await node.post("/v1/agent/claim", params={"wait": 5})
        assert claimed.status_code == 200, claimed.text
        attempt = claimed.json()["job"]["attempt"]
        done = await node.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": attempt, "result": {"echo": "hi"}})
        assert done.status_code == 200, done.text
    events = (await api.get(f"/v1/jobs/{job['id']}/events")).json()["events"]
    claim_position = next(e["position"] for e in events if e["type"] == "job.claimed")
    return job, claim_position


async def test_replay_folds_a_jobs_history_to_the_same_state_the_api_shows(cli, api, live_server, org):
    job, claim_position = await _run_job_to_completion(api, live_server)
    status, out, err = await cli("events", "replay", job["id"], "--server", live_server.url, "--api-key", org[1], "--json")
    assert status == 0, err
    replayed = json.loads(out)
    assert [e["type"] for e in replayed["events"]] == ["job.submitted", "job.claimed", "job.completed"]
    current = (await api.get(f"/v1/jobs/{job['id']}")).json()
    for field in ("id", "status", "attempt", "result", "placement", "created_at", "started_at", "finished_at", "kind", "payload"):
        assert replayed["state"][field] == current[field], field

    status, out, _ = await cli("events", "replay", job["id"], "--as-of", str(claim_position),
                               "--server", live_server.url, "--api-key", org[1])
    assert status == 0
    assert "job.submitted" in out and "-> queued" in out and "-> running" in out and "job.completed" not in out
    assert "status: running" in out


async def test_replay_folds_a_nodes_history_too(cli, api, live_server, org, conn):
    """A node's stream replays like a job's: an auditor can see when it was paired, came online and was drained."""
    code = (await api.post("/v1/pairings", json={"name": "audited"})).json()["code"]
    async with httpx.AsyncClient(base_url=live_server.url) as anonymous:
        redeemed = (await anonymous.post("/v1/pairings/redeem", json={"code": code, "name": "audited", "devices": [CPU]})).json()
    async with httpx.AsyncClient(base_url=live_server.url, headers={"Authorization": f"Bearer {redeemed['credential']}"}) as node:
        assert (await node.post("/v1/agent/heartbeat", json={"devices": [CPU]})).status_code == 200
    assert (await api.post(f"/v1/nodes/{redeemed['node_id']}/drain")).status_code == 200
    history = (await api.get(f"/v1/nodes/{redeemed['node_id']}/events")).json()["events"]
    assert [e["type"] for e in history][-1] == "node.draining" and {e["stream"] for e in history} == {f"node:{redeemed['node_id']}"}
    status, out, err = await cli("events", "replay", redeemed["node_id"], "--server", live_server.url, "--api-key", org[1], "--json")
    assert status == 0, err
    replayed = json.loads(out)
    assert [e["type"] for e in replayed["events"]] == [e["type"] for e in history]
    assert (replayed["state"]["id"], replayed["state"]["name"], replayed["state"]["status"]) == (redeemed["node_id"], "audited", "draining")
    stored = await (await conn.execute("SELECT status, version FROM nodes WHERE id = %s", (redeemed["node_id"],))).fetchone()
    assert (replayed["state"]["status"], replayed["state"]["version"]) == tuple(stored)
    status, out, _ = await cli("events", "replay", redeemed["node_id"], "--server", live_server.url, "--api-key", org[1])
    assert status == 0 and "node.draining" in out and "-> draining" in out
    assert '"label": "cpu0"' in out and "('" not in out  # the devices (and kinds) as JSON, not Python tuples
    status, _, err = await cli("events", "replay", str(uuid.uuid4()), "--server", live_server.url, "--api-key", org[1])
    assert status == 1 and err.startswith("umbra: job_not_found: No job or node")


async def test_replay_of_another_organizations_job_is_not_found(cli, api, live_server, conn):
    from umbra.compute.accounts import create_organization

    job = await submit(api)
    _, other_key = await create_organization(conn, "other")
    status, _, err = await cli("events", "replay", job["id"], "--server", live_server.url, "--api-key", other_key)
    assert status == 1 and err.startswith("umbra: job_not_found:")


async def test_verify_passes_on_a_consistent_database_and_reports_a_tampered_row(cli, api, live_server, conn):
    job, _ = await _run_job_to_completion(api, live_server)
    status, out, err = await cli("verify")
    assert status == 0, out + err
    assert "views match the log" in out and "rebuilding from" in err

    await conn.execute("UPDATE jobs SET priority = 7 WHERE id = %s", (job["id"],))
    status, out, _ = await cli("verify")
    assert status == 1
    assert f"queue {job['id']}: priority: rebuilt 100 != live 7" in out and "1 difference(s)" in out
    status, out, _ = await cli("verify", "--json")
    report = json.loads(out)
    assert status == 1 and report["ok"] is False
    assert [(d["view"], d["id"], d["field"]) for d in report["differences"]] == [("queue", job["id"], "priority")]


async def test_verify_shows_progress_while_a_long_rebuild_runs(cli, monkeypatch):
    import umbra.cli_events as cli_events
    import umbra.projections.verify as verifying

    real = verifying.verify

    async def slow(conn, organization_id=None):
        await anyio.sleep(0.5)
        return await real(conn, organization_id)

    monkeypatch.setattr(cli_events, "PROGRESS_SECONDS", 0.1)
    monkeypatch.setattr(verifying, "verify", slow)
    status, out, err = await cli("verify")
    assert status == 0 and "views match the log" in out
    assert "umbra verify: still folding" in err


def test_tail_follow_against_an_unreachable_server_fails_like_tail_does():
    """A wrong --server is said at once with --follow too (exit 1, the URL named), not retried for ever as a
    "stream interrupted" that was never opened; a server once reached and then gone is still waited out."""
    server = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "UMBRA_API_KEY"}
    plain = subprocess.run([sys.executable, "-m", "umbra.cli", "events", "tail", "--server", server, "--api-key", "uk_a_b"],
                           capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert plain.returncode == 1 and "ConnectError" in plain.stderr, plain.stderr
    try:
        follow = subprocess.run(
            [sys.executable, "-m", "umbra.cli", "events", "tail", "--follow", "--server", server, "--api-key", "uk_a_b"],
            capture_output=True, text=True, timeout=20, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"still retrying after 20 s; stderr: {exc.stderr!r}") from None
    assert follow.returncode != 0 and "ConnectError" in follow.stderr
