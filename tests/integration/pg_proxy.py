"""A TCP proxy in front of PostgreSQL, for the outage tests: a database that goes away (:meth:`PgProxy.cut`)
or a network that drops packets silently (:meth:`PgProxy.freeze`). The ``pg_proxy`` fixture is in conftest."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

from psycopg import conninfo


class PgProxy:
    """Forwards 127.0.0.1:<port> to PostgreSQL; :meth:`cut` makes the database unreachable."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.down = False
        self.closed = False
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._frozen: set[int] = set()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _connect_upstream(self) -> socket.socket:
        host, port = self.upstream
        if host.startswith("/"):  # a Unix-socket directory (the embedded server's)
            server = socket.socket(socket.AF_UNIX)
            server.settimeout(5)
            server.connect(f"{host}/.s.PGSQL.{port}")
            return server
        return socket.create_connection(self.upstream, timeout=5)

    def url(self, db_url: str) -> str:
        return conninfo.make_conninfo(db_url, host="127.0.0.1", port=str(self.port))

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            try:
                server = self._connect_upstream()
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                if id(a) in self._frozen:  # a network that drops packets silently: nothing passes, nothing closes
                    if self.closed:
                        break
                    time.sleep(0.05)
                    continue
                readable, _, _ = select.select([a, b], [], [], 0.5)
                if self.closed:
                    break
                for source in readable:
                    data = source.recv(65536)
                    if not data:
                        raise OSError("closed")
                    (b if source is a else a).sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        """Close every forwarded connection and refuse new ones (the database host went away)."""
        self.down = True
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()

    def freeze(self) -> None:
        """Stop forwarding on every open connection, without closing any (new ones pass as usual)."""
        with self._lock:
            self._frozen.update(id(a) for a, _ in self._pairs)

    def restore(self) -> None:
        self.down = False

    def close(self) -> None:
        self.closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self.listener.close()
