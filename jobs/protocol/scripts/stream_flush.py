"""What writes job streams, each job fenced by its fence in its stream's slot: a claim's fence
raised before its attempt reads the stream (RAISE_FENCE), and one flush of a writer's entries
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


FLUSH_BUCKET = """
-- Appends the entries of jobs ``first``..``last`` of a flush, all of one stream bucket (their streams, the
-- fences hash ``fence_hash`` and the writer's flush mark ``mark`` share one slot), each job fenced by its
-- lease. ``flush``: id, maxlen, live_ttl_s, final_ttl_s; ``jobs``: streams, ids, leases, ttls,
-- entry_counts, entries (flat, job after job: n, then n field names and values), ``at`` where job
-- ``first``'s entries start there. Returns the bucket's answer ('1'/'0' per job) and where the next
-- job's entries start. A flush id the mark holds already is answered from it, nothing written.
local function flush_bucket(mark, fence_hash, flush, jobs, first, last, at)
  local prefix = flush.id .. '|'
  local recorded = redis.call('GET', mark)
  if recorded and string.sub(recorded, 1, #prefix) == prefix then
    for job = first, last do
      for _ = 1, jobs.entry_counts[job] do at = at + tonumber(jobs.entries[at]) + 1 end
    end
    return string.sub(recorded, #prefix + 1), at
  end
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
  local answer = table.concat(out)
  redis.call('SET', mark, prefix .. answer, 'EX', flush.final_ttl_s)
  return answer, at
end
"""

# The values every flush script hands FLUSH_BUCKET, as two tables (its preamble named them alike).
_FLUSH_TABLES = """
local flush = {id = flush_id, maxlen = maxlen, live_ttl_s = live_ttl_s, final_ttl_s = final_ttl_s}
local jobs = {streams = streams, ids = job_ids, leases = leases, ttls = ttls, entry_counts = entry_counts,
              entries = entries}
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

    HELPERS = FLUSH_BUCKET
    BODY = _FLUSH_TABLES + """
return (flush_bucket(flush_mark, fences, flush, jobs, 1, #job_ids, 1))
"""


@dataclass(frozen=True, kw_only=True)
class NodeStreamFlush(LuaScript[bytes | str]):
    """NODE_STREAM_FLUSH: STREAM_FLUSH for several stream buckets of one cluster node in one call, each
    bucket written as STREAM_FLUSH writes it (its own flush mark, so a bucket re-sent alone after a lost
    reply is answered from it, and the other way round).

    A script declares the keys of one slot only (a cluster refuses the call otherwise, CROSSSLOT): the
    one declared key, ``route`` (the first bucket's flush mark), sends the call to its node; the other
    buckets' keys, in other slots the same node serves, go as arguments, which the flag
    ``allow-cross-slot-keys`` lets the script touch. Touching a key the node does not serve (its slot
    moved, or is migrating) fails the command that touches it, and a script is not undone: so the script
    first touches every key it may write (one EXISTS per bucket, which fails on any key of a slot not
    served here, or migrating), then writes. A call refused is refused whole, nothing written; the
    caller then sends its buckets one by one (:class:`~slotq.jobs.protocol.streams.StreamAppender`).

    Returns the buckets' answers, one after the other: one '1'/'0' per job, in the order of ``job_ids``."""

    FLAGS = ("allow-cross-slot-keys",)

    route: Key                     # = flush_marks[1]: the one declared key, whose slot routes the call
    flush_marks: ArgList[str]      # per bucket: keys in other slots of the node (undeclared), as STREAM_FLUSH's
    bucket_fences: ArgList[str]    # per bucket
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

    HELPERS = FLUSH_BUCKET
    BODY = _FLUSH_TABLES + """
local first = 1
for b = 1, #flush_marks do
  local check = {'EXISTS', flush_marks[b], bucket_fences[b]}
  for job = first, first + bucket_jobs[b] - 1 do check[#check + 1] = streams[job] end
  redis.call(unpack(check))
  first = first + bucket_jobs[b]
end
local answers, at = {}, 1
first = 1
for b = 1, #flush_marks do
  local last = first + bucket_jobs[b] - 1
  answers[b], at = flush_bucket(flush_marks[b], bucket_fences[b], flush, jobs, first, last, at)
  first = last + 1
end
return table.concat(answers)
"""
