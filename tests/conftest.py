"""Shared fixtures: a real PostgreSQL, one migrated template, a clone per test.

The server is, in order: ``UMBRA_TEST_DATABASE_URL``; the local server at
127.0.0.1:5432 if it answers; else an embedded PostgreSQL started for the
session. Each test that asks for ``db_url`` gets a fresh database cloned from a
migrated template (``CREATE DATABASE ... TEMPLATE``), so tests are isolated and
NOTIFY works (a rolled-back transaction would never deliver one).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import anyio
import psycopg
import pytest
from psycopg import conninfo, sql

from umbra.migrate import migrate
from umbra.settings import CHEAP_HASHING_VARIABLE

# argon2id at its smallest cost, in this process and every `umbra` process a test starts (they inherit
# the environment): most of the suite's CPU time went to hashing. Set it to 0 to run on the real profile.
# Before anything imports umbra.security, which reads it once.
os.environ.setdefault(CHEAP_HASHING_VARIABLE, "1")

LOCAL_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture(scope="session")
def anyio_backend():
    return "asyncio"


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


@pytest.fixture(scope="session")
def pg_server_url(tmp_path_factory):
    """A maintenance URL on a server where we may create databases."""
    explicit = os.environ.get("UMBRA_TEST_DATABASE_URL")
    if explicit:
        yield explicit
        return
    if os.environ.get("UMBRA_TEST_EMBEDDED") != "1" and _answers(LOCAL_SERVER):
        yield LOCAL_SERVER
        return
    from umbra.embedded import start_embedded

    server = start_embedded(tmp_path_factory.mktemp("pg") / "data", delete_on_stop=True)
    try:
        yield server.url
    finally:
        server.stop()


def _admin(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True)


@pytest.fixture(scope="session")
def template_db(pg_server_url):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    name = f"umbra_tpl_{worker}_{os.getpid()}"
    with _admin(pg_server_url) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    anyio.run(migrate, conninfo.make_conninfo(pg_server_url, dbname=name))
    yield name
    with _admin(pg_server_url) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class FreshDatabases:
    """Clones of the template, made one test ahead and dropped behind, on a thread of their own.

    Cloning the template and dropping a used clone each took a few tenths of a
    second on the test's own path, some 1,500 times a run: about a minute and a
    half of the suite's time on 2 cores. One thread does both, in order, while
    the tests run: a test takes the clone made during the test before it, and
    its own is dropped during the test after.
    """

    def __init__(self, server_url: str, template: str) -> None:
        self._server_url = server_url
        self._template = template
        self._work = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fresh-databases")
        self._next = self._work.submit(self._create)
        self._dropped: list[Future] = []

    def _create(self) -> str:
        name = f"umbra_t_{uuid.uuid4().hex[:16]}"
        with _admin(self._server_url) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(self._template)))
        return name

    def _drop(self, name: str) -> None:
        with _admin(self._server_url) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def take(self) -> str:
        name = self._next.result()
        self._next = self._work.submit(self._create)
        return name

    def give_back(self, name: str) -> None:
        self._dropped.append(self._work.submit(self._drop, name))

    def close(self) -> None:
        """Drop the clone made for no test, and wait for every drop (one that failed fails here)."""
        self._drop(self._next.result())
        for dropped in self._dropped:
            dropped.result()
        self._work.shutdown()


@pytest.fixture(scope="session")
def fresh_databases(pg_server_url, template_db):
    databases = FreshDatabases(pg_server_url, template_db)
    yield databases
    databases.close()


@pytest.fixture
def db_url(pg_server_url, fresh_databases):
    """A fresh, migrated database for this test only."""
    name = fresh_databases.take()
    yield conninfo.make_conninfo(pg_server_url, dbname=name)
    fresh_databases.give_back(name)


@pytest.fixture
async def conn(db_url):
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        yield c


@pytest.fixture
async def org(conn):
    """``(organization_id, api_key)`` of a fresh organization."""
    from umbra.compute.accounts import create_organization

    return await create_organization(conn, "acme")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``umbra``'s app on a real uvicorn socket in a background thread."""

    def __init__(self, db_url: str, **settings_env: str) -> None:
        import uvicorn

        from umbra.api.app import create_app
        from umbra.api.server import config
        from umbra.settings import load_settings

        env = {"UMBRA_DATABASE_URL": db_url, **settings_env}
        self.settings = load_settings(env)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(self.settings, db_url)
        self.server = uvicorn.Server(config(self.app, host="127.0.0.1", port=self.port))  # as `umbra serve` has it
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("live server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture
async def client(live_server):
    """An async HTTP client on the live server."""
    import httpx

    async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as c:
        yield c


@pytest.fixture
def live_server(db_url):
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="0.2") as server:
        yield server
