"""The dashboard in a real browser (Debian's Chromium, driven by Playwright) over the real stack of conftest.py:
its numbers match the API, the stalled flag and the stale banner appear when they should and go when they should,
the job page's drill-downs work, it fits 1,024 px, and /docs renders with every non-local request blocked.

Screenshots go to $EAGLE3_SCREENSHOT_DIR when it is set (docs/img/ keeps a pair for the README)."""

import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.datasets import write_dataset
from tests.ops.conftest import STALL_AFTER_S, OpsStack, RanJobs

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason=f"{CHROMIUM} is absent: `make install-browser` installs Debian's chromium"
    ),
]
playwright_sync = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extras")
expect = playwright_sync.expect

UI_TIMEOUT_MS = 20_000


@pytest.fixture(scope="module")
def browser() -> Iterator["playwright_sync.Browser"]:
    with playwright_sync.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: "playwright_sync.Browser") -> Iterator["playwright_sync.Page"]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _screenshot(page: "playwright_sync.Page", name: str, tmp_path: Path) -> Path:
    target = Path(os.environ.get("EAGLE3_SCREENSHOT_DIR", tmp_path)) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target), full_page=True)
    return target


def _value(row: "playwright_sync.Locator", field: str) -> int:
    return int(row.locator(f'[data-field="{field}"]').first.get_attribute("data-value"))


def test_jobs_list_shows_the_apis_numbers(ops_stack: OpsStack, ran_jobs: RanJobs, page: "playwright_sync.Page") -> None:
    page.goto(f"{ops_stack.stack.api_url}/dashboard")
    expect(page.locator(f'tr[data-job-id="{ran_jobs.dead}"]')).to_be_visible(timeout=UI_TIMEOUT_MS)
    expect(page.locator("#freshness")).to_contain_text("updated", timeout=UI_TIMEOUT_MS)

    listed = ops_stack.api.get("/v1/jobs").json()
    assert {p["job_id"] for p in listed} >= {ran_jobs.clean, ran_jobs.dead}
    for p in listed:
        row = page.locator(f'tr[data-job-id="{p["job_id"]}"]')
        assert row.get_attribute("data-state") == p["state"]
        for field in ("tokens_done", "samples_done", "samples_failed", "samples_rejected", "shards_committed"):
            assert _value(row, field) == p[field], (p["job_id"], field)
        assert _value(row, "shards_dead_lettered") == p["shards_dead_lettered"]
        assert _value(row, "bytes_stored") == p["bytes_stored"]
        assert row.locator('[data-field="kind"]').inner_text() == p["kind"]
        if p["state"] in ("completed", "completed_with_errors"):
            assert row.locator('[data-field="eta"]').inner_text().startswith("done")
            assert row.locator('[data-field="tokens_per_second"]').inner_text().startswith("avg ")

    clean = page.locator(f'tr[data-job-id="{ran_jobs.clean}"]')
    dead = page.locator(f'tr[data-job-id="{ran_jobs.dead}"]')
    assert _value(clean, "samples_rejected") > 0
    assert _value(dead, "samples_failed") > 0 and _value(dead, "shards_dead_lettered") > 0
    colours = {
        job_id: page.locator(f'tr[data-job-id="{job_id}"] .state').evaluate("e => getComputedStyle(e).backgroundColor")
        for job_id in (ran_jobs.clean, ran_jobs.dead)
    }
    assert colours[ran_jobs.clean] != colours[ran_jobs.dead], "completed and completed_with_errors look the same"


def test_workers_panel_and_queue_match_the_cluster(
    ops_stack: OpsStack, ran_jobs: RanJobs, page: "playwright_sync.Page"
) -> None:
    page.goto(f"{ops_stack.stack.api_url}/dashboard")
    expect(page.locator('#workers tr[data-alive="true"]')).to_have_count(2, timeout=UI_TIMEOUT_MS)
    cluster = ops_stack.api.get("/v1/cluster").json()
    shown = set(page.locator("#workers tr").evaluate_all("rows => rows.map(r => r.dataset.worker)"))
    assert shown == {w["name"] for w in cluster["workers"]}
    assert all(re.fullmatch(r"worker-\d@.+", name) for name in shown)
    assert page.locator('[data-field="queue_depth"]').inner_text() == f"{cluster['queue']['depth']:,}"


