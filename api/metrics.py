"""``GET /metrics``: the process instruments plus views read from the database on scrape.

Queue depth is not a counter this process keeps (other processes change the
queue too); it is read from the jobs table at scrape time, one grouped query on
a pooled connection, and handed to a collector that reports exactly what was
read. The log's head position comes from the same scrape, so "events appended"
is visible database-wide even for events other processes wrote.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from umbra import metrics
from umbra.events.types import JOB_STATUSES

from .routing import endpoint

_QUEUE_DEPTH = "SELECT status, count(*) FROM jobs GROUP BY status"
_LOG_HEAD = "SELECT coalesce(max(position), 0) FROM events"


class DatabaseViews(Collector):
    """Reports the values last read by :meth:`refresh` (called by the handler before rendering)."""

    def __init__(self) -> None:
        self.depth: dict[str, int] = {status: 0 for status in JOB_STATUSES}
        self.log_head = 0

    async def refresh(self, conn) -> None:
        rows = await (await conn.execute(_QUEUE_DEPTH)).fetchall()
        depth = {status: 0 for status in JOB_STATUSES}
        depth.update({status: count for status, count in rows})
        self.depth = depth
        self.log_head = (await (await conn.execute(_LOG_HEAD)).fetchone())[0]

    def collect(self):
        depth = GaugeMetricFamily("umbra_queue_depth", "Jobs in the queue projection by status.", labels=["status"])
        for status, count in self.depth.items():
            depth.add_metric([status], count)
        yield depth
        yield GaugeMetricFamily(
            "umbra_log_head_position", "Highest committed position in the event log.", value=self.log_head
        )


def build_registry() -> tuple[CollectorRegistry, DatabaseViews]:
    views = DatabaseViews()
    return metrics.registry_with(views), views


async def scrape(request: Request) -> Response:
    state = request.app.state
    async with state.services.pool.connection() as conn:
        await state.metrics_views.refresh(conn)
    return Response(generate_latest(state.metrics_registry), media_type=CONTENT_TYPE_LATEST)


routes = [
    endpoint(
        "GET",
        "/metrics",
        scrape,
        summary="Prometheus metrics: queue depth, claims, wake latency, long-polls, events, sweeper.",
        auth="none",
        produces="text/plain",
    )
]
