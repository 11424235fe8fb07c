"""The dashboard shows what its key may see, as the views say it: another key's organization replaces the
previous one's views, jobs counted and not listed are not called none, and a device is busy as the API says."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import anyio
import httpx
import psycopg
import pytest

from tests.browser.test_dashboard import CHROMIUM, CHROMIUM_ARGS, needs_chromium
from tests.conftest import LiveServer

pytestmark = [pytest.mark.browser, needs_chromium]


def _organization(db_url: str, name: str) -> tuple[str, str]:
    from umbra.compute.accounts import create_organization

    async def create():
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            return await create_organization(conn, name)

    with ThreadPoolExecutor(1) as pool:  # Playwright's sync API runs an event loop in this thread
        org_id, key = pool.submit(anyio.run, create).result()
    return str(org_id), key


def _pair(api: httpx.Client, clients, base: str, name: str, devices: list[dict]) -> httpx.Client:
    code = api.post("/v1/pairings", json={"name": name}).json()["code"]
    redeemed = api.post("/v1/pairings/redeem", json={"code": code, "name": name, "devices": devices})
    assert redeemed.status_code == 201, redeemed.text
    node = clients(base, redeemed.json()["credential"])
    beat = node.post("/v1/agent/heartbeat", json={"devices": devices, "agent_version": "0.1.0"})
    assert beat.status_code == 200, beat.text
    return node


@pytest.fixture
def served(db_url):
    with LiveServer(db_url, UMBRA_SWEEP_INTERVAL_SECONDS="0.2") as server:
        yield server


@pytest.fixture
def clients():
    """HTTP clients the test opens, closed whether it passes or not."""
    opened: list[httpx.Client] = []

    def open_client(base: str, token: str) -> httpx.Client:
        opened.append(httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30))
        return opened[-1]

    yield open_client
    for c in opened:
        c.close()


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def test_changing_the_key_to_another_organization_replaces_the_previous_organizations_views(served, browser, clients):
    """After "Change key" the page shows what *that* key may see: the previous organization's views, whose log
    positions are higher than the new one's, were kept as the newer ones."""
    from playwright.sync_api import expect

    _, quiet_key = _organization(served.settings.database_url, "quiet")  # no events at all: head position 0
    _, busy_key = _organization(served.settings.database_url, "busy")
    busy = clients(served.url, busy_key)
    jobs = [busy.post("/v1/jobs", json={"kind": "secret-kind", "payload": {}}).json() for _ in range(3)]
    assert all(j["status"] == "blocked" for j in jobs)  # no nodes: blocked
    quiet = clients(served.url, quiet_key)
    assert quiet.get("/v1/projections/queue").json()["counts"]["blocked"] == 0

    page = browser.new_context().new_page()
    page.goto(f"{served.url}/#key={busy_key}")
    expect(page.locator("#conn-state")).to_have_attribute("data-state", "live")
    expect(page.locator("#count-blocked")).to_have_text("3")

    page.click("#change-key")
    page.fill("#key-input", quiet_key)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#conn-state")).to_have_attribute("data-state", "live")
    page.wait_for_timeout(1500)  # the snapshot and the stream's first messages have arrived
    # The quiet organization has no jobs: its dashboard must not list the other organization's.
    expect(page.locator("#count-blocked")).to_have_text("0")
    expect(page.locator(f'#blocked-table tr[data-job="{jobs[0]["id"]}"]')).to_have_count(0)


