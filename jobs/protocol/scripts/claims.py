"""What hands jobs to workers: a worker's claim for its free slots (CLAIM, with the slots it owes
lower lanes), and a full worker's claim after it took a token that ENQUEUE left: a job of a higher
lane for the slot a lower-lane job yields (PREEMPT), or a tenant's first job for its reserve
(LEND_RESERVE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotq.jobs.protocol.keys import LaneKeys
from slotq.jobs.protocol.scripts.layout import Arg, ArgList, Key, KeyList, LuaScript
from slotq.jobs.protocol.scripts.lua import COUNT, NOW, PROMOTE, SYNC_TOKENS

# Claims up to ``want`` jobs from ``lanes`` (tables of waiting, deferred, running): first, for each
# lane n with ``owed[n]`` > 0 (CLAIM: slots of the worker guaranteed to that lane that it does not
# hold), up to that many of the lane's jobs; then highest lane first. Lowest place first within a
# lane. Each claimed job is owned by the claim's lease in ``owners``, moves from its tenant's
# waiting count to its running count, and its lease deadline is the server's now + ``lease_ms``.
# Due retries of every lane are promoted first. The lease is ``<token>#<claim number>``, the claim
# number above every earlier claim's of the queue (``claim_seq``: at least the server's time in
# microseconds, so it rises even after a failover lost the last one). Returns the claim reply (the
# server's now, the lease or '' when nothing was claimed, then id, lane index counted from
# ``lanes[1]`` as 0, ready ms for each claimed job) and the jobs left waiting per lane.
_CLAIM_LANES = NOW + PROMOTE + COUNT + """
local function claim_lanes(jobs, owners, claim_seq, lanes, want, lease_ms, token, promote_limit, tenant_waiting,
                           tenant_running, owed)
  local now = server_ms()
  local deadline = now + lease_ms
  local out, left, ids = {now, ''}, {}, {}
  local function take(index, n)
    local popped = redis.call('ZPOPMIN', lanes[index].waiting, n)
    if #popped > 0 and out[2] == '' then
      local t = redis.call('TIME')
      local number = math.max(tonumber(t[1]) * 1000000 + tonumber(t[2]),
                              tonumber(redis.call('GET', claim_seq) or '0') + 1)
      local text = string.format('%d', number)
      redis.call('SET', claim_seq, text)
      out[2] = token .. '#' .. text
    end
    for j = 1, #popped, 2 do
      redis.call('ZADD', lanes[index].running, deadline, popped[j])
      redis.call('HSET', owners, popped[j], out[2])
      ids[#ids + 1] = popped[j]
      out[#out + 1] = popped[j]
      out[#out + 1] = index - 1
      out[#out + 1] = now
    end
  end
  for _, lane in ipairs(lanes) do promote(jobs, lane.deferred, lane.waiting, now, promote_limit) end
  for index, slots in ipairs(owed or {}) do
    if slots > 0 and #ids < want then take(index, math.min(slots, want - #ids)) end
  end
  for index, lane in ipairs(lanes) do
    if #ids < want then take(index, want - #ids) end
    left[index] = redis.call('ZCARD', lane.waiting)
  end
  if #ids > 0 then
    local entries = redis.call('HMGET', jobs, unpack(ids))
    for n = 1, #ids do
      local _, ready, _, tenant = read_entry(entries[n] or '')
      if ready then out[3 * n + 2] = ready end
      count(tenant_waiting, tenant, -1)
      count(tenant_running, tenant, 1)
    end
  end
  return out, left
end
"""

# A claim carries an id, fresh for each call and the same in each of its retries: redis-py sends a
# command again, whole, when its connection failed or its reply did not come in time, and a claim whose
# reply was lost had already run. It would run again and take more jobs, the first ones left under a
# lease nobody holds until the reaper returns them (a lease later). So each claim that took jobs keeps
# its id and reply in the worker's claim mark (for one lease), and a claim that finds its own id there
# answers that reply again and touches nothing. As the stream writer's flush ids do (stream_flush.py).
_REPLAY = """
local function replayed(claim_mark, claim_id)
  local mark = redis.call('GET', claim_mark)
  local prefix = claim_id .. '|'
  if mark and string.sub(mark, 1, #prefix) == prefix then return cjson.decode(string.sub(mark, #prefix + 1)) end
  return nil
end
local function remembered(claim_mark, claim_id, out, lease_ms)
  if #out > 2 then redis.call('SET', claim_mark, claim_id .. '|' .. cjson.encode(out), 'PX', lease_ms) end
  return out
end
"""

ClaimReply = list[Any]
"""The server's now (ms, the claim time), the claim's lease ('' when it claimed nothing), then id
(bytes), lane index (0-based, counted from the first lane the script was given), ready ms for each
claimed job; empty when the script declined."""


@dataclass(frozen=True, kw_only=True)
class Claim(LuaScript[ClaimReply]):
    """CLAIM: up to ``max_jobs`` jobs for a worker's free slots.

    No lane starves: lanes are strict except for owed slots. Each lane below the top is guaranteed
    floor(slots x SLOTQ_LANE_MIN_SHARE) of every worker's slots while it has work (runtime.py's
    owed_slots), so the worker passes max(0, guaranteed - its jobs of that lane) and the claim fills
    that many slots from that lane first, if it has jobs waiting (else they go to whatever waits,
    strictly by lane). The worker never hands back a job of a lane that holds no more than its
    guaranteed slots there (preemption.py, rule 0), so a job claimed under the guarantee runs to its
    end, and the next claim after it ends refills the slot from the same lane. The wake list is then
    kept at one token per job still waiting. Returns the claim reply."""

    jobs: Key
    owners: Key
    claim_seq: Key
    claim_mark: Key            # the worker's (:attr:`QueueKeys.claim_mark`)
    wake: Key
    tenant_waiting: Key
    tenant_running: Key
    lanes: KeyList[LaneKeys]   # every lane, highest priority first
    max_jobs: Arg[int]
    lease_ms: Arg[int]
    token: Arg[str]            # the worker's: the lease is ``<token>#<claim number>``
    claim_id: Arg[str]         # this call's, the same in its retries (see _REPLAY)
    wake_cap: Arg[int]
    promote_limit: Arg[int]
    owed: ArgList[int]         # per lane (same order): the worker's slots guaranteed to it that it does not hold

    HELPERS = _CLAIM_LANES + SYNC_TOKENS + _REPLAY
    BODY = """
local again = replayed(claim_mark, claim_id)
if again then return again end
local out, left = claim_lanes(jobs, owners, claim_seq, lanes, max_jobs, lease_ms, token, promote_limit, tenant_waiting,
                              tenant_running, owed)
local still_waiting = 0
for _, n in ipairs(left) do still_waiting = still_waiting + n end
sync_tokens(wake, still_waiting, wake_cap)
return remembered(claim_mark, claim_id, out, lease_ms)
"""


@dataclass(frozen=True, kw_only=True)
class Preempt(LuaScript[ClaimReply]):
    """PREEMPT: a busy worker that took a preemption token claims one job of a lane above its
    victim's, to run in the slot the victim yields or in its reserve.

    It declines (returns nothing, touches nothing) while the wake list is empty: the enqueue's
    wake-up was taken by a worker with a free slot, which claims the job without anyone yielding.
    Otherwise it claims as CLAIM does (promoting due retries, fair within a lane; no slots owed),
    counts the preemption for the victim's lane when one yields, takes one wake token for the job
    it claimed, and keeps each lane's preemption tokens at one per job still waiting. Returns the
    claim reply (at most one job; the lane index counts from the top lane), or nothing when it
    declines."""

    jobs: Key
    owners: Key
    claim_seq: Key
    claim_mark: Key            # the worker's (:attr:`QueueKeys.claim_mark`)
    wake: Key
    preemptions: Key
    tenant_waiting: Key
    tenant_running: Key
    lanes: KeyList[LaneKeys]   # every lane above the victim's, highest priority first
    lease_ms: Arg[int]
    token: Arg[str]
    claim_id: Arg[str]
    wake_cap: Arg[int]
    promote_limit: Arg[int]
    victim_lane: Arg[str]      # '' = none yields: the job runs in the worker's reserve, beside its slots

    HELPERS = _CLAIM_LANES + SYNC_TOKENS + _REPLAY
    BODY = """
local again = replayed(claim_mark, claim_id)
if again then return again end
if redis.call('LLEN', wake) == 0 then return {} end
local out, left = claim_lanes(jobs, owners, claim_seq, lanes, 1, lease_ms, token, promote_limit, tenant_waiting,
                               tenant_running)
if #out > 2 then
  if victim_lane ~= '' then redis.call('HINCRBY', preemptions, victim_lane, 1) end
  redis.call('LPOP', wake)
end
for n = 1, #left do sync_tokens(lanes[n].preempt, left[n], wake_cap) end
return remembered(claim_mark, claim_id, out, lease_ms)
"""


@dataclass(frozen=True, kw_only=True)
class LendReserve(LuaScript[ClaimReply]):
    """LEND_RESERVE: a full worker whose lowest running lane is this one took a fair-share token
    (ENQUEUE): it claims the lane's next job to run in its reserve, beside its slots, if that job's
    tenant has nothing running anywhere -- one tenant's backlog holding every slot then does not
    make another tenant's first job wait for one to free.

    It declines (returns nothing; due retries may have been promoted) when the next job's tenant
    has work running, when the lane is empty, or while the wake list is empty (a worker with a free
    slot took the enqueue's wake-up and claims the job: see :class:`Preempt`). Otherwise it claims
    as CLAIM does and takes one wake token for the job it claimed. Returns the claim reply (at most
    one job; lane index 0 is this lane), or nothing."""

    jobs: Key
    owners: Key
    claim_seq: Key
    claim_mark: Key            # the worker's (:attr:`QueueKeys.claim_mark`)
    wake: Key
    tenant_waiting: Key
    tenant_running: Key
    waiting: Key               # the lane's
    deferred: Key
    running: Key
    lease_ms: Arg[int]
    token: Arg[str]
    claim_id: Arg[str]
    promote_limit: Arg[int]

    HELPERS = _CLAIM_LANES + _REPLAY
    BODY = """
local again = replayed(claim_mark, claim_id)
if again then return again end
if redis.call('LLEN', wake) == 0 then return {} end
promote(jobs, deferred, waiting, server_ms(), promote_limit)
local next_job = redis.call('ZRANGE', waiting, 0, 0)[1]
if not next_job then return {} end
local _, _, _, tenant = read_entry(redis.call('HGET', jobs, next_job) or '')
if redis.call('HEXISTS', tenant_running, tenant) == 1 then return {} end
local out = claim_lanes(jobs, owners, claim_seq, {{waiting = waiting, deferred = deferred, running = running}}, 1,
                        lease_ms, token, promote_limit, tenant_waiting, tenant_running)
redis.call('LPOP', wake)
return remembered(claim_mark, claim_id, out, lease_ms)
"""
