"""``umbra events tail|replay`` and ``umbra jobs explain`` over HTTP, and ``umbra verify`` on the database."""

from __future__ import annotations

import json
import os
import signal
import uuid
import subprocess
import sys

import anyio
import httpx
import pytest

from tests.conftest import free_port
from tests.helpers import ROOT, eventually, run_umbra

pytestmark = pytest.mark.anyio

CPU = {"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 8000}


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
    assert "views match the log" in out and "umbra verify: rebuilding 1 jobs" in err

    await conn.execute("UPDATE jobs SET priority = 7 WHERE id = %s", (job["id"],))
    status, out, _ = await cli("verify")
    assert status == 1
    assert f"queue {job['id']}: priority: rebuilt 100 != live 7" in out and "1 difference(s)" in out
    status, out, _ = await cli("verify", "--json")
    report = json.loads(out)
    assert status == 1 and report["ok"] is False
    assert [(d["view"], d["id"], d["field"]) for d in report["differences"]] == [("queue", job["id"], "priority")]


async def test_verify_says_what_it_compares_without_reading_the_log_first(cli, api, live_server, conn, org, monkeypatch):
    """Its first line names the jobs and the nodes it compares, from the views' counts (``job_counts``, ``nodes``):
    it counted the log's distinct streams, which read and sorted the log whole (seconds at a million jobs) before
    verify had begun. Shown here with the log locked: the first line comes all the same."""
    import umbra.projections.verify as verifying

    await _run_job_to_completion(api, live_server)
    await submit(api)

    async def verified(conn, organization_id=None):  # what it compares, not the comparison
        return []

    monkeypatch.setattr(verifying, "verify", verified)
    monkeypatch.setenv("PGOPTIONS", "-c lock_timeout=10s")  # the command's connections: a wait for the log fails
    async with conn.transaction():
        await conn.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
        status, out, err = await cli("verify")
        assert status == 0, err
        first = "umbra verify: rebuilding 2 jobs and 1 nodes from the log"
        assert err.splitlines()[0] == f"{first} (all organizations)", err
        assert "views match the log (2 jobs, 1 nodes, " in out
        status, _, err = await cli("verify", "--org", str(org[0]))
        assert status == 0 and err.splitlines()[0] == f"{first} (organization {org[0]})", err


def test_verify_exits_2_when_it_could_not_compare_and_1_only_for_drift(db_url):
    """``umbra verify`` exits 1 only when the views differ from the log (as diff(1) does), so
    ``umbra verify || alert "views drifted"`` never alerts for an outage: a database it cannot reach, an
    organization that does not exist, exit 2, saying why in one line."""
    unreachable = f"postgresql://nobody@127.0.0.1:{free_port()}/x"
    done = run_umbra("verify", env={"UMBRA_DATABASE_URL": unreachable})
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.startswith("umbra: database_unavailable:") and done.stderr.count("\n") == 1, done.stderr
    done = run_umbra("verify", "--org", str(uuid.uuid4()), env={"UMBRA_DATABASE_URL": db_url})
    assert done.returncode == 2 and done.stderr.startswith("umbra: organization_not_found:"), done.stderr


@pytest.mark.parametrize("drifted", [False, True], ids=["matching", "drifted"])
async def test_verify_into_a_pipe_its_reader_closed_still_exits_with_its_verdict(api, conn, db_url, drifted):
    """``umbra verify | head``: a reader that stops reading does not turn drifted views into success, nor a
    clean audit into an error; stderr says nothing of the pipe."""
    job = await submit(api)
    if drifted:
        await conn.execute("UPDATE jobs SET priority = 7 WHERE id = %s", (job["id"],))

    def verify_into_a_closed_pipe() -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if k != "UMBRA_API_KEY"} | {"UMBRA_DATABASE_URL": db_url}
        process = subprocess.Popen([sys.executable, "-m", "umbra.cli", "verify"], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        process.stdout.close()  # the reader is gone before verify says a word
        with process.stderr:
            err = process.stderr.read().decode()
        return process.wait(timeout=60), err

    status, err = await anyio.to_thread.run_sync(verify_into_a_closed_pipe)
    assert status == (1 if drifted else 0), (status, err)
    assert [line.split(":")[0] for line in err.splitlines()] == ["umbra verify"], err


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


async def test_http_clients_say_a_refused_server_and_a_wrong_key_in_one_line(cli, live_server, org):
    """``events tail|replay`` and ``jobs explain``: nothing listening is one line naming the server; a wrong
    key is ``umbra: unauthenticated: ...``; no key says to pass --api-key or set UMBRA_API_KEY. Each exits 1,
    and none repeats the key."""
    some_id = str(uuid.uuid4())
    nowhere = f"http://127.0.0.1:{free_port()}"
    for command in (["events", "tail"], ["events", "replay", some_id], ["jobs", "explain", some_id]):
        status, out, err = await cli(*command, "--server", nowhere, "--api-key", org[1])
        assert status == 1 and err.count("\n") == 1 and nowhere in err and "Traceback" not in err, (command, err)
        assert org[1] not in err, "the key was echoed"
        status, _, err = await cli(*command, "--server", live_server.url, "--api-key", "uk_0123456789_wrong")
        assert status == 1 and err.startswith("umbra: unauthenticated:") and err.count("\n") == 1, (command, err)
        status, _, err = await cli(*command, "--server", live_server.url)
        assert status == 1 and "UMBRA_API_KEY" in err and err.count("\n") == 1, (command, err)


async def test_http_clients_take_a_key_with_a_line_break_and_never_echo_one_they_cannot_send(cli, api, live_server, org, monkeypatch):
    """A key with a line break or a space around it (read from a file, pasted with the newline) is the key:
    ``events tail``, ``jobs list`` and ``jobs explain`` send it without them. One holding a character no key has
    (a control character, a space inside, a non-ASCII letter) is refused before anything is sent, in one line
    that does not repeat it: the HTTP library's own refusal of such a header ("Illegal header value
    b'Bearer uk_…'") printed the whole key on stderr."""
    job = await submit(api)
    key = org[1]
    commands = (["events", "tail"], ["jobs", "list"], ["jobs", "explain", job["id"]])
    for around in (f"{key}\n", f" {key}\t", f"{key}\r\n"):
        monkeypatch.setenv("UMBRA_API_KEY", around)
        for command in commands:
            status, out, err = await cli(*command, "--server", live_server.url)
            assert status == 0 and (job["id"] in out or command[1] == "explain"), (command, repr(around), err)
    monkeypatch.delenv("UMBRA_API_KEY")
    secret = key.split("_", 2)[2]
    for unsendable in (f"{key}\x01", f"{key[:20]}\n{key[20:]}", f"{key[:20]} {key[20:]}", f"{key}é"):
        for command in commands:
            status, out, err = await cli(*command, "--server", live_server.url, "--api-key", unsendable)
            assert status == 1 and err.count("\n") == 1 and "--api-key" in err, (command, err)
            assert secret[:20] not in err and secret[-20:] not in err, f"the key was echoed: {err}"


def _tail(live_server, api_key: str, *flags: str, **popen) -> subprocess.Popen:
    """``umbra events tail FLAGS`` as a process, its stdout and stderr piped."""
    env = {k: v for k, v in os.environ.items() if k != "UMBRA_API_KEY"}
    return subprocess.Popen([sys.executable, "-m", "umbra.cli", "events", "tail", *flags, "--server", live_server.url,
                             "--api-key", api_key], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            **popen)  # fmt: skip


async def test_tail_into_a_pipe_its_reader_closed_ends_quietly(api, live_server, org):
    """``umbra events tail | head -1``: once the reader has what it wanted and closes the pipe, tail ends as
    cat(1) or grep(1) would, exit 0 and nothing on stderr, so ``set -o pipefail`` sees no failure."""
    jobs = [{"kind": "echo", "payload": {"pad": "p" * 900, "i": i}} for i in range(100)]
    for _ in range(3):  # > 300 kB of output: well past a pipe's buffer
        assert (await api.post("/v1/jobs/batch", json={"jobs": jobs})).status_code == 201

    def tail_into_head() -> tuple[int, str]:
        process = _tail(live_server, org[1])
        process.stdout.readline()
        process.stdout.close()  # head -1 has its line
        status = process.wait(timeout=60)
        with process.stderr:
            return status, process.stderr.read().decode()

    status, err = await anyio.to_thread.run_sync(tail_into_head)
    assert (status, err) == (0, "")


async def test_ctrl_c_ends_tail_follow_with_130_and_no_traceback(api, live_server, org):
    """``events tail --follow`` runs until Ctrl-C: SIGINT ends it with exit 130, as a shell reports an
    interrupted command, and no traceback."""
    await submit(api)

    def follow_then_interrupt() -> tuple[int, str]:
        process = _tail(live_server, org[1], "--follow",
                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
        try:
            process.stdout.readline()  # streaming: the job's event is printed
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        return process.returncode, err.decode()

    status, err = await anyio.to_thread.run_sync(follow_then_interrupt)
    assert status == 130 and "Traceback" not in err, (status, err)
