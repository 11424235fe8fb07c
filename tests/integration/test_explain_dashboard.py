"""The dashboard shows explain's summary next to blocked jobs and jobs queued longer than 30 s (headless Chromium)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anyio
import psycopg
import pytest

from tests.browser.test_dashboard import CHROMIUM, CHROMIUM_ARGS, needs_chromium
from umbra.compute.accounts import create_organization
from umbra.compute.nodes import drain_node

from .queue_support import GPU24, add_node, set_clock, submit


def _run(db_url: str, scenario):
    """Run ``scenario(conn)`` on its own event loop in a worker thread (Playwright's sync API holds this one)."""

    async def main():
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            return await scenario(conn)

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(anyio.run, main).result()


@pytest.mark.browser
@needs_chromium
def test_blocked_and_long_queued_jobs_show_why_and_the_answer_follows_the_fleet(live_server):
    from playwright.sync_api import expect, sync_playwright

    db_url = live_server.settings.database_url

    async def setup(conn):
        org_id, key = await create_organization(conn, "dash")
        node_id = await add_node(conn, org_id, "gpu-box", [GPU24])
        blocked = await submit(conn, org_id, requires={"vram_min_mb": 40000})
        fresh = await submit(conn, org_id, requires={"accelerators": ["cuda"]})
        await set_clock(conn, -120)  # submitted two minutes ago by the database clock
        old = await submit(conn, org_id, requires={"accelerators": ["cuda"]}, priority=1)
        return org_id, key, node_id, str(blocked.id), str(fresh.id), str(old.id)

    org_id, key, node_id, blocked, fresh, old = _run(db_url, setup)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        problems: list[str] = []
        explained: list[str] = []
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.on("request", lambda r: explained.append(r.url.split("/v1/jobs/")[1].split("/")[0]) if r.url.endswith("/explain") else None)
        page.goto(f"{live_server.url}/#key={key}")

        blocked_row = page.locator(f'#blocked-table tr[data-job="{blocked}"]')
        expect(blocked_row.locator(".reason")).to_contain_text("no_eligible_device")
        expect(blocked_row.locator(".explain")).to_contain_text(
            "Blocked because no registered device could ever run it: needs 40000 MB VRAM, largest is 24576 MB (gpu-box/gpu0)"
        )
        waiting_row = page.locator(f'#waiting-table tr[data-job="{old}"]')
        expect(waiting_row.locator(".explain")).to_have_text(
            "Can run on 1 device; the best is gpu-box/gpu0 via vram (score 10, placed:gpu_discrete); "
            "nothing holds it back: the next claim by an eligible node takes it."
        )
        expect(page.locator(f'#waiting-table tr[data-job="{fresh}"]')).to_have_count(0)
        assert set(explained) == {blocked, old}, "only blocked and long-waiting jobs are explained"

        # The only node drains: it takes no new work again, so the waiting job is blocked, and says why.
        _run(db_url, lambda conn: drain_node(conn, org_id, node_id))
        now_blocked = page.locator(f'#blocked-table tr[data-job="{old}"]')
        expect(now_blocked.locator(".reason")).to_contain_text("no_eligible_device: no active node", timeout=20_000)
        expect(now_blocked.locator(".explain")).to_contain_text("Blocked because no registered device could ever run it")
        expect(waiting_row).to_have_count(0)
        assert problems == []
        browser.close()
