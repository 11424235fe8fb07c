"""Operations: shutdown, database outages, metrics, logs and the agent, against real processes.

Every server here is a real ``python -m umbra.cli serve`` process on a free port;
a database outage is made either with ``pg_terminate_backend`` (the server's
sessions end, the database stays up) or with a TCP proxy between the server and
PostgreSQL that can be cut (the database becomes unreachable). Every process a
test starts is killed at its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import anyio
import httpx
import psycopg
import pytest
from psycopg import conninfo

from tests.conftest import free_port
from tests.helpers import bearer, eventually, sessions_waiting_on_a_lock

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
DEVICES = [{"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 8000}]
DEVICE_JSON = json.dumps(DEVICES[0])


# -- umbra serve as a real process ------------------------------------------------------------------


class Serve:
    def __init__(self, db_url: str, log_path: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full = {
            **os.environ,
            "UMBRA_DATABASE_URL": db_url,
            "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2",
            "UMBRA_LOG_LEVEL": "DEBUG",
            **env,
        }
        self.proc = subprocess.Popen([sys.executable, "-m", "umbra.cli", "serve", "--port", str(self.port)],
                                     env=full, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip

    @property
    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def records(self) -> list[dict]:
        out = []
        for line in self.log.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out

    async def ready(self, timeout: float = 30) -> None:
        async def answers():
            assert self.proc.poll() is None, self.log[-3000:]
            try:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"{self.url}/readyz", timeout=3)).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(answers, timeout=timeout, interval=0.1)

    def signal_and_wait(self, signum: int = signal.SIGTERM, timeout: float = 15) -> tuple[float, int | None]:
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return time.monotonic() - started, None
        return time.monotonic() - started, self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def serve(db_url, tmp_path):
    started: list[Serve] = []

    def start(url: str | None = None, **env: str) -> Serve:
        server = Serve(url or db_url, tmp_path / f"serve-{len(started)}.log", **env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


async def pair_node(client: httpx.AsyncClient, base: str, admin_key: str, name: str = "box") -> dict:
    code = (await client.post(f"{base}/v1/pairings", json={"name": name}, headers=bearer(admin_key))).json()["code"]
    redeemed = await client.post(f"{base}/v1/pairings/redeem",
                                 json={"code": code, "name": name, "agent_version": "t", "devices": DEVICES})  # fmt: skip
    assert redeemed.status_code == 201, redeemed.text
    body = redeemed.json()
    beat = await client.post(f"{base}/v1/agent/heartbeat", json={"devices": DEVICES, "agent_version": "t"},
                             headers=bearer(body["credential"]))  # fmt: skip
    assert beat.status_code == 200, beat.text
    body["code"] = code
    return body


async def terminate_server_sessions(db_url: str) -> list[int]:
    """``pg_terminate_backend`` every other session of this test's database; waits until they are gone."""
    dbname = conninfo.conninfo_to_dict(db_url)["dbname"]
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
        ended = [pid for (pid,) in await (await admin.execute(
            "WITH others AS MATERIALIZED (SELECT pid FROM pg_stat_activity WHERE datname = %s "
            "AND datname = current_database() AND pid <> pg_backend_pid()) "
            "SELECT pid FROM others WHERE pg_terminate_backend(pid)", (dbname,))).fetchall()]  # fmt: skip
        for _ in range(300):
            left = (await (await admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)",
                                               (ended,))).fetchone())[0]  # fmt: skip
            if not left:
                break
            await anyio.sleep(0.01)
    return ended


