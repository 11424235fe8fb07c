"""Jobs run as programs: ``umbra agent --command KIND='PROGRAM ARGS...'``.

Much of the work a GPU node does is a script (a training run, a transcode, a
batch of inference) in whatever language it was written in. A command handler
runs one program per job, so such work needs no Python handler written for it:

* the job's payload is the program's standard input, as JSON (its numbers as
  the submitter wrote them); ``UMBRA_JOB_ID``, ``UMBRA_JOB_KIND`` and
  ``UMBRA_JOB_ATTEMPT`` are in its environment, beside the agent's own;
* its standard output is the result: a JSON document as it is, any other
  text as ``{"output": text}`` (its last :data:`OUTPUT_TAIL_BYTES`);
* a line ``umbra-progress FRACTION [MESSAGE]`` on its standard error reports
  progress (``-`` for no fraction); the other lines go to the agent's log, and
  the last :data:`ERROR_TAIL_LINES` of them into the error of a failure;
* exit status 0 completes the job; :data:`RETRYABLE_EXIT` (``EX_TEMPFAIL``
  of sysexits.h) fails it as retryable; any other status, or a signal, fails
  it for good;
* a job cancelled, lost or out of time sends the program ``SIGTERM``, then
  ``SIGKILL`` after :data:`TERMINATE_GRACE_SECONDS`: the slot is free only
  once the program is gone, so the device is never shared with a leftover.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import subprocess
from collections import deque
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream

from umbra.events import documents

from .client import storable_text
from .handlers import PermanentError, RetryableError

log = logging.getLogger(__name__)

#: The exit status that fails a job as retryable (``EX_TEMPFAIL``: "try again later").
RETRYABLE_EXIT = 75
#: Seconds a program has to exit after ``SIGTERM`` before it is killed.
TERMINATE_GRACE_SECONDS = 10.0
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
    if not argv:
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
        environment = {**os.environ, "UMBRA_JOB_ID": str(claim.job_id), "UMBRA_JOB_KIND": str(claim.kind),
                       "UMBRA_JOB_ATTEMPT": str(claim.attempt)}  # fmt: skip
        try:
            process = await anyio.open_process(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, env=environment)  # fmt: skip
        except OSError as exc:  # no such program, not executable: the same on every attempt here
            raise PermanentError(f"could not start {self.argv[0]!r}: {exc.strerror or exc}") from None
        output = _Output()
        errors: deque[str] = deque(maxlen=ERROR_TAIL_LINES)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._feed, process, claim.payload)
                tg.start_soon(self._collect, process.stdout, output)
                tg.start_soon(self._watch_errors, process.stderr, claim, errors)
                status = await process.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop(process)
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await process.aclose()
        if status == 0:
            return output.result()
        said = "; ".join(errors) if errors else "nothing on standard error"
        why = f"killed by signal {-status}" if status < 0 else f"exited with status {status}"
        message = storable_text(f"{self.argv[0]} {why}: {said}", 4000)
        if status == RETRYABLE_EXIT:
            raise RetryableError(message)
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
        """``SIGTERM``, then ``SIGKILL`` if the program is still there after the grace."""
        if process.returncode is not None:
            return
        try:
            process.terminate()
        except ProcessLookupError:
            return
        with anyio.move_on_after(self.terminate_grace):
            await process.wait()
            return
        try:
            process.kill()
        except ProcessLookupError:
            return
        await process.wait()


def _error_line(line: str, claim: Any, errors: deque[str]) -> None:
    """One line of standard error: a progress report, or a line to log and keep for the error."""
    if line.startswith(PROGRESS_PREFIX + " ") or line == PROGRESS_PREFIX:
        fraction_text, _, message = line[len(PROGRESS_PREFIX):].strip().partition(" ")
        try:
            fraction = None if fraction_text in ("", "-") else float(fraction_text)
        except ValueError:
            fraction = math.nan
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
        """The job's result: a JSON document as written, else ``{"output": the text's end}``."""
        if not self.cut:
            try:
                return documents.decode(bytes(self.data))
            except ValueError:
                pass
        text = bytes(self.data[-OUTPUT_TAIL_BYTES:]).decode("utf-8", "replace")
        return {"output": storable_text(text, OUTPUT_TAIL_BYTES)}
