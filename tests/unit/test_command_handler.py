"""``umbra agent --command KIND='PROGRAM ARGS'``: a job run as a program. The payload on its standard input,
its standard output the result, its exit status the outcome, ``umbra-progress`` lines its progress, and a
cancelled job's program stopped before the slot is free. Real processes (this interpreter, ``-c``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from decimal import Decimal

import anyio
import pytest

from umbra.agent import commands
from umbra.agent.cli import _command_spec
from umbra.agent.commands import CommandHandler, parse_command
from umbra.agent.handlers import PermanentError, is_retryable
from umbra.events import documents

pytestmark = pytest.mark.anyio


class FakeClaim:
    """What a handler reads of a claim, and the progress it reports."""

    def __init__(self, payload=None, *, kind: str = "script", attempt: int = 2) -> None:
        self.payload, self.kind, self.attempt, self.job_id = payload, kind, attempt, "0d06c0de-0000-4000-8000-000000000001"
        self.progress: list[tuple[float | None, str | None]] = []

    def report_progress(self, fraction=None, message=None) -> None:
        self.progress.append((fraction, message))


def python(code: str, **kwargs) -> CommandHandler:
    return CommandHandler([sys.executable, "-c", code], **kwargs)


async def test_the_payload_goes_in_as_json_and_a_json_document_out_is_the_result_its_numbers_exact():
    handler = python(
        "import json, os, sys\n"
        "text = sys.stdin.read()\n"
        "print(json.dumps({'read': text.strip(), 'env': [os.environ[k] for k in ('UMBRA_JOB_ID', 'UMBRA_JOB_KIND', "
        "'UMBRA_JOB_ATTEMPT')]}))\n"
        "print('{\"exact\": 0.10000000000000000001}', file=open(os.devnull, 'w'))"
    )
    result = await handler(FakeClaim({"x": Decimal("0.10000000000000000001"), "n": [1, 2]}))
    assert result == {"read": '{"x":0.10000000000000000001,"n":[1,2]}',
                      "env": ["0d06c0de-0000-4000-8000-000000000001", "script", "2"]}  # fmt: skip
    exact = await python("print('{\"p\": 3.14159265358979323846264338327950288}')")(FakeClaim())
    assert exact == {"p": Decimal("3.14159265358979323846264338327950288")}


async def test_text_out_is_the_result_s_output_and_a_huge_output_keeps_its_end():
    assert await python("print('rendered 12 frames')")(FakeClaim()) == {"output": "rendered 12 frames\n"}
    assert await python("pass")(FakeClaim()) == {"output": ""}
    huge = await python("import sys\nsys.stdout.write('x' * 3_000_000 + 'THE END')")(FakeClaim())
    assert huge["output"].endswith("THE END") and len(huge["output"]) == commands.OUTPUT_TAIL_BYTES


async def test_progress_lines_are_reported_and_other_lines_kept_for_a_failure_s_error(caplog):
    caplog.set_level(logging.INFO, logger="umbra.agent.commands")
    claim = FakeClaim()
    handler = python(
        "import sys\n"
        "for line in ['umbra-progress 0.25 epoch 1 of 4', 'loading weights', 'umbra-progress - warming up',\n"
        "             'umbra-progress 7 too far', 'umbra-progress 1']:\n"
        "    print(line, file=sys.stderr, flush=True)\n"
        "sys.exit(3)"
    )
    with pytest.raises(PermanentError) as refused:
        await handler(claim)
    assert claim.progress == [(0.25, "epoch 1 of 4"), (None, "warming up"), (1.0, None)]
    assert str(refused.value).endswith("exited with status 3: loading weights")
    assert not is_retryable(refused.value)
    assert [getattr(r, "line", None) for r in caplog.records] == ["loading weights", "umbra-progress 7 too far"]


async def test_exit_75_is_a_retryable_failure_and_a_signal_or_a_missing_program_a_final_one():
    with pytest.raises(Exception) as retry:
        await python("import sys\nprint('GPU busy', file=sys.stderr)\nsys.exit(75)")(FakeClaim())
    assert is_retryable(retry.value) and "exited with status 75: GPU busy" in str(retry.value)
    with pytest.raises(PermanentError, match="killed by signal 9"):
        await python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")(FakeClaim())
    with pytest.raises(PermanentError, match="could not start '/no/such/program'"):
        await CommandHandler(["/no/such/program"])(FakeClaim())


async def test_a_cancelled_job_s_program_is_terminated_then_killed_before_the_handler_returns(tmp_path):
    """SIGTERM first; a program that ignores it is killed after the grace. Either way it is gone once the
    cancelled handler returns: the slot's device is never shared with a leftover."""
    for ignores, grace in ((False, 30.0), (True, 0.5)):
        pid_file = tmp_path / f"pid-{ignores}"
        handler = python(
            "import os, signal, sys, time\n"
            f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignores else "")
            + "time.sleep(60)", terminate_grace=grace,
        )
        started = time.monotonic()
        with anyio.move_on_after(1.0):
            await handler(FakeClaim())
        pid = int(pid_file.read_text())
        assert time.monotonic() - started < 1.0 + grace + 5
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_flag_takes_a_kind_and_a_command_split_as_a_shell_would():
    assert _command_spec("render=blender -b 'my scene.blend' -a") == ("render", ["blender", "-b", "my scene.blend", "-a"])
    for bad in ("render", "=blender", "render=", "render='unclosed", "render=''", "render='' --arg"):
        with pytest.raises(argparse.ArgumentTypeError):
            _command_spec(bad)
    with pytest.raises(ValueError):
        parse_command("   ")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _pid_in(path) -> int:
    with anyio.fail_after(5):
        while not (path.exists() and path.read_text()):
            await anyio.sleep(0.02)
    return int(path.read_text())