def samples(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric_sum(values: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in values.items() if n == name and all((k, val) in ls for k, val in labels.items()))


# -- database outages ---------------------------------------------------------------------------


async def test_requests_right_after_the_servers_sessions_are_terminated_do_not_answer_500(serve, org, db_url):
    """pg_terminate_backend on the server's sessions: the requests that meet a dead pooled connection
    should be answered as a temporary unavailability (503, retryable), not as an internal error."""
    _, key = org
    server = serve()
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        # fill the pool with several idle connections: concurrent requests, each holding one
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200  # the key is cached now
        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(partial(client.get, "/v1/jobs?limit=1", headers=bearer(key)))
        for _ in range(4):
            assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
        await terminate_server_sessions(db_url)
        statuses = []
        bodies = []

        async def one():
            response = await client.get("/v1/jobs", headers=bearer(key))
            statuses.append(response.status_code)
            bodies.append(response.text)

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(one)
    internal = [b for s, b in zip(statuses, bodies) if s == 500]
    assert not internal, f"statuses {statuses}; a dead pooled connection answered 500 internal: {internal[:1]}"


async def test_requests_during_an_unreachable_database_answer_promptly(serve, org, db_url, pg_proxy):
    """The database host goes away: a request fails with 503 within the pool's wait (POOL_WAIT_SECONDS), not
    psycopg's default 30 s."""
    from umbra.db import POOL_WAIT_SECONDS

    _, key = org
    server = serve(pg_proxy.url(db_url))
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
        pg_proxy.cut()
        await anyio.sleep(0.3)
        outcomes = []
        for _ in range(3):
            started = time.monotonic()
            try:
                response = await client.get("/v1/jobs", headers=bearer(key), timeout=8)
                outcomes.append((response.status_code, round(time.monotonic() - started, 1), response.json().get("error")))
            except httpx.TimeoutException:
                outcomes.append(("timeout", round(time.monotonic() - started, 1), None))
                break
        ready = await client.get("/readyz", timeout=8)
    assert ready.status_code == 503, ready.text
    assert all(o[0] == 503 and o[1] < POOL_WAIT_SECONDS + 1.5 for o in outcomes), f"(status, seconds, error) during the outage: {outcomes}"


async def test_metrics_are_served_while_the_database_is_unreachable(serve, org, db_url, pg_proxy):
    """The process's own instruments are what an operator needs during an outage; a scrape should not
    hang for the pool's timeout (Prometheus' default scrape timeout is 10 s) nor fail as a whole."""
    _, key = org
    server = serve(pg_proxy.url(db_url))
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        assert (await client.get("/metrics")).status_code == 200
        pg_proxy.cut()
        await anyio.sleep(0.3)
        outcomes = []
        for _ in range(4):
            started = time.monotonic()
            try:
                response = await client.get("/metrics", timeout=8)
                outcomes.append((response.status_code, round(time.monotonic() - started, 1)))
            except httpx.TimeoutException:
                outcomes.append(("timeout", round(time.monotonic() - started, 1)))
                break
    assert all(status == 200 and took < 5 for status, took in outcomes), f"(status, seconds) of /metrics scrapes: {outcomes}"


async def test_an_error_log_record_carries_the_request_id(serve, org, db_url):
    """A client reporting a failed request quotes its X-Request-ID; the server's record of the failure
    (the 5xx's warning or traceback) must be findable by it, not only the access-log line."""
    _, key = org
    server = serve()
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        for _ in range(3):
            assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
        await terminate_server_sessions(db_url)
        failed = None
        for n in range(6):
            response = await client.get("/v1/jobs", headers={**bearer(key), "X-Request-ID": f"outage-{n}"})
            if response.status_code >= 500:
                failed = response
                break
    assert failed is not None, "no request met a dead connection"
    request_id = failed.headers["x-request-id"]
    await anyio.sleep(0.3)
    errors = [r for r in server.records()
              if r.get("action") in ("unhandled_error", "database_unavailable") and r.get("path") == "/v1/jobs"]  # fmt: skip
    assert errors, server.log[-2000:]
    assert any(r.get("request_id") == request_id for r in errors), \
        f"the {errors[0]['action']} record has no request id: {sorted(errors[0])}"


async def test_after_an_outage_the_listener_reconnects_and_long_polls_wake_on_notifications(serve, org, db_url, pg_proxy):
    admin_id, key = org
    server = serve(pg_proxy.url(db_url), UMBRA_POLL_FALLBACK_SECONDS="60")
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        node = await pair_node(client, server.url, key)
        pg_proxy.cut()
        await anyio.sleep(1.0)
        not_ready = await client.get("/readyz", timeout=8)
        pg_proxy.restore()

        async def ready_and_listening():
            r = await client.get("/readyz", timeout=5)
            return r.status_code == 200 and r.json().get("listener_connected") is True

        await eventually(ready_and_listening, timeout=15, interval=0.2)
        # flush dead pooled connections (the pool check runs after the listener reconnect)
        await anyio.sleep(0.5)
        got = {}

        async def poll():
            got["r"] = await client.post("/v1/agent/claim", params={"wait": 15}, headers=bearer(node["credential"]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            await anyio.sleep(1.0)
            started = time.monotonic()
            submitted = await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))
            assert submitted.status_code == 201, submitted.text
            with anyio.fail_after(10):
                while "r" not in got:
                    await anyio.sleep(0.02)
            woke = time.monotonic() - started
    assert not_ready.status_code == 503
    assert got["r"].status_code == 200, got["r"].text
    assert woke < 3, woke


# -- graceful shutdown ----------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_stops_an_idle_server_promptly_cleanly_and_with_status_0(serve, org, conn, db_url, signum):
    _, key = org
    server = serve()
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
    took, code = await anyio.to_thread.run_sync(server.signal_and_wait, signum)
    assert code == 0 and took < 5, (code, took, server.log[-2000:])
    assert "Traceback" not in server.log, server.log[-3000:]
    async def sessions_left():
        return (await (await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )).fetchone())[0] == 0  # fmt: skip

    await eventually(sessions_left, timeout=3)


