"""What producers run: a job enters its lane (ENQUEUE: the queue's and its tenant's limits, its
fair-share place, the tokens that wake workers), leaves it before it ran or has its run aborted
(CANCEL), and its leftovers are removed once it finished (FORGET)."""

from __future__ import annotations

from dataclasses import dataclass

from slotq.jobs.protocol.scripts.layout import Arg, Key, KeyList, LuaScript
from slotq.jobs.protocol.scripts.lua import COUNT, ENTRY, NOW


@dataclass(frozen=True, kw_only=True)
class Enqueue(LuaScript[int]):
    """ENQUEUE: write the job record and put the job in its lane at its tenant's fair place.

    The job's ready time is the server's now; so is the tokens window it counts in (now // window).
    Returns 1 enqueued, 0 the id exists (a queued/running job or a kept result), -1 queue full, or a
    tenant's quota refused it: -2 waiting, -3 in flight, -4 tokens this minute.

    Quotas are checked in the same step that counts the job, so two enqueues can never both take a
    tenant's last place. Tokens are a fixed window per tenant (``minute<TAB>tokens``): a job is
    admitted while the minute's tokens plus its own stay within the quota, or into an empty minute
    (a job larger than the whole quota runs alone in its minute rather than never).

    The job's place is its fair-share tag. A tenant with jobs waiting in the lane (its newest place
    is at or behind the lane's next job) goes behind its newest: newest + 1. A tenant with nothing
    waiting there (no newest place, or one the lane's head has passed) goes half a place ahead of the
    next job's whole place, ceil(head) - 0.5: ahead of every backlog's next job, level with another
    tenant that just did the same. In an empty lane the place is the ready time + 1, every tenant's
    newest place being history then -- but never below the lane's newest place given so far + 1: a
    burst of enqueues hands out places faster than the clock runs, and a job enqueued into the lane
    just emptied by claims must still go behind those jobs, or one of them handed back (preempted,
    its worker stopped) would wait behind a job enqueued after it. Equal places are claimed in job id
    order.

    It wakes one idle worker, and when a lower lane has running jobs it also leaves a preemption
    token for one busy worker (the worker decides; see :class:`~.claims.Preempt`). When the job's
    tenant had nothing waiting or running and its lane has running jobs (other tenants' then), it
    leaves a fair-share token for one full worker, which may run the job in its reserve (see
    :class:`~.claims.LendReserve`)."""

    record_key: Key               # the job record (arq's format)
    result_key: Key               # a kept result: the id is taken
    jobs: Key
    wake: Key
    tags: Key                     # the job's lane's tenants' newest places
    tenant_waiting: Key
    tenant_running: Key
    tenant_tokens: Key
    waiting: Key                  # the job's lane: waiting, running, preemption and fair-share tokens
    running: Key
    preempt: Key
    fair: Key
    queued: KeyList[str]          # waiting and deferred of every lane (the queue's max_waiting counts them)
    below: KeyList[str]           # running of every lane below the job's
    job_id: Arg[str]
    record: Arg[bytes]
    record_ttl_ms: Arg[int]
    lane: Arg[str]
    max_waiting: Arg[int | None]  # jobs queued at most (None: no limit)
    wake_cap: Arg[int]
    tenant: Arg[str]
    tenant_max_waiting: Arg[int | None]      # the tenant's quotas (None: none)
    tenant_max_in_flight: Arg[int | None]    # waiting or running
    tenant_tokens_per_min: Arg[int | None]
    tokens: Arg[int]              # what the job reserves of its tenant's tokens per minute
    tokens_window_ms: Arg[int]    # the tokens quota's window (a minute)

    HELPERS = NOW + COUNT
    BODY = """
if redis.call('EXISTS', record_key) == 1 or redis.call('EXISTS', result_key) == 1
   or redis.call('HEXISTS', jobs, job_id) == 1 then
  return 0
end
local now = server_ms()
local queued_jobs, in_lane = 0, 0
for _, key in ipairs(queued) do
  local n = redis.call('ZCARD', key)
  queued_jobs = queued_jobs + n
  if key == waiting then in_lane = n end
end
if max_waiting and queued_jobs >= max_waiting then return -1 end
local tenant_waits = tonumber(redis.call('HGET', tenant_waiting, tenant) or '0')
local tenant_runs = tonumber(redis.call('HGET', tenant_running, tenant) or '0')
if tenant_max_waiting and tenant_waits >= tenant_max_waiting then return -2 end
if tenant_max_in_flight and tenant_waits + tenant_runs >= tenant_max_in_flight then return -3 end
if tenant_tokens_per_min then
  local this_minute = string.format('%d', math.floor(now / tokens_window_ms))
  local minute, used = string.match(redis.call('HGET', tenant_tokens, tenant) or '', '^([^\t]*)\t(.*)$')
  used = minute == this_minute and tonumber(used) or 0
  if used > 0 and used + tokens > tenant_tokens_per_min then return -4 end
  redis.call('HSET', tenant_tokens, tenant, this_minute .. '\t' .. (used + tokens))
end
local place
if in_lane == 0 then
  local newest = redis.call('ZRANGE', tags, -1, -1, 'WITHSCORES')[2]
  place = math.max(now + 1, math.floor(tonumber(newest or '0')) + 1)
  redis.call('DEL', tags)
else
  local head = tonumber(redis.call('ZRANGE', waiting, 0, 0, 'WITHSCORES')[2])
  local newest = redis.call('ZSCORE', tags, tenant)
  if newest and tonumber(newest) >= head then place = tonumber(newest) + 1 else place = math.ceil(head) - 0.5 end
end
redis.call('ZADD', tags, place, tenant)
redis.call('SET', record_key, record, 'PX', record_ttl_ms)
place = string.format('%.1f', place)      -- whole or half: exact, where Lua's own text keeps 14 digits
redis.call('HSET', jobs, job_id, lane .. '\t' .. string.format('%d', now) .. '\t' .. place .. '\t' .. tenant)
redis.call('ZADD', waiting, place, job_id)
count(tenant_waiting, tenant, 1)
if redis.call('LLEN', wake) < wake_cap then redis.call('RPUSH', wake, '1') end
if tenant_waits + tenant_runs == 0 and redis.call('ZCARD', running) > 0
   and redis.call('LLEN', fair) < wake_cap then
  redis.call('RPUSH', fair, '1')
end
for _, key in ipairs(below) do
  if redis.call('ZCARD', key) > 0 then
    if redis.call('LLEN', preempt) < wake_cap then redis.call('RPUSH', preempt, '1') end
    break
  end
end
return 1
"""