async def test_the_program_runs_in_a_session_of_its_own_and_its_children_are_stopped_with_it(tmp_path):
    """A Ctrl-C in the agent's terminal signals the agent's process group, not the program (the agent stops
    gracefully and lets it finish); a cancelled program's children (``bash train.sh`` running the worker that
    holds the GPU) are stopped with it, one ignoring SIGTERM killed after the grace."""
    pid_file, child_file = tmp_path / "pid", tmp_path / "child"
    handler = python(
        "import os, signal, subprocess, time\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"p = subprocess.Popen(['sleep', '60'])\nopen({str(child_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)", terminate_grace=0.5,
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(handler, FakeClaim())
        program, child = await _pid_in(pid_file), await _pid_in(child_file)
        assert os.getpgid(program) != os.getpgrp() and os.getsid(program) == program
        tg.cancel_scope.cancel()
    assert not _alive(program) and not _alive(child)


async def test_a_background_child_holding_the_pipes_neither_hangs_the_job_nor_outlives_it(tmp_path):
    """``server &`` then exit 0: the result is answered once the program is gone, and what it left running in
    its group is stopped (it would hold the device and the pipes)."""
    child_file = tmp_path / "child"
    handler = python("import subprocess\n"
                     f"p = subprocess.Popen(['sleep', '30'])\nopen({str(child_file)!r}, 'w').write(str(p.pid))\n"
                     "print('{\"ok\": true}')")  # fmt: skip
    with anyio.fail_after(8):
        assert await handler(FakeClaim()) == {"ok": True}
    assert not _alive(int(child_file.read_text()))


async def test_a_bare_progress_line_is_nothing_and_the_job_goes_on():
    for line in ("umbra-progress -", "umbra-progress", "umbra-progress  "):
        claim = FakeClaim()
        code = f"import sys, time\nprint({line!r}, file=sys.stderr, flush=True)\ntime.sleep(0.2)\nprint('{{\"done\": 1}}')"
        assert await python(code)(claim) == {"done": 1} and claim.progress == []


async def test_a_failure_s_error_keeps_the_last_lines_of_standard_error_within_its_length():
    code = ("import sys\nfor i in range(30):\n    print(f'noise {i} ' + 'n' * 400, file=sys.stderr)\n"
            "print('RuntimeError: CUDA out of memory', file=sys.stderr)\nsys.exit(1)")
    with pytest.raises(PermanentError) as failed:
        await python(code)(FakeClaim())
    message = str(failed.value)
    assert len(message) <= commands.ERROR_MAX_CHARS and message.endswith("RuntimeError: CUDA out of memory")
    assert message.startswith(f"{sys.executable} exited with status 1: …")


async def test_a_json_result_is_made_storable_and_one_the_server_would_refuse_is_taken_as_text():
    """A NUL in a string (PostgreSQL stores none) becomes U+FFFD, as in text output; a document deeper than the
    server takes, or one that written again no longer fits a request (``1e9`` is sent as ``1E+9``), is the
    result as text, not a completion the server refuses."""
    assert await python("print('{\"na\\\\u0000me\": \"a\\\\u0000b\"}')")(FakeClaim()) == {"na\ufffdme": "a\ufffdb"}
    from umbra.compute.jobs import check_document

    deep = await python("import sys\nsys.stdout.write('[' * 100000 + ']' * 100000)")(FakeClaim())
    assert deep["output"].endswith("]]]")  # the end of it, not a RecursionError
    for levels in (100, 101):  # as deep as the server takes, and one more
        text = "[" * levels + "]" * levels
        shown = await python(f"print({text!r})")(FakeClaim())
        try:
            check_document(documents.decode(text), "result")
        except ValueError:
            assert shown == {"output": text + "\n"}, levels
        else:
            assert shown == documents.decode(text), levels
    grown = await python(f"import sys\nsys.stdout.write('[' + ','.join(['1e9'] * {(commands.OUTPUT_MAX_BYTES - 2) // 4}) + ']')")(FakeClaim())
    assert set(grown) == {"output"}
    # A number the server's database cannot hold is text too, and so is one it would not read back (written out,
    # 1e4300 is 4,301 digits); the largest that reads back stays a number.
    assert await python("print('{\"x\": [1e200000]}')")(FakeClaim()) == {"output": '{"x": [1e200000]}\n'}
    assert await python("print('{\"x\": 1e4300}')")(FakeClaim()) == {"output": '{"x": 1e4300}\n'}
    assert await python("print('{\"x\": 1e4299}')")(FakeClaim()) == {"x": Decimal("1e4299")}


async def test_the_agent_s_own_settings_do_not_reach_the_program(monkeypatch):
    """The agent's ``UMBRA_*`` environment (an API key, a database URL) is not the program's business; the
    job's own variables are set whatever the agent's environment held."""
    monkeypatch.setenv("UMBRA_API_KEY", "uk_secret_org_key")
    monkeypatch.setenv("UMBRA_DATABASE_URL", "postgresql://u:pw@db/umbra")
    monkeypatch.setenv("UMBRA_JOB_ID", "stale")
    monkeypatch.setenv("PATH_FOR_THE_JOB", "kept")
    seen = await python("import os, json\nprint(json.dumps(dict(os.environ)))")(FakeClaim())
    assert sorted(k for k in seen if k.startswith("UMBRA_")) == ["UMBRA_JOB_ATTEMPT", "UMBRA_JOB_ID", "UMBRA_JOB_KIND"]
    assert seen["UMBRA_JOB_ID"] == FakeClaim().job_id and seen["PATH_FOR_THE_JOB"] == "kept"
