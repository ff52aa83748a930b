"""The queue's Lua scripts. Each runs atomically in Redis, so no claim, hand-back, retry or reap
can interleave with another: that is what makes "exactly one worker owns a running job" hold.

An attempt *owns* a job while ``Q:owners[id]`` holds its lease: ``<worker token>#<claim number>``,
set by the claim script and different for every claim, even when the same worker claims the job
again after its lease expired (a Redis outage longer than the lease). Only finishing, retrying,
handing back or reaping the job clears it, each in the same script that moves the job. Every write
made for an attempt (stream batches included) first checks that its lease still owns the job, so
an attempt that stalled past its lease and was reaped can never write again, not even from a
buffer its worker re-sends after claiming the job anew.

Clocks: every time a script decides with is Redis' own (``TIME``, :data:`_NOW`), never a client's,
so a producer or worker whose clock runs off cannot reap live leases, keep dead ones, or disagree
with others about a tokens minute. What each script reads it for:

* lease deadlines (CLAIM, PREEMPT, LEND_RESERVE set them, RENEW extends them) and the reap (REAP
  requeues what is past its deadline): server time, so a lease lives exactly its TTL after the
  claim or the last renewal, whatever the worker's clock says;
* due retries (RETRY_LATER sets the run-at time as server time + the backoff; CLAIM, PREEMPT,
  LEND_RESERVE and REAP promote what is due): server time, the same clock on both sides;
* a job's ready time (ENQUEUE): server time. It is the job's place in an empty lane, the start of
  its retry backoff, and what queue ages and pickup latency are measured from, each against
  server time too (``RedisQueue.counts``, the claim's reply), so producers on different hosts
  place jobs on one timeline;
* the tokens quota's window (ENQUEUE): the server's minute, one window for every producer (two
  producers a minute apart would otherwise reset each other's count);
* the abort time (CANCEL, arq's ``arq:abort`` score): server time, for one clock in the set.
  arq's own clean-up compares it with the worker's clock (it drops aborts more than 60 s in the
  worker's future after acting on them once): harmless, as every worker reads them first.

What still carries a client's clock: the job record's enqueue time (arq's format, written by the
producer: logs and dead letters show it) and the result record's times (the worker's). A TIME call
is allowed in a script that writes because scripts replicate their effects, not themselves (the
default since Redis 5, the only mode since Redis 7 and in Valkey).

Costs: enqueue O(lanes + log N), claim and preempt O(lanes + k log N) for k jobs, lending the
reserve O(log N), renew O(jobs renewed), reap O(lanes + expired), everything else O(1) or O(lanes).
Nothing scans running jobs.
"""

from __future__ import annotations

from slotq.jobs.protocol.keys import DEFAULT_TENANT

# Redis' clock in whole ms: the one clock of leases, reaping, ready times and retries (see above).
_NOW = """
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# A job's ``Q:jobs`` entry: lane, ready ms (enqueued, or its retry due), place in line, tenant (see
# keys.py; an entry written before places existed has its ready time as its place, one written
# before tenants were counted belongs to the default tenant).
_ENTRY = """
local function read_entry(entry)
  local lane, ready, place, tenant = string.match(entry, '^([^\t]*)\t([^\t]*)\t?([^\t]*)\t?([^\t]*)$')
  if place == nil or place == '' then place = ready end
  if tenant == nil or tenant == '' then tenant = '""" + DEFAULT_TENANT + """' end
  return lane, ready, place, tenant
end
"""

# Moves one job of ``tenant`` in (+1) or out (-1) of a per-tenant count (``Q:tenant_waiting``,
# ``Q:tenant_running``). A count that reaches zero is removed, so the hashes hold only tenants with
# work; one that would go below zero (a job enqueued before tenants were counted) is removed too.
_COUNT = """
local function count(hash, tenant, delta)
  if redis.call('HINCRBY', hash, tenant, delta) <= 0 then redis.call('HDEL', hash, tenant) end
