"""Database location and the connection pool.

``resolve_database`` decides where the data lives: ``UMBRA_DATABASE_URL`` when
set, else the embedded server under the data dir (started or adopted).
"""

from __future__ import annotations

import hashlib
import logging
import re
import weakref
from contextlib import asynccontextmanager, contextmanager
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from uuid import UUID

import anyio
import psycopg
from psycopg import conninfo, sql
from psycopg_pool import AsyncConnectionPool

from .embedded import EmbeddedPostgres, install_exit_on_sigterm, start_embedded, unembeddable
from .settings import Settings, SettingsError

log = logging.getLogger(__name__)


def resolve_database(settings: Settings) -> tuple[str, EmbeddedPostgres | None]:
    """Return ``(url, embedded handle or None)``; the caller stops the handle (see :func:`database`)."""
    if settings.database_url:
        return settings.database_url, None
    if (problem := unembeddable(settings.pgdata)) is not None:
        raise SettingsError(f"UMBRA_DATA_DIR {problem}: {str(settings.data_dir)!r}")
    server = start_embedded(settings.pgdata)
    return server.url, server


@contextmanager
def database(settings: Settings) -> Iterator[str]:
    """The database URL of a command: the configured one, or the embedded server's, started (or adopted) here
    and its handle released on the way out, also when the command is ended by SIGTERM or SIGHUP (a handle
    left behind kept the postmaster running after the last real holder left)."""
    with database_and_embedded(settings) as (url, _embedded):
        yield url


@contextmanager
def database_and_embedded(settings: Settings) -> Iterator[tuple[str, EmbeddedPostgres | None]]:
    """:func:`database`, with the embedded server's handle (``None`` with ``UMBRA_DATABASE_URL``), for
    ``umbra serve`` to start it again should its postmaster die (:mod:`umbra.embedded_supervisor`)."""
    if not settings.database_url:
        install_exit_on_sigterm(as_killed=True)  # first: one while the server starts releases its handle too
    url, embedded = resolve_database(settings)
    try:
        yield url, embedded
    finally:
        if embedded is not None:
            embedded.stop()


#: The role request connections act as: it can append events but not rewrite
#: them (migrations/0006). Connections whose login role may not assume it keep
#: their own role; the append-only trigger still protects the log.
SERVICE_ROLE = "umbra_service"


async def assume_service_role(conn: psycopg.AsyncConnection) -> bool:
    """``SET ROLE umbra_service`` when the login role may; returns whether it did. When it may not, a
    warning says so, once per process: the log is then kept from being rewritten by its trigger alone,
    which the login role (its owner) may disable, while the README promises more."""
    global _own_role_warned
    row = await (
        await conn.execute(
            "SELECT to_regrole(%s) IS NOT NULL AND pg_has_role(current_user, %s, 'MEMBER'), current_user",
            (SERVICE_ROLE, SERVICE_ROLE),
        )
    ).fetchone()
    if row and row[0]:
        await conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(SERVICE_ROLE)))
        return True
    if not _own_role_warned:
        _own_role_warned = True
        log.warning(f"connections act as {row[1] if row else 'the login role'}, which may not assume {SERVICE_ROLE}: "
                    f"only the log's trigger keeps events from being rewritten (README: grant {SERVICE_ROLE} to it)",
                    extra={"action": "service_role_not_assumed"})  # fmt: skip
    return False


_own_role_warned = False


class PreparedStatement:
    """A statement ``PREPARE``d once per connection by SQL and run through the simple protocol.

    On a pooled (autocommit) connection ``conn.transaction()`` sends ``BEGIN``
    and ``COMMIT`` alone and waits for each: a round trip of its own, 80-100 µs
    of client CPU here. In one simple-protocol query with the transaction's
    first reads (:func:`begin_with`) or its last write (:func:`commit_with`)
    they cost no round trip, but the server would plan the statements at every
    call (0.25 ms for the group commit's first reads, measured from the
    server's log): so each is prepared once on a connection and run as
    ``EXECUTE name(...)``. The arguments are bound by psycopg's client-side
    quoting, never by string formatting. ``query`` is written as for
    ``conn.execute``, with named placeholders (``%(ids)s``).
    """

    def __init__(self, name: str, query: str) -> None:
        self.name = name
        params = list(dict.fromkeys(_PLACEHOLDER.findall(query)))
        # Sent without arguments, the PREPARE text is not interpolated: a literal ``%%`` becomes ``%``.
        body = _PLACEHOLDER.sub(lambda m: f"${params.index(m.group(1)) + 1}", query).replace("%%", "%")
        self.prepare = f"PREPARE {name} AS {body}"
        self.execute = f"EXECUTE {name}({', '.join(f'%({p})s' for p in params)})" if params else f"EXECUTE {name}"


