"""The queue's Lua scripts. Each runs atomically in Redis, so no claim, hand-back, retry or reap
can interleave with another: that is what makes "exactly one worker owns a running job" hold.

An attempt *owns* a job while ``Q:owners[id]`` holds its lease: ``<worker token>#<claim number>``,
set by the claim script and different for every claim, even when the same worker claims the job
again after its lease expired (a Redis outage longer than the lease). Only finishing, retrying,
handing back or reaping the job clears it, each in the same script that moves the job. Every write
made for an attempt (stream batches included) first checks that its lease still owns the job, so
an attempt that stalled past its lease and was reaped can never write again, not even from a
buffer its worker re-sends after claiming the job anew.

Costs: enqueue O(lanes), claim O(lanes + k log N) for k jobs, renew O(jobs renewed), reap
O(lanes + expired), everything else O(1) or O(lanes). Nothing scans running jobs.
"""

from __future__ import annotations

# KEYS: record, result, jobs, waiting (the lane's), wake, then waiting + deferred of every lane
# ARGV: job id, record, record ttl ms, ready ms, lane, max waiting, wake cap
# Returns 1 enqueued, 0 the id exists (a queued/running job or a kept result), -1 queue full.
ENQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1
   or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return 0
end
local waiting = 0
for i = 6, #KEYS do waiting = waiting + redis.call('ZCARD', KEYS[i]) end
if waiting >= tonumber(ARGV[6]) then return -1 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[5] .. '\\t' .. ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
if redis.call('LLEN', KEYS[5]) < tonumber(ARGV[7]) then redis.call('RPUSH', KEYS[5], '1') end
return 1
"""

# Moves due retries (deferred -> waiting) of one lane; used by CLAIM and REAP.
_PROMOTE = """
local function promote(deferred, waiting, now, limit)
  local due = redis.call('ZRANGEBYSCORE', deferred, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
  for j = 1, #due, 2 do
    redis.call('ZREM', deferred, due[j])
    redis.call('ZADD', waiting, due[j + 1], due[j])
  end
end
"""

# Keeps one wake token per waiting job (capped), so a wake-up is never wasted on an empty queue
# for long and a lost one is restored at the next claim.
_SYNC_WAKE = """
local function sync_wake(wake, waiting, cap)
  local target = math.min(waiting, cap)
  local tokens = redis.call('LLEN', wake)
  if tokens > target then
    if target == 0 then redis.call('DEL', wake) else redis.call('LTRIM', wake, 0, target - 1) end
  else
    for _ = tokens + 1, target do redis.call('RPUSH', wake, '1') end
  end
end
"""

# KEYS: jobs, owners, wake, then waiting/deferred/running of every lane (highest priority first)
# ARGV: now ms, max jobs, lease ms, lease (``<worker token>#<claim number>``), wake cap, promote limit
# Returns a flat list: id, lane index (0-based), ready ms, ... for each claimed job.
CLAIM = _PROMOTE + _SYNC_WAKE + """
local now = tonumber(ARGV[1])
local want = tonumber(ARGV[2])
local deadline = now + tonumber(ARGV[3])
local out = {}
local claimed = 0
local waiting_left = 0
for i = 4, #KEYS, 3 do
  local waiting, running = KEYS[i], KEYS[i + 2]
  promote(KEYS[i + 1], waiting, now, tonumber(ARGV[6]))
  if claimed < want then
    local popped = redis.call('ZPOPMIN', waiting, want - claimed)
    for j = 1, #popped, 2 do
      redis.call('ZADD', running, deadline, popped[j])
      redis.call('HSET', KEYS[2], popped[j], ARGV[4])
      out[#out + 1] = popped[j]
      out[#out + 1] = (i - 4) / 3
      out[#out + 1] = popped[j + 1]
      claimed = claimed + 1
    end
  end
  waiting_left = waiting_left + redis.call('ZCARD', waiting)
end
sync_wake(KEYS[3], waiting_left, tonumber(ARGV[5]))
return out
"""

# KEYS: owners, then the running set of each job (same order as the jobs)
# ARGV: new deadline ms, then job id, lease for each job
# Returns one 1/0 per job: 0 = the lease no longer owns the job (reaped, claimed again).
RENEW = """
local out = {}
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[i / 2 + 1], 'XX', ARGV[1], ARGV[i])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# KEYS: owners, jobs, running, record, retry counter, result, aborts, progress
# ARGV: lease, job id, result record ('' = none), result ttl ms
# Returns 1 finished, 0 the lease no longer owns the job (nothing done).
FINISH = """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[8], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[7], ARGV[2])
redis.call('DEL', KEYS[4], KEYS[5])
if ARGV[3] ~= '' then redis.call('SET', KEYS[6], ARGV[3], 'PX', ARGV[4]) end
return 1
"""

# KEYS: jobs, result, then the job's other keys to remove (its stream, ...); ARGV: job id
# Removes a finished job's result and output now instead of when they expire. Returns 0 (and
# removes nothing) while the job is still queued or running.
FORGET = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('DEL', unpack(KEYS, 2))
return 1
"""

# Reads and writes one job's ``progress`` entry (see keys.py): accounted, started, tokens, interruptions.
_PROGRESS = """
local function read_progress(progress, id)
  local entry = redis.call('HGET', progress, id)
  if not entry then return 0, 0, 0, 0 end
  local accounted, started, tokens, interruptions = string.match(entry, '^(%d+)\t(%d+)\t(%d+)\t(%d+)$')
  return tonumber(accounted), tonumber(started), tonumber(tokens), tonumber(interruptions)
end
local function write_progress(progress, id, accounted, started, tokens, interruptions)
  redis.call('HSET', progress, id, accounted .. '\t' .. started .. '\t' .. tokens .. '\t' .. interruptions)
end
"""

# KEYS: owners, progress, attempt outcomes; ARGV: lease, job id, attempt, tokens in the stream now
# An attempt starts: judge the attempts before it that nobody judged (they were lost: the worker
# was killed, or stalled past its lease), then note where this one starts. The attempt that
# started last was *interrupted* if the stream now holds more tokens than when it started (it
# spent no try), else it *failed*, as did any attempt lost before it could start.
# Returns {1, interruptions so far, newly interrupted (0/1), newly failed}, or {0, 0, 0, 0} when
# the lease no longer owns the job (nothing written).
START_ATTEMPT = _PROGRESS + """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return {0, 0, 0, 0} end
local attempt, tokens = tonumber(ARGV[3]), tonumber(ARGV[4])
local accounted, started, before, interruptions = read_progress(KEYS[2], ARGV[2])
local interrupted, failed = 0, 0
if started == attempt then
  accounted = attempt - 1          -- the same try again after a hand-back: nothing was lost
else
  if started > accounted and started < attempt then
    if tokens > before then interrupted = 1 else failed = 1 end
    accounted = started
  end
  failed = failed + math.max(0, attempt - 1 - accounted)
  accounted = attempt - 1
end
interruptions = interruptions + interrupted
if interrupted > 0 then redis.call('HINCRBY', KEYS[3], 'interrupted', interrupted) end
if failed > 0 then redis.call('HINCRBY', KEYS[3], 'failed', failed) end
write_progress(KEYS[2], ARGV[2], accounted, attempt, tokens, interruptions)
return {1, interruptions, interrupted, failed}
"""

# KEYS: owners, running, deferred, progress, attempt outcomes; ARGV: lease, job id, run-at ms
# The attempt failed with a retryable error: it is judged here (a failure), not when the next starts.
# Returns 1 deferred, 0 the lease no longer owns the job (nothing done).
RETRY_LATER = _PROGRESS + """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return 0 end
local _, started, tokens, interruptions = read_progress(KEYS[4], ARGV[2])
write_progress(KEYS[4], ARGV[2], started, started, tokens, interruptions)
redis.call('HINCRBY', KEYS[5], 'failed', 1)
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
return 1
"""

# KEYS: owners, jobs, running, waiting, retry counter, wake; ARGV: lease, job id, wake cap
# The attempt is given back in the same step that makes the job claimable again, so the next
# claim can never count it (the hand-back race of arq #267 style DECRs done afterwards).
HAND_BACK = """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return 0 end
local entry = redis.call('HGET', KEYS[2], ARGV[2])
local ready = entry and string.match(entry, '\\t(.+)$') or '0'
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[4], ready, ARGV[2])
if tonumber(redis.call('GET', KEYS[5]) or '0') > 0 then redis.call('DECR', KEYS[5]) end
if redis.call('LLEN', KEYS[6]) < tonumber(ARGV[3]) then redis.call('RPUSH', KEYS[6], '1') end
return 1
"""

# KEYS: owners, jobs, wake, then waiting/deferred/running of every lane
# ARGV: now ms, limit per lane, wake cap
# Requeues jobs whose lease deadline passed (their worker died or stalled) at their old place in
# line, and promotes due retries. Returns the number of jobs requeued.
REAP = _PROMOTE + """
local now = tonumber(ARGV[1])
local reaped = 0
for i = 4, #KEYS, 3 do
  local waiting, running = KEYS[i], KEYS[i + 2]
  promote(KEYS[i + 1], waiting, now, tonumber(ARGV[2]))
  local expired = redis.call('ZRANGEBYSCORE', running, '-inf', now, 'LIMIT', 0, ARGV[2])
  for _, id in ipairs(expired) do
    local entry = redis.call('HGET', KEYS[2], id)
    redis.call('ZREM', running, id)
    redis.call('HDEL', KEYS[1], id)
    if entry then
      redis.call('ZADD', waiting, string.match(entry, '\\t(.+)$') or now, id)
      reaped = reaped + 1
    end
  end
end
local room = tonumber(ARGV[3]) - redis.call('LLEN', KEYS[3])
for _ = 1, math.min(reaped, room) do redis.call('RPUSH', KEYS[3], '1') end
return reaped
"""

# KEYS: jobs, owners, record, aborts, progress, then waiting + deferred of every lane
# ARGV: job id, now ms, abort channel prefix
# Returns 1 removed before it started (or while waiting out a retry), -1 running (abort
# requested), 0 not in the queue.
CANCEL = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 6, #KEYS do
  if redis.call('ZREM', KEYS[i], ARGV[1]) == 1 then
    redis.call('HDEL', KEYS[1], ARGV[1])
    redis.call('HDEL', KEYS[5], ARGV[1])
    redis.call('DEL', KEYS[3])
    return 1
  end
end
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
local lease = redis.call('HGET', KEYS[2], ARGV[1])
local owner = lease and string.match(lease, '^(.*)#')
if owner then redis.call('PUBLISH', ARGV[3] .. owner, ARGV[1]) end
return -1
"""

# One flush of a worker's stream writer: every job's pending entries in one call.
# KEYS: owners, the writer's flush mark, then one stream per job (in ARGV's order)
# ARGV: '1' fenced / '' not, flush id, maxlen, live ttl s, final ttl s, then per job: job id,
# lease, ttl (0 keep, 1 live, 2 final), entry count, then per entry: n, field, value, ... (n = 2 x fields).
# Returns one '1'/'0' per job ('0': the lease no longer owns the job, nothing written). A flush id
# already applied (re-sent because its reply was lost) gets its first answer again, unwritten.
# The fences of all jobs are read with one HMGET: a flush costs 4 commands plus one XADD per entry.
STREAM_FLUSH = """
local mark = redis.call('GET', KEYS[2])
local prefix = ARGV[2] .. '|'
if mark and string.sub(mark, 1, #prefix) == prefix then return string.sub(mark, #prefix + 1) end
local starts, ids = {}, {}
local i = 6
while i <= #ARGV do
  starts[#starts + 1] = i
  ids[#ids + 1] = ARGV[i]
  local count = tonumber(ARGV[i + 3])
  i = i + 4
  for _ = 1, count do i = i + tonumber(ARGV[i]) + 1 end
end
local owners = {}
if ARGV[1] ~= '' and #ids > 0 then owners = redis.call('HMGET', KEYS[1], unpack(ids)) end
local out = {}
for job = 1, #starts do
  local stream = KEYS[2 + job]
  local j = starts[job]
  local ttl, count = tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3])
  local ok = ARGV[1] == '' or owners[job] == ARGV[j + 1]
  j = j + 4
  if ok then
    for _ = 1, count do
      local n = tonumber(ARGV[j])
      local cmd = {'XADD', stream, 'MAXLEN', '~', ARGV[3], '*'}
      for f = 1, n do cmd[#cmd + 1] = ARGV[j + f] end
      redis.call(unpack(cmd))
      j = j + n + 1
    end
    if ttl == 1 then redis.call('EXPIRE', stream, ARGV[4]) end
    if ttl == 2 then redis.call('EXPIRE', stream, ARGV[5]) end
  end
  out[job] = ok and '1' or '0'
end
local answer = table.concat(out)
redis.call('SET', KEYS[2], prefix .. answer, 'EX', ARGV[5])
return answer
"""