async def test_sigterm_under_agent_load_keeps_every_acknowledged_claim_and_completion(serve, org, db_url):
    """Agents claim and complete through the group commit while SIGTERM arrives. Afterwards: every
    completion answered 200 is stored, every claim answered 200 is leased to its node, and no job is
    left leased to a node that never received the claim."""
    _, key = org
    server = serve()
    await server.ready()
    acked_claims: dict[str, str] = {}  # job -> node
    acked_completions: set[str] = set()
    async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=200)) as client:
        nodes = [await pair_node(client, server.url, key, f"n{i}") for i in range(6)]
        submitted = await client.post("/v1/jobs/batch", json={"jobs": [{"kind": "echo"} for _ in range(3000)]},
                                      headers=bearer(key))  # fmt: skip
        assert submitted.status_code == 201, submitted.text
        stop = anyio.Event()

        async def agent(node):
            headers = bearer(node["credential"])
            while True:
                try:
                    claimed = await client.post("/v1/agent/claim", params={"wait": 2}, headers=headers)
                except httpx.HTTPError:
                    return
                if claimed.status_code != 200:
                    if stop.is_set():
                        return
                    continue
                job = claimed.json()["job"]
                acked_claims[job["id"]] = node["node_id"]
                while job is not None:
                    try:
                        done = await client.post(f"/v1/agent/jobs/{job['id']}/complete", params={"claim_next": "true"},
                                                 json={"attempt": job["attempt"], "result": {"ok": 1}}, headers=headers)  # fmt: skip
                    except httpx.HTTPError:
                        return
                    if done.status_code != 200:
                        return
                    acked_completions.add(job["id"])
                    following = done.json().get("next_claim")
                    job = following["job"] if following else None
                    if job is not None:
                        acked_claims[job["id"]] = node["node_id"]

        async with anyio.create_task_group() as tg:
            for node in nodes:
                for _ in range(3):
                    tg.start_soon(agent, node)
            await anyio.sleep(1.5)
            stop.set()
            took, code = await anyio.to_thread.run_sync(server.signal_and_wait)
    assert code == 0 and took < 8, (code, took)
    assert acked_completions, "the load did not run"
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        rows = await (await conn.execute("SELECT id::text, status, lease_owner::text FROM jobs")).fetchall()
    by_id = {job_id: (status, owner) for job_id, status, owner in rows}
    lost = [j for j in acked_completions if by_id[j][0] != "complete"]
    assert not lost, f"{len(lost)} acknowledged completions are not stored"
    unheard = [j for j, (status, owner) in by_id.items() if status == "running" and j not in acked_claims]
    assert not unheard, f"{len(unheard)} jobs are leased to a node that never received the claim"