def organization_lock_key(organization_id: UUID, tag: bytes) -> int:
    """The second key of a two-key advisory lock that belongs to one organization: its id and ``tag``, hashed.

    Each kind of lock (claim guards, the capacity lock, idempotency keys) has a
    class of its own as the first key, and the two-key form never meets a
    one-key lock (the log's ordering lock, the sweeper's, a pairing code's).
    ``tag`` tells the locks of one class and organization apart; two that hash
    alike only wait for each other, they never let anything through.
    """
    return int.from_bytes(hashlib.blake2b(organization_id.bytes + tag, digest_size=4).digest(), "big", signed=True)


def uuid_array(ids: Iterable[UUID]) -> str:
    """``ids`` as a ``uuid[]`` literal, for a statement bound on the client side (a prepared one's parameter).

    psycopg's list dumper took 85 µs for 60 ids, this 16: the group commit
    sends a batch's held jobs, nodes and credentials this way.
    """
    return "{" + ",".join([u.hex for u in ids]) + "}"


def text_array(values: Iterable[str]) -> str:
    """``values`` as a ``text[]`` literal, for a statement bound on the client side, as :func:`uuid_array`.

    Each element quoted (a backslash or a quote in it escaped), so that one
    spelled ``NULL`` or holding a comma stays the text it is. psycopg's list
    dumper took 39 µs for 16 request ids, this 5.
    """
    return "{" + ",".join(['"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values]) + "}"


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_GENERIC_INDEX_PLANS = "SELECT set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true);"
#: The statements each connection has prepared (a prepared statement lives as long as its session).
_prepared: weakref.WeakKeyDictionary[psycopg.AsyncConnection, set[str]] = weakref.WeakKeyDictionary()


async def begin_with(conn: psycopg.AsyncConnection, reads: Sequence[tuple[PreparedStatement, Mapping[str, Any]]], *,
                     generic_plans: bool = False, family: Sequence[PreparedStatement] = ()) -> list[list[Any]]:  # fmt: skip
    """``BEGIN`` and ``reads`` (independent of each other) in one round trip on an autocommit connection.

    Returns each read's rows, in order. ``generic_plans`` makes the
    transaction's prepared statements use their generic plan (``SET LOCAL
    plan_cache_mode``) instead of being planned again for each call's values,
    for statements whose best plan does not depend on them, and rules out
    sequential scans for the plans made in it: such statements reach their
    rows by key, and on a table of a few thousand rows the planner believed
    a scan and a hash join cheaper than a hundred probes of a primary key
    (the group commit's lock and write, 1.4 and 0.7 ms a batch at 6,000
    jobs). The caller ends the transaction (``COMMIT``, or ``conn.rollback()``).

    ``family`` holds every statement the transaction may run after these
    (its writes): they are prepared together with the reads, so that on a
    connection either all of them exist or, after something deallocated
    them (psycopg sends ``DEALLOCATE ALL`` at a rollback once it has
    prepared statements of its own), none does. The reads then find out:
    the transaction is rolled back, the whole family prepared again, and
    the reads sent once more, instead of a write failing later on.
    """
    statements = list(dict.fromkeys([*(read for read, _values in reads), *family]))
    query, params = _joined(reads)
    query = "\n".join(["BEGIN;", *([_GENERIC_INDEX_PLANS] if generic_plans else []), query])
    cursor = psycopg.AsyncClientCursor(conn)
    for last in (False, True):
        done = await _prepare(conn, statements)
        try:
            await _run(cursor, done, query, params)
            break
        except (psycopg.errors.InvalidSqlStatementName, psycopg.errors.FeatureNotSupported):
            if last:
                raise
            await conn.rollback()
    cursor.nextset()  # past BEGIN
    if generic_plans:
        cursor.nextset()
    results = []
    for _ in reads:
        results.append(await cursor.fetchall())
        cursor.nextset()
    return results


async def commit_with(conn: psycopg.AsyncConnection,
                      writes: Sequence[tuple[PreparedStatement, Mapping[str, Any]]]) -> list[list[Any]]:  # fmt: skip
    """The transaction's last statements and ``COMMIT`` in one round trip; returns each statement's rows.

    They run in order, and an error in any of them leaves nothing committed:
    PostgreSQL runs nothing of the message after it. A statement without rows
    answers ``[]``.
    """
    return await run_together(conn, writes, then="COMMIT")


async def run_together(conn: psycopg.AsyncConnection, statements: Sequence[tuple[PreparedStatement, Mapping[str, Any]]],
                       *, then: str = "") -> list[list[Any]]:  # fmt: skip
    """Prepared statements of the caller's transaction in one round trip, in order; returns each one's rows.

    ``then`` is sent after them in the same message (:func:`commit_with`
    sends ``COMMIT``). An error stops the message there.
    """
    done = await _prepare(conn, [statement for statement, _values in statements])
    query, params = _joined(statements)
    cursor = psycopg.AsyncClientCursor(conn)
    await _run(cursor, done, f"{query}\n{then}" if then else query, params)
    results = []
    for _ in statements:
        results.append(await cursor.fetchall() if cursor.description is not None else [])
        cursor.nextset()
    return results


def _joined(statements: Sequence[tuple[PreparedStatement, Mapping[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """The statements' ``EXECUTE``s as one query, each one's placeholders renamed apart (``%(s0_ids)s``)."""
    query: list[str] = []
    params: dict[str, Any] = {}
    for index, (statement, values) in enumerate(statements):
        query.append(_PLACEHOLDER.sub(f"%(s{index}_\\1)s", statement.execute) + ";")
        params.update((f"s{index}_{name}", value) for name, value in values.items())
    return "\n".join(query), params


async def _prepare(conn: psycopg.AsyncConnection, statements: Sequence[PreparedStatement]) -> set[str]:
    """Prepare on ``conn`` those of ``statements`` it has not prepared yet; returns its set of prepared names."""
    done = _prepared.setdefault(conn, set())
    for statement in statements:
        if statement.name not in done:
            try:
                await conn.execute(statement.prepare)
            except psycopg.errors.DuplicatePreparedStatement:  # an older one, possibly stale: replaced
                await conn.execute(f"DEALLOCATE {statement.name}")
                await conn.execute(statement.prepare)
            done.add(statement.name)
    return done


async def _run(cursor: psycopg.AsyncClientCursor[Any], done: set[str], query: str, params: Mapping[str, Any]) -> None:
    try:
        await cursor.execute(query, params)
    except (psycopg.errors.InvalidSqlStatementName, psycopg.errors.FeatureNotSupported):
        # Deallocated behind our back, or its table's columns changed ("cached plan must not
        # change result type", until deallocated): prepared afresh at the next call.
        done.clear()
        raise


#: Where a command gets its connections: the caller's own, held throughout, or
#: a pool it borrows from for each step (see :func:`borrowed`).
Database = psycopg.AsyncConnection | AsyncConnectionPool


@asynccontextmanager
async def borrowed(db: Database) -> AsyncIterator[psycopg.AsyncConnection]:
    """A connection for one step of a command: the pool's for that step only, or the one the caller holds.

    A command that computes something slow between its queries (argon2id)
    takes a pool, so no connection is held while it computes; given a
    connection, it runs every step on it, as the CLI and tests do.
    """
    if isinstance(db, AsyncConnectionPool):
        async with db.connection() as conn:
            yield conn
    else:
        yield db


#: How long a statement on a pooled connection waits for a lock (a row, an advisory lock) before it fails
#: (``LockNotAvailable``, answered 503 ``database_unavailable``: try again). Every lock the service takes
#: is held for one short transaction; one held longer is someone else's (an operator's open transaction),
#: and without a bound a request waited for it for as long, holding its pooled connection, and a stopping
#: server waited with it.
LOCK_WAIT_SECONDS = 5

#: How long a connection of the service (a server's, the CLI's) may sit in an open transaction, waiting
#: for its process to send the next statement, before PostgreSQL ends the session (rolling the
#: transaction back). Between two statements the service's transactions wait for nothing but its own
#: Python, milliseconds (an argon2id hash at most): never for a client (a request's body is read, a
#: stream's reader is written to, with no transaction open), nor for a person, nor for another
#: transaction of its own. A transaction idle this long belongs to a process that stopped
#: running (paused, frozen with its virtual machine, hung), and it may hold the log's ordering lock:
#: every other process's writes would wait for it until the operating system gave up on its
#: connection (TCP keepalives: two hours by default). One holding one of the service's own locks, the
#: log's ordering lock among them, is ended sooner (:data:`LOCK_HOLDER_IDLE_SECONDS`).
IDLE_IN_TRANSACTION_SECONDS = 20


async def bound_waits(conn: psycopg.AsyncConnection, *, lock_waits: bool = True) -> None:
    """Bound the connection's idle open transactions (:data:`IDLE_IN_TRANSACTION_SECONDS`) and, unless
    ``lock_waits`` is false, its lock waits (:data:`LOCK_WAIT_SECONDS`).

    Every connection of the service bounds its idle transactions: none of them
    waits for a person between two statements, and a process stopped inside
    one (an ``umbra admin`` command suspended with Ctrl-Z, a frozen server)
    would otherwise hold its locks, the log's ordering lock among them, until
    it resumed. A server's (the pool's, the sweeper's) bound their lock waits
    too; the CLI's do not (:func:`connect`): an operator's command waits as
    long as it takes for a server's transaction to let go.
    """
    await conn.execute("SELECT set_config('idle_in_transaction_session_timeout', %s, false), "
                       "CASE WHEN %s THEN set_config('lock_timeout', %s, false) END",
                       (f"{IDLE_IN_TRANSACTION_SECONDS}s", lock_waits, f"{LOCK_WAIT_SECONDS}s"))  # fmt: skip


async def _configure(conn: psycopg.AsyncConnection) -> None:
    """A pooled connection: the service role, timestamps read in UTC (:func:`in_utc`), waits bounded
    (:func:`bound_waits`)."""
    await in_utc(conn)
    await bound_waits(conn)
    await assume_service_role(conn)


#: How long a statement waits for one of the service's own advisory locks (see :func:`service_lock_wait`).
SERVICE_LOCK_WAIT_SECONDS = 30

#: How long a server's transaction holding one of the service's own advisory locks may sit idle, waiting for the
#: server's next statement, before PostgreSQL ends its session (:data:`IDLE_IN_TRANSACTION_SECONDS`
#: for any transaction). A frozen process's transactions queued for a lock each get it in turn, then
#: sit idle holding it: those of a process frozen while its requests queued for the log's order held
#: every write in the cluster for 20 s each, and the others' writes, waiting behind them, failed after
#: :data:`SERVICE_LOCK_WAIT_SECONDS`. At 2 s, a whole pool's worth (10) of them holds it 20 s. The
#: holders' own gaps between statements are the server's Python of one batch: milliseconds.
LOCK_HOLDER_IDLE_SECONDS = 2


def service_lock_wait(lock_select: str) -> str:
    """``lock_select`` (a SELECT taking the service's own advisory locks) waiting up to
    :data:`SERVICE_LOCK_WAIT_SECONDS`, the transaction's bound (:data:`LOCK_WAIT_SECONDS`) put back once
    they are held.

    Only the service's own transactions take its advisory locks (the log's
    order, idempotency keys, a fleet change, a node's claims and memory, a
    pairing code), and under a burst of large submissions their queue is
    longer than the bound for rows: a 10,000-job batch holds the log's order
    for about a second. Still bounded: some holders go on to wait for a row
    held elsewhere (a decomposition its parent's, a fleet change its node's),
    and a queue behind several of them would otherwise grow by a row's bound
    each. The bound is changed in a subquery the planner cannot fold into
    the lock's own (``OFFSET 0``), so before the lock is waited for, and set
    back in the outer select, once it is held. The outer select also bounds
    the transaction's idle time from then on (:data:`LOCK_HOLDER_IDLE_SECONDS`)
    on a connection whose idle transactions are bounded at all (every one of
    the service's: :func:`bound_waits`); a session that holds a lock open on
    purpose (a test's "change in flight") keeps its own setting.
    """
    return ("SELECT set_config('lock_timeout', bound.was, true), "
            "set_config('idle_in_transaction_session_timeout', CASE current_setting('idle_in_transaction_session_timeout')"
            f" WHEN '0' THEN '0' ELSE '{LOCK_HOLDER_IDLE_SECONDS}s' END, true) "
            f"FROM (SELECT current_setting('lock_timeout') AS was, set_config('lock_timeout', '{SERVICE_LOCK_WAIT_SECONDS}s', true) "
            f"OFFSET 0) AS bound, LATERAL ({lock_select} OFFSET 0) AS held")


def lock_wait_ended(exc: BaseException) -> bool:
    """Whether ``exc`` is a lock wait that ran out (:data:`LOCK_WAIT_SECONDS`): the lock's holder will let go,
    so "try again" is the right answer, as for a database that is away."""
    return isinstance(exc, psycopg.errors.LockNotAvailable)


async def in_utc(conn: psycopg.AsyncConnection) -> None:
    """Read timestamps in UTC on ``conn``, whatever the database's own time zone.

    The API and the log write every time in UTC (RFC 3339 with ``Z``), and
    times read from the database go into events as they are: read in the
    database's zone (initdb takes the machine's), a lease expiry's
    ``not_before`` was recorded as ``+05:30``. Converting in Python instead
    would cost five conversions per Job object on the agents' path.
    """
    await conn.execute("SET TIME ZONE 'UTC'")


#: TCP keepalives on every connection to the database: one whose peer went away silently (a network that
#: drops packets, a host gone without a reset) is ended after about 25 s with nothing heard, as a connection
#: the database closed is, instead of after the operating system's TCP timeout (two hours for one waiting
#: for an answer): a request, a batch or the sweeper waiting on it answers or moves on. Probes are answered
#: by the database host's kernel, so a long statement is not taken for a gone peer; a Unix socket (the
#: embedded server's) has none. Those the database URL sets are its own (:func:`keepalives`).
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}


def keepalives(url: str) -> dict[str, Any]:
    """:data:`KEEPALIVES` but those ``url`` sets itself: an operator's ``?keepalives_idle=300`` (a link whose
    probes cost, a firewall that forgets idle connections sooner) is kept. Passed to ``connect`` beside the
    URL, a keyword overrides the URL's own setting."""
    given = conninfo.conninfo_to_dict(url)
    return {name: value for name, value in KEEPALIVES.items() if name not in given}


async def connect(url: str, **kwargs: Any) -> psycopg.AsyncConnection:
    """A connection of its own (the sweeper's, the CLI's), in autocommit, reading times in UTC as pooled ones do
    and with its idle transactions bounded (:func:`bound_waits`; its lock waits are not), and
    :func:`keepalives`."""
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True, **{**keepalives(url), **kwargs})
    try:
        await in_utc(conn)
        await bound_waits(conn, lock_waits=False)
    except BaseException:
        await conn.close()
        raise
    return conn


@asynccontextmanager
async def own_connection(url: str, **kwargs: Any) -> AsyncIterator[psycopg.AsyncConnection]:
    """:func:`connect` for the length of a block (the listener's, the sweeper's, a migration's, the CLI's),
    closed however the block ends.

    Not ``async with conn``: psycopg's exit rolls back before it closes, and
    the rollback may give the event loop a turn even with nothing to roll
    back (psycopg yields when it has not for 5 ms, as on a loaded machine).
    There a task being cancelled, as every background task is when the
    server stops, is cancelled again: the close was skipped and the
    connection stayed open until the garbage collector found it. These
    connections are in autocommit, so there is nothing to roll back.
    """
    conn = await connect(url, **kwargs)
    try:
        yield conn
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close()


#: What a read meets while the database is away (restarting, failing over, a pooled connection it
#: ended, no connection in time: the pool's timeout is an OperationalError too), or after this
#: process stopped running long enough for PostgreSQL to end its idle transaction's session
#: (:data:`IDLE_IN_TRANSACTION_SECONDS`; nothing of that transaction was committed). A read caught by
#: it is simply made again later; to tell an outage from a refused statement, :func:`database_away`.
DATABASE_AWAY = (psycopg.OperationalError, psycopg.InterfaceError, psycopg.errors.IdleInTransactionSessionTimeout)

#: SQLSTATEs of a connection that failed or a server that is going away or cannot take it:
#: connection exceptions (class 08, but 08P01, a protocol violation: a client's bug), admin,
#: crash and startup shutdown, too many connections.
_AWAY_STATES = {"08000", "08001", "08003", "08004", "08006", "08007", "57P01", "57P02", "57P03", "53300"}


def database_away(exc: BaseException) -> bool:
    """Whether ``exc`` says the database could not be reached or ended the connection, rather than
    refused the statement: only then is "try again" the right answer.

    A deadlock, a serialization failure, a cancelled query or a row too large
    are operational errors too, but sending the request again would not help
    (or would hide a bug): they stay server errors.
    """
    if isinstance(exc, (psycopg.InterfaceError, psycopg.errors.IdleInTransactionSessionTimeout)):
        return True
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate  # None: failed on the client's side (no connection, the pool's timeout)
        return state is None or state in _AWAY_STATES
    return False

#: How long a request waits for a pooled connection, and a new connection for the server, before it
#: fails (503 ``database_unavailable``, try again). psycopg's 30 s default held every request that
#: long while the database was unreachable (and a group-commit batch falling back to its commands one
#: by one, that long per command), and kept a stopping server from exiting.
POOL_WAIT_SECONDS = 5.0
CONNECT_TIMEOUT_SECONDS = 5


@asynccontextmanager
async def open_pool(url: str, *, size: int = 10) -> AsyncIterator[AsyncConnectionPool]:
    pool = AsyncConnectionPool(
        url,
        min_size=min(2, size),
        max_size=size,
        open=False,
        timeout=POOL_WAIT_SECONDS,
        kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_SECONDS, **keepalives(url)},
        configure=_configure,
    )
    await pool.open(wait=True, timeout=30)
    try:
        yield pool
    finally:
        await pool.close()
