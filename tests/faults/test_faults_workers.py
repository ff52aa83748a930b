"""Fault injection on workers: kill -9, SIGTERM, SIGSTOP mid-generation, a kill right after a
claim, and a chaos run (random kill -9s and Redis restarts over 200 jobs).

Nothing may be lost or duplicated: every job ends succeeded, its stream's chunk text (all attempts,
in order) equals the result text, and there is exactly one streamed token per completion token.
Workers are ``slotq worker`` subprocesses on the tiny random model (SLOTQ_THREADS=1, at most three
at a time) with a 3 s in-progress lock, so a killed worker's jobs are free again within 3 s. The
chaos run prints a ``RELIABILITY ...`` line (also appended to /tmp/slotq_reliability.txt).

Resume is checked token for token against an uninterrupted run of the same greedy request. For
that the workers run with SLOTQ_UBATCH=1: a resumed attempt prefills the delivered tokens, and a
batched prefill rounds differently from the token-by-token decode that produced them, which with
random weights flips a near-tied argmax a few hundred tokens later (seen at token 606 of 4000).
With one-token micro-batches the prefill computes exactly what the decode did.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter

import pytest

from slotq.jobs.protocol.keys import job_record_key, result_key, retry_counter_key
from slotq.jobs.protocol.schemas import EntryKind, JobResult, JobStatus
from tests.support.engine import solo_greedy_tokens
from tests.support.faults import (
    LOCK_TTL_S,
    ON_EVERY_FAULT_BACKEND,
    FaultyProxy,
    Fleet,
    check_job,
    entry_time,
    known_bug,
    percentile,
    report,
    stream_summary,
    worker_env,
)
from tests.support.jobs import job_request, raw_entries

pytestmark = pytest.mark.fault

# Long jobs: the tiny model makes a few thousand tokens/s on one thread and attention cost grows
# with the length, so these take seconds -- long enough to be hit mid-generation every time.
LONG_CTX = 8192
KILL_TOKENS = 4000
DRAIN_TOKENS = 6000
RECOVERY_BOUND_S = 30


def long_env(fleet_url: str, model, **overrides):
    return worker_env(fleet_url, model, slots=2, ctx=LONG_CTX, ubatch=1, **overrides)


async def _tokens_streamed(client, job_id: str, at_least: int, timeout: float = 60) -> int:
    """Wait until the job's stream holds ``at_least`` chunk tokens (and no final entry yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = await raw_entries(client, job_id)
        assert not any(e.final for e in entries), "the job finished before the fault could be injected"
        n = sum(len(e.token_ids) for e in entries if e.kind == EntryKind.CHUNK)
        if n >= at_least:
            return n
        await asyncio.sleep(0.002)
    raise TimeoutError(f"{job_id} did not stream {at_least} tokens in {timeout} s")


async def _first_chunk_of_attempt(client, job_id: str, attempt_above: int, timeout: float) -> float:
    """time.time() at which the first chunk of an attempt > ``attempt_above`` reached Redis."""
    async with asyncio.timeout(timeout):
        async for entry in client.stream(job_id):
            if entry.kind == EntryKind.CHUNK and entry.attempt > attempt_above:
                return entry_time(entry)
            assert not entry.final, entry
    raise AssertionError("the stream ended without a chunk of a later attempt")


async def _enqueue_on(fleet: Fleet, victim: str, survivor: str, request, *, keep_paused: bool = False):
    """Enqueue so that ``victim`` runs the job: the survivor is SIGSTOPped until the victim has
    streamed 300+ tokens of it, then continued (unless ``keep_paused``) -- a running worker when
    the fault comes."""
    fleet.pause(survivor)
    try:
        job = await fleet.client.enqueue(request)
        await _tokens_streamed(fleet.client, job.id, at_least=300)
    except BaseException:
        fleet.resume(survivor)
        raise
    if not keep_paused:
        fleet.resume(survivor)
    return job


async def _reference(client, request) -> tuple[JobResult, list[int]]:
    """The same request run uninterrupted on a fresh job."""
    result = await (await client.enqueue(request)).result(timeout=120)
    assert result.status == JobStatus.SUCCEEDED and result.attempts == 1, result
    s = stream_summary(await raw_entries(client, result.id))
    assert s.text == result.text and len(s.token_ids) == result.usage.completion_tokens == request.max_tokens
    return result, s.token_ids