end
"""

# Keeps a token list (wake-ups of idle workers, or preemption tokens of a lane) at one token per
# waiting job, capped: a wake-up is never wasted on an empty queue for long, and a lost one is
# restored at the next claim.
_SYNC_TOKENS = """
local function sync_tokens(list, waiting, cap)
  local target = math.min(waiting, cap)
  local tokens = redis.call('LLEN', list)
  if tokens > target then
    if target == 0 then redis.call('DEL', list) else redis.call('LTRIM', list, 0, target - 1) end
  else
    for _ = tokens + 1, target do redis.call('RPUSH', list, '1') end
  end
end
"""

# KEYS: record, result, jobs, wake, the job's lane's tags, tenant waiting, tenant running, tenant tokens,
#       then its lane group (waiting, deferred, running, preempt), its lane's fair-share tokens, then
#       waiting + deferred of every lane, then running of every lane below the job's
# ARGV: job id, record, record ttl ms, lane, max waiting, token cap, tenant, number of lanes, the lane's
#       index, the tenant's quotas: max waiting, max in flight (waiting or running), tokens per minute
#       ('' = none for each), then the job's tokens, the tokens window ms (a minute)
# The job's ready time is the server's now; so is the tokens window it counts in (now // window).
# Returns 1 enqueued, 0 the id exists (a queued/running job or a kept result), -1 queue full, or a
# tenant's quota refused it: -2 waiting, -3 in flight, -4 tokens this minute.
# Quotas are checked in the same step that counts the job, so two enqueues can never both take a
# tenant's last place. Tokens are a fixed window per tenant (``minute<TAB>tokens``): a job is
# admitted while the minute's tokens plus its own stay within the quota, or into an empty minute
# (a job larger than the whole quota runs alone in its minute rather than never).
# The job's place is its fair-share tag. A tenant with jobs waiting in the lane (its newest place
# is at or behind the lane's next job) goes behind its newest: newest + 1. A tenant with nothing
# waiting there (no newest place, or one the lane's head has passed) goes half a place ahead of the
# next job's whole place, ceil(head) - 0.5: ahead of every backlog's next job, level with another
# tenant that just did the same. In an empty lane the place is the ready time + 1, every tenant's
# newest place being history then -- but never below the lane's newest place given so far + 1: a
# burst of enqueues hands out places faster than the clock runs, and a job enqueued into the lane
# just emptied by claims must still go behind those jobs, or one of them handed back (preempted,
# its worker stopped) would wait behind a job enqueued after it. Equal places are claimed in job id
# order.
# It wakes one idle worker, and when a lower lane has running jobs it also leaves a preemption
# token for one busy worker (the worker decides; see PREEMPT). When the job's tenant had nothing
# waiting or running and its lane has running jobs (other tenants' then), it leaves a fair-share
# token for one full worker, which may run the job in its reserve (see LEND_RESERVE).
ENQUEUE = _NOW + _COUNT + """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1
   or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return 0
end
local lanes, cap, tenant = tonumber(ARGV[8]), tonumber(ARGV[6]), ARGV[7]
local own = 14 + 2 * tonumber(ARGV[9])
local now = server_ms()
local waiting, in_lane = 0, 0
for i = 14, 13 + 2 * lanes do
  local n = redis.call('ZCARD', KEYS[i])
  waiting = waiting + n
  if i == own then in_lane = n end
