"""What a running server process holds: settings, pool, caches, listener."""

from __future__ import annotations

from dataclasses import dataclass, field
from uuid import UUID

import anyio
from psycopg_pool import AsyncConnectionPool

from umbra.compute.auth import VerifiedTokenCache
from umbra.events.listener import LogListener
from umbra.settings import Settings

from .rates import RELEASE_BURST, RELEASES_PER_SECOND, RequestRates


@dataclass
class Services:
    settings: Settings
    database_url: str
    pool: AsyncConnectionPool
    listener: LogListener
    token_cache: VerifiedTokenCache = field(default_factory=VerifiedTokenCache)
    #: Each node's give-backs of unread claims (:mod:`umbra.api.rates`).
    release_rates: RequestRates = field(default_factory=lambda: RequestRates(RELEASES_PER_SECOND, RELEASE_BURST))
    #: How many streams' reads (SSE: the log, the live views) hold a pooled connection at once: a
    #: quarter of the pool. Every stream of an organization reads again at each of its hints, and
    #: three hundred open dashboards of one organization held every connection, so every other
    #: organization's requests waited seconds for one; past the limit the streams wait their turn.
    stream_reads: anyio.CapacityLimiter = field(init=False)
    #: The organizations whose ``POST /v1/projections/verify`` is running in this process: one at a time each
    #: (:func:`umbra.api.projections.verify_projections`).
    verifying: set[UUID] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.stream_reads = anyio.CapacityLimiter(max(1, self.pool.max_size // 4))
