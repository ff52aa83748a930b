"""A claimed job's attempt, from its start to its end, each write fenced by the attempt's lease:
starting it (START_ATTEMPT judges the attempts before it), keeping its lease (RENEW), ending it
(FINISH, RETRY_LATER, HAND_BACK), and requeuing it when its lease expired (REAP)."""

from __future__ import annotations

from dataclasses import dataclass

from slotq.jobs.protocol.keys import LaneKeys
from slotq.jobs.protocol.scripts.layout import Arg, ArgList, Key, KeyList, LuaScript
from slotq.jobs.protocol.scripts.lua import COUNT, ENTRY, NOW, PROGRESS, PROMOTE


@dataclass(frozen=True, kw_only=True)
class StartAttempt(LuaScript[list[int]]):
    """START_ATTEMPT: an attempt starts. Judge the attempts before it that nobody judged (they were
    lost: the worker was killed, or stalled past its lease), then note where this one starts.

    The attempt that started last was *interrupted* if the stream now holds more tokens than when
    it started (it spent no try), else it *failed*, as did any attempt lost before it could start.
    A started attempt lost without progress is also a *worker death*: ``deaths`` counts them in a row
    (an interruption or a retryable error ends the run; an attempt lost before it started neither
    adds nor ends one, as it cannot have killed its worker). With deaths at the limit the job is
    *refused*: nothing is started, and the caller dead-letters it (``killed_its_worker``). So the
    worker that claims a job after two deaths (the default limit) never runs it. With deaths below
    the limit the job is a *suspect*: it starts only isolated, so that a worker it kills takes no
    other job's attempt without progress down with it (which would count as that job's death too);
    otherwise nothing is started and the caller isolates the attempt and asks again.

    Why here and not in REAP, which could keep such a job from ever being claimed: only the next
    attempt knows whether the lost one made progress (it has just read the job's stream), and only a
    worker can write the dead letter, the stream's final error entry and arq's result record. The lease
    fences it: of two workers that both claimed the job (the first stalled past its lease), only the
    owner is answered, and the count stays at the limit, so every later claim is refused as well.
    A lost attempt that was only stalled (its worker frozen, or cut off from Redis longer than the
    lease) cannot be told from a death here: one caught before its first token counts as one.

    Returns {verdict, interruptions so far, newly interrupted (0/1), newly failed, deaths in a row};
    verdict 1 started, 2 a suspect not started (start it isolated), 3 refused, 0 the lease no longer
    owns the job (nothing written)."""

    owners: Key
    progress: Key
    attempt_outcomes: Key
    lease: Arg[str]
    job_id: Arg[str]
    attempt: Arg[int]
    delivered_tokens: Arg[int]     # tokens in the job's stream now
    max_deaths: Arg[int | None]    # None: count deaths, do not act on them
    isolated: Arg[bool]            # no other attempt of its worker is without progress

    HELPERS = PROGRESS
    BODY = """
if redis.call('HGET', owners, job_id) ~= lease then return {0, 0, 0, 0, 0} end
local accounted, started, before, interruptions, deaths = read_progress(progress, job_id)
local interrupted, failed = 0, 0
if started == attempt then
  accounted = attempt - 1          -- the same try again after a hand-back: nothing was lost
else
  if started > accounted and started < attempt then
    if delivered_tokens > before then
      interrupted, deaths = 1, 0
    else
      failed, deaths = 1, deaths + 1
    end
    accounted = started
  end
  failed = failed + math.max(0, attempt - 1 - accounted)
  accounted = attempt - 1
end
interruptions = interruptions + interrupted
if interrupted > 0 then redis.call('HINCRBY', attempt_outcomes, 'interrupted', interrupted) end
if failed > 0 then redis.call('HINCRBY', attempt_outcomes, 'failed', failed) end
local verdict = 1
if max_deaths and deaths >= max_deaths then
  verdict = 3
elseif max_deaths and deaths > 0 and not isolated then
  verdict = 2
end
if verdict == 1 then
  write_progress(progress, job_id, accounted, attempt, delivered_tokens, interruptions, deaths)
else
  write_progress(progress, job_id, accounted, started, before, interruptions, deaths)
end
return {verdict, interruptions, interrupted, failed, deaths}
"""


@dataclass(frozen=True, kw_only=True)
class Renew(LuaScript[list[int]]):
    """RENEW: each lease still owning its job gets the deadline server now + ``lease_ms``.
    Returns one 1/0 per job: 0 = the lease no longer owns the job (reaped, claimed again)."""

    owners: Key
    running: KeyList[str]          # the running set of each job
    lease_ms: Arg[int]
    job_ids: ArgList[str]          # the same jobs, in the same order
    leases: ArgList[str]

    HELPERS = NOW
    BODY = """
local deadline = server_ms() + lease_ms
local out = {}
for i, id in ipairs(job_ids) do
  if redis.call('HGET', owners, id) == leases[i] then
    redis.call('ZADD', running[i], 'XX', deadline, id)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""


@dataclass(frozen=True, kw_only=True)
class Finish(LuaScript[int]):
    """FINISH: store the result and remove the job from the queue (an abort still noted for it in
    ``arq:abort``, a key of its own slot on a cluster, the caller removes next).
    Returns 1 finished, 0 the lease no longer owns the job (nothing done)."""

    owners: Key
    jobs: Key
    running: Key
    record_key: Key
    retry_counter: Key
    result_key: Key
    progress: Key
    tenant_running: Key
    lease: Arg[str]
    job_id: Arg[str]
    result: Arg[bytes]             # the result record (b'' = none: results are not kept)
    result_ttl_ms: Arg[int]

    HELPERS = ENTRY + COUNT
    BODY = """