end
if waiting >= tonumber(ARGV[5]) then return -1 end
local max_waiting, max_in_flight, max_tokens = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local tenant_waiting = tonumber(redis.call('HGET', KEYS[6], tenant) or '0')
local tenant_running = tonumber(redis.call('HGET', KEYS[7], tenant) or '0')
if max_waiting and tenant_waiting >= max_waiting then return -2 end
if max_in_flight and tenant_waiting + tenant_running >= max_in_flight then return -3 end
if max_tokens then
  local this_minute = string.format('%d', math.floor(now / tonumber(ARGV[14])))
  local minute, used = string.match(redis.call('HGET', KEYS[8], tenant) or '', '^([^\t]*)\t(.*)$')
  used = minute == this_minute and tonumber(used) or 0
  if used > 0 and used + tonumber(ARGV[13]) > max_tokens then return -4 end
  redis.call('HSET', KEYS[8], tenant, this_minute .. '\t' .. (used + tonumber(ARGV[13])))
end
local place
if in_lane == 0 then
  local newest = redis.call('ZRANGE', KEYS[5], -1, -1, 'WITHSCORES')[2]
  place = math.max(now + 1, math.floor(tonumber(newest or '0')) + 1)
  redis.call('DEL', KEYS[5])
else
  local head = tonumber(redis.call('ZRANGE', KEYS[9], 0, 0, 'WITHSCORES')[2])
  local newest = redis.call('ZSCORE', KEYS[5], tenant)
  if newest and tonumber(newest) >= head then place = tonumber(newest) + 1 else place = math.ceil(head) - 0.5 end
end
redis.call('ZADD', KEYS[5], place, tenant)
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
place = string.format('%.1f', place)      -- whole or half: exact, where Lua's own text keeps 14 digits
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4] .. '\t' .. string.format('%d', now) .. '\t' .. place .. '\t' .. tenant)
redis.call('ZADD', KEYS[9], place, ARGV[1])
count(KEYS[6], tenant, 1)
if redis.call('LLEN', KEYS[4]) < cap then redis.call('RPUSH', KEYS[4], '1') end
if tenant_waiting + tenant_running == 0 and redis.call('ZCARD', KEYS[11]) > 0
   and redis.call('LLEN', KEYS[13]) < cap then
  redis.call('RPUSH', KEYS[13], '1')
end
for i = 14 + 2 * lanes, #KEYS do
  if redis.call('ZCARD', KEYS[i]) > 0 then
    if redis.call('LLEN', KEYS[12]) < cap then redis.call('RPUSH', KEYS[12], '1') end
    break
  end
