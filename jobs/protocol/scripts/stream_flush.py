"""What writes job streams, each job fenced by its own fence key in its stream's slot: a claim's
fence raised before its attempt reads the stream (RAISE_FENCE), and one flush of a writer's
entries (STREAM_FLUSH), both for a group of jobs whose keys share one slot (every job on a single
Redis; :class:`slotq.jobs.protocol.streams.StreamAppender` groups them).

Why the fence is the job's own key and not the queue's ``owners`` hash: on a Redis Cluster a
job's stream hashes by its stream bucket, so that streaming spreads over every shard, and a script
can only check keys of its own slot. The fence (a hash beside the stream,
:func:`~slotq.jobs.protocol.keys.fence_key`) holds the newest claim that raised it (``seq``,
``lease``):

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


@dataclass(frozen=True)
class FencedStream:
    """One job's keys, in one slot: its stream and its fence."""

    stream: str
    fence: str


@dataclass(frozen=True, kw_only=True)
class RaiseFence(LuaScript[bytes | str]):
    """RAISE_FENCE: each job's fence now holds its new claim, unless a newer claim raised it already.

    Returns one '1' (raised: the claim may write) or '0' (a newer claim holds the fence) per job."""

    jobs: KeyList[FencedStream]
    leases: ArgList[str]           # per job: ``<worker token>#<claim number>``
    ttl_s: Arg[int]                # the fence lives as long as a live stream (a flush refreshes it)

    BODY = """
local out = {}
for job = 1, #jobs do
  local lease = leases[job]
  local seq = string.match(lease, '#(%d+)$')
  local held = redis.call('HGET', jobs[job].fence, 'seq')
  if held and #held > #seq or (held and #held == #seq and held > seq) then
    out[job] = '0'
  else
    redis.call('HSET', jobs[job].fence, 'seq', seq, 'lease', lease)
    redis.call('EXPIRE', jobs[job].fence, ttl_s)
    out[job] = '1'
  end
end
return table.concat(out)
"""


@dataclass(frozen=True, kw_only=True)
class StreamFlush(LuaScript[bytes | str]):
    """STREAM_FLUSH: append each job's entries to its stream, each job fenced by its lease.

    Returns one '1'/'0' per job ('0': the job's fence holds another claim, nothing written). A flush
    id already applied (re-sent because its reply was lost) gets its first answer again, unwritten:
    the writer's mark, beside the streams, keeps the last one. Unfenced jobs (lease '': a producer
    ending a job no worker runs) are always written. A flush costs 2 commands, one HGET per fenced
    job and one XADD per entry."""

    flush_mark: Key                # the writer's last flush id and its answer (in the streams' slot)
    jobs: KeyList[FencedStream]
    flush_id: Arg[str]
    maxlen: Arg[int]               # each stream's approximate length at most (XADD MAXLEN ~)
    live_ttl_s: Arg[int]
    final_ttl_s: Arg[int]          # also how long the flush mark is kept
    leases: ArgList[str]           # per job, in the order of ``jobs`` ('' = not fenced)
    ttls: ArgList[int]             # 0 keep the stream's TTL, 1 live, 2 final
    entry_counts: ArgList[int]
    entries: ArgList[str | int]    # per entry, job after job: n (2 x its fields), then field, value, ...

    BODY = """
local mark = redis.call('GET', flush_mark)
local prefix = flush_id .. '|'
if mark and string.sub(mark, 1, #prefix) == prefix then return string.sub(mark, #prefix + 1) end
local out, at = {}, 1
for job = 1, #jobs do
  local ok = leases[job] == '' or redis.call('HGET', jobs[job].fence, 'lease') == leases[job]
  for _ = 1, entry_counts[job] do
    local n = tonumber(entries[at])
    if ok then
      local cmd = {'XADD', jobs[job].stream, 'MAXLEN', '~', maxlen, '*'}
      for f = 1, n do cmd[#cmd + 1] = entries[at + f] end
      redis.call(unpack(cmd))
    end
    at = at + n + 1
  end
  local ttl = (ttls[job] == 1 and live_ttl_s) or (ttls[job] == 2 and final_ttl_s) or nil
  if ok and ttl then
    redis.call('EXPIRE', jobs[job].stream, ttl)
    if leases[job] ~= '' then redis.call('EXPIRE', jobs[job].fence, ttl) end
  end
  out[job] = ok and '1' or '0'
end
local answer = table.concat(out)
redis.call('SET', flush_mark, prefix .. answer, 'EX', final_ttl_s)
return answer
"""
