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
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources

import anyio
import psycopg

from .db import own_connection

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


async def migrate(url: str) -> list[str]:
    """Apply every pending migration; return the names applied."""
    applied: list[str] = []
    async with own_connection(url, application_name=APPLICATION_NAME) as conn:
        await _take_lock(conn)
        try:
            await conn.execute(_CREATE_TABLE)
            done = {row[0] for row in await (await conn.execute("SELECT version FROM schema_migrations")).fetchall()}
            for migration in available_migrations():
                if migration.version in done:
                    continue
                if migration.transactional:
                    async with conn.transaction():
                        await conn.execute(migration.sql)
                        await conn.execute(_RECORD, (migration.version, migration.name))
                else:
                    for statement in migration.statements():
                        await conn.execute(statement)
                    await conn.execute(_RECORD, (migration.version, migration.name))
                applied.append(migration.name)
                log.info("migration applied", extra={"action": "migration_applied", "migration": migration.name})
        finally:
            await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    return applied


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
