"""``GET /metrics``: the process instruments plus views read from the database on scrape.

Queue depth is not a counter this process keeps (other processes change the
queue too); it is read at scrape time from the counts the database keeps with
the jobs table (:mod:`umbra.projections.job_counts`: a count of the table itself
grew with its terminal jobs until no scrape finished in time), on a pooled
connection, and handed to a collector that reports exactly what was read. The
log's head position comes from the same scrape, so "events appended" is visible
database-wide even for events other processes wrote.
"""

from __future__ import annotations

import hmac

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from umbra import metrics
from umbra.db import DATABASE_AWAY
from umbra.errors import Unauthenticated
from umbra.events.types import JOB_STATUSES
from umbra.projections import job_counts

from .http import bearer_token
from .routing import endpoint

_LOG_HEAD = "SELECT coalesce(max(position), 0) FROM events"


class DatabaseViews(Collector):
    """Reports the values last read by :meth:`refresh` (called by the handler before rendering)."""

    def __init__(self) -> None:
        self.depth: dict[str, int] = {status: 0 for status in JOB_STATUSES}
        self.waiting_for_dependencies = 0
        self.waiting_for_time = 0
        self.log_head = 0
        self.database_up = True

    async def refresh(self, conn) -> None:
        rows = await job_counts.totals(conn)
        depth = {status: 0 for status in JOB_STATUSES}
        depth.update({status: count for status, count, _, _ in rows})
        self.depth = depth
        self.waiting_for_dependencies = sum(waiting for status, _, waiting, _ in rows if status == "blocked")
        self.waiting_for_time = sum(delayed for status, _, _, delayed in rows if status == "blocked")
        self.log_head = (await (await conn.execute(_LOG_HEAD)).fetchone())[0]

    def collect(self):
        depth = GaugeMetricFamily("umbra_queue_depth", "Jobs in the queue projection by status.", labels=["status"])
        for status, count in self.depth.items():
            depth.add_metric([status], count)
        yield depth
        yield GaugeMetricFamily(
            "umbra_jobs_waiting_for_dependencies", "Blocked jobs that wait for the jobs they depend on (counted in "
            "umbra_queue_depth{status=\"blocked\"}; the rest are jobs no device could run, and delayed jobs).",
            value=self.waiting_for_dependencies,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "umbra_jobs_delayed", "Blocked jobs submitted to run later that wait for their not_before (counted in "
            "umbra_queue_depth{status=\"blocked\"}).",
            value=self.waiting_for_time,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "umbra_log_head_position", "Highest committed position in the event log.", value=self.log_head
        )
        yield GaugeMetricFamily(
            "umbra_database_up", "1 if the last scrape read the database, 0 if it did not answer in time "
            "(the views above are then as last read).", value=1 if self.database_up else 0,
        )  # fmt: skip


def build_registry() -> tuple[CollectorRegistry, DatabaseViews]:
    views = DatabaseViews()
    return metrics.registry_with(views), views


#: How long a scrape waits for the database before it answers with the process's own instruments
#: alone (Prometheus gives a scrape 10 s by default).
SCRAPE_DATABASE_SECONDS = 1.0


async def scrape(request: Request) -> Response:
    """The instruments, and the database's views when it answers in time.

    While the database is away the scrape still answers, with ``umbra_database_up 0``
    and the views as last read: the process's own figures matter most then.
    """
    state = request.app.state
    expected = state.services.settings.metrics_token
    if expected is not None and not hmac.compare_digest((bearer_token(request) or "").encode(), expected.encode()):
        raise Unauthenticated("GET /metrics needs the bearer token UMBRA_METRICS_TOKEN names.")
    views: DatabaseViews = state.metrics_views
    try:
        with anyio.fail_after(SCRAPE_DATABASE_SECONDS):
            async with state.services.pool.connection(timeout=SCRAPE_DATABASE_SECONDS) as conn:
                await views.refresh(conn)
        views.database_up = True
    except (TimeoutError, *DATABASE_AWAY):
        views.database_up = False
    return Response(generate_latest(state.metrics_registry), media_type=CONTENT_TYPE_LATEST)


routes = [
    endpoint(
        "GET",
        "/metrics",
        scrape,
        summary="Prometheus metrics: queue depth, claims, wake latency, long-polls, events, sweeper (a bearer token if UMBRA_METRICS_TOKEN is set).",
        auth="none",
        produces="text/plain",
    )
]
