"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by Playwright) against
a real gateway, worker and Redis: the fleet table shows the worker and each worker's speculative
decoding (draft source, acceptance, counts), a dead letter is requeued with its button, a
playground reply streams in (preempting one of two tenants' bulk jobs that fill the slots), the
lane charts draw that traffic and the tenant table its backlog, and a reply survives a page reload
mid-stream. The Shards section stays hidden on one Redis; on a 3-primary Valkey Cluster it lists each
primary, marks the one that holds the queue's slot and where each partition of a partitioned queue
lands. Behind API keys, the key typed into the page is kept for the tab (sessionStorage),
never in localStorage; and the page runs under the gateway's Content-Security-Policy without a
single violation.

``make test`` installs Chromium (``make test-deps``). Without it the test fails in CI (``CI=true``)
and is skipped elsewhere, saying why. ``SLOTQ_SCREENSHOT_TO=docs/dashboard.png`` runs it on the
bundled model instead of the tiny one and saves the README's screenshot there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from slotq.engine import bundled_model_path
from slotq.jobs.gateway.webhooks import emit_event
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol import dead_letters, registry
from slotq.jobs.protocol.keys import CLUSTER_SLOTS, STREAM_BUCKETS
from slotq.jobs.protocol.schemas import JobRequest
from slotq.jobs.protocol.wire import ErrorInfo
from tests.support import free_port
from tests.support.engine import engine_stats
from tests.support.gateway import Stack
from tests.support.jobs import advertise

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

CHROMIUM = Path(os.environ.get("SLOTQ_CHROMIUM", "/usr/bin/chromium"))
# The machine has no internet: background networking (updates, safe browsing, sync) makes Chromium hang.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
SCREENSHOT_TO = os.environ.get("SLOTQ_SCREENSHOT_TO")
MODEL_NAME = "smollm2" if SCREENSHOT_TO else "tiny"
LONG_TOKENS = 300 if SCREENSHOT_TO else 16_000   # still generating after the page has sampled a while
BULK_BACKLOG = {"acme": 5, "globex": 3}           # bulk jobs per tenant: two fill the slots, the rest wait
ADMIN_KEY = "sk-dashboard"
# Every Content-Security-Policy violation the page causes, as the browser reports them to the page.
# (Playwright evaluates a waited-for *expression* with eval, which the policy refuses: the waits
# below are functions, "() => ...".)
RECORD_VIOLATIONS = ("window.policyViolations = [];"
                     "document.addEventListener('securitypolicyviolation',"
                     " (e) => window.policyViolations.push(`${e.violatedDirective} ${e.blockedURI}`));")


def _require_chromium() -> None:
    if CHROMIUM.exists():
        return
    reason = (f"Chromium not found at {CHROMIUM}: install Debian's package (`apt-get install chromium`, which "
              "`make test-deps` does as root) or set SLOTQ_CHROMIUM")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    _require_chromium()
    model = bundled_model_path() if SCREENSHOT_TO else tiny_model_path
    with Stack.started(tmp_path_factory.mktemp("dashboard"), model) as s:
        engine = {"ctx": 2048, "threads": 2} if SCREENSHOT_TO else {"ctx": 16_384}
        # no cache slot, so no reserve: the playground reply takes a bulk job's slot, which the charts show
        s.start_worker("browser-worker", MODEL_NAME, slots=2, cache_slots=0, **engine)
        s.start_gateway("browser-gateway", gateway_webhook_allow_private=True).wait_ready()
        s.start_gateway("browser-keyed", admin_keys=f"ops={ADMIN_KEY}", gateway_webhook_allow_private=True).wait_ready()
        s.wait_for_models({MODEL_NAME})
        yield s


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    """A gateway of a queue split into 3 partitions on a 3-primary Valkey Cluster; no worker (the shards need none)."""
    _require_chromium()
    with Stack.started(tmp_path_factory.mktemp("dashboard-cluster"), tiny_model_path, cluster=True) as s:
        s.start_gateway("cluster-gateway", queue_partitions=3).wait_ready()
        yield s


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    _require_chromium()
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path / "profile", executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900})
        try:
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.add_init_script(RECORD_VIOLATIONS)
            yield page
        finally:
            context.close()


