"""Small test utilities: waiting on conditions without sleeping in assertions."""

from __future__ import annotations

import time
from typing import Awaitable, Callable, TypeVar

import anyio

T = TypeVar("T")


async def eventually(check: Callable[[], Awaitable[T]], *, timeout: float = 10.0, interval: float = 0.02) -> T:
    """Await ``check()`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = await check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")
        await anyio.sleep(interval)


def bearer(token: str) -> dict[str, str]:
    """The Authorization header for ``token``."""
    return {"Authorization": f"Bearer {token}"}
