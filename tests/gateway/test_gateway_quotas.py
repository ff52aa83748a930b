"""Tenants' quotas through real processes (Valkey, ``slotq worker`` on the tiny model, ``slotq
gateway``): jobs waiting, jobs in flight and tokens per minute, each refused with a 429 in OpenAI's
shape with Retry-After, counted per tenant in the gateway's metrics, never touching another
tenant, and given back as the tenant's jobs are cancelled or finish.

The ``held`` model's worker never claims (it stays in its warm-up), so its jobs wait for as long
as a test needs them to; the ``tiny`` model's worker runs them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from slotq.jobs.protocol.redis_queue import RedisQueue
from tests.support.gateway import Stack

pytestmark = pytest.mark.timeout(180)

A, B, C = ({"Authorization": f"Bearer sk-{name}"} for name in ("alpha", "beta", "gamma"))
KEYS = "alpha=sk-alpha,beta=sk-beta,gamma=sk-gamma"
ADMIN_KEYS = "ops=sk-ops"          # the per-tenant metrics are the fleet view's
HELD_QUEUE = "held:queue"
LANES = ["interactive", "bulk"]
RETRY_AFTER_S = 7


def chat(model: str, max_tokens: int = 4) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("quotas"), tiny_model_path) as s:
        s.start_worker("held-worker", "held", queue=HELD_QUEUE, fault_warmup_delay_s=3600)
        s.start_worker("tiny-worker", "tiny")
        s.start_gateway("waiting-and-tokens", api_keys=KEYS, admin_keys=ADMIN_KEYS, tenant_max_waiting=2,
                        tenant_tokens_per_min=100, gateway_retry_after_s=RETRY_AFTER_S)
        s.start_gateway("in-flight", api_keys=KEYS, admin_keys=ADMIN_KEYS, tenant_max_in_flight=2,
                        gateway_retry_after_s=RETRY_AFTER_S)
        for gateway in s.gateways:
            gateway.wait_ready()
        s.wait_for_models({"held", "tiny"})
        yield s


def counts(stack: Stack, tenant: str, queue: str = HELD_QUEUE) -> tuple[int, int]:
    """(waiting, running) of the tenant's jobs, as the queue counts them."""
    async def read() -> tuple[int, int]:
        redis = aioredis.Redis.from_url(stack.redis.url)
        try:
            found = await RedisQueue(redis, queue, LANES).tenant_counts(tenant)
            return found.waiting, found.running
        finally:
            await redis.aclose()
    return asyncio.run(read())


def post_job(url: str, key: dict[str, str], body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/jobs", headers=key, json=body, timeout=30)


def cancel(url: str, key: dict[str, str], job_ids: list[str]) -> None:
    for job_id in job_ids:
        assert httpx.delete(f"{url}/v1/jobs/{job_id}", headers=key, timeout=30).json()["cancelled"]


def assert_quota_refusal(response: httpx.Response, code: str, type: str) -> None:
    assert response.status_code == 429, response.text
    assert response.json()["error"] | {"message": ""} == {"message": "", "type": type, "param": None, "code": code}
    assert 1 <= int(response.headers["Retry-After"]) <= 60


def refusals(url: str, tenant: str, quota: str) -> float:
    admin = {"Authorization": "Bearer sk-ops"}
    for line in httpx.get(f"{url}/metrics", headers=admin, timeout=30).text.splitlines():
        if line.startswith("slotq_gateway_quota_refusals_total{") and f'tenant="{tenant}"' in line \
                and f'quota="{quota}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_tenants_waiting_jobs_are_capped_and_its_places_come_back_when_cancelled(stack):
    url = stack.gateways[0].url
    mine = [post_job(url, A, chat("held")).json()["id"] for _ in range(2)]
    refused = post_job(url, A, chat("held"))
    assert_quota_refusal(refused, "tenant_waiting_quota_exceeded", "requests")
    assert refused.headers["Retry-After"] == str(RETRY_AFTER_S)
    assert refusals(url, "alpha", "waiting") == 1
    theirs = post_job(url, B, chat("held"))                  # another tenant is unaffected
    assert theirs.status_code == 202, theirs.text
    assert counts(stack, "alpha") == (2, 0) and counts(stack, "beta") == (1, 0)
    cancel(url, A, mine[:1])
    assert counts(stack, "alpha") == (1, 0)
    again = post_job(url, A, chat("held"))
    assert again.status_code == 202, again.text
    cancel(url, A, [*mine[1:], again.json()["id"]])
    cancel(url, B, [theirs.json()["id"]])
    assert counts(stack, "alpha") == (0, 0) and counts(stack, "beta") == (0, 0)


def test_a_tenants_jobs_in_flight_are_capped(stack):
    url = stack.gateways[1].url
    mine = [post_job(url, A, chat("held")).json()["id"] for _ in range(2)]
    assert_quota_refusal(post_job(url, A, chat("held")), "tenant_in_flight_quota_exceeded", "requests")
    assert refusals(url, "alpha", "in_flight") == 1
    theirs = post_job(url, B, chat("held"))
    assert theirs.status_code == 202, theirs.text
    cancel(url, A, mine)
    cancel(url, B, [theirs.json()["id"]])
    assert counts(stack, "alpha") == (0, 0)


def test_a_tenants_tokens_per_minute_are_capped(stack):
    """Each request reserves 1 (prompt) + 60 (max_tokens) of gamma's 100 tokens a minute: a minute
    admits one, so of three in a row (which cross at most one minute) one is refused."""
    url = stack.gateways[0].url
    answers = [post_job(url, C, chat("held", max_tokens=60)) for _ in range(3)]
    refused = [r for r in answers if r.status_code == 429]
    assert refused, [r.text for r in answers]
    assert_quota_refusal(refused[0], "tenant_tokens_quota_exceeded", "tokens")
    assert refusals(url, "gamma", "tokens") >= 1
    theirs = post_job(url, B, chat("held", max_tokens=60))        # beta's minute is its own
    assert theirs.status_code == 202, theirs.text
    cancel(url, C, [r.json()["id"] for r in answers if r.status_code == 202])
    cancel(url, B, [theirs.json()["id"]])


def test_finished_jobs_give_their_places_back(stack):
    """Through the quota of two jobs in flight, one after another: each finished job frees its
    place, and the tenant's counts on the running model's queue return to zero."""
    url = stack.gateways[1].url                             # in flight: 2
    for _ in range(4):
        done = httpx.post(f"{url}/v1/chat/completions", headers=A, json=chat("tiny"), timeout=60)
        assert done.status_code == 200, done.text
    assert counts(stack, "alpha", "slotq:queue") == (0, 0)
