"""What writes job streams, each job fenced by its fence in its stream's slot: a claim's fence
raised before its attempt reads the stream (RAISE_FENCE), and one flush of a writer's entries
(STREAM_FLUSH), both for a group of jobs whose keys share one slot (every job on a single Redis, a
stream bucket on a cluster; :class:`slotq.jobs.protocol.streams.StreamAppender` groups them).

Why the fences are not the queue's ``owners`` hash: on a Redis Cluster a job's stream hashes by
its stream bucket, so that streaming spreads over every shard, and a script can only check keys of
its own slot. The fences hash beside the streams (:func:`~slotq.jobs.protocol.keys.fences_key`)
holds, per job, the lease of the newest claim that raised its fence:

* a claim raises the fence to its lease *before* its attempt reads the stream to resume, and only
  upwards (a claim's number, the end of its lease, rises with every claim of the queue:
  :attr:`slotq.jobs.protocol.keys.QueueKeys.claim_seq`); a claim that finds a newer one there has
  lost the job;
* a flush writes a job's entries only while the fence holds the flush's lease. So an older
  attempt's write lands either before the newer attempt raised the fence -- and that attempt reads
  it when it resumes -- or not at all: no token is delivered twice, none is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotq.jobs.protocol.scripts.layout import Arg, ArgList, Key, KeyList, LuaScript

NEWER = """
-- whether the lease ``held`` (or nil) belongs to a later claim than ``lease``: their claim numbers,
-- decimal strings without leading zeros, compared as numbers
local function newer(held, lease)
  if not held then return false end
  local a, b = string.match(held, '#(%d+)$'), string.match(lease, '#(%d+)$')
  return #a > #b or (#a == #b and a > b)
end
"""


@dataclass(frozen=True, kw_only=True)
class RaiseFence(LuaScript[bytes | str]):
    """RAISE_FENCE: each job's fence now holds its new claim, unless a newer claim raised it already.

    Returns one '1' (raised: the claim may write) or '0' (a newer claim holds the fence) per job."""

    fences: Key                    # the bucket's (every job's, on a single Redis)
    job_ids: ArgList[str]
    leases: ArgList[str]           # per job: ``<worker token>#<claim number>``
    ttl_s: Arg[int]                # the fences outlive the last claim or flush by this much

    HELPERS = NEWER
    BODY = """
local out = {}
local held = redis.call('HMGET', fences, unpack(job_ids))
for job = 1, #job_ids do
  if newer(held[job], leases[job]) then
    out[job] = '0'
  else
    redis.call('HSET', fences, job_ids[job], leases[job])
    out[job] = '1'
  end
end
redis.call('EXPIRE', fences, ttl_s)
return table.concat(out)
"""


@dataclass(frozen=True, kw_only=True)
class StreamFlush(LuaScript[bytes | str]):
    """STREAM_FLUSH: append each job's entries to its stream, each job fenced by its lease.

    Returns one '1'/'0' per job ('0': the job's fence holds another claim, nothing written). A flush
    id already applied (re-sent because its reply was lost) gets its first answer again, unwritten:
    the writer's mark, beside the streams, keeps the last one. Unfenced jobs (lease '': a producer
    ending a job no worker runs) are always written. A job's final entry takes its fence away, fenced
    or not (the job is over; a claim that still comes raises it again): a producer ending a job
    cancelled while it waited, after an earlier claim had raised its fence, leaves no field behind
    for good. The fences of all jobs are read with one HMGET: a flush costs 4 commands plus one XADD
    per entry."""

    flush_mark: Key                # the writer's last flush id and its answer (in the streams' slot)
    fences: Key
    streams: KeyList[str]          # one per job
    flush_id: Arg[str]
    maxlen: Arg[int]               # each stream's approximate length at most (XADD MAXLEN ~)
    live_ttl_s: Arg[int]
    final_ttl_s: Arg[int]          # also how long the flush mark is kept
    job_ids: ArgList[str]          # per job, in the order of ``streams``
    leases: ArgList[str]           # per job ('' = not fenced)
    ttls: ArgList[int]             # 0 keep the stream's TTL, 1 live, 2 final
    entry_counts: ArgList[int]
    entries: ArgList[str | int]    # per entry, job after job: n (2 x its fields), then field, value, ...

    BODY = """
local mark = redis.call('GET', flush_mark)
local prefix = flush_id .. '|'
if mark and string.sub(mark, 1, #prefix) == prefix then return string.sub(mark, #prefix + 1) end
local held = redis.call('HMGET', fences, unpack(job_ids))
local out, at, fenced = {}, 1, false
for job = 1, #job_ids do
  local ok = leases[job] == '' or held[job] == leases[job]
  for _ = 1, entry_counts[job] do
    local n = tonumber(entries[at])
    if ok then
      local cmd = {'XADD', streams[job], 'MAXLEN', '~', maxlen, '*'}
      for f = 1, n do cmd[#cmd + 1] = entries[at + f] end
      redis.call(unpack(cmd))
    end
    at = at + n + 1
  end
  if ok and ttls[job] == 1 then redis.call('EXPIRE', streams[job], live_ttl_s) end
  if ok and ttls[job] == 2 then
    redis.call('EXPIRE', streams[job], final_ttl_s)
    redis.call('HDEL', fences, job_ids[job])
  end
  if ok and leases[job] ~= '' and ttls[job] == 1 then fenced = true end
  out[job] = ok and '1' or '0'
end
if fenced then redis.call('EXPIRE', fences, live_ttl_s) end
local answer = table.concat(out)
redis.call('SET', flush_mark, prefix .. answer, 'EX', final_ttl_s)
return answer
"""