# ---------------------------------------------------------------------- kill -9 mid-generation
async def _kill9_scenario(client, fsync_redis, tiny_model_path, tmp_path):
    """Two workers; the one running a long job is SIGKILLed once 300+ tokens are in its stream."""
    fleet = Fleet(client, long_env(fsync_redis.url, tiny_model_path), tmp_path)
    fleet.spawn("k1"), fleet.spawn("k2")
    try:
        await fleet.wait_ready("k1", "k2")
        victim, survivor = "k1", "k2"
        request = job_request("the quick brown fox", max_tokens=KILL_TOKENS)
        job = await _enqueue_on(fleet, victim, survivor, request)

        killed_at = fleet.kill(victim)
        before = await raw_entries(client, job.id)
        assert not any(e.final for e in before), "the job finished before the kill"
        assert {e.attempt for e in before} == {1}
        kept = [t for e in before if e.kind == EntryKind.CHUNK for t in e.token_ids]
        resumed_at = await _first_chunk_of_attempt(client, job.id, attempt_above=1, timeout=RECOVERY_BOUND_S)
        recovery = resumed_at - killed_at
        result = await job.result(timeout=RECOVERY_BOUND_S + 60)
        reference, ref_tokens = await _reference(client, request)
        report(f"KILL9 recovery_s={recovery:.2f} tokens_in_stream_at_kill={len(kept)}")
        return dict(result=result, reference=reference, ref_tokens=ref_tokens, kept=kept, recovery=recovery,
                    survivor=survivor, entries=await raw_entries(client, job.id))
    finally:
        fleet.stop_all()


@ON_EVERY_FAULT_BACKEND
async def test_kill9_mid_generation_resumes_on_other_worker(fclient, fsync_redis, tiny_model_path, tmp_path):
    """The worker running a 4000-token job is SIGKILLed once 300+ tokens are streamed; the other
    one, already running, resumes it within the 30 s bound (in ~3 s: the lock TTL) as attempt 2, and
    the stream is exactly the uninterrupted greedy output."""
    r = await _kill9_scenario(fclient, fsync_redis, tiny_model_path, tmp_path)
    result, entries, kept = r["result"], r["entries"], r["kept"]
    assert r["recovery"] < RECOVERY_BOUND_S, r["recovery"]
    assert result.status == JobStatus.SUCCEEDED, result
    assert result.worker == r["survivor"]
    assert result.attempts == 2
    s = stream_summary(entries)
    assert s.finals == 1 and entries[-1].final
    assert s.attempts == [1, 2]
    assert [e.attempt for e in entries] == sorted(e.attempt for e in entries)     # attempt 2 strictly after 1
    assert s.text == result.text
    # what attempt 1 delivered stays, attempt 2 continues right after it, and the stream is the
    # uninterrupted greedy output (a repeated or skipped token would shift everything after it)
    assert s.token_ids[:len(kept)] == kept
    assert len(s.token_ids) > len(kept)
    assert s.token_ids == r["ref_tokens"][:len(s.token_ids)]
    assert r["reference"].text.startswith(result.text)
    # ... and it is complete: one streamed token per completion token, max_tokens of them
    assert result.usage.completion_tokens == KILL_TOKENS
    assert len(s.token_ids) == KILL_TOKENS, f"{len(s.token_ids)} streamed tokens, {len(kept)} of them before the kill"
    assert s.token_ids == r["ref_tokens"]
    assert result.text == r["reference"].text


# ---------------------------------------------------------------------- SIGTERM
async def _sigterm_scenario(client, fsync_redis, tiny_model_path, tmp_path):
    """Two workers with a 1 s drain grace; the one running a long job gets one SIGTERM."""
    fleet = Fleet(client, long_env(fsync_redis.url, tiny_model_path, drain_grace_s=1), tmp_path)
    fleet.spawn("t1"), fleet.spawn("t2")
    try:
        await fleet.wait_ready("t1", "t2")
        victim, survivor = "t1", "t2"
        request = job_request("a long story about queues", max_tokens=DRAIN_TOKENS)
        # the survivor stays stopped until the victim has exited, so the stream then holds
        # exactly what the handed-back attempt delivered
        job = await _enqueue_on(fleet, victim, survivor, request, keep_paused=True)
        try:
            proc = fleet.procs[victim]
            signalled = time.monotonic()
            proc.proc.terminate()
            code = await asyncio.to_thread(proc.proc.wait, 30)
            exited_after = time.monotonic() - signalled
            handed_back = [e for e in await raw_entries(client, job.id) if e.kind == EntryKind.CHUNK]
        finally:
            fleet.resume(survivor)
        log = proc.log.read_text(errors="replace")
        result = await job.result(timeout=120)
        reference, ref_tokens = await _reference(client, request)
        return dict(result=result, reference=reference, ref_tokens=ref_tokens, victim=victim, survivor=survivor,
                    code=code, exited_after=exited_after, log=log, handed_back=handed_back,
                    entries=await raw_entries(client, job.id))
    finally:
        fleet.stop_all()


