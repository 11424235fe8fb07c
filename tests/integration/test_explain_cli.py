"""``umbra jobs explain ID`` against a live server: summary, ranked eligible devices, ineligible with reasons."""

from __future__ import annotations

import json

import anyio
import pytest

from umbra.cli import main
from umbra.compute.accounts import create_api_key, create_organization
from umbra.events.types import Device, ResidentModel

from .queue_support import CPU8, GPU24, add_node, register_model, submit

pytestmark = pytest.mark.anyio


@pytest.fixture
def cli(live_server, capsys, monkeypatch):
    monkeypatch.delenv("UMBRA_API_KEY", raising=False)

    async def run(*argv: str, key: str | None) -> tuple[int, str, str]:
        capsys.readouterr()
        auth = ["--api-key", key] if key else []
        status = await anyio.to_thread.run_sync(main, [*argv, "--server", live_server.url, *auth])
        out, err = capsys.readouterr()
        return status, out, err

    return run


async def test_explain_prints_the_summary_then_ranked_devices_then_reasons(cli, conn, org):
    org_id, key = org
    await register_model(conn, org_id, "gemma", vram_min_mb=8000)
    warm = Device(kind="gpu_discrete", label="gpu1", vram_total_mb=24576, vram_free_mb=12000, throughput_factor=6.0,
                  resident_models=(ResidentModel(slug="gemma", vram_held_mb=8000),))  # fmt: skip
    await add_node(conn, org_id, "gpu-box", [GPU24, warm])
    await add_node(conn, org_id, "cpu-box", [CPU8])
    await add_node(conn, org_id, "later", [GPU24], online=False)
    job = await submit(conn, org_id, requires={"models": ["gemma"]})
    status, out, err = await cli("jobs", "explain", str(job.id), key=key)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("Can run on 2 devices; the best is gpu-box/gpu0 via vram (score 7, placed:gpu_discrete)")
    assert lines[1] == "" and lines[2] == "eligible, best first:"
    assert lines[3].split() == ["1.", "gpu-box/gpu0", "via", "vram", "score", "7", "placed:gpu_discrete"]
    assert lines[4].split() == ["2.", "gpu-box/gpu1", "via", "vram", "score", "6", "placed:gpu_discrete", "resident"]
    assert lines[5] == "ineligible:"
    assert lines[6].split() == ["cpu-box/cpu", "ram_insufficient", "(needs", "8000", "MB,", "has", "6000", "MB)"]
    assert lines[7].split() == ["later/gpu0", "node_provisioning"]
    assert len(lines) == 8

    status, out, _ = await cli("jobs", "explain", str(job.id), "--json", key=key)
    body = json.loads(out)
    assert status == 0 and body["job_id"] == str(job.id) and len(body["eligible"]) == 2


async def test_explain_refusals_are_one_line(cli, conn, org):
    org_id, key = org
    job = await submit(conn, org_id)
    _, other_key = await create_organization(conn, "other")
    status, out, err = await cli("jobs", "explain", str(job.id), key=other_key)
    assert (status, out) == (1, "") and err.startswith("umbra: job_not_found:") and len(err.splitlines()) == 1
    status, _, err = await cli("jobs", "explain", str(job.id), key=await create_api_key(conn, org_id, ["events:read"]))
    assert status == 1 and err.startswith("umbra: forbidden:")
    status, _, err = await cli("jobs", "explain", str(job.id), key=None)
    assert status == 1 and "jobs:read" in err and "UMBRA_API_KEY" in err


async def test_a_blocked_job_prints_its_reason_and_every_refusal(cli, conn, org):
    org_id, key = org
    await add_node(conn, org_id, "gpu-box", [GPU24])
    job = await submit(conn, org_id, requires={"vram_min_mb": 40000})
    status, out, _ = await cli("jobs", "explain", str(job.id), key=key)
    assert status == 0
    assert out.splitlines()[0].startswith("Blocked because no registered device could ever run it: needs 40000 MB VRAM")
    assert out.splitlines()[-1].split() == ["gpu-box/gpu0", "vram_insufficient", "(needs", "40000", "MB,", "has", "24000", "MB)"]
    assert "eligible, best first:" not in out


async def test_names_a_terminal_would_act_on_are_printed_escaped(cli, conn, org):
    """A node's name is the node's to choose: one holding an ANSI escape, a newline and a bidirectional
    override is printed with those written as escapes, so it can neither clear the operator's screen,
    forge a line of its own, nor reorder what is shown. ``--json`` is JSON as ever."""
    org_id, key = org
    name = "evil\x1b[2J\nforged: eligible\u202e"
    await add_node(conn, org_id, name, [CPU8])
    job = await submit(conn, org_id)
    status, out, err = await cli("jobs", "explain", str(job.id), key=key)
    assert status == 0, err
    assert "\x1b" not in out and "\u202e" not in out
    assert not any(line.startswith("forged") for line in out.splitlines())
    assert "evil\\x1b[2J\\nforged: eligible\\u202e/cpu" in out
    status, out, _ = await cli("jobs", "explain", str(job.id), "--json", key=key)
    assert json.loads(out)["eligible"][0]["node_name"] == name
