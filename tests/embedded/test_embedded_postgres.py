"""The embedded default database: starts in a temp dir, migrates, notifies, stops clean."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import psycopg
import pytest

from umbra.embedded import start_embedded

pytestmark = pytest.mark.slow


def _postmasters_for(pgdata) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = proc.info["cmdline"] or []
            if proc.info["name"] in ("postgres", "postmaster") and str(pgdata) in " ".join(cmd):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_embedded_server_migrates_notifies_and_stops(tmp_path):
    import anyio

    from umbra.migrate import migrate

    pgdata = tmp_path / "pg"
    server = start_embedded(pgdata)
    try:
        assert anyio.run(migrate, server.url)
        with psycopg.connect(server.url, autocommit=True) as listener, psycopg.connect(server.url, autocommit=True) as sender:
            listener.execute("LISTEN umbra_test")
            sender.execute("SELECT pg_notify('umbra_test', 'hello')")
            notes = list(listener.notifies(timeout=5, stop_after=1))
            assert [n.payload for n in notes] == ["hello"]
        assert _postmasters_for(pgdata)
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while _postmasters_for(pgdata) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _postmasters_for(pgdata) == []


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited early with {proc.returncode}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("serve never became ready")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_serve_on_embedded_database_leaves_no_postgres_behind(tmp_path, stop_signal):
    from tests.conftest import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMBRA_")}
    env.update({"UMBRA_DATA_DIR": str(tmp_path / "data"), "UMBRA_PORT": str(port), "LANG": "xx_YY.UTF-8"})
    proc = subprocess.Popen([sys.executable, "-m", "umbra.cli", "serve"], env=env, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        assert _postmasters_for(tmp_path / "data" / "pg")
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while _postmasters_for(tmp_path / "data" / "pg") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _postmasters_for(tmp_path / "data" / "pg") == []


def test_a_killed_server_is_adopted_and_then_stopped(tmp_path):
    """kill -9 of serve orphans postgres; the next run adopts it and stops it on exit."""
    from tests.conftest import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("UMBRA_")}
    env["UMBRA_DATA_DIR"] = str(tmp_path / "data")
    pgdata = tmp_path / "data" / "pg"
    for sig in (signal.SIGKILL, signal.SIGTERM):
        port = free_port()
        env["UMBRA_PORT"] = str(port)
        proc = subprocess.Popen([sys.executable, "-m", "umbra.cli", "serve"], env=env, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(f"http://127.0.0.1:{port}", proc)
            proc.send_signal(sig)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if sig == signal.SIGKILL:
            assert _postmasters_for(pgdata), "expected an orphan after kill -9"
    deadline = time.monotonic() + 10
    while _postmasters_for(pgdata) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _postmasters_for(pgdata) == []


def test_a_stale_pidfile_naming_another_process_is_set_aside_and_that_process_lives(tmp_path):
    """After a killed postmaster, its PID may belong to anything: starting must neither adopt nor kill that."""
    pgdata = tmp_path / "pg"
    first = start_embedded(pgdata)
    left_behind = (pgdata / "postmaster.pid").read_text().split("\n")  # as a killed postmaster leaves it
    first.stop()
    bystander = subprocess.Popen(["sleep", "120"])
    try:
        (pgdata / "postmaster.pid").write_text("\n".join([str(bystander.pid), *left_behind[1:]]))
        server = start_embedded(pgdata)
        try:
            with psycopg.connect(server.url, autocommit=True) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
            assert server.pid != bystander.pid and _postmasters_for(pgdata)
        finally:
            server.stop()
        assert bystander.poll() is None, "the unrelated process was killed"
    finally:
        bystander.kill()
        bystander.wait()
