"""Fixtures of the integration tests: ``umbra`` run in-process on the test's database, an API client, and a
TCP proxy in front of the database (outages)."""

from __future__ import annotations

import anyio
import httpx
import pytest
from psycopg import conninfo

from umbra.cli import main

from .pg_proxy import PgProxy


@pytest.fixture
def cli(db_url, monkeypatch, capsys):
    """Run ``umbra ...`` in a worker thread (it has its own event loop) on this test's database; returns
    (status, stdout, stderr), a refused argument's exit status too. No API key or server comes from the
    environment: a command uses what it is given."""
    monkeypatch.setenv("UMBRA_DATABASE_URL", db_url)
    monkeypatch.delenv("UMBRA_API_KEY", raising=False)
    monkeypatch.delenv("UMBRA_SERVER", raising=False)

    def umbra(argv: list[str]) -> int:
        try:
            return main(argv)
        except SystemExit as exit_:
            return exit_.code

    async def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = await anyio.to_thread.run_sync(umbra, list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture
async def api(live_server, org):
    """An HTTP client of the live server with the organization's all-scopes key."""
    async with httpx.AsyncClient(base_url=live_server.url, headers={"Authorization": f"Bearer {org[1]}"}) as client:
        yield client


@pytest.fixture
def pg_proxy(db_url):
    """A :class:`PgProxy` to the test's database: a server started on ``pg_proxy.url(db_url)`` meets its outages."""
    parts = conninfo.conninfo_to_dict(db_url)
    proxy = PgProxy(parts.get("host") or "127.0.0.1", int(parts.get("port") or 5432))
    yield proxy
    proxy.close()