end
return 1
"""

# Moves due retries (deferred -> waiting) of one lane, each back to its place; used by CLAIM, PREEMPT and REAP.
_PROMOTE = _ENTRY + """
local function promote(jobs, deferred, waiting, now, limit)
  local due = redis.call('ZRANGEBYSCORE', deferred, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
  for j = 1, #due, 2 do
    local lane, _, place, tenant = read_entry(redis.call('HGET', jobs, due[j]) or '')
    redis.call('ZREM', deferred, due[j])
    if lane then redis.call('HSET', jobs, due[j], lane .. '\t' .. due[j + 1] .. '\t' .. place .. '\t' .. tenant) end
    redis.call('ZADD', waiting, place or due[j + 1], due[j])
  end
end
"""

# Claims up to ``want`` jobs from the lane groups (4 keys each) that start at KEYS[first]: first,
# for each lane n with ``owed[n]`` > 0 (CLAIM: slots of the worker guaranteed to that lane that it
# does not hold), up to that many of the lane's jobs; then highest lane first. Lowest place first
# within a lane. KEYS[1] is ``jobs``, KEYS[2] ``owners``; each claimed job moves from its tenant's
# waiting count to its running count, and its lease deadline is the server's now + ``lease_ms``.
# Due retries of every lane are promoted first. Returns the claim reply (the server's now, then id,
# lane index counted from the first group, ready ms for each claimed job) and the jobs left waiting
# per lane.
_CLAIM_LANES = _NOW + _PROMOTE + _COUNT + """
local function claim_lanes(first, want, lease_ms, lease, promote_limit, tenant_waiting, tenant_running, owed)
  local now = server_ms()
  local deadline = now + lease_ms
  local out, left, ids = {now}, {}, {}
  local function take(i, n)
    local popped = redis.call('ZPOPMIN', KEYS[i], n)
    for j = 1, #popped, 2 do
      redis.call('ZADD', KEYS[i + 2], deadline, popped[j])
      redis.call('HSET', KEYS[2], popped[j], lease)
      ids[#ids + 1] = popped[j]
      out[#out + 1] = popped[j]
      out[#out + 1] = (i - first) / 4
      out[#out + 1] = now
    end
  end
  for i = first, #KEYS, 4 do promote(KEYS[1], KEYS[i + 1], KEYS[i], now, promote_limit) end
  for n, slots in ipairs(owed or {}) do
    if slots > 0 and #ids < want then take(first + 4 * (n - 1), math.min(slots, want - #ids)) end
  end
  for i = first, #KEYS, 4 do
    if #ids < want then take(i, want - #ids) end
    left[#left + 1] = redis.call('ZCARD', KEYS[i])
  end
  if #ids > 0 then
    local entries = redis.call('HMGET', KEYS[1], unpack(ids))
    for n = 1, #ids do
      local _, ready, _, tenant = read_entry(entries[n] or '')
      if ready then out[3 * n + 1] = ready end
      count(tenant_waiting, tenant, -1)
      count(tenant_running, tenant, 1)
    end
  end
  return out, left
end
"""

# KEYS: jobs, owners, wake, tenant waiting, tenant running, then the lane group (waiting, deferred,
#       running, preempt) of every lane, highest priority first
# ARGV: max jobs, lease ms, lease (``<worker token>#<claim number>``), token cap, promote limit, then
#       for every lane (same order) the slots owed to it: how many of the worker's slots guaranteed
#       to that lane it does not hold now (0 for the top lane)
# No lane starves: lanes are strict except for owed slots. Each lane below the top is guaranteed
# floor(slots x SLOTQ_LANE_MIN_SHARE) of every worker's slots while it has work (runtime.py's
# owed_slots), so the worker passes max(0, guaranteed - its jobs of that lane) and the claim fills
# that many slots from that lane first, if it has jobs waiting (else they go to whatever waits,
# strictly by lane). The worker never hands back a job of a lane that holds no more than its
# guaranteed slots there (preemption.py, rule 0), so a job claimed under the guarantee runs to its
# end, and the next claim after it ends refills the slot from the same lane.
# Returns the claim reply: the server's now (ms, the claim time), then id, lane index (0-based),
# ready ms for each claimed job.
CLAIM = _CLAIM_LANES + _SYNC_TOKENS + """
local owed = {}
for n = 6, #ARGV do owed[#owed + 1] = tonumber(ARGV[n]) end
local out, left = claim_lanes(6, tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[5]), KEYS[4], KEYS[5],
                              owed)
local waiting = 0
for _, n in ipairs(left) do waiting = waiting + n end
sync_tokens(KEYS[3], waiting, tonumber(ARGV[4]))
return out
"""

# KEYS: jobs, owners, wake, preemptions, tenant waiting, tenant running, then the lane group of every
#       lane above the victim's, highest priority first
# ARGV: lease ms, lease, token cap, promote limit, the victim's lane ('' = none yields: the job runs
#       in the worker's reserve, beside its slots)
# A busy worker that took a preemption token claims one job of a lane above its victim's, to run
# in the slot the victim yields or in its reserve. It declines (returns nothing, touches nothing)
# while the wake list is empty: the enqueue's wake-up was taken by a worker with a free slot, which
# claims the job without anyone yielding. Otherwise it claims as CLAIM does (promoting due retries,
# fair within a lane; no slots owed), counts the preemption for the victim's lane when one yields,
# takes one wake token for the job it claimed, and keeps each lane's preemption tokens at one per
# job still waiting. Returns the claim reply of CLAIM (at most one job; the lane index counts from
# the top lane), or nothing when it declines.
PREEMPT = _CLAIM_LANES + _SYNC_TOKENS + """
if redis.call('LLEN', KEYS[3]) == 0 then return {} end
local out, left = claim_lanes(7, 1, tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[4]), KEYS[5], KEYS[6])
if #out > 1 then
  if ARGV[5] ~= '' then redis.call('HINCRBY', KEYS[4], ARGV[5], 1) end
  redis.call('LPOP', KEYS[3])
end
for n = 1, #left do sync_tokens(KEYS[6 + 4 * n], left[n], tonumber(ARGV[3])) end
return out
"""

# KEYS: jobs, owners, wake, tenant waiting, tenant running, then the lane group of one lane
# ARGV: lease ms, lease, promote limit
# A full worker whose lowest running lane is this one took a fair-share token (ENQUEUE): it claims
# the lane's next job to run in its reserve, beside its slots, if that job's tenant has nothing
# running anywhere -- one tenant's backlog holding every slot then does not make another tenant's
# first job wait for one to free. It declines (returns nothing; due retries may have been promoted)
# when the next job's tenant has work running, when the lane is empty, or while the wake list is
# empty (a worker with a free slot took the enqueue's wake-up and claims the job: see PREEMPT).
# Otherwise it claims as CLAIM does and takes one wake token for the job it claimed.
# Returns the claim reply of CLAIM (at most one job; lane index 0 is this lane), or nothing.
LEND_RESERVE = _CLAIM_LANES + """
if redis.call('LLEN', KEYS[3]) == 0 then return {} end
promote(KEYS[1], KEYS[7], KEYS[6], server_ms(), tonumber(ARGV[3]))
local next_job = redis.call('ZRANGE', KEYS[6], 0, 0)[1]
if not next_job then return {} end
local _, _, _, tenant = read_entry(redis.call('HGET', KEYS[1], next_job) or '')
if redis.call('HEXISTS', KEYS[5], tenant) == 1 then return {} end
local out = claim_lanes(6, 1, tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), KEYS[4], KEYS[5])
redis.call('LPOP', KEYS[3])
return out
"""

# KEYS: owners, then the running set of each job (same order as the jobs)
# ARGV: lease ms, then job id, lease for each job
# Each lease still owning its job gets the deadline server now + lease ms.
# Returns one 1/0 per job: 0 = the lease no longer owns the job (reaped, claimed again).
RENEW = _NOW + """
local deadline = server_ms() + tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[i / 2 + 1], 'XX', deadline, ARGV[i])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# KEYS: owners, jobs, running, record, retry counter, result, aborts, progress, tenant running
# ARGV: lease, job id, result record ('' = none), result ttl ms
# Returns 1 finished, 0 the lease no longer owns the job (nothing done).
FINISH = _ENTRY + _COUNT + """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return 0 end
local _, _, _, tenant = read_entry(redis.call('HGET', KEYS[2], ARGV[2]) or '')
count(KEYS[9], tenant, -1)
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

# Reads and writes one job's ``progress`` entry (see keys.py): accounted, started, tokens, interruptions,
# deaths. An entry written before deaths were counted has none (0).
_PROGRESS = """
local function read_progress(progress, id)
  local entry = redis.call('HGET', progress, id)
  if not entry then return 0, 0, 0, 0, 0 end
  local accounted, started, tokens, interruptions, deaths =
    string.match(entry, '^(%d+)\t(%d+)\t(%d+)\t(%d+)\t?(%d*)$')
  return tonumber(accounted), tonumber(started), tonumber(tokens), tonumber(interruptions), tonumber(deaths) or 0
end
local function write_progress(progress, id, accounted, started, tokens, interruptions, deaths)
  redis.call('HSET', progress, id,
             accounted .. '\t' .. started .. '\t' .. tokens .. '\t' .. interruptions .. '\t' .. deaths)
end
"""

# KEYS: owners, progress, attempt outcomes
# ARGV: lease, job id, attempt, tokens in the stream now, max worker deaths ('' = do not act on them),
#       '1' when the attempt starts isolated (no other attempt of its worker is without progress), else ''
# An attempt starts: judge the attempts before it that nobody judged (they were lost: the worker
# was killed, or stalled past its lease), then note where this one starts. The attempt that
# started last was *interrupted* if the stream now holds more tokens than when it started (it
# spent no try), else it *failed*, as did any attempt lost before it could start.
# A started attempt lost without progress is also a *worker death*: ``deaths`` counts them in a row
# (an interruption or a retryable error ends the run; an attempt lost before it started neither
# adds nor ends one, as it cannot have killed its worker). With deaths at the limit the job is
# *refused*: nothing is started, and the caller dead-letters it (``killed_its_worker``). So the
# worker that claims a job after two deaths (the default limit) never runs it. With deaths below
# the limit the job is a *suspect*: it starts only isolated, so that a worker it kills takes no
# other job's attempt without progress down with it (which would count as that job's death too);
# otherwise nothing is started and the caller isolates the attempt and asks again.
# Why here and not in REAP, which could keep such a job from ever being claimed: only the next
# attempt knows whether the lost one made progress (it has just read the job's stream), and only a
# worker can write the dead letter, the stream's final error entry and arq's result record. The lease
# fences it: of two workers that both claimed the job (the first stalled past its lease), only the
# owner is answered, and the count stays at the limit, so every later claim is refused as well.
# A lost attempt that was only stalled (its worker frozen, or cut off from Redis longer than the
# lease) cannot be told from a death here: one caught before its first token counts as one.
# Returns {verdict, interruptions so far, newly interrupted (0/1), newly failed, deaths in a row};
# verdict 1 started, 2 a suspect not started (start it isolated), 3 refused, 0 the lease no longer
# owns the job (nothing written).
START_ATTEMPT = _PROGRESS + """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return {0, 0, 0, 0, 0} end
local attempt, tokens = tonumber(ARGV[3]), tonumber(ARGV[4])
local accounted, started, before, interruptions, deaths = read_progress(KEYS[2], ARGV[2])
local interrupted, failed = 0, 0
if started == attempt then
  accounted = attempt - 1          -- the same try again after a hand-back: nothing was lost
else
  if started > accounted and started < attempt then
    if tokens > before then
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
if interrupted > 0 then redis.call('HINCRBY', KEYS[3], 'interrupted', interrupted) end
if failed > 0 then redis.call('HINCRBY', KEYS[3], 'failed', failed) end
local max_deaths, verdict = tonumber(ARGV[5]), 1
if max_deaths and deaths >= max_deaths then
  verdict = 3
elseif max_deaths and deaths > 0 and ARGV[6] ~= '1' then
  verdict = 2
end
if verdict == 1 then
  write_progress(KEYS[2], ARGV[2], accounted, attempt, tokens, interruptions, deaths)
else
  write_progress(KEYS[2], ARGV[2], accounted, started, before, interruptions, deaths)
end
return {verdict, interruptions, interrupted, failed, deaths}
"""

# KEYS: owners, running, deferred, progress, attempt outcomes, jobs, tenant waiting, tenant running
# ARGV: lease, job id, backoff ms (the job may run again at the server's now + this)
# The attempt failed with a retryable error: it is judged here (a failure), not when the next starts,
# and it ends a run of worker deaths (its worker lived). A deferred job counts as waiting for its
# tenant. Returns 1 deferred, 0 the lease no longer owns the job (nothing done).
RETRY_LATER = _NOW + _PROGRESS + _ENTRY + _COUNT + """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return 0 end
local _, _, _, tenant = read_entry(redis.call('HGET', KEYS[6], ARGV[2]) or '')
count(KEYS[8], tenant, -1)
count(KEYS[7], tenant, 1)
local _, started, tokens, interruptions = read_progress(KEYS[4], ARGV[2])
write_progress(KEYS[4], ARGV[2], started, started, tokens, interruptions, 0)
redis.call('HINCRBY', KEYS[5], 'failed', 1)
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], server_ms() + tonumber(ARGV[3]), ARGV[2])
return 1
"""

# KEYS: owners, jobs, running, waiting, retry counter, wake, tenant waiting, tenant running
# ARGV: lease, job id, wake cap
# The attempt is given back in the same step that makes the job claimable again, so the next
# claim can never count it (the hand-back race of arq #267 style DECRs done afterwards).
# Returns 1 handed back, 0 the lease no longer owns the job (nothing done).
HAND_BACK = _ENTRY + _COUNT + """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return 0 end
local _, _, place, tenant = read_entry(redis.call('HGET', KEYS[2], ARGV[2]) or '')
count(KEYS[8], tenant, -1)
count(KEYS[7], tenant, 1)
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[4], place or '0', ARGV[2])
if tonumber(redis.call('GET', KEYS[5]) or '0') > 0 then redis.call('DECR', KEYS[5]) end
if redis.call('LLEN', KEYS[6]) < tonumber(ARGV[3]) then redis.call('RPUSH', KEYS[6], '1') end
return 1
"""

# KEYS: owners, jobs, wake, tenant waiting, tenant running, then the lane group (waiting, deferred,
#       running, preempt) of every lane
# ARGV: limit per lane, wake cap
# Requeues jobs whose lease deadline passed by the server's clock (their worker died or stalled) at
# their old place in line, and promotes due retries. Returns the number of jobs requeued.
REAP = _NOW + _PROMOTE + _COUNT + """
local now = server_ms()
local reaped = 0
for i = 6, #KEYS, 4 do
  local waiting, running = KEYS[i], KEYS[i + 2]
  promote(KEYS[2], KEYS[i + 1], waiting, now, tonumber(ARGV[1]))
  local expired = redis.call('ZRANGEBYSCORE', running, '-inf', now, 'LIMIT', 0, ARGV[1])
  for _, id in ipairs(expired) do
    local entry = redis.call('HGET', KEYS[2], id)
    redis.call('ZREM', running, id)
    redis.call('HDEL', KEYS[1], id)
    if entry then
      local _, _, place, tenant = read_entry(entry)
      redis.call('ZADD', waiting, place or now, id)
      count(KEYS[5], tenant, -1)
      count(KEYS[4], tenant, 1)
      reaped = reaped + 1
    end
  end
