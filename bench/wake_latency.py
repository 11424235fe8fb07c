"""Wake latency: how soon a parked long-poll returns after a job is committed.

    python -m bench.wake_latency [--samples 1000]

Runs a real ``umbra serve`` subprocess on a scratch database (safety poll at
30 s, so every fast wake is a notification) with one paired, online node, and
measures, per sample, with the long-poll parked before the job exists:

* ``LISTEN/NOTIFY (bare)`` — the floor: a committed ``NOTIFY`` to a listening
  connection, no server involved;
* ``long-poll, outside commit`` — a job submitted on another connection
  (another process, as far as the server knows): commit → claim response;
* ``long-poll, same-server submit`` — ``POST /v1/jobs`` to the server holding
  the long-poll: request sent → claim response. The hint takes the same path as
  any other (the server's own NOTIFY reaches its own LISTEN connection), so
  this includes the submit request itself; its round trip is shown for scale.
* ``next step released`` and ``waiting read answered`` — a pipeline of two
  jobs, B depending on A, A claimed: a long-poll parked for B (blocked until A
  completes) and a read of A parked until it ends (``GET /v1/jobs/{id}?wait=``),
  then A completed through the agent protocol: request sent → the long-poll
  returns B (the sweeper's prompt look, its hint, the claim), and → the read
  returns A complete. The completion's round trip is shown for scale.

Prints a table of p50/p95/p99 in milliseconds and writes
``bench/results/wake_latency.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import AsyncIterator

import anyio
import httpx
import msgspec
import psycopg

from umbra.compute.accounts import create_organization
from umbra.compute.heartbeat import heartbeat
from umbra.compute.jobs import JobRequest, submit
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.domain.heartbeat import HeartbeatReport
from umbra.events.types import Device

from .common import percentile, print_table, scratch_database, write_json

CPU = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=60000)
CPU_DEVICE = msgspec.to_builtins(CPU)
#: How often the bench's node beats while samples are taken, as ``umbra agent`` does by default.
BEAT_SECONDS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _bare_notify(url: str, samples: int) -> list[float]:
    out: list[float] = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as listener, \
            await psycopg.AsyncConnection.connect(url, autocommit=True) as sender:  # fmt: skip
        await listener.execute("LISTEN bench_wake")
        notes = listener.notifies()
        try:
            for i in range(samples):
                async with sender.transaction():
                    await sender.execute("SELECT pg_notify('bench_wake', %s)", (str(i),))
                committed = time.perf_counter()
                note = await anext(notes)
                assert note.payload == str(i)
                out.append(time.perf_counter() - committed)
        finally:
            await notes.aclose()  # it holds the connection's lock until closed
    return out


async def _setup(url: str) -> tuple[uuid.UUID, str, str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        org, api_key = await create_organization(conn, "bench")
        issued = await issue_pairing_code(conn, org, "bench-box")
        node = await redeem_pairing_code(conn, code=issued.code, name="bench-box", source="127.0.0.1", devices=[CPU])
        await heartbeat(conn, org, node.node_id, HeartbeatReport(devices=(CPU,)), event_interval_seconds=3600)
    return org, api_key, node.credential


async def _parked(client: httpx.AsyncClient, *gauges: str) -> None:
    """Until one long-poll claim (and one of each other gauge named) is parked on the server."""
    while True:
        text = (await client.get("/metrics")).text
        if all(f"{gauge} 1.0" in text for gauge in ("umbra_long_polls_waiting", *gauges)):
            return
        await anyio.sleep(0.001)


async def _parked_claim(client: httpx.AsyncClient, headers: dict[str, str], answered: list[float]) -> None:
    """A long-poll claim that must return a job; appends when it returned, then completes the job: left
    leased, the jobs of a measurement longer than a lease (60 s: 1,000 samples on a slow machine) went back
    to the queue, and later parked claims took them at once instead of waiting for their own."""
    response = await client.post("/v1/agent/claim", params={"wait": 30}, headers=headers)
    answered.append(time.perf_counter())
    assert response.status_code == 200, response.status_code
    job = response.json()["job"]
    done = await client.post(f"/v1/agent/jobs/{job['id']}/complete", json={"attempt": job["attempt"], "result": {}}, headers=headers)
    assert done.status_code == 200, done.text


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@contextlib.asynccontextmanager
async def _clients(base: str, url: str, credential: str) -> AsyncIterator[tuple[httpx.AsyncClient, psycopg.AsyncConnection]]:
    """The samples' HTTP client (one keep-alive connection) and their own database connection, while the node
    beats as its agent would (on a connection of its own): a measurement outlasting the stale threshold
    (45 s; 1,000 samples on a slow machine) otherwise found the node offline, and its claims answered 204."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as client, \
            await psycopg.AsyncConnection.connect(url, autocommit=True) as conn, \
            anyio.create_task_group() as beating:  # fmt: skip
        beating.start_soon(_beat, base, credential)
        yield client, conn
        beating.cancel_scope.cancel()


async def _beat(base: str, credential: str) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        while True:
            await anyio.sleep(BEAT_SECONDS)
            beat = await client.post("/v1/agent/heartbeat", json={"devices": [CPU_DEVICE]}, headers=_bearer(credential))
            assert beat.status_code == 200, beat.text


