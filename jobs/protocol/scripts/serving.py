"""Which model serves a queue: a worker joins a queue only while every other live worker of it serves
the same model and kind (JOIN_QUEUE), so one queue is never served by two models.

Why a record of its own rather than the worker registry: the registry's hashes belong to no queue
(on a cluster each is in a slot of its own) and a check there is a read followed by a write, so two
workers of different models starting together could both find the queue free. ``Q:serving`` is in
the queue's slot and the check and the join are one script, so one of the two always loses.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotq.jobs.protocol.scripts.layout import Arg, Key, LuaScript
from slotq.jobs.protocol.scripts.lua import NOW


@dataclass(frozen=True, kw_only=True)
class JoinQueue(LuaScript[list[bytes]]):
    """JOIN_QUEUE: note that ``worker`` serves ``model`` (of ``kind``) on this queue until ``ttl_ms``
    from now (Redis' clock), unless another worker's entry, still live, names another model or kind.
    Entries past their time (a worker that died) are removed on the way. A worker runs it when it
    starts and with every heartbeat (it renews its entry).

    Returns an empty list when the worker joined, else ``[worker id, kind, model, partitions]`` of one
    worker that serves the queue otherwise (nothing is written then).

    ``partitions`` (``SLOTQ_QUEUE_PARTITIONS``) is part of what a worker serves: workers that split the
    queue differently would leave jobs in partitions some of them never claim. An entry names it after
    the model (``<until ms><TAB><kind><TAB><model><TAB><partitions>``) only when above 1, so a queue of
    one partition keeps the entries of every release; an entry without it is of one partition.

    A renewal whose entry is still live is O(1): while it was live no worker of another model or kind
    could join, so there is nothing to check. Only a join (or a worker back after its entry lapsed)
    reads every entry, O(workers of the queue); a fleet's heartbeats stay O(1) each."""

    serving: Key                  # the queue's workers: worker id -> until ms <TAB> kind <TAB> model [<TAB> partitions]
    worker: Arg[str]
    kind: Arg[str]
    model: Arg[str]
    ttl_ms: Arg[int]
    partitions: Arg[int] = 1

    HELPERS = NOW
    BODY = """
local now = server_ms()
local serves = kind .. '\t' .. model
if partitions > 1 then
  serves = serves .. '\t' .. partitions
end
local mine = redis.call('HGET', serving, worker)
if mine then
  local mine_until, mine_serves = string.match(mine, '^([^\t]*)\t(.*)$')
  if mine_serves == serves and tonumber(mine_until) ~= nil and tonumber(mine_until) > now then
    redis.call('HSET', serving, worker, (now + ttl_ms) .. '\t' .. serves)
    return {}
  end
end
local entries = redis.call('HGETALL', serving)
for i = 1, #entries, 2 do
  local other, entry = entries[i], entries[i + 1]
  local until_ms, other_kind, other_model = string.match(entry, '^([^\t]*)\t([^\t]*)\t(.*)$')
  local other_partitions = 1
  if other_model ~= nil then
    local model_part, partitions_part = string.match(other_model, '^(.*)\t(%d+)$')
    if model_part ~= nil then
      other_model, other_partitions = model_part, tonumber(partitions_part)
    end
  end
  if until_ms == nil or tonumber(until_ms) == nil or tonumber(until_ms) <= now then
    redis.call('HDEL', serving, other)
  elseif other ~= worker and (other_kind ~= kind or other_model ~= model or other_partitions ~= partitions) then
    return {other, other_kind, other_model, tostring(other_partitions)}
  end
end
redis.call('HSET', serving, worker, (now + ttl_ms) .. '\t' .. serves)
return {}
"""
