"""Alert rules, the Grafana dashboard and the worker's HTTP endpoints, checked for real.

* ``promtool check rules`` loads deploy/prometheus/slotq-alerts.yaml and ``promtool test rules``
  runs deploy/prometheus/slotq-alerts.test.yaml, whose series make every alert fire. promtool comes
  from Debian's ``prometheus`` package (``make test-deps`` installs it when run as root); without
  it these tests skip, except in CI (``CI=true``), where they fail saying so.
* Every metric name the rules and the dashboard use is served by a real ``slotq worker`` (tiny
  model) at /metrics, next to /ready and /live.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.schemas import JobStatus
from tests.support import REPO_ROOT, free_port
from tests.support.jobs import WorkerProcess, clean_env, job_request
from tests.support.processes import wait_for

ROOT = REPO_ROOT
RULES = ROOT / "deploy/prometheus/slotq-alerts.yaml"
RULE_TESTS = ROOT / "deploy/prometheus/slotq-alerts.test.yaml"
DASHBOARD = ROOT / "deploy/grafana/slotq-dashboard.json"
METRIC_NAME = re.compile(r"\b(slotq_[a-z0-9_]+|process_[a-z0-9_]+)\b")
ALERTS = {"SlotqNoLiveWorker", "SlotqQueueWaitHigh", "SlotqDeadLettersGrowing", "SlotqKVCacheHigh",
          "SlotqWorkerRestarting", "SlotqBackgroundLoopRestarting", "SlotqDegraded", "SlotqMemoryHigh",
          "SlotqRedisRefusing", "SlotqStreamStalled"}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = ("promtool is not installed: it comes with Debian's `prometheus` package; `make test-deps` "
                   "installs it when run as root (apt-get install --no-install-recommends prometheus)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI: {message}")
        pytest.skip(message)
    return path


def test_alert_rules_load(promtool: str) -> None:
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_every_alert_fires_on_its_series(promtool: str) -> None:
    tests = RULE_TESTS.read_text()
    fired = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n\s+- exp_labels", tests))
    assert fired == ALERTS                                      # each alert has a firing case
    out = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], capture_output=True, text=True,
                         cwd=RULE_TESTS.parent, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def used_metric_names() -> dict[str, set[str]]:
    rules = RULES.read_text()
    exprs = re.findall(r"^\s+expr: (.+)$", rules, flags=re.MULTILINE)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {"rules": {m for e in exprs for m in METRIC_NAME.findall(e)},
            "dashboard": {m for q in queries for m in METRIC_NAME.findall(q)}}


def exported_names(text: str) -> set[str]:
    """Every sample name the exposition can carry, also for labelled metrics with no child yet."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                "summary": ("_count", "_sum", "_created"), "gauge": ("",)}
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def _serves(text: str, names: set[str]) -> bool:
    """The exposition carries every one of ``names``, and the worker's two slots, ready."""
    return names <= exported_names(text) and "slotq_slots_active 2.0" in text and "slotq_worker_ready 1.0" in text


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    graphs = [p for p in panels if p["type"] != "row"]
    assert graphs and all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in graphs)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in graphs)
    assert {"slotq_slots_active", "slotq_kv_cache_usage_ratio", "slotq_degradation_level",
            "slotq_queue_oldest_waiting_age_seconds"} <= used_metric_names()["dashboard"]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_rules_and_dashboard_use_only_metrics_a_real_worker_serves(
        redis_url: str, client: SlotqClient, tiny_model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    env = clean_env(redis_url=redis_url, model=tiny_model_path, slots=2, ctx=256, threads=1, metrics_port=port)
    worker = WorkerProcess("obs1", env, tmp_path)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                status, body = _get(f"http://127.0.0.1:{port}/ready")
                if status == 200:
                    break
                assert status == 503 and json.loads(body)["state"] in ("connecting_to_redis", "loading_model",
                                                                      "warming_up"), body
            except (urllib.error.URLError, ConnectionError):
                pass
            assert worker.proc.poll() is None and time.monotonic() < deadline, worker.log_tail()
            await asyncio.sleep(0.2)
        ready = json.loads(body)
        expected = {"ok": True, "state": "ready", "worker": "obs1", "slots_active": 2, "degradation": "none"}
        assert ready == ready | expected
        assert _get(f"http://127.0.0.1:{port}/live")[0] == 200
        job = await client.enqueue(job_request(max_tokens=8))
        assert (await job.result(timeout=60)).status == JobStatus.SUCCEEDED
        used = used_metric_names()
        deadline = time.monotonic() + 30
        while True:          # until a sample (taken once a second) after the job serves every name used
            status, text = _get(f"http://127.0.0.1:{port}/metrics")
            if (status == 200 and _serves(text, set().union(*used.values()))) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert status == 200
    finally:
        worker.stop()
    exported = exported_names(text)
    for where, names in used.items():
        assert names, where
        missing = sorted(names - exported)
        assert not missing, f"{where} use metrics no worker serves: {missing}"
    assert "slotq_slots_active 2.0" in text and "slotq_worker_ready 1.0" in text


def test_live_fails_when_the_event_loop_stops_stamping_and_ready_says_why() -> None:
    from slotq.jobs.worker.health import Health, serve

    state = {"ok": False}
    health = Health(stuck_after_s=0.3,
                    ready_check=lambda: (state["ok"], {"state": "ready" if state["ok"] else "warming_up"}))
    port = free_port()
    server = serve(port, health, addr="127.0.0.1")
    try:
        assert _get(f"http://127.0.0.1:{port}/live")[0] == 200
        assert _get(f"http://127.0.0.1:{port}/ready") == (503, '{"ok": false, "state": "warming_up"}')
        state["ok"] = True
        assert _get(f"http://127.0.0.1:{port}/ready")[0] == 200
        wait_for(lambda: _get(f"http://127.0.0.1:{port}/live")[0] == 503, 10,
                 "/live failing while nobody calls tick() (a stuck loop)")
        status, body = _get(f"http://127.0.0.1:{port}/live")
        assert status == 503 and json.loads(body)["event_loop_idle_s"] >= 0.3
        health.tick()
        assert _get(f"http://127.0.0.1:{port}/live")[0] == 200
        assert "# TYPE" in _get(f"http://127.0.0.1:{port}/metrics")[1]
    finally:
        server.shutdown()
