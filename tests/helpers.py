"""Small test utilities: waiting on conditions without sleeping in assertions, running ``umbra``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Awaitable, Callable, Iterator, TypeVar

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
