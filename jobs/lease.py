"""Job leases: who may run a job and write its stream right now.

arq marks a claimed job with an ``arq:in-progress:{id}`` key holding ``1`` that lives for
job_timeout + 10 s. slotq replaces that value with the worker's own token at job start, keeps a
short TTL renewed by the heartbeat, and makes every stream write check the token atomically. A
worker that stalled or lost Redis for longer than the TTL, while another worker claimed the job,
finds a foreign value: its writes are refused and it abandons the job instead of running it twice.
A key that lapsed while nobody claimed the job (the job is still in the queue) is taken back.
"""

from __future__ import annotations

from dataclasses import dataclass

from arq.constants import in_progress_key_prefix

# KEYS: lock, queue; ARGV: token, job id, ttl ms. True when the caller holds (or retook) the lease.
_OWNS = """
local function owns(lock, queue, token, job_id, ttl)
  local holder = redis.call('GET', lock)
  if holder == token then return true end
  if not holder and redis.call('ZSCORE', queue, job_id) then
    redis.call('SET', lock, token, 'PX', ttl)
    return true
  end
  return false
end
"""

RENEW_SCRIPT = _OWNS + """
if owns(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"""

# KEYS: lock, queue, stream, write mark; ARGV: token ('' = unfenced), job id, ttl ms, maxlen,
# stream ttl s, batch id, then per entry: n, field, value, ... (n = 2 x fields).
# Returns 0 when the lease is someone else's, 1 when written (or already written: a batch whose
# reply was lost and that is sent again carries the same id and is not appended twice).
FENCED_XADD_SCRIPT = _OWNS + """
if ARGV[1] ~= '' and not owns(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3]) then return 0 end
if redis.call('GET', KEYS[4]) == ARGV[6] then return 1 end
redis.call('SET', KEYS[4], ARGV[6], 'EX', ARGV[5])
local i = 7
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local cmd = {'XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*'}
  for j = 1, n do cmd[#cmd + 1] = ARGV[i + j] end
  redis.call(unpack(cmd))
  i = i + n + 1
end
redis.call('EXPIRE', KEYS[3], ARGV[5])
return 1
"""


@dataclass(frozen=True)
class Lease:
    """This worker's lease token and the lock settings its jobs use."""

    token: str
    queue_name: str
    ttl_ms: int

    @staticmethod
    def lock_key(job_id: str) -> str:
        return in_progress_key_prefix + job_id
