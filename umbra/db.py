"""Database location and the connection pool.

``resolve_database`` decides where the data lives: ``UMBRA_DATABASE_URL`` when
set, else the embedded server under the data dir (started or adopted).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from .embedded import EmbeddedPostgres, start_embedded
from .settings import Settings


def resolve_database(settings: Settings) -> tuple[str, EmbeddedPostgres | None]:
    """Return ``(url, embedded handle or None)``; the caller stops the handle."""
    if settings.database_url:
        return settings.database_url, None
    server = start_embedded(settings.pgdata)
    return server.url, server


#: The role request connections act as: it can append events but not rewrite
#: them (migrations/0006). Connections whose login role may not assume it keep
#: their own role; the append-only trigger still protects the log.
SERVICE_ROLE = "umbra_service"


async def assume_service_role(conn: psycopg.AsyncConnection) -> bool:
    """``SET ROLE umbra_service`` when the login role may; returns whether it did."""
    row = await (
        await conn.execute(
            "SELECT to_regrole(%s) IS NOT NULL AND pg_has_role(current_user, %s, 'MEMBER')",
            (SERVICE_ROLE, SERVICE_ROLE),
        )
    ).fetchone()
    if row and row[0]:
        await conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(SERVICE_ROLE)))
        return True
    return False


async def begin_with(conn: psycopg.AsyncConnection, query: str, params: Mapping[str, Any]) -> psycopg.AsyncCursor[Any]:
    """``BEGIN`` and a transaction's first statement in one round trip; returns the statement's cursor.

    On a pooled (autocommit) connection ``conn.transaction()`` sends ``BEGIN``
    alone and waits for it: a round trip of its own, 80-100 µs of client CPU
    here. Sent as one simple-protocol query instead, the parameters are bound by
    psycopg's client-side quoting (never by string formatting) and the server
    plans the statement each time, which for a short read costs less than the
    round trip (docs/PERFORMANCE.md). The caller ends the transaction
    (``COMMIT``, or ``conn.rollback()`` on failure).
    """
    cursor = psycopg.AsyncClientCursor(conn)
    await cursor.execute("BEGIN;\n" + query, params)
    cursor.nextset()
    return cursor


@asynccontextmanager
async def open_pool(url: str, *, size: int = 10) -> AsyncIterator[AsyncConnectionPool]:
    pool = AsyncConnectionPool(
        url,
        min_size=min(2, size),
        max_size=size,
        open=False,
        kwargs={"autocommit": True},
        configure=assume_service_role,
    )
    await pool.open(wait=True, timeout=30)
    try:
        yield pool
    finally:
        await pool.close()
