"""``umbra agent --ollama``: the models the Ollama server beside the agent holds loaded reach the node's
devices with each heartbeat, and through them placement: a job whose model is loaded is placed as resident."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from uuid import uuid4

import anyio
import pytest

from tests.helpers import eventually
from umbra.agent.resident import MB, OllamaModels, RunningModel, ollama_url, place_resident
from umbra.domain.device_reports import MAX_RESIDENT_MODELS as MAX_RESIDENT
from umbra.domain.eligibility import NodeView, judge_device
from umbra.domain.models import RegisteredModel
from umbra.events.types import Device, Requirements, ResidentModel

from .test_agent_process import ROOT, _paired_file, api, server  # noqa: F401

pytestmark = pytest.mark.anyio

GIB = 1024**3
CPU = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=60000)
GPU0 = Device(kind="gpu_discrete", label="cuda:0 RTX 4090", vram_total_mb=24564, vram_free_mb=4000, accelerators=("cuda",))
GPU1 = Device(kind="gpu_discrete", label="cuda:1 RTX 4090", vram_total_mb=24564, vram_free_mb=4000, accelerators=("cuda",))


class FakeOllama:
    """An HTTP server answering ``GET /api/ps`` as Ollama does, with what the test sets."""

    def __init__(self) -> None:
        self.models: list[dict] = []
        self.status = 200
        self.body: bytes | None = None  # sent as it is instead of the models, when set
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = fake.body if fake.body is not None else json.dumps({"models": fake.models}).encode()
                self.send_response(fake.status if self.path == "/api/ps" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeOllama:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def _running(name: str, vram_gib: float) -> RunningModel:
    return RunningModel(name=name, size=int(max(vram_gib, 1) * GIB), size_vram=int(vram_gib * GIB))


def test_each_loaded_model_is_reported_on_the_device_that_holds_it():
    on_cpu, on_gpu = _running("phi3:mini", 0), _running("gemma3:27b", 17.5)
    [cpu, gpu] = place_resident([CPU, GPU0], [on_cpu, on_gpu])
    assert cpu.resident_models == (ResidentModel(slug="phi3:mini", vram_held_mb=1024),)  # the RAM it takes
    assert gpu.resident_models == (ResidentModel(slug="gemma3:27b", vram_held_mb=17920),)
    # Several GPUs: Ollama spreads a model over them and does not say how; each reports it, with half.
    [cpu, gpu0, gpu1] = place_resident([CPU, GPU0, GPU1], [on_gpu])
    assert cpu.resident_models == () and gpu0.resident_models == gpu1.resident_models == (
        ResidentModel(slug="gemma3:27b", vram_held_mb=8960),)
    # An Apple silicon GPU is the GPU; with no GPU at all, the CPU holds it.
    metal = Device(kind="gpu_integrated", label="metal:0 Apple M2 Max GPU", vram_total_mb=21845, vram_free_mb=20000,
                   ram_total_mb=32768, ram_free_mb=20000, accelerators=("metal",))
    assert place_resident([CPU, metal], [on_gpu])[1].resident_models[0].vram_held_mb == 17920
    assert place_resident([CPU], [on_gpu])[0].resident_models == (ResidentModel(slug="gemma3:27b", vram_held_mb=0),)


def test_a_model_ollama_holds_in_ram_counts_as_held_by_the_cpu_so_its_job_fits_there():
    """A 30 GB model loaded in RAM, 10 GB of RAM left free: its job needs no more memory than the model has
    taken already, and is placed on the CPU as resident; a job of another model that size does not fit."""
    registry = {slug: RegisteredModel(slug=slug, vram_min_mb=0, ram_min_mb=30000) for slug in ("llama3:70b-q2", "other")}
    cpu = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=10000)
    loaded = RunningModel(name="llama3:70b-q2", size=30000 * MB, size_vram=0)
    [reported] = place_resident([cpu], [loaded])
    assert reported.resident_models == (ResidentModel(slug="llama3:70b-q2", vram_held_mb=30000),)
    box = NodeView(id=uuid4(), name="box", status="online", trust_domain="local", devices=(reported,))
    verdict = judge_device(box, reported, Requirements(models=("llama3:70b-q2",)), registry)
    assert (verdict.eligible, verdict.via, verdict.resident) == (True, "ram", True), verdict
    assert judge_device(box, reported, Requirements(models=("other",)), registry).reason == "ram_insufficient"
    # Split between a GPU the agent does not report and RAM: the CPU holds the part in RAM.
    split = RunningModel(name="llama3:70b-q2", size=30000 * MB, size_vram=20000 * MB)
    assert place_resident([cpu], [split])[0].resident_models[0].vram_held_mb == 10000


def test_what_a_device_already_reported_is_kept_and_what_a_report_cannot_carry_is_left_out():
    held = Device(kind="gpu_discrete", label="g", vram_total_mb=8192, vram_free_mb=100,
                  resident_models=(ResidentModel(slug="sd-xl", vram_held_mb=7000),))
    [gpu] = place_resident([held], [_running("", 1), _running("x" * 201, 1), _running("tiny", 0.0001)])
    assert gpu.resident_models == (ResidentModel(slug="sd-xl", vram_held_mb=7000), ResidentModel(slug="tiny", vram_held_mb=1))
    [gpu] = place_resident([held], [_running(f"m{i}", 0.01) for i in range(MAX_RESIDENT + 5)])
    assert len(gpu.resident_models) == MAX_RESIDENT
    assert place_resident([CPU, GPU0], []) == [CPU, GPU0]
    # A model in system RAM on a node that reports no CPU device (``--device`` GPUs only) is on none of them.
    assert place_resident([GPU0], [_running("phi3:mini", 0)]) == [GPU0]


def test_the_ollama_url_is_the_one_given_else_ollamas_own_setting_else_its_default(monkeypatch):
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    assert ollama_url() == "http://127.0.0.1:11434"
    monkeypatch.setenv("OLLAMA_HOST", "0.0.0.0:11500")
    assert ollama_url() == "http://0.0.0.0:11500"
    assert ollama_url("https://gpu-box:443/") == "https://gpu-box:443"



@pytest.mark.parametrize("setting,url", [
    ("0.0.0.0", "http://0.0.0.0:11434"),  # what Ollama's docs suggest for a server other machines reach
    ("gpu-box", "http://gpu-box:11434"),
    (":11500", "http://127.0.0.1:11500"),
    ("::1", "http://[::1]:11434"),
    ("[::1]:11500", "http://[::1]:11500"),
    (" 127.0.0.1:11500/ ", "http://127.0.0.1:11500"),
    ("http://gpu-box", "http://gpu-box"),  # a scheme given: its own default port, as Ollama reads it
])  # fmt: skip
def test_ollama_host_is_read_as_ollama_reads_it(monkeypatch, setting, url):
    """``--ollama``'s default is ``OLLAMA_HOST``, Ollama's own setting: a host without a port is Ollama's port
    11434 (``OLLAMA_HOST=0.0.0.0`` listens there), not HTTP's 80, and an empty host is the loopback; so the
    agent asks the server Ollama started, not another port where nothing answers and no model reads
    resident."""
    monkeypatch.setenv("OLLAMA_HOST", setting)
    assert ollama_url() == url
    assert ollama_url(setting) == url

def test_an_ollama_that_does_not_answer_reads_as_nothing_loaded_said_once_until_it_answers(caplog):
    caplog.set_level(logging.INFO, logger="umbra.agent.resident")
    with FakeOllama() as ollama:
        models = OllamaModels(ollama.url)
        ollama.models = [{"name": "gemma3:27b", "model": "gemma3:27b", "size": 19 * GIB, "size_vram": 18 * GIB,
                          "expires_at": "2026-12-07T10:00:00Z", "details": {"family": "gemma3"}}]
        assert models() == [RunningModel(name="gemma3:27b", size=19 * GIB, size_vram=18 * GIB)]
        ollama.status = 500
        assert models() == []
        ollama.status, ollama.body = 200, b"<html>not ollama</html>"
        assert models() == []
        ollama.body = b'{"models": [{"size": 3}]}'  # no name
        assert models() == []
        assert [r.message for r in caplog.records] == ["ollama did not say which models it holds"]
        ollama.body = None
        assert [m.name for m in models()] == ["gemma3:27b"]
        assert [r.message for r in caplog.records][-1] == "ollama answers again"
        models.close()
    closed = OllamaModels(ollama.url, timeout=1)  # nothing listens there any more
    assert closed() == []
    closed.close()


def test_the_log_never_names_an_ollama_password(caplog):
    """An Ollama behind an authenticating proxy is given as ``https://user:password@host``: the log names the host."""
    caplog.set_level(logging.INFO, logger="umbra.agent.resident")
    with FakeOllama() as ollama:
        url = ollama.url.replace("://", "://agent:S3cretPw@")
    ollama_gone = OllamaModels(url, timeout=1)
    assert ollama_gone() == []
    ollama_gone.close()
    logged = [record.__dict__ for record in caplog.records]
    assert [r["url"] for r in logged] == [ollama.url] and "S3cretPw" not in caplog.text


