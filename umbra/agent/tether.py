"""A job's program ends with its agent, even an agent killed outright (Linux).

An agent that stops in any ordinary way stops its programs first
(:mod:`umbra.agent.commands`). One killed with ``SIGKILL`` (``kill -9``, the
kernel's OOM killer, a supervisor's last resort) does nothing more: its
program, reparented to init, ran on, holding the GPU, while the job's lease
ran out and the job ran again on another node, two copies at once.

So each program is started by a few lines of this interpreter
(:data:`_START`, about 30 ms) that ask the kernel to send it ``SIGKILL``
when its parent dies (``prctl(PR_SET_PDEATHSIG)``), then become the program
(``execvp``: the same process, its pid the one the agent waits for and
signals). Not in ``preexec_fn``: Python code run between ``fork`` and
``exec`` in a process with threads (the agent's handlers and DNS lookups run
in some) can deadlock on a lock another thread held at the fork.

Three things make it hold:

* the signal is sent when the *thread* that forked dies, not its process.
  asyncio, which ``umbra agent`` runs on, starts programs from its event
  loop's thread, which outlives every program: the handler reaps its program
  before it returns;
* an agent that died before the request was made sent no signal: the
  program checks that its parent is still the agent after asking, and ends
  itself otherwise;
* Python's own start is undone before the program runs: signals it ignores
  (``SIGPIPE``, ``SIGXFSZ``) are set back to their default, as
  :class:`subprocess.Popen` does, and ``LC_CTYPE``, which it sets in a C
  locale (PEP 538), is put back as the program's environment had it.

What it does not reach: processes the program started itself. An agent
that stops ends the program's whole process group; an agent killed outright
ends only the program, and what it started runs on unless it ends with its
parent (its own ``PDEATHSIG``, or by reading from or writing to a pipe the
program held). A set-user-ID program loses the request at ``exec``. On other
systems programs start as they are, without it.
"""

from __future__ import annotations

import os
import sys

#: Run as ``python -I -S -c _START AGENT_PID LC_CTYPE PROGRAM ARGS...``: LC_CTYPE is ``=value``, or empty
#: for none. Exit status 127 (a shell's "command not found") when the program cannot be started.
_START = """\
import ctypes, os, signal, sys
agent, ctype, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != agent:
    os.kill(os.getpid(), signal.SIGKILL)
for number in (signal.SIGPIPE, signal.SIGXFSZ):
    signal.signal(number, signal.SIG_DFL)
if ctype:
    os.environ["LC_CTYPE"] = ctype[1:]
else:
    os.environ.pop("LC_CTYPE", None)
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    print(f"could not start {argv[0]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
    os._exit(127)
"""


def tethered(argv: list[str], environment: dict[str, str]) -> list[str]:
    """The command that runs ``argv`` (looked up in ``environment``'s ``PATH``) so that it gets ``SIGKILL`` when
    this process dies; ``argv`` itself where the kernel cannot do that (not Linux) or no interpreter is known."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return argv
    ctype = environment.get("LC_CTYPE")
    return [sys.executable, "-I", "-S", "-c", _START, str(os.getpid()), "" if ctype is None else f"={ctype}", *argv]
