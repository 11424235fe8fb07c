"""``umbra serve`` keeps the embedded PostgreSQL it started running.

A postmaster that died while the server ran (the OOM killer, ``kill -9``, a
crash of the postmaster itself) left the service answering 503 until someone
restarted it. The server watches the postmaster's PID and starts it again on
the same data dir: PostgreSQL's crash recovery replays the WAL, so nothing
that was acknowledged is lost, and the pool and the listener reconnect by
themselves (the listener's reconnection has the pool's dead idle connections
replaced). A database that cannot be started again after
:data:`RESTART_ATTEMPTS` starts fails the server: it exits non-zero saying
so, for a service manager to restart the whole thing or a person to look.

A postmaster that dies while the server is stopping is left alone: a Ctrl-C
in a terminal reaches the postmaster too (it is in the server's process
group), and the server stops it on its way out in any case.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import anyio

from .embedded import EmbeddedPostgres
from .errors import DatabaseUnavailable

log = logging.getLogger(__name__)

#: How often the postmaster's PID is looked at (a read of ``/proc``), in seconds.
WATCH_SECONDS = 1.0
#: Starts tried before the server gives up. A start whose server did not then stay up
#: :data:`STABLE_SECONDS` counts too: a postmaster that dies at every start is not started for ever.
RESTART_ATTEMPTS = 5
#: Seconds before the first start (the dead postmaster's backends leave first: PostgreSQL refuses to start
#: while they hold its shared memory), doubled before each next one: 1, 2, 4, 8, 16.
FIRST_DELAY_SECONDS = 1.0
#: Seconds a started server must stay up for its starts to be forgotten.
STABLE_SECONDS = 60.0


async def supervise(server: EmbeddedPostgres, *, stopping: Callable[[], bool], watch_seconds: float = WATCH_SECONDS,
                    attempts: int = RESTART_ATTEMPTS, first_delay: float = FIRST_DELAY_SECONDS,
                    stable_seconds: float = STABLE_SECONDS) -> None:  # fmt: skip
    """Start ``server`` again each time its postmaster dies, unless ``stopping()``; raise
    :class:`~umbra.errors.DatabaseUnavailable` once ``attempts`` starts in a row did not keep it up.

    The start blocks (``pg_ctl``, a crash recovery), so it runs in a worker
    thread; a server asked to stop meanwhile waits for it, and then stops the
    database it started.
    """
    tried = 0  # starts since the server last stayed up stable_seconds
    started_at: float | None = None
    while True:
        while server.running:
            await anyio.sleep(watch_seconds)
        if stopping():
            return
        if started_at is not None and time.monotonic() - started_at >= stable_seconds:
            tried = 0
        log.error("the embedded database stopped; starting it again",
                  extra={"action": "embedded_stopped", "pid": server.pid})  # fmt: skip
        last_error: Exception | None = None
        while True:
            if tried >= attempts:
                outcome = "could not be started again" if last_error is not None else "did not stay up"
                raise DatabaseUnavailable(f"The embedded database stopped and {outcome} ({tried} starts); "
                                          "see its log, pg/log in the data dir.") from last_error  # fmt: skip
            await anyio.sleep(first_delay * 2**tried)
            if stopping():
                return
            tried += 1
            try:
                await anyio.to_thread.run_sync(server.restart)
                break
            except Exception as exc:  # the start's own failure (pg_ctl, a refused data dir): tried again
                last_error = exc
                log.warning("the embedded database did not start", extra={
                    "action": "embedded_start_failed", "attempt": tried, "error": type(exc).__name__,
                    "detail": (str(exc).strip().splitlines() or [""])[0][:300]})  # fmt: skip
        started_at = time.monotonic()
        log.warning("the embedded database started again",
                    extra={"action": "embedded_restarted", "pid": server.pid, "attempt": tried})  # fmt: skip