def test_job_page_drills_down_to_settings_charts_rejected_lines_and_trainer_curves(
    ops_stack: OpsStack, ran_jobs: RanJobs, page: "playwright_sync.Page"
) -> None:
    page.goto(f"{ops_stack.stack.api_url}/dashboard")
    page.locator(f'tr[data-job-id="{ran_jobs.clean}"] a').first.click()
    expect(page).to_have_url(re.compile(f"/dashboard/jobs/{ran_jobs.clean}$"))

    details = ops_stack.api.get(f"/v1/jobs/{ran_jobs.clean}/details").json()
    rejected = ops_stack.api.get(f"/v1/jobs/{ran_jobs.clean}/rejected").json()
    expect(page.locator('[data-field="aux_layer_ids"]')).to_have_text(
        ", ".join(map(str, details["job"]["aux_layer_ids"])), timeout=UI_TIMEOUT_MS
    )
    assert page.locator('[data-field="storage_root"]').inner_text() == details["storage_root"]
    expect(page.locator("#rejected tbody tr")).to_have_count(len(rejected))
    shown_lines = page.locator("#rejected tbody tr").evaluate_all("rows => rows.map(r => Number(r.dataset.line))")
    assert sorted(shown_lines) == sorted(r["line"] for r in rejected)
    expect(page.locator("#dead-count")).to_have_text("none")
    expect(page.locator("#rate-chart svg path")).to_have_count(1)
    expect(page.locator("#shards-chart svg path")).to_have_count(1)

    run = page.locator('h3[data-run="ops"]')
    expect(run).to_contain_text("step 2")
    curves = page.frame_locator("iframe.curves")
    expect(curves.locator("svg").first).to_be_visible(timeout=UI_TIMEOUT_MS)


def test_job_page_lists_dead_letters_with_their_reasons(
    ops_stack: OpsStack, ran_jobs: RanJobs, page: "playwright_sync.Page"
) -> None:
    page.goto(f"{ops_stack.stack.api_url}/dashboard/jobs/{ran_jobs.dead}")
    letters = ops_stack.api.get(f"/v1/jobs/{ran_jobs.dead}/details").json()["dead_letters"]
    assert letters, "the model check must have dead-lettered the job's shards"
    rows = page.locator("#dead-letters tbody tr")
    expect(rows).to_have_count(len(letters), timeout=UI_TIMEOUT_MS)
    for letter in letters:
        row = page.locator(f'#dead-letters tr[data-shard="{letter["shard_index"]}"]')
        expect(row).to_contain_text("ModelMismatch")
        expect(row).to_contain_text(letter["reason"][:40])
    expect(page.locator("#trainer-count")).to_have_text("no run follows this job")


def test_stalled_flag_appears_while_workers_are_frozen_and_clears_when_they_commit(
    ops_stack: OpsStack, ran_jobs: RanJobs, page: "playwright_sync.Page"
) -> None:
    page.goto(f"{ops_stack.stack.api_url}/dashboard")
    ops_stack.pause("worker-")
    try:
        job_id = ops_stack.submit(ops_stack.dataset, shard_token_budget=200, draft_vocab_size=64)
        row = page.locator(f'tr[data-job-id="{job_id}"]')
        expect(row).to_be_visible(timeout=UI_TIMEOUT_MS)
        assert row.locator('[data-stalled="true"]').count() == 0, "a job just submitted is not stalled yet"
        expect(row.locator('[data-field="tokens_per_second"]')).to_have_text("starting")
        expect(row.locator('[data-stalled="true"]')).to_be_visible(timeout=(STALL_AFTER_S + 10) * 1000)
        activity = ops_stack.api.get(f"/v1/jobs/{job_id}/details").json()["activity"]
        assert activity["stalled"] and activity["last_commit_ts"] is None
    finally:
        ops_stack.resume("worker-")
    assert ops_stack.wait_finished(job_id)["state"] == "completed"
    expect(row.locator('[data-stalled="true"]')).to_have_count(0, timeout=UI_TIMEOUT_MS)
    expect(row).to_have_attribute("data-state", "completed")