async def test_sigterm_while_the_database_is_unreachable_stops_promptly(serve, org, db_url, pg_proxy):
    """A request stuck waiting for a pooled connection must not hold the stop for the graceful timeout."""
    _, key = org
    server = serve(pg_proxy.url(db_url))
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
        pg_proxy.cut()
        await anyio.sleep(0.3)
        answers = []

        async def request():
            with contextlib.suppress(httpx.HTTPError):
                answers.append((await client.get("/v1/jobs", headers=bearer(key))).status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(request)
            await anyio.sleep(1.0)
            took, code = await anyio.to_thread.run_sync(server.signal_and_wait)
    assert code == 0 and took < 5, (code, round(took, 1), answers)


# -- metrics ----------------------------------------------------------------------------------------


async def test_claim_and_event_counters_match_the_log(serve, org, conn, db_url):
    _, key = org
    server = serve(UMBRA_POLL_FALLBACK_SECONDS="30")
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        before = samples((await client.get("/metrics")).text)
        head_before = (await (await conn.execute("SELECT coalesce(max(position), 0) FROM events")).fetchone())[0]
        node = await pair_node(client, server.url, key)
        headers = bearer(node["credential"])
        for _ in range(6):
            assert (await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))).status_code == 201
        first = (await client.post("/v1/agent/claim", params={"wait": 0}, headers=headers)).json()
        nxt = (await client.post(f"/v1/agent/jobs/{first['job']['id']}/complete", params={"claim_next": "true"},
                                 json={"attempt": first["job"]["attempt"], "result": {}}, headers=headers)).json()["next_claim"]  # fmt: skip
        many = (await client.post("/v1/agent/claim", params={"wait": 0, "max": 3}, headers=headers)).json()
        held = [nxt["job"], *[c["job"] for c in many["claims"]]]
        done = await client.post("/v1/agent/complete", params={"claim_next": 1},
                                 json={"results": [{"job_id": j["id"], "attempt": j["attempt"], "result": {}} for j in held]},
                                 headers=headers)  # fmt: skip
        assert done.status_code == 200, done.text
        after = samples((await client.get("/metrics")).text)
    claimed_events = (await (await conn.execute(
        "SELECT count(*) FROM events WHERE type LIKE 'job.claimed%%' AND position > %s", (head_before,))).fetchone())[0]  # fmt: skip
    head_after = (await (await conn.execute("SELECT coalesce(max(position), 0) FROM events")).fetchone())[0]
    claims = metric_sum(after, "umbra_claims_total") - metric_sum(before, "umbra_claims_total")
    appended = metric_sum(after, "umbra_events_appended_total") - metric_sum(before, "umbra_events_appended_total")
    assert claimed_events == 6
    assert claims == claimed_events, f"umbra_claims_total moved by {claims}, the log has {claimed_events} claims"
    assert appended == head_after - head_before, (appended, head_after - head_before)
    assert after[("umbra_queue_depth", (("status", "complete"),))] == 5


# -- the reference agent ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def agent_process(tmp_path: Path, *args: str):
    log_path = tmp_path / f"agent-{time.monotonic_ns()}.log"
    handle = open(log_path, "wb")
    command = [sys.executable, "-m", "umbra.cli", "agent", "--claim-wait", "2", "--device", DEVICE_JSON,
               "--credential-file", str(tmp_path / "cred" / "credential.json"), "--log-level", "DEBUG", *args]  # fmt: skip
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    process.log_path = log_path  # type: ignore[attr-defined]
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        handle.close()


def _log_of(process) -> str:
    return Path(process.log_path).read_text(errors="replace")


async def _job(conn, job_id: str):
    row = await (await conn.execute("SELECT status, attempt, result::text FROM jobs WHERE id = %s", (job_id,))).fetchone()
    return row


async def test_agent_keeps_its_job_across_a_server_restart_mid_job(serve, org, conn, db_url, tmp_path):
    """The server is stopped while the agent runs a job and comes back on the same port: the agent keeps
    renewing and reports the result; the job runs once. The lease (10 s) must outlast the stop, the 2 s pause
    and the second server's start (a few seconds on a loaded machine: at 6 s it ran out there once), and the
    job (8 s) outlasts a lease's first renewals, so the restart falls among them."""
    _, key = org
    env = {"UMBRA_LEASE_SECONDS": "10", "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1"}
    first = serve(**env)
    await first.ready()
    async with httpx.AsyncClient(base_url=first.url, timeout=15) as client:
        code = (await client.post("/v1/pairings", json={"name": "restart"}, headers=bearer(key))).json()["code"]
        async with agent_process(tmp_path, "--server", first.url, "--code", code, "--name", "restart") as agent:
            async def online():
                nodes = (await client.get("/v1/nodes", headers=bearer(key))).json()["nodes"]
                return any(n["status"] == "online" for n in nodes)

            await eventually(online, timeout=20)
            job_id = (await client.post("/v1/jobs", json={"kind": "sleep", "payload": {"seconds": 8}},
                                        headers=bearer(key))).json()["id"]  # fmt: skip
            await eventually(lambda: _running_and_logged(conn, agent, job_id), timeout=10)
            await anyio.sleep(0.5)
            took, code_ = await anyio.to_thread.run_sync(first.signal_and_wait)
            assert code_ == 0
            await anyio.sleep(2.0)
            # start again on the same port
            second = _serve_on(db_url, tmp_path / "serve-again.log", first.port, **env)
            try:
                await second.ready()
                done = await eventually(lambda: _finished(conn, job_id), timeout=20)
            finally:
                second.kill()
    status, attempt, result = done
    assert (status, attempt) == ("complete", 1), (done, _log_of(agent)[-3000:])
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        types = [t for (t,) in await (await c.execute(
            "SELECT type FROM events WHERE stream = %s ORDER BY version", (f"job:{job_id}",))).fetchall()]  # fmt: skip
    assert "job.lease_expired" not in types, types


