"""Jobs run as programs: ``umbra agent --command KIND='PROGRAM ARGS...'``.

Much of the work a GPU node does is a script (a training run, a transcode, a
batch of inference) in whatever language it was written in. A command handler
runs one program per job, so such work needs no Python handler written for it:

* the job's payload is the program's standard input, as JSON (its numbers as
  the submitter wrote them); ``UMBRA_JOB_ID``, ``UMBRA_JOB_KIND`` and
  ``UMBRA_JOB_ATTEMPT`` are in its environment, beside the agent's own;
* its standard output is the result: a JSON document as it is (its strings
  made storable), any other text as ``{"output": text}`` (its last
  :data:`OUTPUT_TAIL_BYTES`), as is a document the server would refuse;
* a line ``umbra-progress FRACTION [MESSAGE]`` on its standard error reports
  progress (``-`` for no fraction); the other lines go to the agent's log, and
  the last :data:`ERROR_TAIL_LINES` of them into the error of a failure;
* exit status 0 completes the job; :data:`RETRYABLE_EXIT` (``EX_TEMPFAIL``
  of sysexits.h) fails it as retryable; ending by a signal someone else sent
  it to stop (:data:`STOPPING_SIGNALS`: a service manager stopping every
  process of the agent's service) is an interruption (:class:`Interrupted`:
  given back while the agent is stopping, else retried); any other status,
  or another signal (``SIGKILL``, a crash), fails it for good;
* it runs in a session of its own: a Ctrl-C in the agent's terminal stops
  the agent gracefully (the program finishes within ``--grace``), and the
  program and whatever it starts are one process group;
* a job cancelled, lost or out of time sends that group ``SIGTERM``, then
  ``SIGKILL`` after :data:`TERMINATE_GRACE_SECONDS`; so does the program's
  exit, for what it left running: the slot is free only once the group is
  gone, so the device is never shared with a leftover;
* on Linux it gets ``SIGKILL`` when the agent dies without stopping it
  (``kill -9``), rather than run on beside the job's next run on another node
  (:mod:`umbra.agent.tether`; what the program started itself is not reached
  that way); a program that cannot be started there exits 127.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import subprocess
from collections import deque
from decimal import Decimal
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream

from umbra.events import documents

from .client import storable_text
from .handlers import Interrupted, PermanentError, RetryableError
from .tether import tethered

log = logging.getLogger(__name__)

#: The exit status that fails a job as retryable (``EX_TEMPFAIL``: "try again later").
RETRYABLE_EXIT = 75
#: Signals that stop a program on purpose; one ended by one of them was interrupted, not failed.
STOPPING_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
#: Seconds a program (and what it started) has to exit after ``SIGTERM`` before it is killed: short, for the
#: job is given back (a second Ctrl-C, a lost lease) only once its program is gone.
TERMINATE_GRACE_SECONDS = 3.0
#: How long a program's group is waited for after ``SIGKILL`` (a process in uninterruptible sleep).
KILLED_WAIT_SECONDS = 5.0
#: How long standard output and error are read after the program and its group are gone: a process it
#: started in a session of its own may hold them open for ever.
PIPES_DRAIN_SECONDS = 1.0
#: The longest error a failure carries (the server takes 10,000 characters).
ERROR_MAX_CHARS = 4000
#: The deepest JSON result kept as one (``umbra.compute.jobs.MAX_JSON_DEPTH``: the server refuses deeper
#: documents; the agent imports nothing of the server's). A deeper output is the result as text.
RESULT_MAX_DEPTH = 100
#: Standard output kept: a result larger than this (the server takes request bodies of 1 MiB) is cut
#: to its end and answered as text.
OUTPUT_MAX_BYTES = 1_000_000
#: Of standard output that is not a JSON document, the end kept as the result's ``output``.
OUTPUT_TAIL_BYTES = 64 * 1024
#: Lines of standard error quoted in a failure's error.
ERROR_TAIL_LINES = 20
#: The prefix of a standard-error line that reports progress.
PROGRESS_PREFIX = "umbra-progress"


def parse_command(text: str) -> list[str]:
    """``PROGRAM ARGS...`` split as a POSIX shell would (quotes kept together), without running a shell."""
    argv = shlex.split(text)
    if not argv or not argv[0]:
        raise ValueError("a command needs a program")
    return argv


class CommandHandler:
    """The handler for one job kind that runs ``argv`` for each job."""

    def __init__(self, argv: list[str], *, terminate_grace: float = TERMINATE_GRACE_SECONDS) -> None:
        self.argv = list(argv)
        self.terminate_grace = terminate_grace

    def __repr__(self) -> str:
        return f"CommandHandler({shlex.join(self.argv)!r})"

    async def __call__(self, claim: Any) -> Any:
        environment = {name: value for name, value in os.environ.items() if not name.startswith("UMBRA_")}
        environment.update(UMBRA_JOB_ID=str(claim.job_id), UMBRA_JOB_KIND=str(claim.kind), UMBRA_JOB_ATTEMPT=str(claim.attempt))
        try:
            # A session of its own: a Ctrl-C in the agent's terminal stops the agent gracefully, not the
            # program; and the program and whatever it starts are one process group, stopped together.
            # Tethered: an agent killed outright (SIGKILL) takes the program with it.
            process = await anyio.open_process(tethered(self.argv, environment), stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment,
                                               start_new_session=True)  # fmt: skip
        except OSError as exc:  # no such program, not executable (elsewhere than Linux): the same on every attempt
            raise PermanentError(f"could not start {self.argv[0]!r}: {exc.strerror or exc}") from None
        output = _Output()
        errors: deque[str] = deque(maxlen=ERROR_TAIL_LINES)
        try:
            async with anyio.create_task_group() as tg:
                exact = getattr(claim, "exact_payload", None)  # a Claim made by hand may have none: its payload then
                tg.start_soon(self._feed, process, claim.payload if exact is None else exact)
                read = anyio.Event()

                async def read_both() -> None:
                    async with anyio.create_task_group() as readers:
                        readers.start_soon(self._collect, process.stdout, output)
                        readers.start_soon(self._watch_errors, process.stderr, claim, errors)
                    read.set()

                tg.start_soon(read_both)
                status = await process.wait()
                await self._stop(process)  # what it left running (holding its pipes open, or the device)
                with anyio.move_on_after(PIPES_DRAIN_SECONDS):  # what is still in the pipes is read
                    await read.wait()
                tg.cancel_scope.cancel()  # a process outside its group may hold them open still
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop(process)
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await process.aclose()
        if status == 0:
            return output.result()
        why = f"killed by signal {-status}" if status < 0 else f"exited with status {status}"
        message = _failure(f"{self.argv[0]} {why}: ", errors)
        if status == RETRYABLE_EXIT:
            raise RetryableError(message)
        if -status in STOPPING_SIGNALS:  # not ours: the agent signals the group only once the program ended
            raise Interrupted(message)
        raise PermanentError(message)

    @staticmethod
    async def _feed(process: anyio.abc.Process, payload: Any) -> None:
        """The payload on standard input, then end of input; a program that reads none of it is no failure."""
        assert process.stdin is not None
        try:
            await process.stdin.send(documents.encode(payload) + b"\n")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            await process.stdin.aclose()

    @staticmethod
    async def _collect(stream: ByteReceiveStream | None, output: _Output) -> None:
        assert stream is not None
        async for chunk in stream:
            output.add(chunk)

    @staticmethod
    async def _watch_errors(stream: ByteReceiveStream | None, claim: Any, errors: deque[str]) -> None:
        assert stream is not None
        pending = b""
        async for chunk in stream:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                _error_line(line.decode("utf-8", "replace").rstrip("\r"), claim, errors)
            if len(pending) > 64 * 1024:  # a line without end: taken as it is
                _error_line(pending.decode("utf-8", "replace"), claim, errors)
                pending = b""
        if pending:
            _error_line(pending.decode("utf-8", "replace"), claim, errors)

    async def _stop(self, process: anyio.abc.Process) -> None:
        """``SIGTERM`` to the program and everything in its process group, ``SIGKILL`` to what is left after
        the grace; returns once the program is reaped and its group empty (or, for a group that outlives a
        ``SIGKILL``, after :data:`KILLED_WAIT_SECONDS`)."""
        _signal_group(process.pid, signal.SIGTERM)
        with anyio.move_on_after(self.terminate_grace):
            await process.wait()
            while _signal_group(process.pid, 0):
                await anyio.sleep(0.05)
            return
        _signal_group(process.pid, signal.SIGKILL)
        await process.wait()
        with anyio.move_on_after(KILLED_WAIT_SECONDS):
            while _signal_group(process.pid, 0):
                await anyio.sleep(0.05)


def _signal_group(pgid: int, number: int) -> bool:
    """Send ``number`` (0: only ask) to a process group; False once no process of it is left."""
    try:
        os.killpg(pgid, number)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _failure(prefix: str, errors: deque[str]) -> str:
    """A failure's error: ``prefix`` and the last lines of standard error, their end kept within
    :data:`ERROR_MAX_CHARS` (the last line says most often why: "CUDA out of memory")."""
    said = storable_text("; ".join(errors), 10**6) if errors else "nothing on standard error"
    room = ERROR_MAX_CHARS - len(prefix)
    if len(said) > room:
        said = "…" + said[-(room - 1):]
    return storable_text(prefix, ERROR_MAX_CHARS // 2) + said


def _error_line(line: str, claim: Any, errors: deque[str]) -> None:
    """One line of standard error: a progress report, or a line to log and keep for the error."""
    if line.startswith(PROGRESS_PREFIX + " ") or line == PROGRESS_PREFIX:
        fraction_text, _, message = line[len(PROGRESS_PREFIX):].strip().partition(" ")
        try:
            fraction = None if fraction_text in ("", "-") else float(fraction_text)
        except ValueError:
            fraction = math.nan
        if fraction is None and not message.strip():
            return  # says nothing: nothing to report
        if fraction is None or (math.isfinite(fraction) and 0 <= fraction <= 1):
            claim.report_progress(fraction, message.strip() or None)
            return
        log.warning("a progress line the agent could not read", extra={"action": "command_progress_unread",
                    "job_id": str(claim.job_id), "line": line[:200]})  # fmt: skip
        return
    if not line.strip():
        return
    errors.append(line[:500])
    log.info("command said", extra={"action": "command_stderr", "job_id": str(claim.job_id), "line": line[:2000]})


class _Output:
    """Standard output: all of it up to :data:`OUTPUT_MAX_BYTES`; past that only its end is kept (the rest is
    read and dropped, so the program never blocks on a full pipe), and the result is that end as text."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.cut = False

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > OUTPUT_MAX_BYTES:
            del self.data[: len(self.data) - OUTPUT_TAIL_BYTES]
            self.cut = True

    def result(self) -> Any:
        """The job's result: a JSON document as written (its strings made storable), else ``{"output": the
        text's end}``: also for a document deeper than the server takes, holding a number it cannot store, or
        one that, written again, would not fit a request (``1e9`` is sent as ``1E+9``)."""
        if not self.cut:
            try:
                document = _storable(documents.decode(bytes(self.data)), RESULT_MAX_DEPTH)
                if len(documents.encode(document)) <= OUTPUT_MAX_BYTES:
                    return document
            except (ValueError, RecursionError):
                pass
        text = bytes(self.data[-OUTPUT_TAIL_BYTES:]).decode("utf-8", "replace")
        return {"output": storable_text(text, OUTPUT_TAIL_BYTES)}


def _storable(value: Any, levels: int) -> Any:
    """``value`` with every string (keys too) as the server can store it (:func:`storable_text`: no NUL, no
    lone surrogate); ValueError for arrays and objects nested more than ``levels`` deep, or a number the server
    cannot store (:func:`~umbra.events.documents.storable_number`) or would not read back once stored
    (:func:`~umbra.events.documents.readable_number`: it refuses such a result)."""
    if isinstance(value, Decimal) and not (documents.storable_number(value) and documents.readable_number(value)):
        raise ValueError("a number the server cannot store")
    if isinstance(value, str):
        return storable_text(value, len(value) * 10 + 1)
    if isinstance(value, (dict, list)) and levels <= 0:
        raise ValueError("nested too deep")
    if isinstance(value, dict):
        return {storable_text(k, len(k) * 10 + 1): _storable(v, levels - 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v, levels - 1) for v in value]
    return value
