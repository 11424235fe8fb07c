"""The dashboard at ``/``: how it is served, and, in headless Chromium, that it
shows the live queue and nodes and updates without a reload."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import httpx
import psycopg
import pytest

from tests.conftest import LiveServer

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium (/usr/bin/chromium) is not installed")

#: A unified-memory GPU: jobs over its VRAM still fit its RAM (the slow path).
APPLE = {
    "kind": "gpu_integrated", "label": "m2-ultra", "vram_total_mb": 16384, "vram_free_mb": 12288,
    "ram_total_mb": 65536, "ram_free_mb": 60000, "accelerators": ["metal"],
    "resident_models": [{"slug": "gemma4:26b", "vram_held_mb": 4096}],
}  # fmt: skip


def _organization(db_url: str) -> tuple[str, str]:
    from umbra.compute.accounts import create_organization

    async def create():
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            return await create_organization(conn, "dash")

    org_id, key = anyio.run(create)
    return str(org_id), key


def test_page_and_assets_are_served_with_a_strict_content_security_policy(live_server):
    with httpx.Client(base_url=live_server.url) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "'unsafe-inline'" not in page.headers["content-security-policy"]
        assert '<script src="/static/dashboard.js" defer></script>' in page.text
        script = client.get("/static/dashboard.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert "innerHTML" not in script.text, "server data is inserted as text only"
        assert client.get("/static/dashboard.css").headers["content-type"].startswith("text/css")
        for missing in ("/static/dashboard.html", "/static/../app.py", "/static/secrets.txt"):
            refused = client.get(missing)
            assert refused.status_code == 404 and refused.json()["error"] == "not_found"


def test_the_projection_stream_takes_access_token_for_eventsource_and_json_routes_do_not(live_server):
    _, key = _organization(live_server.settings.database_url)
    with httpx.Client(base_url=live_server.url, timeout=10) as client:
        with client.stream("GET", "/v1/projections/stream", params={"views": "queue", "access_token": key}) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            first = next(line for line in stream.iter_lines() if line.startswith("data:"))
            assert '"counts"' in first
        assert client.get("/v1/projections/queue", params={"access_token": key}).status_code == 401


def _served(db_url: str, port: int | None = None) -> LiveServer:
    """A started live server run the way ``umbra serve`` runs it (streams end on shutdown)."""
    from umbra.api import server as serving

    live = LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="0.2")
    if port is not None:
        live.port, live.url = port, f"http://127.0.0.1:{port}"
    live.server = serving.Server(serving.config(live.app, host="127.0.0.1", port=live.port))
    live.thread = threading.Thread(target=live.server.run, daemon=True)
    return live.__enter__()


@pytest.fixture
def restartable_server(db_url):
    """A live server the test may stop and bring back on the same port."""
    holder = {"server": _served(db_url)}
    yield holder
    holder["server"].__exit__(None, None, None)


@pytest.mark.browser
@needs_chromium
def test_dashboard_shows_the_live_queue_and_nodes_without_reloading(restartable_server):
    from playwright.sync_api import expect, sync_playwright

    live_server = server = restartable_server["server"]
    _, key = _organization(live_server.settings.database_url)
    api = httpx.Client(base_url=live_server.url, headers={"Authorization": f"Bearer {key}"}, timeout=15)
    code = api.post("/v1/pairings", json={"name": "mac-studio", "locality": "studio"}).json()["code"]
    credential = api.post("/v1/pairings/redeem", json={"code": code, "name": "mac-studio", "devices": [APPLE]}).json()["credential"]
    node = httpx.Client(base_url=live_server.url, headers={"Authorization": f"Bearer {credential}"}, timeout=15)
    assert node.post("/v1/agent/heartbeat", json={"devices": [APPLE], "agent_version": "0.1.0"}).status_code == 200
    ARTIFACTS.mkdir(exist_ok=True)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1360, "height": 900})
        page = context.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda error: problems.append(str(error)))
        api_urls: list[str] = []
        page.on("request", lambda request: api_urls.append(request.url) if "/v1/" in request.url else None)
        page.goto(f"{live_server.url}/#key={key}")

        expect(page.locator("#conn-state")).to_have_attribute("data-state", "live")
        expect(page.locator("#count-queued")).to_have_text("0")
        card = page.locator("article.node").filter(has_text="mac-studio")
        expect(card.locator(".status")).to_have_text("online")
        expect(card.locator(".chip")).to_contain_text("gemma4:26b")
        expect(card.locator(".meter").first).to_contain_text("4.0 GB / 16 GB")
        assert "key=" not in page.url, "the key is taken out of the address bar"
        page.evaluate("window.__sameDocument = true")

        fast = api.post("/v1/jobs", json={"kind": "echo", "payload": {}, "requires": {"vram_min_mb": 2048}}).json()
        expect(page.locator("#count-queued")).to_have_text("1")
        assert node.post("/v1/agent/claim", params={"wait": 5}).json()["job"]["id"] == fast["id"]
        expect(page.locator("#count-running")).to_have_text("1")
        expect(page.locator("#count-queued")).to_have_text("0")
        row = page.locator(f'#running-table tr[data-job="{fast["id"]}"]')
        expect(row).to_contain_text("mac-studio")
        expect(row).to_contain_text("placed:gpu_integrated")
        expect(row.locator(".badge.slow")).to_have_count(0)
        expect(row.locator(".progress-cell")).to_have_text("—")
        renewed = node.post(f"/v1/agent/jobs/{fast['id']}/renew",
                            json={"attempt": 1, "progress": {"fraction": 0.4, "message": "epoch 4 of 10"}})
        assert renewed.status_code == 200, renewed.text
        expect(row.locator(".progress-cell")).to_have_text("40% epoch 4 of 10")

        slow = api.post("/v1/jobs", json={"kind": "echo", "payload": {}, "requires": {"vram_min_mb": 30000}}).json()
        assert node.post("/v1/agent/claim", params={"wait": 5}).json()["job"]["id"] == slow["id"]
        slow_row = page.locator(f'#running-table tr[data-job="{slow["id"]}"]')
        expect(slow_row.locator(".badge.slow")).to_have_text("slow path")
        expect(slow_row).to_contain_text("slow_path")

        blocked = api.post("/v1/jobs", json={"kind": "echo", "payload": {}, "requires": {"vram_min_mb": 500000}}).json()
        blocked_row = page.locator(f'#blocked-table tr[data-job="{blocked["id"]}"]')
        expect(blocked_row).to_contain_text("no_eligible_device")
        expect(page.locator("#count-blocked")).to_have_text("1")
        assert page.evaluate("window.__sameDocument") is True, "updates arrived without a reload"
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        page.emulate_media(color_scheme="dark")
        page.screenshot(path=str(ARTIFACTS / "dashboard-dark.png"), full_page=True)

        # The server goes away: the page says so, then recovers by itself when it is back.
        server.__exit__(None, None, None)
        expect(page.locator("#banner")).to_be_visible(timeout=15_000)
        expect(page.locator("#banner")).to_have_text("disconnected — reconnecting")
        expect(page.locator("#conn-state")).to_have_attribute("data-state", "reconnecting")
        page.screenshot(path=str(ARTIFACTS / "dashboard-disconnected.png"))
        server = restartable_server["server"] = _served(server.settings.database_url, port=server.port)
        expect(page.locator("#conn-state")).to_have_attribute("data-state", "live", timeout=20_000)
        expect(page.locator("#banner")).to_be_hidden()
        assert api.post(f"/v1/jobs/{blocked['id']}/cancel").status_code == 200
        expect(page.locator("#count-cancelled")).to_have_text("1")
        expect(page.locator("#count-blocked")).to_have_text("0")
        assert page.evaluate("window.__sameDocument") is True
        assert problems == []
        assert any("/v1/projections/stream" in url for url in api_urls)
        assert not [url for url in api_urls if key in url], "the key travels in a header, never in a URL"
        browser.close()
    api.close()
    node.close()
