"""Running the app under uvicorn so that long-lived responses end on shutdown.

uvicorn stops accepting connections and then waits for in-flight responses to
finish before it runs the lifespan shutdown. An SSE stream or a parked
long-poll never finishes by itself, so a plain ``uvicorn.run`` would wait for
every dashboard to hang up. :class:`Server` tells the application first
(``app.state.stop_streams``): streams end after their current message and
long-polls answer 204, and the graceful wait then completes at once.
``timeout_graceful_shutdown`` remains as a backstop for anything else.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import threading
from typing import Iterator

import uvicorn

log = logging.getLogger(__name__)

#: Seconds uvicorn waits for in-flight requests after the streams were told to stop.
GRACEFUL_SHUTDOWN_SECONDS = 10


class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's graceful shutdown for SIGHUP too (a closed terminal, a dropped SSH session).

        uvicorn captures SIGINT and SIGTERM only; a SIGHUP met the process's exit handler in the
        middle of the event loop, and every open request and stream died with a traceback.
        """
        if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
            with super().capture_signals():  # (a SIGHUP ignored, as under nohup, stays ignored)
                yield
            return
        previous = signal.signal(signal.SIGHUP, lambda _sig, frame: self.handle_exit(signal.SIGTERM, frame))
        try:
            with super().capture_signals():  # re-raises the captured SIGTERM once stopped: the usual exit
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    async def startup(self, sockets=None) -> None:
        state = getattr(self.config.app, "state", None)
        if state is not None:  # a failed background task stops the process (api.app._essential)
            state.request_shutdown = lambda: setattr(self, "should_exit", True)
            state.stopping = lambda: self.should_exit  # from the signal on, before the lifespan ends the tasks
        await super().startup(sockets)
        for server in self.servers:  # uvicorn's own startup lines are below the log level: say where once
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                host = f"[{host}]" if ":" in host else host
                log.info(f"serving on http://{host}:{port}", extra={"action": "serving", "url": f"http://{host}:{port}"})
        # What startup made (modules, routes, the pool, caches) lives as long as the process: it is
        # kept out of the cyclic collector, whose full passes over it stopped the event loop (and the
        # agents' batches with it) for 21-25 ms each, 11 times in a 6-second drain; 6 ms in all after.
        gc.freeze()

    async def shutdown(self, sockets=None) -> None:
        state = getattr(self.config.app, "state", None)
        stop_streams = getattr(state, "stop_streams", None)
        if stop_streams is not None:
            stop_streams()
        await super().shutdown(sockets)


def config(app, *, host: str, port: int, **options) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=options.pop("log_level", "warning"),
        log_config=None,  # its loggers write JSON through umbra.logs, as the service's own do
        access_log=False,  # api.middleware writes the structured access log
        # X-Forwarded-For is read by api.http.client_address alone, and only from
        # UMBRA_TRUSTED_PROXIES. uvicorn's own reading trusts 127.0.0.1 by
        # default: behind a local proxy that passes the header on, a client could
        # name any address, and with it any pairing rate-limit bucket.
        proxy_headers=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        **options,
    )


def serve(app, *, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM, ending streams and long-polls cleanly first."""
    Server(config(app, host=host, port=port)).run()
