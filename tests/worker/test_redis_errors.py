"""A worker whose Redis answers errors (issue 43, "visible degradation"): an error no retry outlasts (a
Lua error, OOM, a bad argument, WRONGTYPE) is told from an outage, counted, and never retried for ever;
the stream writer's backlog is measured; ``/ready`` fails past ``SLOTQ_HEALTH_MAX_STALL_S``; and an
attempt whose stream fence fails to rise leaves nothing bound in the writer. Real Valkey, real errors:
each is provoked on the server (a key of the wrong type, ``maxmemory``, a script that raises)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.protocol.connection import is_transient
from slotq.jobs.protocol.keys import fences_key, stream_key
from slotq.jobs.protocol.schemas import JobStatus
from slotq.jobs.worker.stream_writer import DETERMINISTIC_TRIES, StreamWriter
from slotq.jobs.worker.worker import SlotqWorker
from tests.support import free_port
from tests.support.jobs import job_request

SPIN = "local start = os.clock() repeat until os.clock() - start > tonumber(ARGV[1]) / 1000 return 1"   # CPU ms


def failures(operation: str, kind: str) -> float:
    return REGISTRY.get_sample_value("slotq_redis_failures_total", {"operation": operation, "kind": kind}) or 0.0


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    r = Redis.from_url(redis_url)
    try:
        yield r
    finally:
        await r.aclose()


async def raised(call: Awaitable[object]) -> BaseException:
    try:
        await call
    except (RedisError, OSError) as exc:
        return exc
    raise AssertionError("no error")


async def test_errors_no_retry_outlasts_are_told_from_an_outage(redis: Redis) -> None:
    await redis.hset("a-hash", "f", "v")
    deterministic = {
        "WRONGTYPE": await raised(redis.get("a-hash")),
        "Lua error": await raised(redis.eval("return redis.call('GET', 'a-hash')", 0)),
        "bad argument": await raised(redis.execute_command("EXPIRE", "a-hash", "soon")),
    }
    await redis.config_set("maxmemory", "1")
    try:
        deterministic["OOM"] = await raised(redis.set("more", "x" * 1000))
    finally:
        await redis.config_set("maxmemory", "0")
    assert {what: is_transient(error) for what, error in deterministic.items()} == dict.fromkeys(deterministic, False)

    nobody = Redis(port=free_port(), socket_connect_timeout=1)
    busy = Redis.from_url(f"redis://127.0.0.1:{redis.connection_pool.connection_kwargs['port']}")
    await redis.config_set("busy-reply-threshold", "20")
    try:
        refused = await raised(nobody.ping())
        spin = asyncio.create_task(busy.eval(SPIN, 0, 300))
        await asyncio.sleep(0.15)
        busy_reply = await raised(redis.get("a-hash"))
        await spin
    finally:
        await redis.config_set("busy-reply-threshold", "5000")
        await nobody.aclose()
        await busy.aclose()
    assert isinstance(busy_reply, ResponseError) and str(busy_reply).startswith("BUSY")
    assert is_transient(refused) and is_transient(busy_reply)


async def test_a_flush_redis_refuses_for_good_is_given_up_and_its_attempt_stopped(redis: Redis) -> None:
    """The job's stream key holds a string: every XADD of the flush is WRONGTYPE. The flush is tried
    DETERMINISTIC_TRIES times, then given up (before, it was re-sent for ever and the attempt's last
    write never returned); the attempt is told, as if fenced off, and nothing stays buffered."""
    stopped: list[tuple[str, str]] = []
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60, writer_id="w",
                          on_fenced=lambda job, lease: stopped.append((job, lease)))
    writer.bind("j", "w#1")
    assert (await writer.open("j")).raised
    await redis.set(stream_key("j"), "not a stream")
    before = failures("flush", "deterministic")
    writer.add_chunk("j", attempt=1, choice=0, text="a", token_ids=[1, 2], n_tokens=2)
    assert writer.backlog()[0] == 2
    async with asyncio.timeout(30):
        assert await writer.write_all("j")
    assert stopped == [("j", "w#1")]
    assert failures("flush", "deterministic") - before == DETERMINISTIC_TRIES
    assert writer.backlog() == (0, 0.0)
    assert writer.unwritten("j") == (0, 0)


async def test_the_backlog_counts_tokens_and_ages_until_redis_takes_them(redis: Redis) -> None:
    writer = StreamWriter(redis, flush_ms=100, maxlen=1000, ttl_s=60, writer_id="w")
    assert writer.backlog() == (0, 0.0)
    writer.add_chunk("j", attempt=1, choice=0, text="ab", token_ids=[1, 2], n_tokens=2)
    writer.add_chunk("k", attempt=1, choice=0, text="c", token_ids=[3], n_tokens=1)
    await asyncio.sleep(0.05)
    tokens, waited = writer.backlog()
    assert tokens == 3 and waited >= 0.05
    assert await writer.flush()
    assert writer.backlog() == (0, 0.0)


async def test_a_worker_whose_claims_and_reaps_redis_refuses_says_so_and_turns_unready(
        start_worker: Callable[..., Awaitable[SlotqWorker]], redis: Redis) -> None:
    """The lanes' sets hold strings, so every CLAIM and REAP fails with a Lua error (WRONGTYPE) while
    Redis itself answers (the heartbeat stays current): each failure is counted as deterministic, and
    after SLOTQ_HEALTH_MAX_STALL_S of nothing but failures /ready fails with ``redis_stalled``; once
    the keys are fixed, the next reap that works makes the worker ready again."""
    worker = await start_worker(health_max_stall_s=1.0, poll_delay_s=0.2)
    async with asyncio.timeout(30):         # ready once its first heartbeat lands (after the warm-up)
        while not worker.health.ready()[0]:
            assert worker.health.ready()[1]["state"] == "warming_up", worker.health.ready()[1]
            await asyncio.sleep(0.05)
    assert worker.runtime is not None
    keys = worker.runtime.queue.keys
    claims, reaps = failures("claim", "deterministic"), failures("reap", "deterministic")
    broken = [key for lane in keys.lanes for key in (keys.waiting(lane), keys.running(lane))]
    for key in broken:
        await redis.set(key, "not a sorted set")
    async with asyncio.timeout(30):
        while worker.health.ready()[0]:
            await asyncio.sleep(0.1)
    assert worker.health.ready()[1]["state"] == "redis_stalled"
    assert failures("claim", "deterministic") > claims and failures("reap", "deterministic") > reaps
    await redis.delete(*broken)
    async with asyncio.timeout(30):
        while not worker.health.ready()[0]:
            await asyncio.sleep(0.1)


async def test_an_attempt_whose_fence_fails_to_rise_leaves_nothing_bound(
        start_worker: Callable[..., Awaitable[SlotqWorker]], client: SlotqClient, redis: Redis) -> None:
    """The fences hash holds a string: RAISE_FENCE fails and the attempt ends with that error. The writer
    was bound to the attempt's lease before the fence; it is unbound all the same (before, the bind came
    before the attempt's ``try`` and stayed for good)."""
    worker = await start_worker()
    await redis.set(fences_key(), "not a hash")
    handle = await client.enqueue(job_request(max_tokens=4))
    result = await handle.result(timeout=60)
    assert result.status == JobStatus.FAILED
    assert worker.writer is not None
    deadline = time.monotonic() + 10
    while worker.writer.tracked_jobs() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert worker.writer.tracked_jobs() == 0