async def test_sigterm_hands_back_without_using_a_try(fclient, fsync_redis, tiny_model_path, tmp_path):
    """One SIGTERM, 1 s grace, a job that needs longer: handed back, finished by the other worker.
    The hand-back does not use a try: the result says attempts == 1 (the attempt that ran to the
    end saw job_try 1)."""
    r = await _sigterm_scenario(fclient, fsync_redis, tiny_model_path, tmp_path)
    result, entries = r["result"], r["entries"]
    assert r["code"] == 0, r["log"][-3000:]
    assert r["exited_after"] < 1 + 10, r["exited_after"]          # grace 1 s, then hand back and exit
    assert "Traceback" not in r["log"], r["log"][-3000:]
    assert r["handed_back"], "nothing was streamed before the hand-back"
    assert not any(e.final for e in r["handed_back"])
    assert result.status == JobStatus.SUCCEEDED, result
    assert result.worker == r["survivor"]
    assert result.attempts == 1
    assert result.usage.completion_tokens == DRAIN_TOKENS
    assert result.text == r["reference"].text
    assert sum(e.final for e in entries) == 1 and entries[-1].final
    # the stream continues seamlessly after the handed-back part
    s = stream_summary(entries)
    streamed = sum(len(e.token_ids) for e in r["handed_back"])
    assert 0 < streamed < DRAIN_TOKENS
    assert s.token_ids[:streamed] == [t for e in r["handed_back"] for t in e.token_ids]
    assert s.text == result.text, (f"the stream holds {len(s.token_ids)} tokens for {DRAIN_TOKENS}; {streamed} were "
                                   f"streamed before the hand-back (attempt labels {s.attempts})")
    assert s.token_ids == r["ref_tokens"]
    assert s.attempts == [1]           # the hand-back did not count: both parts ran as try 1


async def test_sigterm_with_grace_finishes_running_job_on_same_worker(fclient, fsync_redis, tiny_model_path, tmp_path):
    """One SIGTERM, 60 s grace: the running job finishes where it runs; the other worker, already
    running, does not get it."""
    fleet = Fleet(fclient, long_env(fsync_redis.url, tiny_model_path, drain_grace_s=60), tmp_path)
    fleet.spawn("g1"), fleet.spawn("g2")
    try:
        await fleet.wait_ready("g1", "g2")
        job = await _enqueue_on(fleet, "g1", "g2", job_request("finish me first", max_tokens=3000))
        proc = fleet.procs["g1"]
        proc.proc.terminate()
        code = await asyncio.to_thread(proc.proc.wait, 60)
        log = proc.log.read_text(errors="replace")
        assert code == 0, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        # the worker is gone; the result is already there
        result = await job.result(timeout=5)
        assert result.status == JobStatus.SUCCEEDED, result
        assert result.worker == "g1"
        assert result.attempts == 1
        s = await check_job(fclient, result, max_tokens=3000)
        assert s.attempts == [1]
        assert [w.id for w in (await fclient.queue_info()).workers] == ["g2"]
    finally:
        fleet.stop_all()


