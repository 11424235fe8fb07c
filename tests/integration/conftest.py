"""Fixtures of the command-line tests: ``umbra`` run in-process on the test's database, and an API client."""

from __future__ import annotations

import anyio
import httpx
import pytest

from umbra.cli import main


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
