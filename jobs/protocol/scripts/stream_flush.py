"""What writes job streams, each job fenced by its fence in its stream's slot: a claim's fence
raised as its attempt reads the stream (OPEN_STREAMS), and one flush of a writer's entries
(STREAM_FLUSH), both for a group of jobs whose keys share one slot (every job on a single Redis, a
stream bucket on a cluster; :class:`slotq.jobs.protocol.streams.StreamAppender` groups them), and
NODE_STREAM_FLUSH, STREAM_FLUSH for the buckets of one cluster node in one call.

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
from typing import Any

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
class OpenStreams(LuaScript[list[list[Any]]]):
    """OPEN_STREAMS: each job's fence now holds its new claim, unless a newer claim raised it already,
    and the stream of each job whose fence rose is read in the same step: the attempt resumes from
    what it holds. One call instead of a fence, an XRANGE and an XINFO per job, each a round trip
    that every claimed job waited for, in turn, before the engine saw it.

    Returns per job ``{0}`` (a newer claim holds the fence: nothing read) or ``{1, trimmed, entries}``:
    ``entries`` as XRANGE gives them, ``trimmed`` 1 when MAXLEN trimming dropped entries of a stream
    that still holds some (XINFO STREAM's ``entries-added`` above its ``length``)."""

    fences: Key                    # the bucket's (every job's, on a single Redis)
    streams: KeyList[str]          # each job's stream, in the fences' slot
    job_ids: ArgList[str]          # the same jobs, in the same order
    leases: ArgList[str]           # per job: ``<worker token>#<claim number>``, '' = not fenced: only read
    ttl_s: Arg[int]                # the fences outlive the last claim or flush by this much

    HELPERS = NEWER
    BODY = """
local out = {}
local held = redis.call('HMGET', fences, unpack(job_ids))
for job = 1, #job_ids do
  if leases[job] ~= '' and newer(held[job], leases[job]) then
    out[job] = {0}
  else
    if leases[job] ~= '' then redis.call('HSET', fences, job_ids[job], leases[job]) end
    local entries = redis.call('XRANGE', streams[job], '-', '+')
    local trimmed = 0
    if #entries > 0 then
      local info, length, added = redis.call('XINFO', 'STREAM', streams[job]), 0, 0
      for i = 1, #info, 2 do
        if info[i] == 'length' then length = info[i + 1] elseif info[i] == 'entries-added' then added = info[i + 1] end
      end
      if added > length then trimmed = 1 end
    end
    out[job] = {1, trimmed, entries}
  end
end
redis.call('EXPIRE', fences, ttl_s)
return out
"""


WRITE_BUCKET = """
-- Appends the entries of jobs ``first``..``last`` of a flush, all of one stream bucket (their streams and
-- the fences hash ``fence_hash`` share one slot), each job fenced by its lease. ``flush``: maxlen,
-- live_ttl_s; ``jobs``: streams, ids, leases, ttls, entry_counts, entries (flat, job after job: n, then n
-- field names and values), ``at`` where job ``first``'s entries start there. Returns the bucket's answer
-- ('1'/'0' per job) and where the next job's entries start.
local function write_bucket(fence_hash, flush, jobs, first, last, at)
  local held = redis.call('HMGET', fence_hash, unpack(jobs.ids, first, last))
  local out, fenced = {}, false
  for job = first, last do
    local ok = jobs.leases[job] == '' or held[job - first + 1] == jobs.leases[job]
    for _ = 1, jobs.entry_counts[job] do
      local n = tonumber(jobs.entries[at])
      if ok then
        local cmd = {'XADD', jobs.streams[job], 'MAXLEN', '~', flush.maxlen, '*'}
        for f = 1, n do cmd[#cmd + 1] = jobs.entries[at + f] end
        redis.call(unpack(cmd))
      end
      at = at + n + 1
    end
    if ok and jobs.ttls[job] == 1 then redis.call('EXPIRE', jobs.streams[job], flush.live_ttl_s) end
    if ok and jobs.ttls[job] == 2 then
      redis.call('EXPIRE', jobs.streams[job], flush.final_ttl_s)
      redis.call('HDEL', fence_hash, jobs.ids[job])
    end
    if ok and jobs.leases[job] ~= '' and jobs.ttls[job] == 1 then fenced = true end
    out[#out + 1] = ok and '1' or '0'
  end
  if fenced then redis.call('EXPIRE', fence_hash, flush.live_ttl_s) end
  return table.concat(out), at
end
"""

# What every flush script starts with: the values WRITE_BUCKET takes, as two tables (the preamble named them
# alike in both scripts), and the answer of a flush id the writer's mark holds already (re-sent after a lost
# reply: answered from the mark, nothing written).
_FLUSH_START = """
local flush = {maxlen = maxlen, live_ttl_s = live_ttl_s, final_ttl_s = final_ttl_s}
local jobs = {streams = streams, ids = job_ids, leases = leases, ttls = ttls, entry_counts = entry_counts,
              entries = entries}
local prefix = flush_id .. '|'
local recorded = redis.call('GET', flush_mark)
if recorded and string.sub(recorded, 1, #prefix) == prefix then return string.sub(recorded, #prefix + 1) end
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

    HELPERS = WRITE_BUCKET
    BODY = _FLUSH_START + """
local answer = write_bucket(fences, flush, jobs, 1, #job_ids, 1)
redis.call('SET', flush_mark, prefix .. answer, 'EX', final_ttl_s)
return answer
"""


@dataclass(frozen=True, kw_only=True)
class NodeStreamFlush(LuaScript[bytes | str]):
    """NODE_STREAM_FLUSH: STREAM_FLUSH for several stream buckets of one cluster node in one call, each
    bucket's jobs fenced in its own fences hash as STREAM_FLUSH fences them.

    A script declares the keys of one slot only (a cluster refuses the call otherwise, CROSSSLOT): the
    one declared key, ``flush_mark`` (the writer's flush mark in the first bucket's slot), sends the call
    to its node; the other buckets' keys, in other slots the same node serves, go as arguments, which the
    flag ``allow-cross-slot-keys`` lets the script touch. Touching a key the node does not serve (its slot
    moved, or is migrating) fails the command that touches it, and a script is not undone: so the script
    first touches every key it may write (one EXISTS per bucket, which fails on any key of a slot not
    served here, or migrating), then writes. A call refused is refused whole, nothing written.

    The one flush mark records the whole call's answer: a call re-sent after a lost reply is answered
    from it. The caller re-sends a flush with the buckets grouped as they were, and when a node refuses
    the call, reads the mark before sending its buckets one by one
    (:class:`~slotq.jobs.protocol.streams.StreamAppender`), so a call that was applied is never applied
    again bucket by bucket. A flush thus costs one GET and one SET per node, and one EXISTS and one HMGET
    per bucket, besides its XADDs.

    Returns the buckets' answers, one after the other: one '1'/'0' per job, in the order of ``job_ids``."""

    FLAGS = ("allow-cross-slot-keys",)

    flush_mark: Key                # the writer's, in the first bucket's slot: the one declared key
    bucket_fences: ArgList[str]    # per bucket: keys in other slots of the node (undeclared)
    bucket_jobs: ArgList[int]      # per bucket: how many of the jobs below are its own, bucket after bucket
    streams: ArgList[str]          # per job
    flush_id: Arg[str]
    maxlen: Arg[int]
    live_ttl_s: Arg[int]
    final_ttl_s: Arg[int]
    job_ids: ArgList[str]
    leases: ArgList[str]
    ttls: ArgList[int]
    entry_counts: ArgList[int]
    entries: ArgList[str | int]

    HELPERS = WRITE_BUCKET
    BODY = _FLUSH_START + """
local first = 1
for b = 1, #bucket_fences do
  local check = {'EXISTS', bucket_fences[b]}
  for job = first, first + bucket_jobs[b] - 1 do check[#check + 1] = streams[job] end
  redis.call(unpack(check))
  first = first + bucket_jobs[b]
end
local answers, at = {}, 1
first = 1
for b = 1, #bucket_fences do
  local last = first + bucket_jobs[b] - 1
  answers[b], at = write_bucket(bucket_fences[b], flush, jobs, first, last, at)
  first = last + 1
end
local answer = table.concat(answers)
redis.call('SET', flush_mark, prefix .. answer, 'EX', final_ttl_s)
return answer
"""
