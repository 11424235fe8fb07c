"""Which models this machine holds loaded, read from the local model server (Ollama), for each heartbeat.

Placement prefers a device where a job's model is resident to one that must
load it, and one that must load it to one that must evict another model
(SPEC: resident beats load beats eviction); with model affinity a node takes
the jobs whose models it holds first, and a node that would load a job's
models leaves it to a node that holds them, for up to the affinity. All of it
knows what is resident only from the heartbeats, and an agent that reports
nothing makes every device look cold. So with ``--ollama``, each heartbeat
asks the Ollama server beside the agent what it has loaded (``GET /api/ps``)
and reports each model on the device holding it.

Ollama says how much of a model sits in GPU memory (``size_vram``), not on
which GPU: a model with none is on the CPU device, holding its ``size`` of
RAM (the memory a job of that model finds already taken by it, as a GPU's
resident model holds VRAM); one with some, on the GPU
when there is one (an Apple silicon GPU included); on a machine with several,
it is reported on each, its VRAM split evenly between them, as Ollama spreads
a model's layers over the GPUs it has. Slugs are Ollama's names
(``gemma3:27b``), which is what an organization's model registry names them
by for these jobs to match.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import httpx
import msgspec

from umbra.domain.device_reports import LABEL_MAX, MAX_RESIDENT_MODELS
from umbra.events.types import Device, ResidentModel

log = logging.getLogger(__name__)

#: Where Ollama listens unless ``OLLAMA_HOST`` says otherwise (its own default).
OLLAMA_DEFAULT = "http://127.0.0.1:11434"
#: Ollama answers from memory: a server that takes longer is hung, and a heartbeat must not wait on it.
OLLAMA_TIMEOUT_SECONDS = 2.0
MB = 1024 * 1024


class RunningModel(msgspec.Struct, frozen=True):
    """One model Ollama has loaded: its name, and of its bytes how many are in GPU memory."""

    name: str
    size: int = 0
    size_vram: int = 0


class _Running(msgspec.Struct):
    models: list[RunningModel] = []


#: The port Ollama listens on when ``OLLAMA_HOST`` names a host alone.
OLLAMA_PORT = "11434"


def ollama_url(given: str | None = None) -> str:
    """The Ollama server's URL: the one given, else ``OLLAMA_HOST`` (Ollama's own setting: a URL, or
    ``host:port`` read as Ollama reads it), else its default.

    Without a scheme, a host alone is on Ollama's port (``OLLAMA_HOST=0.0.0.0``, what Ollama's docs
    suggest for a server other machines reach, listens on 0.0.0.0:11434, not on HTTP's port 80) and a
    port alone (``:11500``) on the loopback. A URL with a scheme is taken as written."""
    url = (given or os.environ.get("OLLAMA_HOST") or "").strip() or OLLAMA_DEFAULT
    if "://" in url:
        return url.rstrip("/")
    hostport, _, path = url.partition("/")
    if hostport.startswith("["):  # [v6]:port or [v6]
        host, _, rest = hostport[1:].partition("]")
        port = rest.removeprefix(":")
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    else:  # a name, an IPv4 address or a bare IPv6 address
        host, port = hostport, ""
    host = host or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port or OLLAMA_PORT}" + (f"/{path}".rstrip("/") if path.strip("/") else "")


def parse_running(body: bytes) -> list[RunningModel]:
    """Models from an ``/api/ps`` answer; raises ``msgspec.DecodeError`` / ``ValidationError`` for another body."""
    return msgspec.json.decode(body, type=_Running).models


def place_resident(devices: Sequence[Device], running: Sequence[RunningModel]) -> list[Device]:
    """``devices`` with each running model added to the resident models of the device that holds it
    (see the module's docstring). A model whose name a report could not carry is left out."""
    cpus = [i for i, device in enumerate(devices) if device.kind == "cpu"]
    gpus = [i for i, device in enumerate(devices) if device.kind != "cpu"]
    added: dict[int, list[ResidentModel]] = {}
    for model in running:
        if not 0 < len(model.name) <= LABEL_MAX:
            continue
        in_vram = max(model.size_vram, 0)
        holders = gpus if in_vram > 0 and gpus else cpus[:1]  # none: a model in RAM, no CPU reported
        # What the model holds on each holder: its share of the VRAM on a GPU; on the CPU device, the RAM it
        # takes (its size less what an unreported GPU holds), which a job of that model may count as its own.
        in_ram = max(model.size - in_vram, 0)
        for i in holders:
            held = -(-(in_vram if devices[i].kind != "cpu" else in_ram) // (MB * len(holders)))  # MB, rounded up
            added.setdefault(i, []).append(ResidentModel(slug=model.name, vram_held_mb=held))
    return [
        msgspec.structs.replace(device, resident_models=(*device.resident_models, *added[i])[:MAX_RESIDENT_MODELS])
        if i in added else device
        for i, device in enumerate(devices)
    ]  # fmt: skip


class OllamaModels:
    """Reads the models an Ollama server has loaded, once per call; an Ollama that does not answer reads as
    none loaded (its models are not held any more, or not knowably), said once in the log until it answers."""

    def __init__(self, url: str, *, timeout: float = OLLAMA_TIMEOUT_SECONDS) -> None:
        self.url = url
        #: What the log names: the URL without a user name or password it may carry (behind an authenticating proxy).
        self.shown_url = str(httpx.URL(url).copy_with(userinfo=b""))
        self._client = httpx.Client(base_url=url, timeout=timeout, trust_env=False)
        self._failing = False

    def __call__(self) -> list[RunningModel]:
        try:
            response = self._client.get("/api/ps")
            response.raise_for_status()
            running = parse_running(response.content)
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            if not self._failing:
                log.warning("ollama did not say which models it holds", extra={
                    "action": "resident_models_unknown", "url": self.shown_url, "error": type(exc).__name__})  # fmt: skip
            self._failing = True
            return []
        if self._failing:
            log.info("ollama answers again", extra={"action": "resident_models_known", "url": self.shown_url})
        self._failing = False
        return running

    def close(self) -> None:
        self._client.close()
