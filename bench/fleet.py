"""Benchmark fixtures: a real ``umbra serve`` subprocess, an organization, paired nodes, queued jobs.

The server runs as a separate process (``python -m umbra.cli serve``) so the
benchmark's clients and the server do not share one Python interpreter's
event loop or GIL; on a 2-core machine they still share the cores with
PostgreSQL, which is part of what is being measured.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import anyio
import httpx
import psycopg

from umbra.compute.accounts import create_organization
from umbra.compute.heartbeat import heartbeat
from umbra.compute.jobs import JobRequest, submit
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.domain.heartbeat import HeartbeatReport
from umbra.events.types import Device

CPU = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=60000)
CPU_JSON = {"kind": "cpu", "label": "cpu", "vram_total_mb": 0, "vram_free_mb": 0, "ram_total_mb": 65536,
            "ram_free_mb": 60000, "throughput_factor": 1.0, "accelerators": [], "resident_models": []}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_open_files(wanted: int) -> int:
    """Raise this process's open-file limit towards ``wanted`` (up to the hard limit); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, wanted), hard) if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


@dataclass
class Server:
    process: subprocess.Popen
    base: str

    @property
    def pid(self) -> int:
        return self.process.pid


@contextmanager
def serve(url: str, **env: str) -> Iterator[Server]:
    """``umbra serve`` on a free port against ``url``; stopped with SIGTERM afterwards."""
    port = free_port()
    environment = {**os.environ, "UMBRA_DATABASE_URL": url, "UMBRA_LOG_LEVEL": "WARNING", **env}
    process = subprocess.Popen(
        [sys.executable, "-m", "umbra.cli", "serve", "--port", str(port)], env=environment, stdout=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise SystemExit("umbra serve did not become ready")
            time.sleep(0.1)
        yield Server(process, base)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def new_organization(url: str, name: str = "bench") -> tuple[uuid.UUID, str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return await create_organization(conn, name)


async def pair_over_http(client: httpx.AsyncClient, api_key: str, names: list[str]) -> list[tuple[uuid.UUID, str]]:
    """Pair each named node through the API (code, redeem, first heartbeat); returns ``(node_id, credential)``.

    Redemption is rate-limited to 20 per source address per 15 minutes, so at
    most 20 nodes per database this way.
    """
    out = []
    for name in names:
        issued = await client.post("/v1/pairings", json={"name": name}, headers={"Authorization": f"Bearer {api_key}"})
        issued.raise_for_status()
        redeemed = await client.post(
            "/v1/pairings/redeem",
            json={"code": issued.json()["code"], "name": name, "agent_version": "bench", "devices": [CPU_JSON]},
        )
        redeemed.raise_for_status()
        body = redeemed.json()
        await beat(client, body["credential"])
        out.append((uuid.UUID(body["node_id"]), body["credential"]))
    return out


async def beat(client: httpx.AsyncClient, credential: str) -> None:
    response = await client.post(
        "/v1/agent/heartbeat", json={"devices": [CPU_JSON], "agent_version": "bench"},
        headers={"Authorization": f"Bearer {credential}"},
    )  # fmt: skip
    response.raise_for_status()


GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24000, accelerators=("cuda",),
             throughput_factor=10.0)


async def pair_in_process(
    url: str, organization_id: uuid.UUID, names: list[str], *, device: Device = CPU
) -> list[tuple[uuid.UUID, str]]:
    """Pair nodes by calling the compute layer directly (no rate limit); each is online after one beat."""
    out = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for index, name in enumerate(names):
            issued = await issue_pairing_code(conn, organization_id, name)
            source = f"127.{(index >> 16) & 255}.{(index >> 8) & 255}.{index & 255 or 1}"
            node = await redeem_pairing_code(conn, code=issued.code, name=name, source=source, devices=[device])
            await heartbeat(conn, organization_id, node.node_id, HeartbeatReport(devices=(device,)), event_interval_seconds=3600)
            out.append((node.node_id, node.credential))
    return out


async def beat_in_process(url: str, organization_id: uuid.UUID, node_ids: list[uuid.UUID]) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for node_id in node_ids:
            await heartbeat(conn, organization_id, node_id, HeartbeatReport(devices=(CPU,)), event_interval_seconds=3600)


async def submit_noops(url: str, organization_id: uuid.UUID, count: int, *, batch: int = 5000, kind: str = "noop") -> None:
    """Queue ``count`` no-op jobs in batches (one transaction per batch)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for start in range(0, count, batch):
            specs = [JobRequest(kind=kind, payload={"i": i}) for i in range(start, min(count, start + batch))]
            await submit(conn, organization_id, specs, actor="bench", batch=True)


async def sleep_until(predicate, timeout: float, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await anyio.sleep(interval)