async def test_sigterm_drain_waits_for_the_result_write(fclient, fsync_redis, tiny_model_path, tmp_path):
    """One SIGTERM, 60 s grace; the job finishes within it but its result write is slow (a proxy
    holds it for 1 s). The drain must wait for that too: exit 0, result written by this worker."""
    client = fclient
    proxy = FaultyProxy(fsync_redis.port)
    await proxy.start()
    fleet = Fleet(client, long_env(proxy.url, tiny_model_path, drain_grace_s=60), tmp_path)
    fleet.spawn("d1")
    try:
        await fleet.wait_ready("d1")
        job = await client.enqueue(job_request("slow goodbye", max_tokens=1000))
        await _tokens_streamed(client, job.id, at_least=50)
        proxy.arm(result_key(job.id).encode(), "delay", delay_s=1.0)
        proc = fleet.procs["d1"]
        proc.proc.terminate()
        code = await asyncio.to_thread(proc.proc.wait, 60)
        log = proc.log.read_text(errors="replace")
        assert proxy.fired.is_set(), "the result write never went through the proxy"
        known_bug(code == 0 and "Traceback" not in log, f"exit {code}: {log[-1500:]}")
        result = await job.result(timeout=10)
        assert result.status == JobStatus.SUCCEEDED and result.worker == "d1" and result.attempts == 1, result
        await check_job(client, result, max_tokens=1000)
    finally:
        await asyncio.to_thread(fleet.stop_all)       # the proxy runs on this loop: keep it serving
        await proxy.close()


# ---------------------------------------------------------------------- stall
@ON_EVERY_FAULT_BACKEND
async def test_worker_stalled_longer_than_lock_does_not_run_job_twice(fclient, fsync_redis, tiny_model_path,
                                                                     tmp_path):
    """A worker frozen (SIGSTOP: a VM pause, a swap storm) for longer than the 3 s lock loses its job
    to the other worker; when it wakes it must not carry on with it as well (fenced lease), and it
    must live on."""
    client = fclient
    fleet = Fleet(client, long_env(fsync_redis.url, tiny_model_path), tmp_path)
    fleet.spawn("s1"), fleet.spawn("s2")
    try:
        await fleet.wait_ready("s1", "s2")
        request = job_request("frozen in time", max_tokens=KILL_TOKENS)
        job = await _enqueue_on(fleet, "s1", "s2", request)
        fleet.pause("s1")
        try:
            await _first_chunk_of_attempt(client, job.id, attempt_above=1, timeout=RECOVERY_BOUND_S)
        finally:
            fleet.resume("s1")
        result = await job.result(timeout=120)
        await asyncio.sleep(1)          # let the woken worker write whatever it still would
        assert result.status == JobStatus.SUCCEEDED, result
        assert result.worker == "s2" and result.attempts == 2, result
        entries = await raw_entries(client, job.id)
        s = await check_job(client, result, max_tokens=KILL_TOKENS)
        assert s.attempts == [1, 2], s.attempts
        assert [e.attempt for e in entries] == sorted(e.attempt for e in entries), "attempt 1 wrote after attempt 2"
        reference, ref_tokens = await _reference(client, request)
        assert s.token_ids == ref_tokens
        # the woken worker gave the job up and still serves
        assert fleet.procs["s1"].proc.poll() is None, fleet.logs()
        fleet.pause("s2")
        try:
            again = await (await client.enqueue(job_request("after the stall", max_tokens=8))).result(timeout=30)
        finally:
            fleet.resume("s2")
        assert again.status == JobStatus.SUCCEEDED and again.worker == "s1", again
    finally:
        codes = fleet.stop_all()
    assert codes == {"s1": 0, "s2": 0}, fleet.logs()


# ---------------------------------------------------------------------- killed right after a claim
async def test_worker_killed_right_after_claiming_a_job_frees_it_within_lock_ttl(fclient, fsync_redis,
                                                                                 tiny_model_path, tmp_path):
    """c1 reaches Redis through a proxy that freezes its connection right after its claim of the
    job has been executed in Redis (the claim's reply, which names the job, never reaches it); c1
    is then SIGKILLed. The claim must lapse like any other lease, and c2 run the job within seconds."""
    client = fclient
    proxy = FaultyProxy(fsync_redis.port)
    await proxy.start()
    fleet = Fleet(client, worker_env(fsync_redis.url, tiny_model_path, slots=2), tmp_path)
    fleet.spawn("c1", redis_url=proxy.url), fleet.spawn("c2")
    try:
        await fleet.wait_ready("c1", "c2")
        job_id = "claim-window-1"
        # The claim script's reply for one job: an array of 5 (the server's clock in ms, the lease, then
        # id, lane index, ready ms) whose job is this id in lane 0 (interactive). Its header and clock are part
        # of the needle: the id followed by ":0" alone also ends the waiting lane's head in the replies
        # of the worker's queue counts (its elastic loop and metrics read them every second), which
        # froze that connection instead when it ran between the enqueue and the claim, and the job was
        # still queued.
        claim_reply = rb"\*5\r\n:\d+\r\n\$\d+\r\n[^\r]+\r\n\$%d\r\n%s\r\n:0\r\n" % (len(job_id),
                                                                              re.escape(job_id.encode()))
        proxy.arm(re.compile(claim_reply), "freeze", on="reply")
        fleet.pause("c2")
        try:
            job = await client.enqueue(job_request("claimed, then gone", max_tokens=16, idempotency_key=job_id))
            try:
                async with asyncio.timeout(30):
                    await proxy.fired.wait()
            except TimeoutError:
                raise AssertionError("c1 never received a reply naming the job: did it claim it?") from None
            assert await client.status(job_id) == JobStatus.RUNNING      # claimed in Redis, by c1
            killed_at = time.monotonic()
            await asyncio.to_thread(fleet.kill, "c1")
        finally:
            fleet.resume("c2")
        try:
            result = await job.result(timeout=LOCK_TTL_S + 7)
        except TimeoutError:
            raise AssertionError(f"the job is still claimed {time.monotonic() - killed_at:.0f} s after the kill: "
                                 f"status {await client.status(job_id)}") from None
        assert result.status == JobStatus.SUCCEEDED and result.worker == "c2", result
        await check_job(client, result, max_tokens=16)
    finally:
        await asyncio.to_thread(fleet.stop_all)       # the proxy runs on this loop: keep it serving
        await proxy.close()


