"""What a running server process holds: settings, pool, caches, listener."""

from __future__ import annotations

from dataclasses import dataclass, field

from psycopg_pool import AsyncConnectionPool

from umbra.compute.auth import VerifiedTokenCache
from umbra.events.listener import LogListener
from umbra.settings import Settings


@dataclass
class Services:
    settings: Settings
    database_url: str
    pool: AsyncConnectionPool
    listener: LogListener
    token_cache: VerifiedTokenCache = field(default_factory=VerifiedTokenCache)