def _serve_on(db_url: str, log_path: Path, port: int, **env: str) -> Serve:
    server = Serve.__new__(Serve)
    server.port, server.url, server.log_path = port, f"http://127.0.0.1:{port}", log_path
    server._log = open(log_path, "wb")
    full = {**os.environ, "UMBRA_DATABASE_URL": db_url, "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2", "UMBRA_LOG_LEVEL": "DEBUG", **env}
    server.proc = subprocess.Popen([sys.executable, "-m", "umbra.cli", "serve", "--port", str(port)],
                                   env=full, stdout=server._log, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
    return server


async def _running_and_logged(conn, agent, job_id: str):
    row = await _job(conn, job_id)
    return row is not None and row[0] == "running" and job_id in _log_of(agent)


async def _finished(conn, job_id: str):
    row = await _job(conn, job_id)
    return row if row is not None and row[0] in ("complete", "failed", "cancelled", "partial") else None


async def test_a_second_sigterm_stops_the_agent_at_once_even_when_the_server_is_down(serve, org, conn, db_url, tmp_path):
    """``umbra agent --help``: "a second signal gives up on it at once". With the server unreachable the
    agent must not sit in report retries for a whole lease before it exits."""
    _, key = org
    env = {"UMBRA_LEASE_SECONDS": "12", "UMBRA_HEARTBEAT_INTERVAL_SECONDS": "1"}
    server = serve(**env)
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        code = (await client.post("/v1/pairings", json={"name": "twice"}, headers=bearer(key))).json()["code"]
        async with agent_process(tmp_path, "--server", server.url, "--code", code, "--name", "twice", "--grace", "30") as agent:
            async def online():
                nodes = (await client.get("/v1/nodes", headers=bearer(key))).json()["nodes"]
                return any(n["status"] == "online" for n in nodes)

            await eventually(online, timeout=20)
            job_id = (await client.post("/v1/jobs", json={"kind": "sleep", "payload": {"seconds": 60}},
                                        headers=bearer(key))).json()["id"]  # fmt: skip
            await eventually(lambda: _running_and_logged(conn, agent, job_id), timeout=10)
            server.proc.kill()  # the controller is gone
            server.proc.wait()
            agent.send_signal(signal.SIGTERM)
            await anyio.sleep(0.3)
            started = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            try:
                code_ = await anyio.to_thread.run_sync(lambda: agent.wait(timeout=16))
            except subprocess.TimeoutExpired:
                code_ = None
            took = time.monotonic() - started
    assert code_ == 0 and took < 5, (code_, round(took, 1), _log_of(agent)[-1500:])


@contextlib.asynccontextmanager
async def agents_claiming_through_an_outage(serve, key: str, db_url: str, pg_proxy, prefix: str):
    """A server whose database was just cut, and four agents' claims waiting on it; yields
    ``(server, client, nodes)``. The claims are abandoned at the end."""
    server = serve(pg_proxy.url(db_url))
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        nodes = [await pair_node(client, server.url, key, f"{prefix}{i}") for i in range(4)]
        pg_proxy.cut()
        for _ in range(3):  # the dead pooled connections are handed out and discarded
            with contextlib.suppress(httpx.HTTPError):
                await client.get("/v1/jobs", headers=bearer(key), timeout=1)

        async def claim(node):
            with contextlib.suppress(httpx.HTTPError):
                await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(node["credential"]))

        async with anyio.create_task_group() as tg:
            for node in nodes:
                tg.start_soon(claim, node)
            yield server, client, nodes
            tg.cancel_scope.cancel()


async def test_agent_commands_work_again_soon_after_a_database_outage_ends(serve, org, db_url, pg_proxy):
    """Claims that joined a group-commit batch during an outage must not keep the agents' path blocked
    after the database is back: a batch that got no connection fails its commands at once, rather than
    run each alone, each waiting for a connection again, inside a cancel-shielded scope."""
    _, key = org
    async with agents_claiming_through_an_outage(serve, key, db_url, pg_proxy, "o") as (server, client, nodes):
        await anyio.sleep(2.0)
        pg_proxy.restore()

        async def ready():
            return (await client.get("/readyz", timeout=5)).status_code == 200

        await eventually(ready, timeout=10, interval=0.2)
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200, "ordinary requests work again"
        started = time.monotonic()
        try:
            answer = await client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(nodes[0]["credential"]),
                                       timeout=8)  # fmt: skip
            outcome = (answer.status_code, round(time.monotonic() - started, 1))
        except httpx.TimeoutException:
            outcome = ("timeout", round(time.monotonic() - started, 1))
    assert outcome[0] == 204 and outcome[1] < 3, f"a claim after the outage ended: {outcome}"


