"""What writes job streams: one flush of a worker's stream writer (STREAM_FLUSH), every job's
pending entries in one call (:class:`slotq.jobs.protocol.streams.StreamAppender` sends it)."""

from __future__ import annotations

from dataclasses import dataclass

from slotq.jobs.protocol.scripts.layout import Arg, ArgList, Key, KeyList, LuaScript


@dataclass(frozen=True, kw_only=True)
class StreamFlush(LuaScript[bytes | str]):
    """STREAM_FLUSH: append each job's entries to its stream, each job fenced by its lease.

    Returns one '1'/'0' per job ('0': the lease no longer owns the job, nothing written). A flush id
    already applied (re-sent because its reply was lost) gets its first answer again, unwritten.
    The fences of all jobs are read with one HMGET: a flush costs 4 commands plus one XADD per entry."""

    owners: Key                    # the queue's owners hash ('' when not fenced)
    flush_mark: Key                # the writer's last flush id and its answer
    streams: KeyList[str]          # one per job
    fenced: Arg[bool]              # write a job's entries only while its lease owns it
    flush_id: Arg[str]
    maxlen: Arg[int]               # each stream's approximate length at most (XADD MAXLEN ~)
    live_ttl_s: Arg[int]
    final_ttl_s: Arg[int]          # also how long the flush mark is kept
    job_ids: ArgList[str]          # per job, in the order of ``streams``
    leases: ArgList[str]
    ttls: ArgList[int]             # 0 keep the stream's TTL, 1 live, 2 final
    entry_counts: ArgList[int]
    entries: ArgList[str | int]    # per entry, job after job: n (2 x its fields), then field, value, ...

    BODY = """
local mark = redis.call('GET', flush_mark)
local prefix = flush_id .. '|'
if mark and string.sub(mark, 1, #prefix) == prefix then return string.sub(mark, #prefix + 1) end
local owned_by = {}
if fenced and #job_ids > 0 then owned_by = redis.call('HMGET', owners, unpack(job_ids)) end
local out, at = {}, 1
for job = 1, #job_ids do
  local ok = not fenced or owned_by[job] == leases[job]
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
  if ok and ttls[job] == 2 then redis.call('EXPIRE', streams[job], final_ttl_s) end
  out[job] = ok and '1' or '0'
end
local answer = table.concat(out)
redis.call('SET', flush_mark, prefix .. answer, 'EX', final_ttl_s)
return answer
"""
