"""The embedded default database: starts in a temp dir, migrates, notifies, stops clean."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import psycopg
import pytest

from tests.helpers import sighup_at_default
from umbra.embedded import _HANDLE_STARTS, _prune_dead_handles, _record_handle, start_embedded

pytestmark = pytest.mark.slow


def _postmasters_for(pgdata) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            cmd = proc.info["cmdline"] or []
            if proc.info["name"] in ("postgres", "postmaster") and proc.info["status"] != psutil.STATUS_ZOMBIE \
                    and str(pgdata) in " ".join(cmd):  # fmt: skip
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
        assert str(os.getpid()) in json.loads((pgdata / _HANDLE_STARTS).read_text())
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
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        with sighup_at_default():  # serve takes SIGHUP as from a closed terminal
            proc = subprocess.Popen([sys.executable, "-m", "umbra.cli", "serve"], env=env, stderr=log_file)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        assert _postmasters_for(tmp_path / "data" / "pg")
        made = subprocess.run([sys.executable, "-m", "umbra.cli", "admin", "create-org", "acme", "--json"], env=env,
                              capture_output=True, check=True, timeout=60)  # fmt: skip
        key = json.loads(made.stdout)["api_key"]
        with socket.create_connection(("127.0.0.1", port)) as stream:  # a dashboard's stream, open at the signal
            stream.sendall(f"GET /v1/events/stream?access_token={key} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            assert stream.recv(100).startswith(b"HTTP/1.1 200")
            proc.send_signal(stop_signal)
            assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logged = log_path.read_text(errors="replace")
    assert "Traceback" not in logged, logged[-3000:]  # every signal is a graceful stop, SIGHUP included
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


@pytest.mark.parametrize("socket_lock_too", [False, True], ids=["pidfile", "pidfile-and-socket-lock"])
def test_a_stale_pidfile_naming_another_process_is_set_aside_and_that_process_lives(tmp_path, socket_lock_too):
    """After a killed postmaster, its PID may belong to anything: starting must neither adopt nor kill that.

    The socket lives in the data dir too, with its lock file naming the postmaster: that PID may be a zombie
    nobody waits for (in a container whose first process is the server) or another process of the server's
    user. PostgreSQL refuses to start while the PID it names exists (one it may not signal, another user's,
    it takes for no postmaster of its own); the stale lock goes with the stale ``postmaster.pid``."""
    pgdata = tmp_path / "pg"
    first = start_embedded(pgdata)
    left_behind = (pgdata / "postmaster.pid").read_text().split("\n")  # as a killed postmaster leaves it
    (socket_lock,) = pgdata.glob(".s.PGSQL.*.lock")
    lock_lines = socket_lock.read_text().split("\n")
    first.stop()
    as_server = pgdata.stat().st_uid if socket_lock_too and os.geteuid() == 0 else None
    bystander = subprocess.Popen(["sleep", "120"], user=as_server)
    try:
        (pgdata / "postmaster.pid").write_text("\n".join([str(bystander.pid), *left_behind[1:]]))
        if socket_lock_too:
            socket_lock.write_text("\n".join([str(bystander.pid), *lock_lines[1:]]))
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


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_handle_whose_pid_now_names_another_process_is_pruned_and_a_live_holder_kept(tmp_path):
    """A dead holder's PID given to some later process is no holder: its server must still be stopped."""
    pgdata = tmp_path / "pg"
    pgdata.mkdir()
    holder, reused = subprocess.Popen(["sleep", "120"]), subprocess.Popen(["sleep", "120"])
    try:
        dead = _dead_pid()
        (pgdata / ".handle_pids.json").write_text(json.dumps([holder.pid, reused.pid, dead]))
        _record_handle(pgdata, holder.pid)
        _record_handle(pgdata, reused.pid)
        starts = json.loads((pgdata / _HANDLE_STARTS).read_text())
        starts[str(reused.pid)] -= 3600  # recorded by the holder that had this PID an hour ago
        (pgdata / _HANDLE_STARTS).write_text(json.dumps(starts))

        _prune_dead_handles(pgdata)

        assert json.loads((pgdata / ".handle_pids.json").read_text()) == [holder.pid]
        assert list(json.loads((pgdata / _HANDLE_STARTS).read_text())) == [str(holder.pid)]
    finally:
        for proc in (holder, reused):
            proc.kill()
            proc.wait()


def test_a_holder_killed_but_not_yet_reaped_is_pruned(tmp_path):
    """A killed holder stays a zombie until its parent waits for it (an init that reaps late, a supervisor
    between two calls): it will never let go of its handle, so the next command, adopting the orphaned
    server, must not keep it running for that zombie."""
    pgdata = tmp_path / "pg"
    pgdata.mkdir()
    holder = subprocess.Popen(["sleep", "120"])
    try:
        (pgdata / ".handle_pids.json").write_text(json.dumps([holder.pid]))
        _record_handle(pgdata, holder.pid)
        holder.send_signal(signal.SIGKILL)  # not waited for: a zombie
        deadline = time.monotonic() + 10
        while psutil.Process(holder.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)

        _prune_dead_handles(pgdata)

        assert json.loads((pgdata / ".handle_pids.json").read_text()) == []
        assert json.loads((pgdata / _HANDLE_STARTS).read_text()) == {}
    finally:
        holder.kill()
        holder.wait()


def test_an_unrecorded_handle_is_kept_only_if_its_process_predates_the_list(tmp_path):
    """With no recorded create time, a process created after the list was last written cannot have added itself."""
    pgdata = tmp_path / "pg"
    pgdata.mkdir()
    handles = pgdata / ".handle_pids.json"
    proc = subprocess.Popen(["sleep", "120"])
    try:
        handles.write_text(json.dumps([proc.pid]))
        _prune_dead_handles(pgdata)
        assert json.loads(handles.read_text()) == [proc.pid]

        written = time.time() - 3600  # left by a holder that died before this process started
        os.utime(handles, (written, written))
        _prune_dead_handles(pgdata)
        assert json.loads(handles.read_text()) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_damaged_record_of_holders_is_ignored_not_fatal(tmp_path):
    from umbra.embedded import _prune_dead_handles

    (tmp_path / ".handle_pids.json").write_text("[]")
    (tmp_path / ".umbra_handle_starts.json").write_text('{"abc": 1.0, "12": "soon", "13": 5}')
    _prune_dead_handles(tmp_path)
    assert json.loads((tmp_path / ".umbra_handle_starts.json").read_text()) == {}