@dataclass(frozen=True, kw_only=True)
class NoteAbort(LuaScript[int]):
    """NOTE_ABORT: note an abort request in arq's ``arq:abort`` set at the server's now, before
    CANCEL tells the job's worker (the set is a key of its own slot on a cluster, so CANCEL cannot
    write it). A worker told of an abort reads the set; ``run_job`` reads it before a job starts.
    Returns 1."""

    aborts: Key
    arq_id: Arg[str]

    HELPERS = NOW
    BODY = """
redis.call('ZADD', aborts, server_ms(), arq_id)
return 1
"""


@dataclass(frozen=True, kw_only=True)
class DropAbort(LuaScript[int]):
    """DROP_ABORT: remove a job's abort note from ``arq:abort`` (its job ended, or was not running
    when CANCEL came). A script, not a ZREM, so that it can share a round trip with another script
    (:meth:`~slotq.jobs.protocol.scripts.layout.ScriptRunner.run_all`). Returns how many it removed."""

    aborts: Key
    arq_id: Arg[str]

    BODY = """
return redis.call('ZREM', aborts, arq_id)
"""


@dataclass(frozen=True, kw_only=True)
class Cancel(LuaScript[int]):
    """CANCEL: remove a job that has not started, or request the abort of a running one (published
    to its worker, after NOTE_ABORT noted it; the caller removes that note unless the job runs).

    Returns 1 removed before it started (or while waiting out a retry), -1 running (abort
    requested; FINISH ends it), 0 not in the queue."""

    jobs: Key
    owners: Key
    record_key: Key
    progress: Key
    tenant_waiting: Key
    queued: KeyList[str]            # waiting and deferred of every lane
    job_id: Arg[str]
    abort_channel_prefix: Arg[str]  # the channel of the worker that runs it is this + its token

    HELPERS = ENTRY + COUNT
    BODY = """
local entry = redis.call('HGET', jobs, job_id)
if not entry then return 0 end
for _, key in ipairs(queued) do
  if redis.call('ZREM', key, job_id) == 1 then
    local _, _, _, tenant = read_entry(entry)
    count(tenant_waiting, tenant, -1)
    redis.call('HDEL', jobs, job_id)
    redis.call('HDEL', progress, job_id)
    redis.call('DEL', record_key)
    return 1
  end
end
local lease = redis.call('HGET', owners, job_id)
local owner = lease and string.match(lease, '^(.*)#')
if owner then redis.call('PUBLISH', abort_channel_prefix .. owner, job_id) end
return -1
"""


@dataclass(frozen=True, kw_only=True)
class Forget(LuaScript[int]):
    """FORGET: remove a finished job's result and attempt counter now instead of when they expire
    (its stream and fence, in the job's own slot, the caller deletes next). Returns 1, or 0
    (removing nothing) while the job is still queued or running."""

    jobs: Key
    result_key: Key
    retry_counter: Key
    job_id: Arg[str]

    BODY = """
if redis.call('HEXISTS', jobs, job_id) == 1 then return 0 end
redis.call('DEL', result_key, retry_counter)
return 1
"""
