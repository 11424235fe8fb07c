"""`umbra serve` keeps its embedded PostgreSQL running: a postmaster that dies (the OOM killer, ``kill -9``, a
crash) is started again on the same data dir, and one that cannot be stops the process with a clear message."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers import bearer
from umbra.embedded import working_in

from .test_embedded_postgres import _postmasters_for, _wait_ready
from .test_embedded_recovery import _force_stop, _umbra_env

pytestmark = pytest.mark.slow

#: How long a restarted server may take to serve again: a start, a crash recovery, the listener's back-off.
RECOVERY_BOUND_SECONDS = 90


def _postmaster_pid(pgdata: Path) -> int:
    return int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])


def _serve(data: Path, port: int, log_path: Path) -> subprocess.Popen:
    with open(log_path, "wb") as log_file:
        return subprocess.Popen([sys.executable, "-m", "umbra.cli", "serve"], env=_umbra_env(data, port),
                                stdout=subprocess.DEVNULL, stderr=log_file)  # fmt: skip


def _ready_again(base: str, serve: subprocess.Popen) -> dict:
    """The first ``/readyz`` answer that is ready with the listener connected, within the bound."""
    deadline = time.monotonic() + RECOVERY_BOUND_SECONDS
    answer: dict = {}
    while time.monotonic() < deadline:
        assert serve.poll() is None, f"serve exited with {serve.returncode} instead of starting its database again"
        try:
            response = httpx.get(base + "/readyz", timeout=5)
            answer = response.json()
            if response.status_code == 200 and answer.get("listener_connected"):
                return answer
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"serve was not ready {RECOVERY_BOUND_SECONDS} s after its postmaster was killed: {answer}")


def _busy_backend(pgdata: Path) -> int:
    """The pid of the backend running the busy query, once it runs."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in working_in(pgdata):
            with contextlib.suppress(psutil.Error):
                if "SELECT" in " ".join(psutil.Process(pid).cmdline()):
                    return pid
        time.sleep(0.1)
    raise AssertionError("the busy query never ran")


def _logged_actions(log_path: Path) -> list[str]:
    actions = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            actions.append(json.loads(line).get("action", ""))
        except ValueError:
            continue
    return actions


@pytest.mark.timeout(300)
def test_a_killed_postmaster_is_started_again_and_nothing_acknowledged_is_lost(tmp_path):
    """kill -9 of the embedded postmaster: serve starts it again on the same data dir (crash recovery replays
    the WAL), the pool and the listener reconnect, the job acknowledged before the kill is there, a new one is
    taken, and SIGTERM still stops serve and its postmaster. Before, serve answered 503 until restarted."""
    from tests.conftest import free_port

    port = free_port()
    data = tmp_path / "data"
    pgdata = data / "pg"
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    serve = _serve(data, port, log_path)
    try:
        _wait_ready(base, serve)
        made = subprocess.run([sys.executable, "-m", "umbra.cli", "admin", "create-org", "acme", "--json"],
                              env=_umbra_env(data), capture_output=True, check=True, timeout=60)  # fmt: skip
        key = json.loads(made.stdout)["api_key"]
        submitted = httpx.post(base + "/v1/jobs", json={"kind": "echo"}, headers=bearer(key), timeout=10)
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["id"]

        # A backend busy with a long computation outlives its postmaster (it learns of the death only when it
        # next waits), and may still write the data dir: nothing is started beside it.
        busy = subprocess.Popen([sys.executable, "-c", "import psycopg, sys; psycopg.connect(sys.argv[1]).execute("
                                 "'SELECT count(*) FROM generate_series(1, 10000000000)')",
                                 f"postgresql://postgres@/postgres?host={pgdata}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        backend = _busy_backend(pgdata)
        killed = _postmaster_pid(pgdata)
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "embedded_start_failed" not in _logged_actions(log_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "embedded_start_failed" in _logged_actions(log_path) and psutil.pid_exists(backend)
        assert _postmasters_for(pgdata) == [], "a postmaster was started beside the dead one's busy backend"
        os.kill(backend, signal.SIGKILL)
        busy.wait(timeout=30)

        _ready_again(base, serve)
        assert _postmaster_pid(pgdata) != killed
        kept = httpx.get(f"{base}/v1/jobs/{job_id}", headers=bearer(key), timeout=10)
        assert kept.status_code == 200 and kept.json()["id"] == job_id, kept.text
        again = httpx.post(base + "/v1/jobs", json={"kind": "echo"}, headers=bearer(key), timeout=10)
        assert again.status_code == 201, again.text

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
        deadline = time.monotonic() + 15
        while _postmasters_for(pgdata) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _postmasters_for(pgdata) == [], "the restarted postmaster outlived serve"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        _force_stop(pgdata)
    logged = log_path.read_text(errors="replace")
    assert _logged_actions(log_path).count("embedded_restarted") == 1, logged[-3000:]
    assert "the dead postmaster's processes still run" in logged, logged[-3000:]
    assert key not in logged


@pytest.mark.timeout(300)
def test_serve_exits_non_zero_saying_why_when_its_database_cannot_be_started_again(tmp_path):
    """A data dir PostgreSQL refuses (here: opened to other users) after the postmaster was killed: serve
    gives up after a few attempts and exits non-zero with one line saying so, for a service manager to act."""
    from tests.conftest import free_port

    port = free_port()
    data = tmp_path / "data"
    pgdata = data / "pg"
    log_path = tmp_path / "serve.log"
    serve = _serve(data, port, log_path)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", serve)
        pgdata.chmod(0o777)  # a running postmaster does not look again; a starting one refuses it
        os.kill(_postmaster_pid(pgdata), signal.SIGKILL)
        try:
            status = serve.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail("serve neither started its database again nor gave up")
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        pgdata.chmod(0o700)
        _force_stop(pgdata)
    logged = log_path.read_text(errors="replace")
    assert status == 1, logged[-3000:]
    said = [line for line in logged.splitlines() if line.startswith("umbra serve: error:")]
    assert len(said) == 1 and "embedded database" in said[0], logged[-3000:]
    assert _postmasters_for(pgdata) == []
