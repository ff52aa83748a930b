"""The queue's Lua scripts, by subsystem: :mod:`.admission` (what producers run: ENQUEUE, CANCEL,
FORGET), :mod:`.claims` (handing jobs to workers: CLAIM, PREEMPT, LEND_RESERVE), :mod:`.attempts`
(a claimed attempt until it ends: START_ATTEMPT, RENEW, FINISH, RETRY_LATER, HAND_BACK, REAP) and
:mod:`.stream_flush` (STREAM_FLUSH). Each script is one class there, whose fields are its KEYS and
ARGV for both the Python and the Lua side (:mod:`.layout`); :mod:`.lua` holds the Lua helpers
they share. Each runs atomically in Redis, so no claim, hand-back, retry or reap can interleave
with another: that is what makes "exactly one worker owns a running job" hold.

An attempt *owns* a job while ``Q:owners[id]`` holds its lease: ``<worker token>#<claim number>``,
set by the claim script and different for every claim, even when the same worker claims the job
again after its lease expired (a Redis outage longer than the lease). Only finishing, retrying,
handing back or reaping the job clears it, each in the same script that moves the job. Every write
made for an attempt (stream batches included) first checks that its lease still owns the job, so
an attempt that stalled past its lease and was reaped can never write again, not even from a
buffer its worker re-sends after claiming the job anew.

Clocks: every time a script decides with is Redis' own (``TIME``, :data:`.lua.NOW`), never a
client's, so a producer or worker whose clock runs off cannot reap live leases, keep dead ones, or
disagree with others about a tokens minute. What each script reads it for:

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
