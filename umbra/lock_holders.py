"""The sessions a backend waits for, named for the person who can end them.

A statement whose lock wait ran out (``lock_timeout``) is no longer waiting, and
PostgreSQL's error names nothing: who held the lock is asked while it waits, from
a second connection (:func:`note_holders`), and said in the refusal. What a
holder is running is not said: another session's statement may carry anything,
a password among it.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import psycopg

#: Seconds between two looks at who holds what a waiting backend waits for.
LOOK_SECONDS = 0.05

_HOLDERS = """
SELECT DISTINCT a.pid, a.application_name, a.usename, a.state, floor(extract(epoch FROM now() - a.xact_start))::bigint
FROM unnest(pg_blocking_pids(%s)) AS b (pid) JOIN pg_stat_activity AS a USING (pid)
WHERE a.pid <> pg_backend_pid()  -- a concurrent index build waits for every older snapshot, this look's own
ORDER BY a.pid"""


@dataclass(frozen=True)
class LockHolder:
    pid: int
    application_name: str
    #: None where the looking role may not see them (not a superuser, nor ``pg_read_all_stats``, nor the holder's
    #: own role).
    user: str | None
    state: str | None
    transaction_seconds: int | None

    def __str__(self) -> str:
        said = [f"application_name {self.application_name!r}"]
        if self.user is not None:
            said.append(f"user {self.user}")
        if self.state is not None:
            said.append(self.state)
        if self.transaction_seconds is not None:
            said.append(f"its transaction open {self.transaction_seconds} s")
        return f"pid {self.pid} ({', '.join(said)})"


async def lock_holders(conn: psycopg.AsyncConnection, pid: int) -> list[LockHolder]:
    """The sessions holding (or queued ahead for) a lock backend ``pid`` waits for; none if it waits for none."""
    return [LockHolder(*row) for row in await (await conn.execute(_HOLDERS, (pid,))).fetchall()]


async def note_holders(conn: psycopg.AsyncConnection, pid: int, seen: dict[int, LockHolder]) -> None:
    """Until cancelled, add to ``seen`` each session backend ``pid`` waits for, as last seen, by its pid.

    Cancelled between two looks, never in one: psycopg closes a connection whose query is cancelled twice, as
    a cancelled scope does, and ``conn`` looks again at the next wait. A look that fails (the database gone)
    ends the looking, not what it watched, which meets the same failure itself if it matters.
    """
    while True:
        try:
            with anyio.CancelScope(shield=True):  # a few milliseconds: it waits for no lock
                found = await lock_holders(conn, pid)
        except psycopg.Error:
            return
        seen.update((holder.pid, holder) for holder in found)
        await anyio.sleep(LOOK_SECONDS)