end
local room = tonumber(ARGV[2]) - redis.call('LLEN', KEYS[3])
for _ = 1, math.min(reaped, room) do redis.call('RPUSH', KEYS[3], '1') end
return reaped
"""

# KEYS: jobs, owners, record, aborts, progress, tenant waiting, then waiting + deferred of every lane
# ARGV: job id, abort channel prefix
# A running job's abort is noted at the server's now (arq's ``arq:abort`` set).
# Returns 1 removed before it started (or while waiting out a retry), -1 running (abort
# requested; FINISH ends it), 0 not in the queue.
CANCEL = _NOW + _ENTRY + _COUNT + """
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then return 0 end
for i = 7, #KEYS do
  if redis.call('ZREM', KEYS[i], ARGV[1]) == 1 then
    local _, _, _, tenant = read_entry(entry)
    count(KEYS[6], tenant, -1)
    redis.call('HDEL', KEYS[1], ARGV[1])
    redis.call('HDEL', KEYS[5], ARGV[1])
    redis.call('DEL', KEYS[3])
    return 1
  end
end
redis.call('ZADD', KEYS[4], server_ms(), ARGV[1])
local lease = redis.call('HGET', KEYS[2], ARGV[1])
local owner = lease and string.match(lease, '^(.*)#')
if owner then redis.call('PUBLISH', ARGV[2] .. owner, ARGV[1]) end
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