def _job(stack: Stack, job_id: str) -> dict[str, Any]:
    return httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=10).json()


def _finished(stack: Stack, job_id: str, timeout: float = 60) -> dict[str, Any]:
    """The job once its result is stored (a moment after its stream's last event)."""
    deadline = time.monotonic() + timeout
    while (job := _job(stack, job_id)).get("status") in ("queued", "running", None) and time.monotonic() < deadline:
        time.sleep(0.05)
    return job


def _send(page: Any, prompt: str, max_tokens: int, *, ignore_eos: bool = False) -> None:
    page.fill("#play-prompt", prompt)
    page.fill("#play-max", str(max_tokens))
    page.fill("#play-temp", "0")
    page.set_checked("#play-ignore-eos", ignore_eos)
    page.click("#play-send")


def _playground(page: Any) -> dict[str, Any]:
    return page.evaluate("JSON.parse(localStorage.getItem('slotq.playground'))")


def _in_a_loop(make: Any) -> Any:
    """Run a coroutine beside Playwright's sync API, which holds this thread's event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, make()).result()


def _bulk_backlog(stack: Stack) -> list[str]:
    """Long bulk jobs of two tenants: the slots fill with them and the rest wait."""
    async def enqueue() -> list[str]:
        async with await SlotqClient.connect(stack.redis.url) as client:
            return [(await client.enqueue(JobRequest(prompt=f"{tenant} report {i}", max_tokens=LONG_TOKENS,
                                                     ignore_eos=True, lane="bulk", tenant=tenant))).id
                    for tenant, count in BULK_BACKLOG.items() for i in range(count)]
    return _in_a_loop(enqueue)


def _cancel(stack: Stack, job_ids: list[str]) -> None:
    async def cancel() -> None:
        async with await SlotqClient.connect(stack.redis.url) as client:
            await asyncio.gather(*(client.cancel(job_id) for job_id in job_ids))
    _in_a_loop(cancel)


def _assert_no_policy_violation(page: Any) -> None:
    assert page.evaluate("window.policyViolations") == []


def _chart(page: Any, name: str) -> dict[str, float]:
    return page.evaluate(f"(({{points, max}}) => ({{points: +points, max: +max}}))"
                         f"(document.querySelector('#chart-{name}').dataset)")


def test_dashboard_fleet_dead_letters_and_playground(stack, page, tmp_path):
    # a dead letter, as a worker records one when a job has exhausted its tries
    letter_id = f"dead-{uuid.uuid4().hex[:8]}"

    async def record() -> None:
        redis = Redis.from_url(stack.redis.url)
        await dead_letters.record(redis, letter_id, {"prompt": "requeue me", "max_tokens": 4},
                                  ErrorInfo(code="tries_exhausted", message="worker lost 5 times", retryable=True),
                                  5, time.time())
        await redis.aclose()

    _in_a_loop(record)

    page.goto(stack.url)
    # the fleet: the worker and its queue, live
    row = page.wait_for_selector('#workers tbody tr[data-worker="browser-worker"]')
    assert MODEL_NAME in row.inner_text() and "/ 2" in row.inner_text()
    assert page.inner_text('#queues tbody tr[data-queue="slotq:queue"]').startswith("slotq:queue")
    assert "live" in page.inner_text("#conn")

    # dead letters: listed, and requeued with the button
    button = page.wait_for_selector(f'#dead-letters button.requeue[data-job="{letter_id}"]')
    button.click()
    page.wait_for_selector(f'#dead-letters tr[data-job="{letter_id}"]', state="detached")
    assert _finished(stack, letter_id)["status"] == "succeeded"

    # two tenants' bulk jobs fill both slots and wait: the tenant table shows who waits
    backlog = _bulk_backlog(stack)
    try:
        page.wait_for_function("() => document.querySelectorAll('#tenants tbody tr[data-tenant]').length == "
                               f"{len(BULK_BACKLOG)}")
        assert {row.get_attribute("data-tenant") for row in page.query_selector_all("#tenants tr[data-tenant]")} \
            == set(BULK_BACKLOG)

        # the playground: a reply streams in (an interactive job: a bulk job yields its slot), and it
        # is exactly the job's result
        page.wait_for_selector(f'#play-model option:text-is("{MODEL_NAME}")', state="attached")
        _send(page, "Write one sentence about queues.", 48)
        page.wait_for_function("() => document.querySelector('#play-status').textContent.startsWith('done')")
        state = _playground(page)
        result = _finished(stack, state["request"]["idempotency_key"])["result"]
        assert page.inner_text("#play-output") != "" and state["text"] == result["text"]

        # the lane charts: tokens/s and queue depth over time, and the preemption the reply caused
        page.wait_for_function("() => +document.querySelector('#chart-preempted').dataset.max > 0", timeout=60_000)
        page.wait_for_function("() => +document.querySelector('#chart-tokens').dataset.max > 0", timeout=60_000)
        assert _chart(page, "waiting")["max"] > 0 and _chart(page, "tokens")["points"] >= 2
        assert page.query_selector_all("#chart-tokens polyline") and page.query_selector_all("#chart-preempted rect")
        assert "preempted in 15 min" in page.inner_text('#lane-legend [data-lane="bulk"]')
        _assert_no_policy_violation(page)
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    finally:
        _cancel(stack, backlog)
    if SCREENSHOT_TO:
        shutil.copy(tmp_path / "dashboard.png", SCREENSHOT_TO)


def test_playground_reply_survives_a_reload_mid_stream(stack, page):
    page.goto(stack.url)
    page.wait_for_selector(f'#play-model option:text-is("{MODEL_NAME}")', state="attached")
    _send(page, "Tell me a long story.", 300 if SCREENSHOT_TO else 4000, ignore_eos=True)
    page.wait_for_function("() => (JSON.parse(localStorage.getItem('slotq.playground')) || {}).lastId")
    job_id = _playground(page)["request"]["idempotency_key"]
    assert _job(stack, job_id)["status"] == "running"            # reloading mid-stream, not after the end
    before = _playground(page)
    page.reload()
    page.wait_for_function("() => document.querySelector('#play-status').textContent.startsWith('done')",
                           timeout=120_000)
    after = _playground(page)
    assert "resumed after reload" in page.inner_text("#play-status")
    assert after["text"].startswith(before["text"])
    job = _finished(stack, job_id)
    assert job["status"] == "succeeded" and job["result"]["attempts"] == 1     # the reload did not cancel it
    assert after["text"] == job["result"]["text"]                # nothing lost, nothing repeated
    _assert_no_policy_violation(page)


def test_dashboard_lists_webhook_attempts(stack, page):
    """An endpoint that is down: its failed attempt shows, with the error and the next retry."""
    down = f"http://127.0.0.1:{free_port()}/hooks"                 # nothing listens there
    endpoint = httpx.post(f"{stack.url}/v1/webhook_endpoints", json={
        "name": "down", "url": down, "event_types": ["batch.failed"]}).json()

    async def emit() -> str:
        redis = Redis.from_url(stack.redis.url)
        try:
            return await emit_event(redis, "default", "batch.failed", f"batch_{uuid.uuid4().hex[:8]}")
        finally:
            await redis.aclose()

    event_id = _in_a_loop(emit)
    page.goto(stack.url)
    row = page.wait_for_selector(f'#webhook-attempts tr.retrying:has(code:text-is("{endpoint["id"]}"))')
    assert "batch.failed" in row.inner_text() and event_id in row.inner_text() and "ConnectError" in row.inner_text()
    assert "default" in row.inner_text() and "in " in row.inner_text()                 # the next attempt is due
    httpx.delete(f"{stack.url}/v1/webhook_endpoints/{endpoint['id']}").raise_for_status()
    _assert_no_policy_violation(page)


def test_the_key_is_kept_for_the_tab_only(stack, page):
    keyed = stack.gateways[1]                                    # SLOTQ_ADMIN_KEYS: the page asks for a key
    page.goto(keyed.url)
    page.wait_for_selector("#key-form", state="visible")
    page.fill("#key", ADMIN_KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector('#workers tbody tr[data-worker="browser-worker"]')
    assert page.evaluate("sessionStorage.getItem('slotq.apiKey')") == ADMIN_KEY
    assert page.evaluate("localStorage.getItem('slotq.apiKey')") is None
    # the slot bars are drawn through the CSSOM, which the policy allows where style attributes are refused
    assert page.evaluate("document.querySelector('#workers .bar > span').style.width").endswith("%")
    _assert_no_policy_violation(page)


def test_the_fleet_table_shows_each_workers_drafts(stack, page):
    """The figures of a worker that drafts (a heartbeat the worker's code builds from an engine
    snapshot: the tiny model's engine drafts nothing worth showing) beside the real worker's."""
    async def heartbeat(leave: bool) -> None:
        redis = Redis.from_url(stack.redis.url)
        try:
            if leave:
                await registry.leave(redis, "drafting-worker")
            else:
                await advertise(redis, "drafting-worker", engine_stats(
                    spec="ngram", spec_draft_tokens=40, spec_accepted_tokens=30), queue="drafting:queue")
        finally:
            await redis.aclose()

    _in_a_loop(lambda: heartbeat(leave=False))
    try:
        page.goto(stack.url)
        row = page.wait_for_selector('#workers tbody tr[data-worker="drafting-worker"]')
        assert row.query_selector("td.spec").inner_text() == "ngram 75 % 30 / 40"
        real = page.inner_text('#workers tbody tr[data-worker="browser-worker"] td.spec')
        assert real.split()[0] in ("off", "ngram", "draft"), real
        assert "drafts kept" in page.text_content("#workers thead")
        # one Redis: no shards, so no Shards section
        assert page.wait_for_selector('#shards[data-clustered="false"]', state="attached").is_hidden()
        _assert_no_policy_violation(page)
    finally:
        _in_a_loop(lambda: heartbeat(leave=True))


def test_the_shards_section_shows_each_primary_and_where_the_queue_is(cluster_stack, page):
    page.goto(cluster_stack.url)
    page.wait_for_selector('#shards[data-clustered="true"]', state="visible")
    rows = page.query_selector_all("#shards tbody tr[data-node]")
    assert len(rows) == 3
    assert page.inner_text("#shards-queue") == "slotq:queue"
    [home] = page.query_selector_all("#shards tbody tr:has(.queue-slot)")          # one primary holds the queue's slot
    assert re.fullmatch(r"queue · slot \d+", home.query_selector(".queue-slot").inner_text())
    held = sorted(int(n) for row in rows for mark in row.query_selector_all(".partitions")
                  for n in re.findall(r"\d+", mark.inner_text()))
    assert held == [0, 1, 2]                                        # each partition of the queue on its primary
    assert "partition 0" in home.inner_text()
    for row in rows:
        assert row.query_selector(".buckets").inner_text() == f"16 / {STREAM_BUCKETS} stream buckets"
        assert re.search(r"\d+–\d+ \d+ slots", row.inner_text()), row.inner_text()
    slots = sum(int(n) for n in re.findall(r"(\d+) slots", page.inner_text("#shards tbody")))
    assert slots == CLUSTER_SLOTS
    # the ops/s share bars are drawn through the CSSOM, as the others
    assert page.evaluate("document.querySelector('#shards .bar > span').style.width").endswith("%")
    _assert_no_policy_violation(page)
