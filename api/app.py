"""The Starlette application: routes, error handling and process lifespan."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware

from umbra.compute import sweeper
from umbra.compute.group_commit import GroupCommit, HintNotifier
from umbra.db import open_pool
from umbra.embedded import EmbeddedPostgres
from umbra.embedded_supervisor import supervise
from umbra.errors import UmbraError
from umbra.events.listener import LogListener
from umbra.settings import Settings

from . import agent, agent_jobs, dashboard, events, explain, health, jobs, metrics, models, nodes, openapi, pairing, projections
from .errors import HANDLERS
from .job_waits import JobWaits
from .longpoll import WaiterHub
from .middleware import RequestContext
from .routing import matching_whole_path, redirect_trailing_slash
from .services import Services
from .sse import LogWatch

log = logging.getLogger(__name__)

#: Route modules, each exposing ``routes``; the table every check (auth
#: matrix, OpenAPI) walks.
#: The router tries routes in this order, so the agents' hot path (claim, renew, complete)
#: comes first; no two modules' paths overlap, so the order changes nothing else.
ROUTE_MODULES = [agent, agent_jobs, health, events, metrics, openapi, pairing, nodes, models, dashboard, projections, jobs,
                 explain]  # fmt: skip


def all_routes():
    return [matching_whole_path(route) for module in ROUTE_MODULES for route in module.routes]


def _essential(app: Starlette, name: str, run: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """``run``, whose failure fails the server: it is marked failed and asked to stop.

    The background tasks share the lifespan's task group, so one that raises
    ends them all and closes the pool. uvicorn only logs a lifespan that
    fails after startup and goes on serving: ``/healthz`` said 200 while every
    request that needed the database failed, and no supervisor restarted it.
    """

    @functools.wraps(run)
    async def essential(*args: Any, **kwargs: Any) -> None:
        try:
            await run(*args, **kwargs)
        except Exception as exc:
            # Said to anyone who asks /healthz: the type, never the text (it may name tables, roles, hosts),
            # but for a refusal of the service's own, whose message is written for its clients.
            app.state.failure = exc.message if isinstance(exc, UmbraError) else f"the {name} stopped: {type(exc).__name__}"
            log.critical("background task failed; stopping the server", exc_info=True,
                         extra={"action": "background_task_failed", "task": name})  # fmt: skip
            request_shutdown = getattr(app.state, "request_shutdown", None)
            if request_shutdown is not None:
                request_shutdown()
            raise

    return essential


def create_app(settings: Settings, database_url: str, *, embedded: EmbeddedPostgres | None = None) -> Starlette:
    """The application on ``database_url``; with ``embedded`` (the embedded server it is on), that server is
    started again should its postmaster die while the application serves."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with open_pool(database_url, size=settings.pool_size) as pool:
            listener = LogListener(database_url)
            services = Services(settings=settings, database_url=database_url, pool=pool, listener=listener)
            app.state.services = services
            # Long-polls and SSE streams wake on the one listener's hints.
            waiters = WaiterHub(poll_seconds=settings.poll_fallback_seconds)
            log_watch = LogWatch()
            for subscriber in (waiters, log_watch):
                listener.on_hint(subscriber.on_hint)
                listener.on_reconnect(subscriber.on_reconnect)
            listener.on_recheck(waiters.on_recheck)
            listener.on_recheck(log_watch.on_recheck)
            listener.on_everything(waiters.recheck_all)
            listener.on_everything(log_watch.wake_all)
            app.state.waiters, app.state.log_watch = waiters, log_watch
            # The sweeper's leader looks at jobs waiting for others as soon as the log moves, and reads of a
            # job that wait for it to end (`?wait=`) wake on the same hints; after a reconnect, both look again.
            log_moved = sweeper.LogMoved()
            job_waits = app.state.job_waits = JobWaits(poll_seconds=settings.poll_fallback_seconds)
            for watcher in (log_moved, job_waits):
                listener.on_hint(watcher.on_hint)
                listener.on_reconnect(watcher.on_reconnect)
                listener.on_everything(watcher.on_reconnect)
            listener.on_waiting(log_moved.on_waiting)
            # Agents' claims, renewals and completions share transactions; their hints
            # are sent after commit, outside the data transactions.
            notifier = HintNotifier(pool)
            app.state.group_commit = GroupCommit(pool, notifier, affinity_seconds=settings.model_affinity_seconds)
            app.state.stop_streams = lambda: (waiters.stop(), log_watch.stop(), job_waits.stop())
            async with anyio.create_task_group() as tg:
                # A lost LISTEN connection means, as a rule, that PostgreSQL restarted or failed over,
                # and every pooled connection died with it: the idle ones are checked and replaced at
                # once, rather than failing one request each. Checking each connection as it is handed
                # out (a round trip every time) cost the agents' drain 6-10 % of its rate.
                listener.on_reconnect(lambda: tg.start_soon(pool.check))
                await tg.start(_essential(app, "listener", listener.run))
                await tg.start(_essential(app, "hint notifier", notifier.run))
                await tg.start(_essential(app, "group commit", app.state.group_commit.run))
                tg.start_soon(_essential(app, "long-poll safety poll", waiters.safety_poll), pool)
                tg.start_soon(_essential(app, "job waits", job_waits.run), pool)
                # From startup, not on first request: a restarted server must recover leases.
                tg.start_soon(functools.partial(_essential(app, "sweeper", sweeper.run), settings, database_url,
                                                log_moved=log_moved))
                if embedded is not None:
                    tg.start_soon(functools.partial(_essential(app, "embedded database supervisor", supervise), embedded,
                                                    stopping=lambda: app.state.stopping()))
                yield
                app.state.stop_streams()
                tg.cancel_scope.cancel()

    routes = all_routes()
    templates = {route.endpoint: route.path for route in routes if hasattr(route, "endpoint")}
    app = Starlette(
        routes=routes,
        exception_handlers=HANDLERS,
        lifespan=lifespan,
        middleware=[Middleware(RequestContext, route_templates=templates, trusted_proxies=settings.trusted_proxies)],
    )
    redirect_trailing_slash(app.router)
    app.state.metrics_registry, app.state.metrics_views = metrics.build_registry()
    app.state.failure = None
    app.state.stopping = lambda: False  # whether the server is stopping: api.server.Server says as it starts
    return app
