"""Forward-only numbered SQL migrations, applied under an advisory lock.

Files in ``migrations/`` are named ``NNNN_name.sql`` and applied in order, each
in its own transaction together with its row in ``schema_migrations``, so a
failed migration leaves nothing half-applied. Concurrent ``migrate`` runs (two
servers starting at once) serialise on the advisory lock; the loser finds the
work done and applies nothing.

A migration whose first line is :data:`NO_TRANSACTION` runs outside a
transaction, its statements one by one, and is recorded once they all
succeeded: for ``CREATE INDEX CONCURRENTLY``, which PostgreSQL refuses inside a
transaction. Built in a migration's transaction, an index on ``jobs`` held off
every writer of the queue while it read the whole table (a maintenance window
on a large queue); built concurrently, the queue goes on. Such a migration may
stop half-way (a statement fails, the process dies) and is then run again
whole, so each statement must be safe to repeat: an index is dropped if it
exists (a concurrent build that failed leaves an invalid one behind) before it
is built. Its statements end with ``;`` at the end of a line; no function
bodies.

A migration waits for a lock another session holds (an operator's open
transaction that read a table it alters) for at most the lock timeout
(``UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS``), then lets go and is tried again
after a pause, :data:`LOCK_ATTEMPTS` times in all, before the run fails naming
the sessions it waited for (:class:`MigrationBlocked`). Unbounded, its lock
request, queued ahead of every later one, stopped each writer of the table
behind it for as long as the operator's transaction stayed open: the whole
service, for a table such as ``jobs``. A migration in a transaction let go of
is rolled back whole; one outside a transaction keeps the statements it
completed and, where a concurrent build was stopped, an invalid index, and is
run again whole (so each of its statements is safe to repeat, as above).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from dataclasses import dataclass
from importlib import resources

import anyio
import psycopg

from . import jitter
from .db import own_connection
from .errors import UmbraError
from .lock_holders import LockHolder, note_holders
from .settings import Settings

log = logging.getLogger(__name__)

#: The first line of a migration that runs outside a transaction (see the module's docstring).
NO_TRANSACTION = "-- umbra: no transaction"
_STATEMENT_END = re.compile(r";[ \t]*$", re.MULTILINE)

#: Advisory lock key held while migrating ("umbramig" in ASCII).
MIGRATION_LOCK_KEY = 0x756D6272616D6967
_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def transactional(self) -> bool:
        return not self.sql.startswith(NO_TRANSACTION)

    def statements(self) -> list[str]:
        """The statements of a migration run outside a transaction, one by one (comments and all)."""
        return [part.strip() for part in _STATEMENT_END.split(self.sql) if _has_sql(part)]


def _has_sql(text: str) -> bool:
    return any(line.strip() and not line.strip().startswith("--") for line in text.splitlines())


def available_migrations() -> list[Migration]:
    out = []
    for entry in resources.files("umbra.migrations").iterdir():
        match = _NAME.match(entry.name)
        if match:
            out.append(Migration(int(match.group(1)), entry.name, entry.read_text()))
    out.sort(key=lambda m: m.version)
    versions = [m.version for m in out]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration numbers: {versions}")
    return out


_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""


_RECORD = "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)"
#: ``application_name`` of a migrating connection (one waiting for the lock included).
APPLICATION_NAME = "umbra-migrate"
#: Seconds between tries for the lock while another run migrates.
LOCK_RETRY_SECONDS = 0.2


async def _take_lock(conn: psycopg.AsyncConnection) -> None:
    """Take the migration lock, trying again until the run holding it lets go.

    Tried, not waited for in a statement: a statement waiting for a lock holds a snapshot, and
    ``CREATE INDEX CONCURRENTLY`` in the holder's no-transaction migration waits for every snapshot older
    than its own: two servers starting at once deadlocked.
    """
    while not (await (await conn.execute("SELECT pg_try_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))).fetchone())[0]:  # type: ignore[index]
        await anyio.sleep(LOCK_RETRY_SECONDS)


#: Times a migration is tried while another session holds a lock it needs, each waiting for it at most the
#: lock timeout, before the run gives up. The table's writers, queued behind each try, go on in the pauses
#: between them, which double from one lock timeout (each drawn from half of it to all, so that servers
#: starting together do not try in step). With the default 2 s timeout, a run gives up within 22 s.
LOCK_ATTEMPTS = 4


class MigrationBlocked(UmbraError):
    """A migration whose locks another session held through every try: nothing of it was committed but what a
    migration outside a transaction completed before (see the module's docstring)."""

    def __init__(self, migration: str, lock_timeout_seconds: float, holders: list[LockHolder]) -> None:
        who = "; ".join(map(str, holders)) or "a session gone before it could be named"
        pid = str(holders[0].pid) if len(holders) == 1 else "pid"
        super().__init__("migration_blocked",
                         f"{migration} was not applied: another session held a lock it needs through {LOCK_ATTEMPTS} "
                         f"waits of {lock_timeout_seconds:g} s (UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS): {who}. Let its "
                         f"transaction end (or end it: SELECT pg_terminate_backend({pid})), then run this again.")  # fmt: skip
        self.holders = holders


async def migrate(url: str, *, lock_timeout_seconds: float = Settings.migrate_lock_timeout_seconds) -> list[str]:
    """Apply every pending migration; return the names applied. Raises :class:`MigrationBlocked` for one whose
    locks another session held through every try (:data:`LOCK_ATTEMPTS`), the ones before it applied."""
    applied: list[str] = []
    async with own_connection(url, application_name=APPLICATION_NAME) as conn:
        await _take_lock(conn)
        try:
            lock_timeout = f"{max(1, math.ceil(lock_timeout_seconds * 1000))}ms"  # 0 would be no bound at all
            await conn.execute("SELECT set_config('lock_timeout', %s, false)", (lock_timeout,))
            await conn.execute(_CREATE_TABLE)
            done = {row[0] for row in await (await conn.execute("SELECT version FROM schema_migrations")).fetchall()}
            for migration in available_migrations():
                if migration.version in done:
                    continue
                await _apply(conn, url, migration, lock_timeout_seconds)
                applied.append(migration.name)
                log.info("migration applied", extra={"action": "migration_applied", "migration": migration.name})
        finally:
            await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    return applied


async def _apply(conn: psycopg.AsyncConnection, url: str, migration: Migration, lock_timeout_seconds: float) -> None:
    """Apply ``migration``, tried again while another session holds a lock it needs (see the module's docstring).

    The first try runs alone; once it waited in vain, a second connection, opened in the pause, looks at
    whom each further try waits for while it waits, to name them if none gets through.
    """
    holders: dict[int, LockHolder] = {}
    async with contextlib.AsyncExitStack() as stack:
        watcher: psycopg.AsyncConnection | None = None
        for attempt in range(1, LOCK_ATTEMPTS + 1):
            seen: dict[int, LockHolder] = {}
            if await _try(conn, migration, watcher, seen):
                return
            holders = seen or holders
            log.info("migration waited for a lock held by another session", extra={
                "action": "migration_lock_wait", "migration": migration.name, "attempt": attempt,
                "holder_pids": ",".join(map(str, holders))})  # fmt: skip
            if attempt == LOCK_ATTEMPTS:
                break
            if watcher is None:
                watcher = await stack.enter_async_context(own_connection(url, application_name=APPLICATION_NAME))
            await anyio.sleep(lock_timeout_seconds * 2 ** (attempt - 1) * jitter.uniform(0.5, 1.0))
    raise MigrationBlocked(migration.name, lock_timeout_seconds, list(holders.values()))


async def _try(conn: psycopg.AsyncConnection, migration: Migration, watcher: psycopg.AsyncConnection | None,
               seen: dict[int, LockHolder]) -> bool:  # fmt: skip
    """Run ``migration`` once: True once applied and recorded, False if a lock wait ran out (a migration in a
    transaction rolled back). With a ``watcher``, the sessions it waits for are noted in ``seen`` meanwhile."""
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        if watcher is not None:
            tg.start_soon(note_holders, watcher, conn.info.backend_pid, seen)
        try:
            await _run(conn, migration)
        except Exception as exc:  # raised below, not through the task group (which would wrap it in a group)
            failure = exc
        tg.cancel_scope.cancel()
    if isinstance(failure, psycopg.errors.LockNotAvailable):
        return False
    if failure is not None:
        raise failure
    return True


async def _run(conn: psycopg.AsyncConnection, migration: Migration) -> None:
    if migration.transactional:
        async with conn.transaction():
            await conn.execute(migration.sql)
            await conn.execute(_RECORD, (migration.version, migration.name))
    else:
        for statement in migration.statements():
            await conn.execute(statement)
        await conn.execute(_RECORD, (migration.version, migration.name))


async def _applied(conn: psycopg.AsyncConnection) -> dict[int, str]:
    """The migrations the database records as applied, version to name, oldest first (none before any)."""
    exists = await (await conn.execute("SELECT to_regclass('schema_migrations') IS NOT NULL")).fetchone()
    if not (exists and exists[0]):
        return {}
    return dict(await (await conn.execute("SELECT version, name FROM schema_migrations ORDER BY version")).fetchall())


async def pending_migrations(conn: psycopg.AsyncConnection) -> list[str]:
    """Names of migrations not yet applied (empty when the schema is current)."""
    done = await _applied(conn)
    return [m.name for m in available_migrations() if m.version not in done]


async def migrations_ahead(conn: psycopg.AsyncConnection) -> list[str]:
    """Names of migrations the database has applied that this release does not ship, oldest first.

    A newer release migrated the database: during a rolling upgrade servers of
    the previous release still run against it (a migration keeps what they use,
    see 0032), so this is said, not refused.
    """
    shipped = {m.version for m in available_migrations()}
    return [name for version, name in (await _applied(conn)).items() if version not in shipped]