def test_stale_banner_appears_when_the_api_stops_answering_and_goes_when_it_is_back(
    ops_stack: OpsStack, ran_jobs: RanJobs, page: "playwright_sync.Page"
) -> None:
    page.goto(f"{ops_stack.stack.api_url}/dashboard")
    banner = page.locator("#stale-banner")
    expect(page.locator("#freshness")).to_contain_text("updated", timeout=UI_TIMEOUT_MS)
    expect(banner).to_be_hidden()
    ops_stack.pause("producer")  # the API hangs: requests get no answer, as with a wedged process or a lost route
    try:
        expect(banner).to_be_visible(timeout=UI_TIMEOUT_MS)
        expect(banner).to_contain_text("not live")
        assert "stale" in page.locator("body").get_attribute("class")
    finally:
        ops_stack.resume("producer")
    expect(banner).to_be_hidden(timeout=UI_TIMEOUT_MS)


def test_jobs_list_and_job_page_fit_a_1024_px_window(
    ops_stack: OpsStack, ran_jobs: RanJobs, browser: "playwright_sync.Browser"
) -> None:
    context = browser.new_context(viewport={"width": 1024, "height": 768})
    try:
        page = context.new_page()
        page.goto(f"{ops_stack.stack.api_url}/dashboard")
        expect(page.locator(f'tr[data-job-id="{ran_jobs.clean}"]')).to_be_visible(timeout=UI_TIMEOUT_MS)
        overflow = page.evaluate(
            "() => { const w = document.querySelector('.table-wrap'); return [w.scrollWidth, w.clientWidth]; }"
        )
        assert overflow[0] <= overflow[1], f"the jobs table is {overflow[0]} px wide in a {overflow[1]} px column"
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 1024
        page.goto(f"{ops_stack.stack.api_url}/dashboard/jobs/{ran_jobs.clean}")
        expect(page.locator("#rejected tbody tr").first).to_be_visible(timeout=UI_TIMEOUT_MS)
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 1024, "the job page overflows"
    finally:
        context.close()


def test_api_docs_render_with_every_non_local_request_blocked(
    ops_stack: OpsStack, page: "playwright_sync.Page"
) -> None:
    api_host = urlparse(ops_stack.stack.api_url).netloc
    outside: list[str] = []

    def only_local(route: "playwright_sync.Route") -> None:
        if urlparse(route.request.url).netloc == api_host:
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_local)
    page.goto(f"{ops_stack.stack.api_url}/docs")
    expect(page.locator(".opblock").first).to_be_visible(timeout=UI_TIMEOUT_MS)
    assert page.locator(".opblock").count() >= 10
    assert outside == [], f"the docs asked for files outside the API: {outside}"


def test_a_running_job_shows_live_rate_eta_and_charts(
    ops_stack: OpsStack, ran_jobs: RanJobs, page: "playwright_sync.Page", tmp_path: Path
) -> None:
    dataset, _ = write_dataset(tmp_path / "bigger.jsonl", repeat=40)
    job_id = ops_stack.submit(dataset, shard_token_budget=150, draft_vocab_size=64)
    page.goto(f"{ops_stack.stack.api_url}/dashboard")
    row = page.locator(f'tr[data-job-id="{job_id}"]')
    expect(row).to_have_attribute("data-state", "running", timeout=60_000)
    expect(row.locator('[data-field="eta"]')).to_contain_text("at ", timeout=UI_TIMEOUT_MS)
    rate = row.locator('[data-field="tokens_per_second"]').inner_text()
    assert rate.endswith("/s") and not rate.startswith("avg"), rate
    _screenshot(page, "dashboard-jobs.png", tmp_path)
    page.goto(f"{ops_stack.stack.api_url}/dashboard/jobs/{job_id}")
    expect(page.locator("#rate-chart svg path")).to_have_count(1, timeout=UI_TIMEOUT_MS)
    _screenshot(page, "dashboard-job.png", tmp_path)
    assert ops_stack.wait_finished(job_id, timeout_s=300)["state"] == "completed"


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_pause(ops_stack: OpsStack) -> Iterator[None]:
    yield
    ops_stack.resume("worker-")
    ops_stack.resume("producer")