if redis.call('HGET', owners, job_id) ~= lease then return 0 end
local _, _, _, tenant = read_entry(redis.call('HGET', jobs, job_id) or '')
count(tenant_running, tenant, -1)
redis.call('HDEL', owners, job_id)
redis.call('HDEL', jobs, job_id)
redis.call('HDEL', progress, job_id)
redis.call('ZREM', running, job_id)
redis.call('DEL', record_key, retry_counter)
if result ~= '' then redis.call('SET', result_key, result, 'PX', result_ttl_ms) end
return 1
"""


@dataclass(frozen=True, kw_only=True)
class RetryLater(LuaScript[int]):
    """RETRY_LATER: the attempt failed with a retryable error; the job may run again at the
    server's now + ``backoff_ms``. The attempt is judged here (a failure), not when the next starts,
    and it ends a run of worker deaths (its worker lived). A deferred job counts as waiting for its
    tenant. Returns 1 deferred, 0 the lease no longer owns the job (nothing done)."""

    owners: Key
    running: Key
    deferred: Key
    progress: Key
    attempt_outcomes: Key
    jobs: Key
    tenant_waiting: Key
    tenant_running: Key
    lease: Arg[str]
    job_id: Arg[str]
    backoff_ms: Arg[int]

    HELPERS = NOW + PROGRESS + ENTRY + COUNT
    BODY = """
if redis.call('HGET', owners, job_id) ~= lease then return 0 end
local _, _, _, tenant = read_entry(redis.call('HGET', jobs, job_id) or '')
count(tenant_running, tenant, -1)
count(tenant_waiting, tenant, 1)
local _, started, delivered, interruptions = read_progress(progress, job_id)
write_progress(progress, job_id, started, started, delivered, interruptions, 0)
redis.call('HINCRBY', attempt_outcomes, 'failed', 1)
redis.call('HDEL', owners, job_id)
redis.call('ZREM', running, job_id)
redis.call('ZADD', deferred, server_ms() + backoff_ms, job_id)
return 1
"""


@dataclass(frozen=True, kw_only=True)
class HandBack(LuaScript[int]):
    """HAND_BACK: return the job to its place in line without using a try. The attempt is given
    back in the same step that makes the job claimable again, so the next claim can never count it
    (the hand-back race of arq #267 style DECRs done afterwards). Returns 1 handed back, 0 the
    lease no longer owns the job (nothing done)."""

    owners: Key
    jobs: Key
    running: Key
    waiting: Key
    retry_counter: Key
    wake: Key
    tenant_waiting: Key
    tenant_running: Key
    lease: Arg[str]
    job_id: Arg[str]
    wake_cap: Arg[int]

    HELPERS = ENTRY + COUNT
    BODY = """
if redis.call('HGET', owners, job_id) ~= lease then return 0 end
local _, _, place, tenant = read_entry(redis.call('HGET', jobs, job_id) or '')
count(tenant_running, tenant, -1)
count(tenant_waiting, tenant, 1)
redis.call('HDEL', owners, job_id)
redis.call('ZREM', running, job_id)
redis.call('ZADD', waiting, place or '0', job_id)
if tonumber(redis.call('GET', retry_counter) or '0') > 0 then redis.call('DECR', retry_counter) end
if redis.call('LLEN', wake) < wake_cap then redis.call('RPUSH', wake, '1') end
return 1
"""


@dataclass(frozen=True, kw_only=True)
class Reap(LuaScript[int]):
    """REAP: requeue jobs whose lease deadline passed by the server's clock (their worker died or
    stalled) at their old place in line, and promote due retries. Returns the number of jobs
    requeued."""

    owners: Key
    jobs: Key
    wake: Key
    tenant_waiting: Key
    tenant_running: Key
    lanes: KeyList[LaneKeys]   # every lane
    limit: Arg[int]            # jobs requeued, and retries promoted, per lane at most
    wake_cap: Arg[int]

    HELPERS = NOW + PROMOTE + COUNT
    BODY = """
local now = server_ms()
local reaped = 0
for _, lane in ipairs(lanes) do
  promote(jobs, lane.deferred, lane.waiting, now, limit)
  local expired = redis.call('ZRANGEBYSCORE', lane.running, '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(expired) do
    local entry = redis.call('HGET', jobs, id)
    redis.call('ZREM', lane.running, id)
    redis.call('HDEL', owners, id)
    if entry then
      local _, _, place, tenant = read_entry(entry)
      redis.call('ZADD', lane.waiting, place or now, id)
      count(tenant_running, tenant, -1)
      count(tenant_waiting, tenant, 1)
      reaped = reaped + 1
    end
  end
end
local room = wake_cap - redis.call('LLEN', wake)
for _ = 1, math.min(reaped, room) do redis.call('RPUSH', wake, '1') end
return reaped
"""