async def test_sigterm_during_an_outage_with_agents_claiming_stops_the_server(serve, org, db_url, pg_proxy):
    """Agents' claims are parked in a group-commit batch waiting for a connection when SIGTERM arrives;
    the process must still exit within a supervisor's stop timeout."""
    _, key = org
    async with agents_claiming_through_an_outage(serve, key, db_url, pg_proxy, "s") as (server, _, _):
        await anyio.sleep(1.0)
        took, code = await anyio.to_thread.run_sync(server.signal_and_wait, signal.SIGTERM, 16)
    assert code is not None and took < 12, f"exit status {code} after {took:.1f}s (None: still running)"


# -- logs ----------------------------------------------------------------------------------------------


async def test_no_secret_reaches_the_log_on_error_paths(serve, org, db_url):
    """Tokens and pairing codes go through failing requests (their sessions terminated mid-way, an SSE
    stream with ?access_token= broken by it) at DEBUG: none of them may appear in the server's output."""
    _, key = org
    server = serve()
    await server.ready()
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        node = await pair_node(client, server.url, key, "secretive")
        code = (await client.post("/v1/pairings", json={"name": "later"}, headers=bearer(key))).json()["code"]
        streamed = anyio.Event()

        async def stream():
            with contextlib.suppress(httpx.HTTPError):
                async with client.stream("GET", f"/v1/events/stream?access_token={key}") as response:
                    async for _ in response.aiter_lines():
                        streamed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            await streamed.wait()
            for _ in range(3):
                await terminate_server_sessions(db_url)
                for call in (
                    client.get("/v1/jobs", headers=bearer(key)),
                    client.post("/v1/agent/heartbeat", json={"devices": DEVICES}, headers=bearer(node["credential"])),
                    client.post("/v1/agent/claim", params={"wait": 0}, headers=bearer(node["credential"])),
                    client.post("/v1/pairings/redeem", json={"code": code, "name": "later", "devices": DEVICES}),
                    client.get(f"/v1/events/stream?access_token={key}&after=notanumber"),
                ):
                    with contextlib.suppress(httpx.HTTPError):
                        await call
            await anyio.sleep(1.5)
            tg.cancel_scope.cancel()
    await anyio.to_thread.run_sync(server.signal_and_wait)
    text = server.log
    assert any(mark in text for mark in ("unhandled_error", "database_unavailable", "Traceback")), "no error path was exercised"
    for secret in (key, key.split("_", 2)[2], node["credential"], node["credential"].split("_", 2)[2]):
        assert secret not in text, "a token reached the log"
    for digits in (code, node["code"]):
        assert not re.search(rf"(?<![0-9]){digits}(?![0-9])", text), "a pairing code reached the log"


async def test_the_listener_replaces_a_connection_the_network_silently_dropped(db_url, pg_proxy):
    """No reset, no answer: the idle probe times out and the listener reconnects (its subscribers then
    re-read), instead of waiting for the operating system's TCP timeout."""
    from umbra.events.listener import LogListener

    listener = LogListener(pg_proxy.url(db_url), idle_check_seconds=0.2, probe_seconds=0.5)
    reconnected = anyio.Event()
    listener.on_reconnect(reconnected.set)
    async with anyio.create_task_group() as tg:
        await tg.start(listener.run)
        pg_proxy.freeze()
        with anyio.fail_after(10):
            await reconnected.wait()
        assert listener.reconnects == 1 and listener.connected.is_set()
        tg.cancel_scope.cancel()


