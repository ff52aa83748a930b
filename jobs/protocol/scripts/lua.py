"""Lua helper functions that several scripts share; a script's ``BODY`` starts with those it calls.
Each takes the keys it touches as parameters (it never reads KEYS or ARGV: the script's preamble
named them, see :mod:`slotq.jobs.protocol.scripts.layout`)."""

from __future__ import annotations

from slotq.jobs.protocol.keys import DEFAULT_TENANT

# Redis' clock in whole ms: the one clock of leases, reaping, ready times and retries (see the package).
NOW = """
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# A job's ``Q:jobs`` entry: lane, ready ms (enqueued, or its retry due), place in line, tenant (see
# keys.py; an entry written before places existed has its ready time as its place, one written
# before tenants were counted belongs to the default tenant).
ENTRY = """
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
COUNT = """
local function count(hash, tenant, delta)
  if redis.call('HINCRBY', hash, tenant, delta) <= 0 then redis.call('HDEL', hash, tenant) end
end
"""

# Keeps a token list (wake-ups of idle workers, or preemption tokens of a lane) at one token per
# waiting job, capped: a wake-up is never wasted on an empty queue for long, and a lost one is
# restored at the next claim.
SYNC_TOKENS = """
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

# Moves due retries (deferred -> waiting) of one lane, each back to its place; used by CLAIM, PREEMPT,
# LEND_RESERVE and REAP.
PROMOTE = ENTRY + """
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

# Reads and writes one job's ``progress`` entry (see keys.py): accounted, started, tokens, interruptions,
# deaths. An entry written before deaths were counted has none (0).
PROGRESS = """
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
