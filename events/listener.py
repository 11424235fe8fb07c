"""One LISTEN connection per process, fanning hints out to in-process subscribers.

Notifications are hints: on ``umbra_log`` they carry an organization, a position
and a count of newly claimable jobs (``*`` when more organizations moved than
one payload can name), on ``umbra_recheck`` an organization whose parked claims
must try again; never data. Subscribers re-read the database. Because a
notification sent while we were disconnected is gone for good, every reconnect
calls ``on_reconnect`` subscribers so they re-check from their last position.

The connection is dedicated (autocommit, outside the pool): psycopg holds a
connection's lock while it waits in ``notifies()``, so sharing it would queue
queries behind the wait.
"""

from __future__ import annotations

import logging
from typing import Callable
from uuid import UUID

import anyio
import psycopg

from umbra import jitter
from umbra.db import own_connection

from .store import EVERYTHING, LOG_CHANNEL, RECHECK_CHANNEL, WAITING_CHANNEL, parse_hints

log = logging.getLogger(__name__)

#: ``application_name`` of the LISTEN connection, so operators (and the chaos
#: test) can find it in ``pg_stat_activity``.
APPLICATION_NAME = "umbra-listener"

#: The listener's connection, against a network that drops packets silently (no reset): a connect
#: that gets no answer gives up, TCP keepalives end a connection whose peer is gone (every connection
#: has them: :data:`umbra.db.KEEPALIVES`), and the idle probe must answer in time. Otherwise the
#: listener would wait for the operating system's TCP timeout while every waiter and stream fell back
#: to its safety poll.
CONNECTION_OPTIONS = {"connect_timeout": 5}
PROBE_SECONDS = 5.0

HintCallback = Callable[[UUID, int, int], None]
ReconnectCallback = Callable[[], None]
OrganizationCallback = Callable[[UUID], None]


class LogListener:
    """Listens on :data:`LOG_CHANNEL`, :data:`RECHECK_CHANNEL` and :data:`WAITING_CHANNEL` and calls subscribers
    synchronously."""

    def __init__(self, url: str, *, idle_check_seconds: float = 5.0, probe_seconds: float = PROBE_SECONDS,
                 ignore_backend_pids: Callable[[], set[int]] | None = None) -> None:  # fmt: skip
        self._url = url
        self._idle_check = idle_check_seconds
        self._probe = probe_seconds
        self._hint_subscribers: list[HintCallback] = []
        self._reconnect_subscribers: list[ReconnectCallback] = []
        #: The organization-named channels' subscribers, by channel.
        self._organization_subscribers: dict[str, list[OrganizationCallback]] = {RECHECK_CHANNEL: [], WAITING_CHANNEL: []}
        self._everything_subscribers: list[ReconnectCallback] = []
        self._ignore = ignore_backend_pids or (lambda: set())
        self.connected = anyio.Event()
        self.reconnects = 0
        self.backend_pid: int | None = None

    def on_hint(self, callback: HintCallback) -> None:
        self._hint_subscribers.append(callback)

    def on_reconnect(self, callback: ReconnectCallback) -> None:
        self._reconnect_subscribers.append(callback)

    def on_everything(self, callback: ReconnectCallback) -> None:
        """``callback()`` for a notification naming no organization (:data:`~umbra.events.store.EVERYTHING`):
        more moved than one can name, so everything is to be re-checked, as after a reconnect."""
        self._everything_subscribers.append(callback)

    def on_recheck(self, callback: OrganizationCallback) -> None:
        """``callback(organization_id)`` for each :data:`~umbra.events.store.RECHECK_CHANNEL` notification."""
        self._organization_subscribers[RECHECK_CHANNEL].append(callback)

    def on_waiting(self, callback: OrganizationCallback) -> None:
        """``callback(organization_id)`` for each :data:`~umbra.events.store.WAITING_CHANNEL` notification."""
        self._organization_subscribers[WAITING_CHANNEL].append(callback)

    def _dispatch(self, payload: str, sender_pid: int, channel: str = LOG_CHANNEL) -> None:
        if sender_pid in self._ignore():
            return
        if channel in self._organization_subscribers:
            try:
                organization_id = UUID(hex=payload)
            except ValueError:
                log.warning("ignored malformed notification", extra={"action": "bad_hint"})
                return
            for callback in self._organization_subscribers[channel]:
                callback(organization_id)
            return
        if payload == EVERYTHING:
            for callback in self._everything_subscribers:
                callback()
            return
        hints = parse_hints(payload)
        if hints is None:
            log.warning("ignored malformed notification", extra={"action": "bad_hint"})
            return
        for hint in hints:
            for callback in self._hint_subscribers:
                callback(*hint)

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled, reconnecting with jittered back-off."""
        delay = 0.1
        started = False
        while True:
            try:
                async with own_connection(self._url, application_name=APPLICATION_NAME, **CONNECTION_OPTIONS) as conn:
                    await conn.execute(f"LISTEN {LOG_CHANNEL}; LISTEN {RECHECK_CHANNEL}; LISTEN {WAITING_CHANNEL}")
                    self.backend_pid = conn.info.backend_pid
                    if self.connected.is_set():
                        self.connected = anyio.Event()
                    self.connected.set()
                    if not started:
                        started = True
                        task_status.started()
                    else:
                        self.reconnects += 1
                        log.info("listener reconnected", extra={"action": "listener_reconnected"})
                        for callback in self._reconnect_subscribers:
                            callback()
                    delay = 0.1
                    while True:
                        got_any = False
                        async for note in conn.notifies(timeout=self._idle_check):
                            got_any = True
                            self._dispatch(note.payload, note.pid, note.channel)
                        if not got_any:
                            with anyio.fail_after(self._probe):
                                await conn.execute("SELECT 1")  # prove the connection on idle
            except (psycopg.OperationalError, psycopg.InterfaceError, TimeoutError) as exc:
                self.connected = anyio.Event()
                log.warning("listener connection lost", extra={"action": "listener_lost", "error": str(exc)[:200]})
                await anyio.sleep(delay + jitter.uniform(0, delay))
                delay = min(delay * 2, 5.0)
                if not started:
                    continue
