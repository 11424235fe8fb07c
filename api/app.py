"""The Starlette application: routes, error handling and process lifespan."""

from __future__ import annotations

import contextlib
import logging

import anyio
from starlette.applications import Starlette

from umbra.db import open_pool
from umbra.events.listener import LogListener
from umbra.settings import Settings

from . import health
from .errors import HANDLERS
from .services import Services

log = logging.getLogger(__name__)

#: Route modules, each exposing ``routes``; the table every check (auth
#: matrix, OpenAPI) walks.
ROUTE_MODULES = [health]


def all_routes():
    return [route for module in ROUTE_MODULES for route in module.routes]


def create_app(settings: Settings, database_url: str) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with open_pool(database_url, size=settings.pool_size) as pool:
            listener = LogListener(database_url)
            services = Services(settings=settings, database_url=database_url, pool=pool, listener=listener)
            app.state.services = services
            async with anyio.create_task_group() as tg:
                await tg.start(listener.run)
                yield
                tg.cancel_scope.cancel()

    return Starlette(routes=all_routes(), exception_handlers=HANDLERS, lifespan=lifespan)