async def test_a_job_whose_model_the_agents_ollama_holds_is_placed_as_resident(server, api, tmp_path):  # noqa: F811
    response = await api.put("/v1/models/gemma3:27b", json={"vram_min_mb": 16000, "ram_min_mb": 20000})
    assert response.status_code in (200, 201), response.text
    credential_file, node_id = await _paired_file(server, api, tmp_path, "ollama-box")
    gpu = json.dumps({"kind": "gpu_discrete", "label": "cuda:0", "vram_total_mb": 24564, "vram_free_mb": 20000,
                      "accelerators": ["cuda"]})
    with FakeOllama() as ollama:
        ollama.models = [{"name": "gemma3:27b", "size": 19 * GIB, "size_vram": 17 * GIB}]
        command = [sys.executable, "-m", "umbra.cli", "agent", "--claim-wait", "1", "--heartbeat", "1",
                   "--device", gpu, "--ollama", ollama.url, "--credential-file", str(credential_file)]
        log_file = tmp_path / "agent.log"
        with log_file.open("wb") as log:
            agent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
        try:
            async def reported():
                node = (await api.get(f"/v1/nodes/{node_id}")).json()
                return [d["resident_models"] for d in node["devices"]] == [[{"slug": "gemma3:27b", "vram_held_mb": 17408}]]

            await eventually(reported, timeout=20)
            response = await api.post("/v1/jobs", json={"kind": "echo", "payload": {"x": 1},
                                                        "requires": {"models": ["gemma3:27b"]}})
            assert response.status_code == 201, response.text
            job_id = response.json()["id"]

            async def placed():
                job = (await api.get(f"/v1/jobs/{job_id}")).json()
                return job if job["status"] == "complete" else None

            job = await eventually(placed, timeout=20)
            assert (job["placement"]["device_id"], job["placement"]["resident"]) == ("cuda:0", True), job["placement"]
            ollama.models = []  # unloaded: the next heartbeats say so
            await eventually(lambda: _no_resident(api, node_id), timeout=20)
        finally:
            agent.terminate()
            with anyio.fail_after(30):
                while agent.poll() is None:
                    await anyio.sleep(0.1)
    assert agent.returncode == 0, log_file.read_text()[-2000:]


async def _no_resident(api, node_id: str) -> bool:
    node = (await api.get(f"/v1/nodes/{node_id}")).json()
    return all(d["resident_models"] == [] for d in node["devices"])
