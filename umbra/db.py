"""Database location and the connection pool.

``resolve_database`` decides where the data lives: ``UMBRA_DATABASE_URL`` when
set, else the embedded server under the data dir (started or adopted).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from psycopg_pool import AsyncConnectionPool

from .embedded import EmbeddedPostgres, start_embedded
from .settings import Settings


def resolve_database(settings: Settings) -> tuple[str, EmbeddedPostgres | None]:
    """Return ``(url, embedded handle or None)``; the caller stops the handle."""
    if settings.database_url:
        return settings.database_url, None
    server = start_embedded(settings.pgdata)
    return server.url, server


@asynccontextmanager
async def open_pool(url: str, *, size: int = 10) -> AsyncIterator[AsyncConnectionPool]:
    pool = AsyncConnectionPool(url, min_size=min(2, size), max_size=size, open=False, kwargs={"autocommit": True})
    await pool.open(wait=True, timeout=30)
    try:
        yield pool
    finally:
        await pool.close()