# ---------------------------------------------------------------------- chaos
CHAOS_JOBS = 200
CHAOS_WORKERS = 3
CHAOS_SEED = 20241129
CHAOS_MIN_TOKENS, CHAOS_MAX_TOKENS = 64, 768
CHAOS_OUTSTANDING = 16
CHAOS_MAX_KILLS = 40
CHAOS_CTX = 1024
CHAOS_REDIS_RESTARTS = 2
CHAOS_PROMPTS = [f"chaos prompt {i}: {w}" for i, w in enumerate(
    ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"])]


def _diagnose(result, request, entries, expected, kills) -> None:
    """Write what a broken job's stream looks like to /tmp/slotq_chaos_failures.txt."""
    with open("/tmp/slotq_chaos_failures.txt", "a") as f:
        f.write(f"\n=== {result.id} worker={result.worker} attempts={result.attempts} max_tokens={request.max_tokens} "
                f"usage={result.usage} result_text_len={len(result.text)} expected_tokens={len(expected)}\n")
        f.write(f"kills={[round(k, 3) for k in kills]}\n")
        pos = 0
        for e in entries:
            ok = e.token_ids == expected[pos:pos + len(e.token_ids)]
            f.write(f"  {e.id} t={entry_time(e):.3f} {e.kind} a={e.attempt} ids={len(e.token_ids)} n={e.n_tokens} "
                    f"text={len(e.text)} at={pos} matches_ref={ok} final={e.final}\n")
            pos += len(e.token_ids)


async def _dump_stuck(client, handles, fleet, kills, redis_restarts) -> None:
    """Where the jobs that never finished are stuck, to /tmp/slotq_chaos_failures.txt."""
    r = client.redis
    with open("/tmp/slotq_chaos_failures.txt", "a") as f:
        f.write(f"\n=== chaos timed out; kills={[round(k, 3) for k in kills]} redis_outages={redis_restarts} "
                f"alive={fleet.alive()}\n")
        keys = client.queue.keys
        for h in handles:
            if await r.exists(result_key(h.id)):
                continue
            entries = await raw_entries(client, h.id)
            lane, _ = await client.queue.place(h.id)
            deadline = await r.zscore(keys.running(lane), h.id) if lane else None
            f.write(f"  {h.id} status={await client.status(h.id)} lane={lane} "
                    f"owner={await r.hget(keys.owners, h.id)!r} "
                    f"lease_deadline_in_s={(deadline / 1000 - time.time()) if deadline else None} "
                    f"retry={await r.get(retry_counter_key(h.id))!r} job={await r.exists(job_record_key(h.id))} "
                    f"entries={[(e.kind.value, e.attempt, len(e.token_ids), e.final) for e in entries]}\n")
        f.write(fleet.logs() + "\n")


async def test_chaos_kill9_workers_nothing_lost(fclient, fsync_redis, tiny_model_path, tmp_path):
    """200 jobs, 3 workers SIGKILLed at random moments (seeded) and replaced, and now and then Redis
    SIGKILLed and restarted, until every job is done: each one succeeded, exactly once, with exactly
    the tokens of an uninterrupted greedy run in its stream."""
    client = fclient
    rng = random.Random(CHAOS_SEED)
    references = await solo_greedy_tokens(tiny_model_path, CHAOS_PROMPTS, max_tokens=CHAOS_MAX_TOKENS,
                                          ctx=CHAOS_CTX)
    # job_timeout 20 s: a job that hangs for any reason fails in 20 s, not an hour; max_tries and
    # max_worker_deaths 20: a job may be hit by several kills in a row before its first token -- the
    # retry budget is not under test, nor the quarantine of jobs that kill their workers
    fleet = Fleet(client, worker_env(fsync_redis.url, tiny_model_path, slots=4, ctx=CHAOS_CTX, ubatch=1,
                                     job_timeout_s=20, max_tries=20, max_worker_deaths=20), tmp_path)
    names = [fleet.spawn().name for _ in range(CHAOS_WORKERS)]
    pending: set[str] = set()
    stuck_claims: set[str] = set()
    kills: list[float] = []                  # time.time() of each worker SIGKILL
    redis_restarts: list[float] = []         # outage lengths
    try:
        await fleet.wait_ready(*names)
        started = time.monotonic()
        requests = [job_request(rng.choice(CHAOS_PROMPTS), max_tokens=rng.randint(CHAOS_MIN_TOKENS, CHAOS_MAX_TOKENS))
                    for _ in range(CHAOS_JOBS)]
        handles = []

        async def produce() -> list[JobResult]:
            """Closed loop: CHAOS_OUTSTANDING unfinished jobs at all times (more than the fleet's
            12 slots), so every worker is busy whenever it is killed."""
            room = asyncio.Semaphore(CHAOS_OUTSTANDING)

            async def one(handle) -> JobResult:
                try:
                    return await handle.result()
                finally:
                    pending.discard(handle.id)
                    room.release()

            waiters = []
            for request in requests:
                await room.acquire()
                handles.append(await client.enqueue(request))
                pending.add(handles[-1].id)
                waiters.append(asyncio.create_task(one(handles[-1])))
            return await asyncio.gather(*waiters)

        async def watch_claims(stop: asyncio.Event) -> None:
            """Count jobs whose lease expired over 3 s ago and that no reaper requeued (every
            worker reaps once per poll_delay_s, 1 s)."""
            running = client.queue.keys.running("interactive")
            while not stop.is_set():
                await asyncio.sleep(0.5)
                try:
                    late = await client.redis.zrangebyscore(running, "-inf", time.time() * 1000 - 3000)
                except Exception:
                    continue                                 # Redis is down for a moment
                stuck_claims.update(job_id.decode() for job_id in late)

        async def chaos(stop: asyncio.Event) -> None:
            while not stop.is_set() and len(kills) < CHAOS_MAX_KILLS:
                await asyncio.sleep(rng.uniform(0.2, 0.9))
                if stop.is_set():
                    return
                if len(redis_restarts) < CHAOS_REDIS_RESTARTS and rng.random() < 0.15:
                    await fleet.kill_redis_quietly(fsync_redis)
                    t = time.monotonic()
                    await asyncio.sleep(rng.uniform(0.3, 1.5))
                    await asyncio.to_thread(fsync_redis.restart)
                    redis_restarts.append(time.monotonic() - t)
                    continue
                try:
                    ready = {w.id for w in (await client.queue_info()).workers if w.ready}
                except Exception:
                    continue                                 # Redis is down for a moment
                serving = sorted(ready & set(fleet.alive()))  # kill workers that serve, not ones still starting
                if serving:
                    kills.append(fleet.kill(rng.choice(serving)))
                    fleet.spawn()                           # a replacement, starting up while jobs wait

        stop = asyncio.Event()
        chaos_task = asyncio.create_task(chaos(stop))
        watch_task = asyncio.create_task(watch_claims(stop))
        try:
            async with asyncio.timeout(150):
                results = await produce()
        except TimeoutError:
            await _dump_stuck(client, handles, fleet, kills, redis_restarts)
            raise
        finally:
            stop.set()
            await chaos_task
            await watch_task
        wall = time.monotonic() - started

        # ---- every job exactly once, nothing lost, nothing duplicated
        assert len({h.id for h in handles}) == CHAOS_JOBS
        assert [r.id for r in results] == [h.id for h in handles]
        lost = [r for r in results if r.status != JobStatus.SUCCEEDED]
        duplicated, missing, diverged = [], [], []
        diverged_at: list[str] = []
        recoveries: list[float] = []
        takeovers = 0
        for request, result in zip(requests, results):
            entries = await raw_entries(client, result.id)
            s = stream_summary(entries)
            if result.status != JobStatus.SUCCEEDED:
                continue
            expected = references[request.prompt][:request.max_tokens]
            if (s.finals != 1 or not entries[-1].final or s.text != result.text
                    or len(s.token_ids) != request.max_tokens
                    or [e.attempt for e in entries] != sorted(e.attempt for e in entries)
                    or result.usage.completion_tokens != request.max_tokens):
                _diagnose(result, request, entries, expected, kills)
            assert s.finals == 1 and entries[-1].final, (result.id, [e.kind for e in entries[-3:]])
            assert [e.attempt for e in entries] == sorted(e.attempt for e in entries), result.id
            assert s.text == result.text, (result.id, s.text, result.text)
            assert result.usage.completion_tokens == request.max_tokens, result
            if len(s.token_ids) > request.max_tokens:
                duplicated.append(result.id)
            elif len(s.token_ids) < request.max_tokens:
                missing.append(result.id)
            elif s.token_ids != expected:
                # Not asserted: with several sequences in one KV cache (and prefix reuse across jobs
                # of the same prompt) llama.cpp's reductions round differently from a solo run, and
                # a near-tied argmax of the random model can flip. Seen in most runs, always at token
                # 557 of one prompt and in first attempts as much as in resumed ones: numerics, not
                # resume. Reported for information ("position/max_tokens@try").
                diverged.append(result.id)
                first = next(i for i, (a, b) in enumerate(zip(s.token_ids, expected)) if a != b)
                diverged_at.append(f"{first}/{len(expected)}@try{result.attempts}")
            # recovery: from the kill that ended an attempt to the next attempt's first entry. The
            # kill is taken as the first one after the attempt's last entry (an upper bound: the
            # real one can only be later); attempts that streamed nothing are not measured.
            if result.id in stuck_claims:
                continue                         # stuck behind a claim lock: not a recovery
            times: dict[int, list[float]] = {}
            for e in entries:
                times.setdefault(e.attempt, []).append(entry_time(e))
            attempts = sorted(times)
            for prev, nxt in zip(attempts, attempts[1:]):
                kill = next((t for t in sorted(kills) if max(times[prev]) - 0.002 <= t <= min(times[nxt])), None)
                if kill is None:
                    takeovers += 1               # a lease that lapsed during a Redis outage
                else:
                    recoveries.append(min(times[nxt]) - kill)
        info = await client.queue_info()
        report(f"RELIABILITY jobs={CHAOS_JOBS} workers_killed={len(kills)} redis_restarts={len(redis_restarts)} "
               f"lost={len(lost)} duplicated_chunks={len(duplicated)} missing_tokens={len(missing)} "
               f"diverged_from_solo_greedy={len(diverged)}{diverged_at or ''} "
               f"retried={sum(r.attempts > 1 for r in results)} "
               f"max_attempts={max(r.attempts for r in results)} recoveries_measured={len(recoveries)} "
               f"recovery_p50_s={percentile(recoveries, 0.5):.2f} recovery_max_s={max(recoveries, default=0):.2f} "
               f"lease_takeovers={takeovers} stuck_claims={len(stuck_claims)} wall_s={wall:.1f}")
        assert not lost, lost[:3]
        assert not duplicated and not missing, (duplicated[:3], missing[:3])
        # the queue is empty, no job is left running or dead-lettered
        assert info.queued == info.running == info.deferred == 0, info
        assert info.dead_letters == 0
        assert len(kills) >= 5, "the chaos loop should have killed several workers"
        assert sum(r.attempts > 1 for r in results) >= 5, "the kills should have interrupted running jobs"
        # Recovery times are reported, not bounded: with 16 jobs outstanding on 12 slots a requeued job
        # also waits for a free slot, so they measure the machine's load as much as the reaper (a CI
        # run beside other work saw 54 s on today's and on the previous code alike). That every killed
        # job came back is asserted above: all succeeded within the run's time limit.
        assert recoveries, "no attempt was resumed after a kill"
        assert len(Counter(r.worker for r in results)) >= 3
    finally:
        fleet.stop_all()
