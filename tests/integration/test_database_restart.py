"""The server across a PostgreSQL restart: no request fails on a connection the database closed."""

from __future__ import annotations

import anyio
import psycopg
import pytest

from tests.helpers import bearer

pytestmark = pytest.mark.anyio


async def test_requests_after_the_database_dropped_every_connection_all_succeed(live_server, client, org, db_url):
    """A restart ends every session; once the listener has reconnected, the pool's dead idle connections
    have been replaced, not handed out one failed request each."""
    _, key = org
    for _ in range(6):  # open several pooled connections
        assert (await client.get("/v1/jobs", headers=bearer(key))).status_code == 200
    dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
        ended = [pid for (pid,) in await (await admin.execute(
            "WITH others AS MATERIALIZED (SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()) "
            "SELECT pid FROM others WHERE pg_terminate_backend(pid)", (dbname,))).fetchall()]  # fmt: skip
        assert len(ended) >= 2
        for _ in range(200):  # until the terminated sessions have ended (they send their FATAL and close)
            left = (await (await admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (ended,))).fetchone())[0]  # fmt: skip
            if not left:
                break
            await anyio.sleep(0.01)
    listener = live_server.app.state.services.listener
    for _ in range(500):  # the listener's connection died too: its reconnection has the pool checked
        if listener.reconnects and listener.connected.is_set():
            break
        await anyio.sleep(0.01)
    await anyio.sleep(0.2)  # the check runs beside the listener
    statuses = [(await client.get("/v1/jobs", headers=bearer(key))).status_code for _ in range(12)]
    assert statuses == [200] * 12
    created = await client.post("/v1/jobs", json={"kind": "echo"}, headers=bearer(key))
    assert created.status_code == 201


def test_a_background_task_that_fails_fails_health_and_stops_the_server(db_url, monkeypatch):
    """Not a process that answers /healthz 200 while nothing behind it works."""
    import threading
    import time

    import httpx

    from tests.conftest import free_port
    from umbra.api import server as serving
    from umbra.api.app import create_app
    from umbra.compute import sweeper
    from umbra.settings import load_settings

    release = threading.Event()

    async def failing_sweeper(settings, url, *, log_moved):
        import anyio

        await anyio.to_thread.run_sync(release.wait, 10)
        raise RuntimeError("the sweeper broke")

    monkeypatch.setattr(sweeper, "run", failing_sweeper)
    port = free_port()
    app = create_app(load_settings({"UMBRA_DATABASE_URL": db_url}), db_url)
    server = serving.Server(serving.config(app, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        release.set()
        thread.join(timeout=15)
        assert not thread.is_alive(), "the server stopped by itself"
        assert app.state.failure == "the sweeper stopped: RuntimeError"  # the type only: the text may name internals
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=15)


async def test_health_says_failed_once_a_background_task_failed(db_url):
    import httpx

    from umbra.api.app import create_app
    from umbra.settings import load_settings

    app = create_app(load_settings({"UMBRA_DATABASE_URL": db_url}), db_url)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.get("/healthz")).status_code == 200
        app.state.failure = "the sweeper stopped: RuntimeError"
        failed = await client.get("/healthz")
        not_ready = await client.get("/readyz")  # a load balancer stops sending it requests at once
    assert not_ready.status_code == 503 and not_ready.json()["error"] == "background_task_failed"
    assert failed.status_code == 503 and failed.json() == {
        "status": "failed", "error": "background_task_failed", "message": "the sweeper stopped: RuntimeError"}
