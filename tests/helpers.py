"""Small test utilities: waiting on conditions without sleeping in assertions, running ``umbra``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import anyio
import psycopg

T = TypeVar("T")


async def eventually(check: Callable[[], Awaitable[T]], *, timeout: float = 10.0, interval: float = 0.02) -> T:
    """Await ``check()`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = await check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")
        await anyio.sleep(interval)


async def until(condition: Callable[[], object], *, timeout: float = 10.0) -> object:
    """:func:`eventually` for a condition read without awaiting (a hub's count of parked long-polls, a list an
    answer lands in)."""

    async def check() -> object:
        return condition()

    return await eventually(check, timeout=timeout)


@contextmanager
def sighup_at_default() -> Iterator[None]:
    """Within the block, SIGHUP at its default, as a terminal's session has it, whatever the test run's own
    disposition (under ``nohup`` it is ignored): for this process, and for the processes started in the block,
    which inherit it."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def bearer(token: str) -> dict[str, str]:
    """The Authorization header for ``token``."""
    return {"Authorization": f"Bearer {token}"}


_WAITING = """
SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
WHERE NOT l.granted AND a.datname = current_database() AND (%(type)s::text IS NULL OR l.locktype = %(type)s)
"""


async def sessions_waiting_on_a_lock(conn, locktype: str | None = None) -> int:
    """How many sessions of ``conn``'s database (this test's own) wait for a lock, of ``locktype`` if given."""
    row = await (await conn.execute(_WAITING, {"type": locktype})).fetchone()
    return row[0]


async def waiting_on_a_lock(conn, locktype: str | None = None) -> bool:
    """Whether a session of ``conn``'s database (this test's own) waits for a lock, of ``locktype`` if given."""
    return await sessions_waiting_on_a_lock(conn, locktype) > 0


async def until_done_or_waiting(conn, done: Callable[[], bool], *, timeout: float = 10.0) -> None:
    """Wait until ``done()`` or until a session of this database waits for a lock: how far a concurrent step got."""
    with anyio.move_on_after(timeout):
        while not done() and not await waiting_on_a_lock(conn):
            await anyio.sleep(0.01)


@contextlib.asynccontextmanager
async def lock_held_for_a_second(db_url: str, lock_sql: str, params: tuple = ()):
    """``(waiter, holder)``: a connection whose lock waits are bounded at 300 ms, and another session that
    holds ``lock_sql``'s lock for one second from now (in its open transaction) before it lets go."""
    async with await psycopg.AsyncConnection.connect(db_url) as holder, \
            await psycopg.AsyncConnection.connect(db_url) as waiter:  # fmt: skip
        await waiter.execute("SET lock_timeout = '300ms'")
        await waiter.commit()
        await holder.execute(lock_sql, params)

        async def release_later() -> None:
            await anyio.sleep(1.0)
            await holder.commit()

        async with anyio.create_task_group() as tg:
            tg.start_soon(release_later)
            yield waiter, holder


#: The source checkout: ``python -m umbra.cli`` runs from here.
ROOT = Path(__file__).resolve().parents[1]


def run_umbra(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``umbra ARGV`` as a process, with this environment but no UMBRA_API_KEY or UMBRA_SERVER, updated by ``env``."""
    environment = {k: v for k, v in os.environ.items() if k not in ("UMBRA_API_KEY", "UMBRA_SERVER")}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "umbra.cli", *argv], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


async def generic_plans(conn, run: Callable[[], Awaitable[Any]], *, table: str) -> list[str]:
    """The plans (auto_explain's JSON, sent as notices) of the statements ``run()`` sends on ``conn`` that read
    ``table``, each planned generic, as a pooled connection's prepared statement comes to be planned, with
    sequential scans priced out: what a read of a large table would take. Skips where auto_explain is missing."""
    plans: list[str] = []

    def note(diagnostic) -> None:
        if f'"Relation Name": "{table}"' in (diagnostic.message_primary or ""):
            plans.append(diagnostic.message_primary)

    try:
        await conn.execute("LOAD 'auto_explain'")
    except psycopg.Error as exc:  # a server built without contrib
        import pytest

        pytest.skip(f"auto_explain is not available: {exc}")
    for name, value in (("plan_cache_mode", "force_generic_plan"), ("enable_seqscan", "off"),
                        ("auto_explain.log_min_duration", "0"), ("auto_explain.log_format", "json"),
                        ("auto_explain.log_level", "notice")):  # fmt: skip
        await conn.execute("SELECT set_config(%s, %s, false)", (name, value))
    conn.add_notice_handler(note)
    try:
        await run()
    finally:
        conn.remove_notice_handler(note)
        await conn.execute("RESET ALL")
    assert plans, f"no plan read {table}"
    return plans


def index_names(plan: str) -> set[str]:
    """The indexes an auto_explain JSON plan (:func:`generic_plans`) reads."""

    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if "Index Name" in node:
                yield node["Index Name"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    return set(walk(json.loads(plan[plan.index("{") :])))