async def test_a_claim_during_a_database_outage_answers_503_not_500(db_url, conn, org, pg_proxy):
    """The database unreachable -> 503 database_unavailable, for the claim long-poll too (its attempt runs
    in a task group: the error must reach the handlers as itself, not wrapped in an exception group)."""
    from tests.conftest import LiveServer
    from tests.integration.test_broken_commit import paired

    org_id, _ = org
    _, credential = await paired(conn, org_id)
    with LiveServer(pg_proxy.url(db_url)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            warm = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
            assert warm.status_code == 204  # the credential is now cached: the claim needs no query to authenticate
            pg_proxy.cut()
            response = await client.post("/v1/agent/claim?wait=0", headers=bearer(credential))
    assert response.status_code == 503 and response.json()["error"] == "database_unavailable", response.text


async def test_a_protocol_violation_is_a_bug_not_an_outage(conn):
    """SQLSTATE 08P01 is what PostgreSQL answers to a client's bug (a bind with the wrong number of
    parameters): answered 503 "try again", it would hide the bug behind an outage for ever."""
    from psycopg import errors, pq

    from umbra.db import database_away

    result = conn.pgconn.exec_params(b"SELECT $1::int + $2::int", [b"1"])
    assert result.status == pq.ExecStatus.FATAL_ERROR
    exc = errors.error_from_result(result, encoding="utf-8")
    assert exc.sqlstate == "08P01"
    assert not database_away(exc), f"{type(exc).__name__} ({exc.sqlstate}: {exc}) would be answered 503"


def test_serve_started_under_nohup_survives_sighup(db_url):
    """A server started with SIGHUP ignored (``nohup ./dev serve &``, then the SSH session ends)
    keeps ignoring it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMBRA_")}
    env.update({"UMBRA_DATABASE_URL": db_url, "UMBRA_PORT": str(port)})
    proc = subprocess.Popen([sys.executable, "-m", "umbra.cli", "serve"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "serve exited before it was ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve never became ready"
            time.sleep(0.1)
        proc.send_signal(signal.SIGHUP)
        time.sleep(3)
        assert proc.poll() is None, f"serve started with SIGHUP ignored exited on SIGHUP (status {proc.returncode})"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def test_a_server_stopped_while_it_holds_the_logs_order_stalls_the_others_writes_only_briefly(db_url, conn, org):
    """A process paused or frozen while its transactions hold or wait for the log's ordering lock (here:
    three submissions that took it in turn and then sent nothing more, the way a frozen process's queued
    requests do) has each session ended by PostgreSQL once it has sat idle holding the lock for
    ``LOCK_HOLDER_IDLE_SECONDS``: another process's submission, queued behind them, waits, then goes
    through, and the frozen ones' work is rolled back, never acknowledged. Before, each held it for as long
    as its process stayed frozen, and the others' writes failed (503) after ``SERVICE_LOCK_WAIT_SECONDS``.
    Both sides are pools as the server opens them."""
    from tests.integration.queue_support import submit
    from umbra import db

    org_id, _ = org
    frozen_count = 3
    thaw = anyio.Event()
    ended: list[BaseException] = []

    async def frozen_writer(pool, holding: anyio.Event) -> None:
        async with pool.connection() as frozen:
            try:
                async with frozen.transaction():
                    await submit(frozen, org_id, "frozen")  # holds the log's ordering lock to commit
                    holding.set()
                    await thaw.wait()  # sends nothing more until the test ends
            except db.DATABASE_AWAY as exc:
                ended.append(exc)

    async with db.open_pool(db_url, size=frozen_count) as frozen_pool, db.open_pool(db_url, size=2) as live_pool:
        async with anyio.create_task_group() as tg:
            first = anyio.Event()
            tg.start_soon(frozen_writer, frozen_pool, first)
            await first.wait()
            for _ in range(frozen_count - 1):
                tg.start_soon(frozen_writer, frozen_pool, anyio.Event())
            await eventually(lambda: _queued_behind(conn, frozen_count - 1))
            started = time.monotonic()
            with anyio.fail_after(SERVICE_LOCK_WAIT_SECONDS_LEFT):
                async with live_pool.connection() as live:
                    done = await submit(live, org_id, "live")
            waited = time.monotonic() - started
            thaw.set()
    # It waited behind the frozen holders, ended in turn: the two queued before it each held the lock that long.
    assert waited >= (frozen_count - 1) * db.LOCK_HOLDER_IDLE_SECONDS, waited
    assert len(ended) == frozen_count and all(db.database_away(exc) for exc in ended), ended  # thawed: 503s
    kinds = await (await conn.execute("SELECT kind FROM jobs WHERE organization_id = %s", (org_id,))).fetchall()
    assert kinds == [("live",)] and done.kind == "live"
    frozen_events = await (await conn.execute(
        "SELECT count(*) FROM events WHERE organization_id = %s AND data ->> 'kind' = 'frozen'", (org_id,))).fetchone()  # fmt: skip
    assert frozen_events == (0,)


async def test_an_admin_command_stopped_inside_its_transaction_lets_go_of_its_locks(cli, conn, org, monkeypatch):
    """An ``umbra admin`` command suspended (Ctrl-Z) inside its transaction, here just after it took the
    pairing code's lock, has its session ended by PostgreSQL once it has sat idle holding one of the
    service's locks for ``LOCK_HOLDER_IDLE_SECONDS``, as a server's would: the servers' transactions that
    need the lock wait briefly, not until the operator resumes it. Resumed, the command fails, database
    unavailable, and wrote nothing. Before, the CLI's connection had no bound: the lock was held for as
    long as the command stayed stopped."""
    from umbra import db
    from umbra.compute import pairing

    org_id, _ = org
    issue = pairing.issue_pairing_code
    suspended: list[int] = []  # the command's backend, once it holds the lock
    resume = threading.Event()

    async def issued_then_suspended(command_conn, *args, **kwargs):
        issued = await issue(command_conn, *args, **kwargs)
        [(pid,)] = await (await command_conn.execute("SELECT pg_backend_pid()")).fetchall()
        suspended.append(pid)
        while not resume.is_set():  # sends nothing more, as a stopped process
            await anyio.sleep(0.05)
        return issued

    async def holding() -> bool:
        return bool(suspended)

    async def session_ended() -> bool:
        row = await (await conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (suspended[0],))).fetchone()
        return row == (0,)

    monkeypatch.setattr(pairing, "issue_pairing_code", issued_then_suspended)
    async with anyio.create_task_group() as tg:
        outcome: list[tuple[int, str, str]] = []

        async def command() -> None:
            outcome.append(await cli("admin", "pairing-code", "--org", str(org_id), "--name", "box-9", "--json"))

        tg.start_soon(command)
        try:
            await eventually(holding)
            # Ended at the bound of a lock holder (2 s), well before the bound of any idle transaction (20 s).
            await eventually(session_ended, timeout=db.IDLE_IN_TRANSACTION_SECONDS - 5, interval=0.1)
        finally:
            resume.set()
    [(status, out, err)] = outcome
    assert status == 1 and out == "" and "database_unavailable" in err, (status, out, err)
    codes = await (await conn.execute("SELECT count(*) FROM pairing_codes WHERE organization_id = %s", (org_id,))).fetchone()
    assert codes == (0,)


#: The live submission's bound: short of SERVICE_LOCK_WAIT_SECONDS (30 s), where it would fail.
SERVICE_LOCK_WAIT_SECONDS_LEFT = 25


async def _queued_behind(conn, expected: int) -> bool:
    return await sessions_waiting_on_a_lock(conn, "advisory") >= expected


async def _pooled_and_own_parameters(url: str) -> list[dict[str, str]]:
    """The connection parameters of a pooled connection (a request's) and of one of its own (the sweeper's)."""
    from umbra.db import open_pool, own_connection

    async with open_pool(url, size=1) as pool:
        async with pool.connection() as pooled:
            parameters = [pooled.info.get_parameters()]
    async with own_connection(url) as own:
        parameters.append(own.info.get_parameters())
    return parameters


async def test_every_connection_to_the_database_has_tcp_keepalives(db_url):
    """A pooled connection (every request's, the group commit's) and a connection of its own (the sweeper's,
    the listener's) whose peer went away silently are ended within seconds of silence, not after the
    operating system's TCP timeout: behind a network that dropped packets, a request waited for ever."""
    from umbra.db import KEEPALIVES

    for parameters in await _pooled_and_own_parameters(db_url):
        assert {name: parameters.get(name) for name in KEEPALIVES} == {name: str(v) for name, v in KEEPALIVES.items()}


async def test_keepalives_the_database_url_sets_are_its_own(db_url):
    """``UMBRA_DATABASE_URL=...?keepalives_idle=300`` (a link whose probes cost, a firewall that forgets idle
    connections sooner): the URL's setting is kept, in either form of URL; only those it leaves unset are
    :data:`~umbra.db.KEEPALIVES`'."""
    from urllib.parse import quote

    from umbra.db import KEEPALIVES

    parts = conninfo.conninfo_to_dict(db_url)
    url = (f"postgresql://{quote(parts.get('user', ''), safe='')}@{quote(parts.get('host', ''), safe='')}"
           f":{parts.get('port', 5432)}/{parts['dbname']}?keepalives_idle=300&keepalives_count=7")  # fmt: skip
    expected = {**{name: str(v) for name, v in KEEPALIVES.items()}, "keepalives_idle": "300", "keepalives_count": "7"}
    for given in (url, conninfo.make_conninfo(db_url, keepalives_idle=300, keepalives_count=7)):
        for parameters in await _pooled_and_own_parameters(given):
            assert {name: parameters.get(name) for name in KEEPALIVES} == expected, given