def test_a_blocked_job_counted_in_the_tiles_is_not_reported_as_no_blocked_jobs(served, browser, clients):
    """Behind 200 earlier queued jobs a blocked job is still listed (the view lists blocked jobs before queued
    ones), never a blocked tile at 1 beside "No blocked jobs."."""
    from playwright.sync_api import expect

    _, key = _organization(served.settings.database_url, "deep")
    api = clients(served.url, key)
    cpu = {"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 8000}
    _pair(api, clients, served.url, "box", [cpu])
    batch = api.post("/v1/jobs/batch", json={"jobs": [{"kind": "echo", "payload": {}} for _ in range(200)]})
    assert batch.status_code == 201 and {j["status"] for j in batch.json()["jobs"]} == {"queued"}
    blocked = api.post("/v1/jobs", json={"kind": "echo", "payload": {}, "requires": {"accelerators": ["cuda"]}}).json()
    assert blocked["status"] == "blocked"
    snapshot = api.get("/v1/projections/queue").json()
    assert snapshot["counts"]["blocked"] == 1 and snapshot["truncated"] is True

    page = browser.new_context().new_page()
    page.goto(f"{served.url}/#key={key}")
    expect(page.locator("#conn-state")).to_have_attribute("data-state", "live")
    expect(page.locator("#count-blocked")).to_have_text("1")
    # Either the blocked job is listed, or at least the page does not claim there is none.
    listed = page.locator(f'#blocked-table tr[data-job="{blocked["id"]}"]').count()
    assert listed == 1 or page.locator("#blocked-empty").is_hidden(), (
        "the Blocked panel says 'No blocked jobs.' while the blocked tile counts 1"
    )


def test_a_device_the_api_calls_busy_is_marked_busy(served, browser, clients):
    """A device is marked busy as the nodes view says (a non-CPU device with no free VRAM: here a unified-memory
    GPU reporting none), not by a reading of the page's own that missed it beside "no free device"."""
    from playwright.sync_api import expect

    _, key = _organization(served.settings.database_url, "igpu")
    api = clients(served.url, key)
    igpu = {"kind": "gpu_integrated", "label": "igpu0", "vram_total_mb": 0, "vram_free_mb": 0,
            "ram_total_mb": 16384, "ram_free_mb": 12000, "accelerators": ["metal"]}  # fmt: skip
    _pair(api, clients, served.url, "mini", [igpu])
    view = api.get("/v1/projections/nodes").json()["nodes"][0]
    assert view["devices"][0]["busy"] is True and view["schedulable"] is False

    page = browser.new_context().new_page()
    page.goto(f"{served.url}/#key={key}")
    card = page.locator("article.node").filter(has_text="mini")
    expect(card.locator(".status")).to_have_text("online")
    expect(card).to_contain_text("no free device")
    expect(card.locator('.device[data-device="igpu0"] .busy')).to_have_count(1)


def test_a_cordoned_device_is_marked_cordoned_with_its_reason(served, browser, clients):
    """A device an operator cordoned carries a "cordoned" mark whose title is the reason given; its neighbour,
    in service, carries none."""
    from playwright.sync_api import expect

    _, key = _organization(served.settings.database_url, "cordons")
    api = clients(served.url, key)
    gpu = {"kind": "gpu_discrete", "label": "gpu0", "vram_total_mb": 24576, "vram_free_mb": 24000, "accelerators": ["cuda"]}
    cpu = {"kind": "cpu", "label": "cpu", "ram_total_mb": 65536, "ram_free_mb": 60000}
    _pair(api, clients, served.url, "rig", [gpu, cpu])
    node_id = api.get("/v1/nodes").json()["nodes"][0]["id"]
    assert api.post(f"/v1/nodes/{node_id}/cordon", json={"device": "gpu0", "reason": "ECC errors"}).status_code == 200

    page = browser.new_context().new_page()
    page.goto(f"{served.url}/#key={key}")
    card = page.locator("article.node").filter(has_text="rig")
    mark = card.locator('.device[data-device="gpu0"] .busy')
    expect(mark).to_have_text("cordoned")
    expect(mark).to_have_attribute("title", "ECC errors")
    expect(card.locator('.device[data-device="cpu"] .busy')).to_have_count(0)


def _quiet_and_busy(served, clients) -> tuple[str, str, list[dict]]:
    """The keys of two organizations, "quiet", with nothing, and "busy", and busy's three blocked jobs."""
    _, quiet_key = _organization(served.settings.database_url, "quiet")
    _, busy_key = _organization(served.settings.database_url, "busy")
    busy = clients(served.url, busy_key)
    jobs = [busy.post("/v1/jobs", json={"kind": "secret-kind", "payload": {}}).json() for _ in range(3)]
    assert all(j["status"] == "blocked" for j in jobs)
    return quiet_key, busy_key, jobs


def test_a_snapshot_read_with_the_previous_key_does_not_come_back_after_a_key_change(served, browser, clients):
    """A snapshot still being read with the previous key when the key changes is not shown: it is the other
    organization's, at a higher position, and every later view of the new one would be dropped as stale."""
    from playwright.sync_api import expect

    quiet_key, busy_key, jobs = _quiet_and_busy(served, clients)

    page = browser.new_context().new_page()
    held = []

    def hold_busy_snapshot(route):
        # A slow snapshot read of the old key (a busy server, a slow link): answered only after the key changed.
        if route.request.headers.get("authorization") == f"Bearer {busy_key}" and not held:
            held.append(route)
        else:
            route.continue_()

    page.route("**/v1/projections/queue", hold_busy_snapshot)
    page.goto(f"{served.url}/#key={busy_key}")
    expect(page.locator("#count-blocked")).to_have_text("3")  # from the stream's first message
    page.wait_for_timeout(300)
    assert held, "the page's snapshot read was not held"

    page.click("#change-key")
    page.fill("#key-input", quiet_key)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#conn-state")).to_have_attribute("data-state", "live")
    expect(page.locator("#count-blocked")).to_have_text("0")
    held[0].continue_()  # the old key's read answers now
    page.wait_for_timeout(1500)
    assert page.locator("#count-blocked").inner_text() == "0", "the previous organization's queue is back on screen"
    assert page.locator(f'#blocked-table tr[data-job="{jobs[0]["id"]}"]').count() == 0


def test_a_queued_job_waiting_behind_200_blocked_ones_is_not_called_none_waiting(served, browser, clients):
    """Behind 200 blocked jobs (listed before queued ones) an older queued job is not listed: the Waiting panel
    says so rather than "No job has waited longer than 30 s." beside a queued tile at 1."""
    from playwright.sync_api import expect

    _, key = _organization(served.settings.database_url, "waiting")
    api = clients(served.url, key)
    cpu = {"kind": "cpu", "label": "cpu0", "ram_total_mb": 8192, "ram_free_mb": 8000}
    _pair(api, clients, served.url, "box", [cpu])
    waiting = api.post("/v1/jobs", json={"kind": "echo", "payload": {}}).json()
    assert waiting["status"] == "queued"  # an online node could run it; no agent is claiming
    batch = api.post("/v1/jobs/batch", json={"jobs": [{"kind": "gpu", "payload": {}, "requires": {"accelerators": ["cuda"]}}
                                                      for _ in range(200)]})  # fmt: skip
    assert batch.status_code == 201 and {j["status"] for j in batch.json()["jobs"]} == {"blocked"}
    view = api.get("/v1/projections/queue").json()
    assert view["counts"]["queued"] == 1 and waiting["id"] not in {j["id"] for j in view["jobs"]}

    page = browser.new_context().new_page()
    page.clock.install(time=datetime.now(timezone.utc))
    page.goto(f"{served.url}/#key={key}")
    expect(page.locator("#conn-state")).to_have_attribute("data-state", "live")
    expect(page.locator("#count-queued")).to_have_text("1")
    page.clock.set_system_time(datetime.now(timezone.utc) + timedelta(minutes=5))  # the job has waited 5 min
    page.clock.run_for(2000)  # tick() re-renders the Waiting panel
    listed = page.locator(f'#waiting-table tr[data-job="{waiting["id"]}"]').count()
    empty = page.locator("#waiting-empty")
    assert listed == 1 or not empty.is_visible() or "No job has waited" not in empty.inner_text(), (
        f"Waiting says {empty.inner_text()!r} while a queued job has waited 5 minutes"
    )


def test_a_key_given_in_the_address_of_a_dashboard_already_open_is_used_and_taken_out_of_the_address(
    served, browser, clients
):
    """``$URL/#key=…`` opened in a tab already showing the dashboard changes only the fragment: the page is not
    loaded again, and it read the key on load alone. The new key stayed in the address bar (and the history)
    while the page went on showing the previous key's organization."""
    from playwright.sync_api import expect

    quiet_key, busy_key, _ = _quiet_and_busy(served, clients)

    page = browser.new_context().new_page()
    page.goto(f"{served.url}/#key={busy_key}")
    expect(page.locator("#count-blocked")).to_have_text("3")
    assert "key=" not in page.url
    page.evaluate("window.__sameDocument = true")

    page.goto(f"{served.url}/#key={quiet_key}")
    expect(page.locator("#count-blocked")).to_have_text("0")
    expect(page.locator("#conn-state")).to_have_attribute("data-state", "live")
    assert page.evaluate("window.__sameDocument") is True, "only the fragment changed: the page was not reloaded"
    assert "key=" not in page.url, "the key is taken out of the address bar"
    assert page.evaluate("localStorage.getItem('umbra.apiKey')") == quiet_key


def test_a_stream_gone_silent_is_called_disconnected_and_connected_again(served, browser):
    """A server that goes away without closing the connection (its host gone, the network dropped) sends
    nothing more, not even the ping it sends after 15 s of silence: the page went on saying "live" for ever.
    Here the page's clock is moved on past the bound while nothing arrives."""
    from playwright.sync_api import expect

    _, key = _organization(served.settings.database_url, "quiet")
    page = browser.new_context().new_page()
    page.clock.install()
    page.goto(f"{served.url}/#key={key}")
    expect(page.locator("#conn-state")).to_have_attribute("data-state", "live")
    page.clock.fast_forward(60_000)  # a minute without a byte: no message, and no ping
    expect(page.locator("#conn-state")).to_have_attribute("data-state", "reconnecting")
    expect(page.locator("#banner")).to_be_visible()
    page.clock.fast_forward(2_000)  # the retry
    expect(page.locator("#conn-state")).to_have_attribute("data-state", "live")
