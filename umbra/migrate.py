"""Forward-only numbered SQL migrations, applied under an advisory lock.

Files in ``migrations/`` are named ``NNNN_name.sql`` and applied in order, each
in its own transaction together with its row in ``schema_migrations``, so a
failed migration leaves nothing half-applied. Concurrent ``migrate`` runs (two
servers starting at once) serialise on the advisory lock; the loser finds the
work done and applies nothing.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources

import psycopg

log = logging.getLogger(__name__)

#: Advisory lock key held while migrating ("umbramig" in ASCII).
MIGRATION_LOCK_KEY = 0x756D6272616D6967
_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


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


async def migrate(url: str) -> list[str]:
    """Apply every pending migration; return the names applied."""
    applied: list[str] = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        try:
            await conn.execute(_CREATE_TABLE)
            done = {row[0] for row in await (await conn.execute("SELECT version FROM schema_migrations")).fetchall()}
            for migration in available_migrations():
                if migration.version in done:
                    continue
                async with conn.transaction():
                    await conn.execute(migration.sql)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                        (migration.version, migration.name),
                    )
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
