"""Chaos in CI: a short run of ``bench.chaos`` with real processes, plus what it taught.

The run: 500 jobs, 4 ``umbra agent`` processes ``kill -9``'d and restarted
every second or so, the ``umbra serve`` process ``kill -9``'d and restarted
once, its LISTEN connection terminated once. Afterwards no acknowledged job is
missing, every job is terminal, none was claimed while held or completed
twice, ``umbra verify`` exits 0, and the event log read over HTTP while it was
being written, and again afterwards, equals the table.
"""

from __future__ import annotations

import logging
import socket

import psycopg
import pytest

from bench.chaos import ChaosConfig, run
from tests.helpers import eventually
from umbra.events.listener import APPLICATION_NAME

pytestmark = pytest.mark.anyio


@pytest.mark.slow
@pytest.mark.timeout(170)
async def test_killing_agents_the_server_and_the_listener_loses_nothing_and_repeats_nothing(db_url, tmp_path):
    config = ChaosConfig(jobs=500, agents=4, server_kills=1, agent_kill_interval=1.0, lease_seconds=3,
                         time_limit=100, work_dir=tmp_path)  # fmt: skip
    report = await run(db_url, config)
    assert report.violations == [], report.line()
    assert report.acknowledged == report.jobs == 500
    assert set(report.statuses) <= {"complete", "failed"}
    assert report.completions == report.statuses.get("complete", 0)
    assert report.server_kills == 1 and report.listener_kills == 1 and report.listener_reconnected
    assert report.agent_kills >= 3, "the agents were killed while they worked"
    assert report.events >= 3 * 500, "submitted, claimed and completed, at least"


async def test_the_listener_is_named_in_pg_stat_activity(live_server, db_url):
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        async def listener():
            rows = await (await conn.execute(
                "SELECT query FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
                (APPLICATION_NAME,))).fetchall()  # fmt: skip
            return rows

        rows = await eventually(listener)
    assert len(rows) == 1 and rows[0][0].upper().startswith(("LISTEN", "SELECT 1"))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_client_killed_mid_request_is_not_a_server_error(live_server, org):
    """An agent killed while sending its body: the request ends quietly, with no error logged."""
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("umbra", "uvicorn.error")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(records)
        logger.setLevel(logging.INFO)
    try:
        with socket.create_connection(("127.0.0.1", live_server.port)) as raw:
            raw.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + org[1].encode()
                        + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"kind\": ")  # fmt: skip

        async def request_logged():
            return [r for r in records.records if getattr(r, "action", None) == "http_request" and r.path == "/v1/jobs"]

        [logged] = await eventually(request_logged)
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(records)
            logger.setLevel(level)
    assert logged.status == 499
    assert [r for r in records.records if r.levelno >= logging.ERROR] == []
