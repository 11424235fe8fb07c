"""The embedded database's supervision as a policy: when it starts the server again, and when it gives up.

A stand-in for the server's handle (``running``, ``restart``), so the decisions are checked without a
postmaster to kill; ``tests/embedded/test_embedded_supervision.py`` kills a real one.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import anyio
import pytest

from umbra.embedded_supervisor import supervise
from umbra.errors import DatabaseUnavailable

pytestmark = pytest.mark.anyio

FAST = {"watch_seconds": 0.001, "first_delay": 0.001}


class Server:
    """A handle whose postmaster the test kills (``up = False``), whose next ``failing`` starts fail, and whose
    started postmaster dies at once with ``dies_after_start``."""

    def __init__(self, *, failing: int = 0, dies_after_start: bool = False) -> None:
        self.up = True
        self.pid = 100
        self.failing = failing
        self.dies_after_start = dies_after_start
        self.starts = 0
        self.restarted = anyio.Event()

    @property
    def running(self) -> bool:
        return self.up

    def restart(self) -> None:
        self.starts += 1
        if self.failing:
            self.failing -= 1
            raise RuntimeError("pg_ctl: could not start server")
        self.pid += 1
        self.up = not self.dies_after_start
        self.restarted.set()


async def test_a_dead_postmaster_is_started_again_and_logged_once(caplog):
    server = Server(failing=2)
    caplog.set_level(logging.INFO, logger="umbra.embedded_supervisor")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: supervise(server, stopping=lambda: False, **FAST))
        server.up = False
        with anyio.fail_after(30):
            await server.restarted.wait()
        await anyio.sleep(0.05)  # still watching, not starting again
        tg.cancel_scope.cancel()
    assert server.starts == 3 and server.up
    actions = [getattr(record, "action", None) for record in caplog.records]
    assert actions.count("embedded_stopped") == 1 and actions.count("embedded_restarted") == 1
    assert actions.count("embedded_start_failed") == 2


async def test_a_postmaster_that_dies_while_the_server_stops_is_left_alone():
    server = Server()
    server.up = False
    with anyio.fail_after(30):
        await supervise(server, stopping=lambda: True, **FAST)
    assert server.starts == 0


async def test_a_database_that_will_not_start_fails_the_server_after_its_attempts():
    server = Server(failing=100)
    server.up = False
    with anyio.fail_after(30), pytest.raises(DatabaseUnavailable, match=r"could not be started again \(3 starts\)") as raised:
        await supervise(server, stopping=lambda: False, attempts=3, **FAST)
    assert server.starts == 3
    assert isinstance(raised.value.__cause__, RuntimeError)  # the last start's own error, for the log


async def test_a_postmaster_that_dies_at_every_start_is_not_started_for_ever():
    server = Server(dies_after_start=True)
    server.up = False
    with anyio.fail_after(30), pytest.raises(DatabaseUnavailable, match=r"did not stay up \(4 starts\)"):
        await supervise(server, stopping=lambda: False, attempts=4, **FAST)
    assert server.starts == 4


async def test_starts_are_forgotten_once_the_server_stayed_up():
    server = Server()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: supervise(server, stopping=lambda: False, attempts=2, stable_seconds=0, **FAST))
        for _ in range(5):  # more deaths than attempts, each after the server stayed up
            server.restarted = anyio.Event()
            server.up = False
            with anyio.fail_after(30):
                await server.restarted.wait()
        tg.cancel_scope.cancel()
    assert server.starts == 5


def test_the_processes_working_in_a_data_dir_are_found_and_zombies_are_not(tmp_path):
    """What a start after a death waits for (``EmbeddedPostgres.restart``): a dead postmaster's backend still busy
    with a query works in the data dir, and may write it; a process elsewhere, or one ended, does not count."""
    from umbra.embedded import working_in

    pgdata, elsewhere = tmp_path / "pg", tmp_path / "other"
    pgdata.mkdir(), elsewhere.mkdir()
    inside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=pgdata)
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=elsewhere)
    try:
        assert working_in(pgdata) == [inside.pid]
        inside.kill()
        deadline = time.monotonic() + 30
        while working_in(pgdata) and time.monotonic() < deadline:  # a zombie until waited for: not counted
            time.sleep(0.05)
        assert working_in(pgdata) == []
    finally:
        for process in (inside, outside):
            process.kill()
            process.wait()