async def _long_poll_samples(base: str, url: str, org: uuid.UUID, api_key: str, credential: str, samples: int, *, via_http: bool):
    latencies: list[float] = []
    round_trips: list[float] = []
    node_headers, key_headers = _bearer(credential), _bearer(api_key)
    async with _clients(base, url, credential) as (client, conn):
        for i in range(samples):
            answered: list[float] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_parked_claim, client, node_headers, answered)
                await _parked(client)
                if via_http:
                    started = time.perf_counter()
                    response = await client.post("/v1/jobs", json={"kind": "bench", "payload": {"i": i}}, headers=key_headers)
                    assert response.status_code == 201
                    round_trips.append(time.perf_counter() - started)
                else:
                    await submit(conn, org, [JobRequest(kind="bench", payload={"i": i})], actor="bench", batch=False)
                    started = time.perf_counter()  # submit() returns once its transaction committed
            latencies.append(answered[0] - started)
    return latencies, round_trips


async def _next_step_samples(base: str, url: str, org: uuid.UUID, api_key: str, credential: str, samples: int):
    """Per sample: completion request sent → the parked claim returns the dependent, and → the parked read of
    the completed job returns; and the completion's round trip."""
    released: list[float] = []
    answered: list[float] = []
    round_trips: list[float] = []
    node_headers, key_headers = _bearer(credential), _bearer(api_key)
    async with _clients(base, url, credential) as (client, conn):
        for i in range(samples):
            [first, _], _ = await submit(conn, org, [JobRequest(kind="step", payload={"i": i}),
                                                     JobRequest(kind="step", depends_on=[0])], actor="bench", batch=True)  # fmt: skip
            claimed = await client.post("/v1/agent/claim", params={"wait": 0}, headers=node_headers)
            assert claimed.status_code == 200 and claimed.json()["job"]["id"] == str(first.id), claimed.text
            next_step: list[float] = []
            read: list[float] = []

            async def waiting_read() -> None:
                response = await client.get(f"/v1/jobs/{first.id}", params={"wait": 30}, headers=key_headers)
                read.append(time.perf_counter())
                assert response.json()["status"] == "complete", response.text

            async with anyio.create_task_group() as tg:
                tg.start_soon(_parked_claim, client, node_headers, next_step)
                tg.start_soon(waiting_read)
                await _parked(client, "umbra_job_reads_waiting")
                started = time.perf_counter()
                done = await client.post(f"/v1/agent/jobs/{first.id}/complete", headers=node_headers,
                                         json={"attempt": claimed.json()["job"]["attempt"], "result": {}})  # fmt: skip
                round_trips.append(time.perf_counter() - started)
                assert done.status_code == 200, done.text
            released.append(next_step[0] - started)
            answered.append(read[0] - started)
            second = await client.post("/v1/agent/claim", params={"wait": 0}, headers=node_headers)
            assert second.status_code == 204, second.status_code  # the dependent was the parked claim's
    return released, answered, round_trips


def _serve(url: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "UMBRA_DATABASE_URL": url, "UMBRA_POLL_FALLBACK_SECONDS": "30", "UMBRA_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "umbra.cli", "serve", "--port", str(port)], env=env, stdout=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("umbra serve did not become ready")
        time.sleep(0.1)


def _server_mean_ms(base: str, histogram: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics").text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or "le" not in sample.labels
    }
    count = values.get(f"{histogram}_count", 0)
    return values.get(f"{histogram}_sum", 0) / count * 1000 if count else float("nan")


def _row(name: str, samples: list[float]) -> list:
    ms = [s * 1000 for s in samples]
    return [name, len(ms), percentile(ms, 50), percentile(ms, 95), percentile(ms, 99), max(ms)]


def run(samples: int) -> dict:
    """Measure every row; returns ``{"results": [...], "server_hint_to_claim_mean_ms": ...}``."""
    with scratch_database("umbra_bench_wake") as url:
        org, api_key, credential = anyio.run(_setup, url)
        proc, base = _serve(url)
        try:
            bare = anyio.run(_bare_notify, url, samples)
            outside, _ = anyio.run(lambda: _long_poll_samples(base, url, org, api_key, credential, samples, via_http=False))
            same, round_trips = anyio.run(lambda: _long_poll_samples(base, url, org, api_key, credential, samples, via_http=True))
            released, answered, completions = anyio.run(lambda: _next_step_samples(base, url, org, api_key, credential, samples))
            hint_to_claim = _server_mean_ms(base, "umbra_wake_latency_seconds")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    rows = [
        _row("LISTEN/NOTIFY (bare)", bare),
        _row("long-poll, outside commit", outside),
        _row("long-poll, same-server submit", same),
        _row("  (POST /v1/jobs round trip)", round_trips),
        _row("next step released (completion -> its dependent's claim)", released),
        _row("waiting read answered (completion -> ?wait= read)", answered),
        _row("  (POST .../complete round trip)", completions),
    ]
    results = [dict(zip(["measurement", "samples", "p50_ms", "p95_ms", "p99_ms", "max_ms"], row)) for row in rows]
    return {"results": results, "server_hint_to_claim_mean_ms": hint_to_claim}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1000, help="samples per measurement (default 1000)")
    args = parser.parse_args()
    payload = run(args.samples)
    headers = ["measurement", "samples", "p50 ms", "p95 ms", "p99 ms", "max ms"]
    rows = [[r["measurement"], r["samples"], r["p50_ms"], r["p95_ms"], r["p99_ms"], r["max_ms"]] for r in payload["results"]]
    print_table("Wake latency: commit -> parked long-poll returns", headers, rows)
    print(f"\nserver side, hint received -> claim committed (mean of its histogram): {payload['server_hint_to_claim_mean_ms']:.2f} ms")
    print(f"\nwrote {write_json('wake_latency', payload)}")


if __name__ == "__main__":
    main()
