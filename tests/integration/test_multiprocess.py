"""Two real ``umbra serve`` processes on one database.

A job submitted through process A wakes an agent long-polling process B (the
notification crosses processes through PostgreSQL), exactly one process sweeps
at a time and another takes over when it dies, and a SIGTERM ends a server
promptly even with a dashboard stream and a long-poll open.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import anyio
import httpx
import pytest

from tests.conftest import free_port
from tests.helpers import eventually, until
from umbra.compute.sweeper import SWEEPER_LOCK_KEY

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

DEVICES = [{"kind": "cpu", "label": "cpu", "ram_total_mb": 65536, "ram_free_mb": 30000}]


class ServeProcess:
    def __init__(self, db_url: str, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {
            **os.environ,
            "UMBRA_DATABASE_URL": db_url,
            "UMBRA_POLL_FALLBACK_SECONDS": "30",  # a fast wake must come from a notification
            "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2",
            "UMBRA_LOG_LEVEL": "WARNING",
            **env,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "umbra.cli", "serve", "--port", str(self.port)],
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    async def ready(self) -> None:
        async def answers():
            assert self.proc.poll() is None, self.proc.stderr.read().decode()[-2000:]
            try:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"{self.url}/readyz")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(answers, timeout=30, interval=0.1)

    def stop(self, timeout: float = 15) -> float:
        """SIGTERM; returns how long the process took to exit."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("server did not stop on SIGTERM") from None
        self.proc.stderr.close()
        return time.monotonic() - started


@pytest.fixture
def servers(db_url):
    started: list[ServeProcess] = []

    def start(**env: str) -> ServeProcess:
        process = ServeProcess(db_url, **env)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.proc.poll() is None:
            process.proc.kill()
            process.proc.wait()
        if not process.proc.stderr.closed:
            process.proc.stderr.close()


async def _sweeper_holders(conn) -> int:
    # A bigint advisory key is stored as (classid = high 32 bits, objid = low 32 bits).
    row = await (
        await conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid::bigint = %s AND objid::bigint = %s AND objsubid = 1",
            (SWEEPER_LOCK_KEY >> 32, SWEEPER_LOCK_KEY & 0xFFFFFFFF),
        )
    ).fetchone()
    return row[0]


async def _paired_node(client: httpx.AsyncClient, a: ServeProcess, b: ServeProcess, admin_key: str) -> str:
    """Pairing code from A, redeemed and heartbeating on B; returns the node credential."""
    code = (await client.post(f"{a.url}/v1/pairings", json={"name": "box"}, headers=_auth(admin_key))).json()["code"]
    redeemed = await client.post(
        f"{b.url}/v1/pairings/redeem", json={"code": code, "name": "box", "agent_version": "t", "devices": DEVICES}
    )
    assert redeemed.status_code == 201, redeemed.text
    credential = redeemed.json()["credential"]
    beat = await client.post(
        f"{b.url}/v1/agent/heartbeat", json={"devices": DEVICES, "agent_version": "t"}, headers=_auth(credential)
    )
    assert beat.status_code == 200 and beat.json()["status"] == "online", beat.text
    return credential


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_submit_on_one_process_wakes_a_long_poll_on_another_and_one_sweeper_leads(conn, org, servers):
    _, admin_key = org
    a, b = servers(UMBRA_LEASE_SECONDS="1", UMBRA_LEASE_EXPIRED_DELAY_SECONDS="0"), servers(
        UMBRA_LEASE_SECONDS="1", UMBRA_LEASE_EXPIRED_DELAY_SECONDS="0"
    )
    await a.ready()
    await b.ready()
    await eventually(lambda: _holders_are(conn, 1))
    async with httpx.AsyncClient(timeout=60) as client:
        credential = await _paired_node(client, a, b, admin_key)
        responses: list[httpx.Response] = []

        async def long_poll():
            responses.append(await client.post(f"{b.url}/v1/agent/claim", params={"wait": 30}, headers=_auth(credential)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_poll)
            await eventually(lambda: _long_polls_waiting(client, b, 1))
            started = time.monotonic()
            submitted = await client.post(f"{a.url}/v1/jobs", json={"kind": "echo", "payload": {"n": 1}}, headers=_auth(admin_key))
            assert submitted.status_code == 201, submitted.text
            await until(lambda: responses, timeout=10)
            woke_after = time.monotonic() - started
        assert responses[0].status_code == 200
        job_id = responses[0].json()["job"]["id"]
        assert job_id == submitted.json()["id"]
        assert woke_after < 5, woke_after

        # The agent never renews its 1 s lease: the one leading sweeper expires it once.
        async def requeued():
            events = (await client.get(f"{a.url}/v1/jobs/{job_id}/events", headers=_auth(admin_key))).json()["events"]
            return [e["type"] for e in events] if any(e["type"] == "job.lease_expired" for e in events) else None

        types = await eventually(requeued, timeout=15)
        assert types.count("job.lease_expired") == 1
        assert await _sweeper_holders(conn) == 1

    # Kill whichever process leads; the other takes the sweeper over.
    a.proc.kill()
    a.proc.wait()
    await eventually(lambda: _holders_are(conn, 1), timeout=20)
    assert b.proc.poll() is None


async def test_sigterm_ends_a_server_promptly_with_streams_and_long_polls_open(conn, org, servers):
    _, admin_key = org
    a = servers()
    await a.ready()
    async with httpx.AsyncClient(timeout=60) as client:
        code = (await client.post(f"{a.url}/v1/pairings", json={"name": "box"}, headers=_auth(admin_key))).json()["code"]
        redeemed = (
            await client.post(f"{a.url}/v1/pairings/redeem", json={"code": code, "name": "box", "devices": DEVICES})
        ).json()
        await client.post(f"{a.url}/v1/agent/heartbeat", json={"devices": DEVICES}, headers=_auth(redeemed["credential"]))
        outcomes: dict[str, object] = {}

        async def stream():
            async with client.stream("GET", f"{a.url}/v1/events/stream", headers=_auth(admin_key)) as response:
                async for _ in response.aiter_lines():
                    pass
            outcomes["stream"] = "ended"

        async def long_poll():
            response = await client.post(
                f"{a.url}/v1/agent/claim", params={"wait": 60}, headers=_auth(redeemed["credential"])
            )
            outcomes["poll"] = response.status_code

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            tg.start_soon(long_poll)
            await eventually(lambda: _long_polls_waiting(client, a, 1))
            took = await anyio.to_thread.run_sync(a.stop)
    assert took < 8, took
    assert outcomes == {"stream": "ended", "poll": 204}


async def _holders_are(conn, n: int) -> bool:
    return await _sweeper_holders(conn) == n


async def _long_polls_waiting(client: httpx.AsyncClient, server: ServeProcess, n: int) -> bool:
    text = (await client.get(f"{server.url}/metrics")).text
    return f"umbra_long_polls_waiting {float(n)}" in text
