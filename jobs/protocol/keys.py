"""Every Redis key slotq's processes share: a queue's, arq's records, job streams, dead letters
and the worker registry. A name that is one key has one function here; no other module spells a
key (the gateway's own records, read by gateway replicas only, are in
:mod:`slotq.jobs.gateway.records`).

Keys of no one queue (per-job keys put the job id in braces, so a future move to Redis Cluster
keeps them in one slot):

================================  ======  ===========================================================
``slotq:stream:{<id>}``           STREAM  the job's output entries (:mod:`slotq.jobs.protocol.streams`)
``slotq:fences``                  HASH    job id -> its stream fence: the lease of the newest claim that raised it
                                          (on a cluster one per stream bucket: ``slotq:fences:{<bucket tag>}``)
``slotq:stream-mark:<writer>``    STRING  the last flush a stream writer applied, and its answer (on a cluster
                                          one per stream bucket: ``slotq:stream-mark:{<bucket tag>}:<writer>``)
``slotq:dlq:{<id>}``              HASH    a dead letter (:mod:`slotq.jobs.protocol.dead_letters`; on a cluster
                                          every dead-letter key is named otherwise, see :class:`DeadLetterKeys`)
``slotq:dlq``                     ZSET    job id -> time it was dead-lettered
``slotq:dlq:reasons``             HASH    reason (the error code) -> dead letters kept with it
``slotq:worker:<worker id>``      HASH    a live worker's heartbeat, with a TTL (:mod:`slotq.jobs.protocol.registry`)
``slotq:workers``                 ZSET    worker id -> time of its last heartbeat (ms)
``slotq:catalog``                 HASH    ``<model><TAB><worker id>`` -> what that worker can load, as JSON: the models
                                          a fleet can serve, loaded or not (:mod:`slotq.jobs.protocol.catalog`)
``slotq:catalog:loading:<model>`` STRING  the worker switching to load the model, with a TTL: one idle worker, not
                                          all, answers a model's demand (:mod:`slotq.jobs.protocol.catalog`)
================================  ======  ===========================================================

A queue ``Q`` (one per model, ``SLOTQ_QUEUE_NAME``) with lanes ``L`` (highest priority first):

================================  ======  ===========================================================
``Q:waiting:L``                   ZSET    job id -> place in line (its fair-share tag); claimed lowest first
``Q:deferred:L``                  ZSET    job id -> run-at time (ms, Redis' clock) of a retry waiting out its backoff
``Q:running:L``                   ZSET    job id -> lease deadline ms (Redis' clock); expired ones are reaped
``Q:jobs``                        HASH    job id -> ``lane<TAB>ready ms<TAB>place<TAB>tenant``, every job in the queue
``Q:tags:L``                      ZSET    tenant -> place of its newest job in lane L (dropped when L runs dry)
``Q:preempt:L``                   LIST    one token per job of lane L that waits while a lower lane runs (capped)
``Q:fair:L``                      LIST    one token per job of lane L whose tenant had nothing running or waiting while
                                          lane L had running jobs (capped): a full worker lends it its reserve
``Q:preemptions``                 HASH    lane -> jobs of that lane that yielded their slot to a higher lane
``Q:tenant_waiting``              HASH    tenant -> its jobs waiting or deferred (only tenants with some)
``Q:tenant_running``              HASH    tenant -> its jobs running (only tenants with some)
``Q:tenant_tokens``               HASH    tenant -> ``minute<TAB>tokens`` admitted in that minute (the tokens quota)
``Q:owners``                      HASH    job id -> lease of the attempt running it (``<worker token>#<claim number>``)
``Q:progress``                    HASH    job id -> ``accounted<TAB>started<TAB>tokens<TAB>interruptions<TAB>deaths``
``Q:attempt_outcomes``            HASH    ``interrupted`` / ``failed`` -> attempts judged so, since the queue began
``Q:wake``                        LIST    one token per waiting job (capped): an idle worker BLPOPs one
``Q:claim_seq``                   STRING  the number of the queue's newest claim (see :attr:`QueueKeys.claim_seq`)
``Q:serving``                     HASH    worker id -> ``<until ms><TAB><kind><TAB><model>[<TAB><partitions>]``: the
                                          workers serving the queue, all of one model, kind and partition count
                                          (:mod:`slotq.jobs.protocol.scripts.serving`)
``Q:claim_mark:<token>``          STRING  a worker's last claim id and its reply, replayed to the claim re-sent after a
                                          lost reply (:mod:`slotq.jobs.protocol.scripts.claims`); lives one lease
``Q:abort:<token>``               PUBSUB  cancel requests for the jobs of one worker
``arq:job:<arq id>``              STRING  the job record in arq's format (function, payload, enqueue time)
``arq:retry:<arq id>``            STRING  attempt counter (arq's ``run_job`` increments it)
``arq:result:<arq id>``           STRING  the result record in arq's format
``arq:abort``                     ZSET    arq's pending aborts, by arq id (checked by ``run_job`` before a job starts)
================================  ======  ===========================================================

**On a Redis Cluster** (:attr:`QueueKeys.clustered`) every key of a queue and its jobs' arq keys
share one hash slot, and each job's stream and fence share another, the job's own:

* the queue's keys begin with ``{Q}`` instead of ``Q`` (``{slotq:queue}:waiting:interactive``; a
  queue name that already holds a ``{...}`` hash tag is used as it is), so every script of the
  claim path (enqueue, claim, preempt, renew, finish, retry, hand back, reap, cancel) stays one
  atomic script in one slot;
* a job's *arq id*, the id arq's ``run_job`` sees and builds its keys from, is ``{Q}:<id>``
  (``arq:job:{slotq:queue}:<id>``), so the job record, attempt counter and result record live in
  the queue's slot too; on a single Redis the arq id is the job id;
* a job's stream is ``slotq:stream:{<bucket tag>}:<id>``, in one of :data:`STREAM_BUCKETS` buckets
  picked by the job id, whose hash tags hash into equal parts of the slot space: the streaming load
  -- most of what a fleet writes -- spreads over the shards, while a writer's flush and a reader's
  blocking XREAD still cover many jobs in one command per bucket. The bucket's fences
  (``slotq:fences:{<bucket tag>}``) are what let a stream write be checked against the job's owner
  without the queue's slot (:mod:`slotq.jobs.protocol.scripts.stream_flush`);
* dead letters share one slot of their own (:class:`DeadLetterKeys`), so recording and removing
  one stays one atomic script;
* ``arq:abort`` and the worker registry are keys of their own slots, written by one command each.

docs/cluster.md writes the protocol down: which steps span two slots, in what order, and why no
job is lost or token written twice when a process dies between them.

**Partitions** (``SLOTQ_QUEUE_PARTITIONS``, :mod:`slotq.jobs.protocol.partitioned_queue`): a queue ``Q`` of P > 1
partitions is P queues of the layout above, ``Q`` itself and ``Q#<n>`` for partitions 1..P-1
(:func:`partition_names`: each ``n`` picked so that the partitions' hash slots lie P-ths of the slot space
apart, one per primary of an evenly split cluster of P). A job lives in partition
``crc32(job id) mod P`` (:func:`partition_of`) with every key of it -- its entries in the partition's
sets and hashes, and its arq keys under the partition's arq id (``arq:job:{Q#<n>}:<id>`` on a cluster,
:class:`PartitionedKeys`). ``Q:serving`` (partition 0's) names each worker's P after its model when
above 1. With P = 1 nothing here changes.

A job's *place* in its lane is its fair-share tag (:mod:`slotq.jobs.protocol.scripts`, ``ENQUEUE``):
``place of its tenant's newest job + 1`` while the tenant has jobs waiting in the lane, else
``ceil(place of the lane's next job) - 0.5``, or in an empty lane its ready time + 1, never below
the lane's newest place + 1 (so a job handed back goes ahead of every job enqueued after it). Within a
tenant, places follow enqueue order; a tenant with nothing waiting goes just ahead of the lane's
next job (level with another tenant that did the same; equal places go in job id order), however
many jobs other tenants have queued. A job handed
back, reaped or promoted after its retry backoff keeps its place. An entry of ``Q:jobs`` written
before places existed (``lane<TAB>ready ms``) has its ready time as its place, and one written
before tenants were counted belongs to the default tenant.

The per-tenant counts move in the same script that moves the job (enqueue, claim, preempt, retry,
hand-back, reap, finish, cancel), so they are exact and reading one is O(1); ENQUEUE checks a
tenant's quotas against them (:class:`slotq.jobs.protocol.redis_queue.TenantQuotas`).

``Q:progress`` is how a lost attempt is told from a failed one (:mod:`slotq.jobs.protocol.scripts`,
``START_ATTEMPT``): attempts up to ``accounted`` have been judged; attempt ``started`` began with
``tokens`` delivered tokens in the job's stream; ``interruptions`` earlier attempts were lost after
delivering new tokens, and so spent no try; the last ``deaths`` attempts that started were lost
without delivering any (their worker died), in a row: at ``SLOTQ_MAX_WORKER_DEATHS`` the job is refused.

Counts are O(1): ZCARD of a lane's sets, HLEN of ``Q:jobs`` (everything not finished, the demand
KEDA scales on), HGET of a tenant's counts. This module is the only place that knows arq's key names
(their prefixes are spelled out in :mod:`slotq.jobs.protocol.arq_formats`).
"""

from __future__ import annotations

import functools
import itertools
import re
import zlib
from dataclasses import dataclass

from redis.crc import key_slot

from slotq.jobs.protocol.arq_formats import ABORT_JOBS_SET, JOB_KEY_PREFIX, RESULT_KEY_PREFIX, RETRY_KEY_PREFIX

LANE_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
DEFAULT_TENANT = "default"       # the tenant of a job that names none (JobRequest.tenant's default)
JOB_FUNCTION = "generate"        # the one arq function name
WORKER_INDEX = "slotq:workers"
CATALOG = "slotq:catalog"


CLUSTER_SLOTS = 16_384
# On a cluster: job streams spread over at most this many shards. 48 falls evenly on 2, 3, 4, 6, 8, 12, 16,
# 24 and 48 primaries (16 per primary at 3, 8 at 6).
STREAM_BUCKETS = 48


def _spread_tags(count: int) -> tuple[str, ...]:
    """``count`` hash tags, the k-th hashing into the middle half of the k-th of ``count`` equal ranges of
    the slots, so on a cluster whose primaries hold equal contiguous ranges (as every tool splits them,
    however it rounds their edges) the buckets fall on the primaries as evenly as ``count`` allows
    (exactly when the primaries divide it)."""
    width = CLUSTER_SLOTS / count
    tags = []
    for k in range(count):
        low, high = (k + 0.25) * width, (k + 0.75) * width
        tags.append(next(f"b{k}.{n}" for n in itertools.count() if low <= key_slot(f"b{k}.{n}".encode()) < high))
    return tuple(tags)


STREAM_TAGS = _spread_tags(STREAM_BUCKETS)


MAX_QUEUE_PARTITIONS = 64


def partition_of(job_id: str, partitions: int) -> int:
    """The partition of a queue of ``partitions`` that holds ``job_id`` (``SLOTQ_QUEUE_PARTITIONS``): a pure
    function of the id, so every process that knows the count finds a job's partition from its id alone."""
    return zlib.crc32(job_id.encode()) % partitions if partitions > 1 else 0


@functools.lru_cache(maxsize=256)
def partition_names(queue: str, partitions: int) -> tuple[str, ...]:
    """The names of the ``partitions`` sub-queues of ``queue`` (``SLOTQ_QUEUE_PARTITIONS``), each a whole
    queue of :class:`QueueKeys`'s layout. Partition 0 is ``queue`` itself, so one partition is exactly the
    unpartitioned queue; partition ``i >= 1`` is ``<queue>#<n>``, ``n`` the smallest integer whose hash slot
    (on a cluster the name is the keys' hash tag) lies ``i`` P-ths of the slot space after ``queue``'s own
    slot. On a cluster whose primaries hold equal contiguous slot ranges (every tool splits them so) the P
    partitions then sit at the same place in P consecutive primaries' ranges: one per primary when there are
    P of them, whatever slot ``queue``'s name happens to hash to. Relative to ``queue``'s slot rather than
    absolute parts because partition 0's slot is fixed by the name: absolute parts would put it beside
    another partition half the time. The exact slot costs about 16,384 hashes per partition (a few ms),
    once per process.

    A name that already holds a hash tag (``{...}``) pins every key of its queue to that tag's slot, so it
    cannot be partitioned: ValueError."""
    if not 1 <= partitions <= MAX_QUEUE_PARTITIONS:
        raise ValueError(f"partitions must be 1..{MAX_QUEUE_PARTITIONS}: {partitions}")
    if partitions > 1 and re.search(r"\{[^}]+\}", queue):
        raise ValueError(f"queue {queue!r} holds a hash tag, which fixes its slot: a partitioned queue's name "
                         "must not (SLOTQ_QUEUE_PARTITIONS)")
    home = key_slot(queue.encode())
    names = [queue]
    for i in range(1, partitions):
        target = (home + round(i * CLUSTER_SLOTS / partitions)) % CLUSTER_SLOTS
        names.append(next(f"{queue}#{n}" for n in itertools.count() if key_slot(f"{queue}#{n}".encode()) == target))
    return tuple(names)


def stream_bucket(job_id: str) -> int:
    """The bucket of a job's stream on a cluster (its keys share the bucket's hash tag)."""
    return zlib.crc32(job_id.encode()) % STREAM_BUCKETS


def stream_key(job_id: str, *, clustered: bool = False) -> str:
    if clustered:
        return f"slotq:stream:{{{STREAM_TAGS[stream_bucket(job_id)]}}}:{job_id}"
    return f"slotq:stream:{{{job_id}}}"


def write_mark_key(writer_id: str, bucket: int | None = None) -> str:
    """The last flush a stream writer applied, and its answer (makes a re-sent flush idempotent): one
    per writer, and on a cluster one per stream ``bucket``, in the slot of the bucket's streams."""
    if bucket is None:
        return f"slotq:stream-mark:{writer_id}"
    return f"slotq:stream-mark:{{{STREAM_TAGS[bucket]}}}:{writer_id}"


def fences_key(bucket: int | None = None) -> str:
    """The stream fences (job id -> lease, :mod:`slotq.jobs.protocol.scripts.stream_flush`): one hash on
    a single Redis, one per stream ``bucket`` on a cluster, in the slot of the bucket's streams."""
    return "slotq:fences" if bucket is None else f"slotq:fences:{{{STREAM_TAGS[bucket]}}}"


def job_fences_key(job_id: str, *, clustered: bool = False) -> str:
    """The fences hash that holds ``job_id``'s fence."""
    return fences_key(stream_bucket(job_id) if clustered else None)


def worker_key(worker_id: str) -> str:
    return f"slotq:worker:{worker_id}"


def loading_key(model: str) -> str:
    """Which worker is switching to ``model`` (:mod:`slotq.jobs.protocol.catalog`)."""
    return f"slotq:catalog:loading:{model}"


# arq's keys of a job, from its arq id (:meth:`QueueKeys.arq_id`; the job id on a single Redis)
def job_record_key(arq_id: str) -> str:
    return JOB_KEY_PREFIX + arq_id


def retry_counter_key(arq_id: str) -> str:
    return RETRY_KEY_PREFIX + arq_id


def result_key(arq_id: str) -> str:
    return RESULT_KEY_PREFIX + arq_id


ABORTS = ABORT_JOBS_SET


@dataclass(frozen=True)
class DeadLetterKeys:
    """The keys of the dead letters, which belong to no queue (:mod:`slotq.jobs.protocol.dead_letters`).

    On a single Redis they keep the names they always had: a record ``slotq:dlq:{<id>}``, the index
    ``slotq:dlq`` and the count per reason ``slotq:dlq:reasons``. On a Redis Cluster (``clustered``) a
    record, the index and the counts are written by one script, so they share the hash tag
    ``{slotq:dlq}``: ``{slotq:dlq}:job:<id>``, ``{slotq:dlq}:index``, ``{slotq:dlq}:reasons`` (the
    records' ``job:`` keeps a job named ``index`` or ``reasons`` apart). One slot holds them all: a
    dead letter is rare, and an operator reads them as one list."""

    clustered: bool = False

    def record(self, job_id: str) -> str:
        return f"{{slotq:dlq}}:job:{job_id}" if self.clustered else f"slotq:dlq:{{{job_id}}}"

    @property
    def index(self) -> str:
        """Job id -> the time it was dead-lettered."""
        return "{slotq:dlq}:index" if self.clustered else "slotq:dlq"

    @property
    def reasons(self) -> str:
        """Reason (the error code) -> dead letters kept with it."""
        return "{slotq:dlq}:reasons" if self.clustered else "slotq:dlq:reasons"


@dataclass(frozen=True)
class QueueKeys:
    """The key names of one queue and its lanes; ``clustered``: laid out for a Redis Cluster (see
    the module)."""

    queue: str
    lanes: tuple[str, ...]
    clustered: bool = False

    def __post_init__(self) -> None:
        if not self.lanes or len(set(self.lanes)) != len(self.lanes):
            raise ValueError(f"lanes must be distinct and at least one: {self.lanes}")
        for lane in self.lanes:
            if not LANE_RE.match(lane):
                raise ValueError(f"lane {lane!r}: use 1-32 of a-z 0-9 _ - starting with a letter")

    @property
    def prefix(self) -> str:
        """What every key of the queue begins with: its name, wrapped in a hash tag on a cluster."""
        if not self.clustered or re.search(r"\{[^}]+\}", self.queue):
            return self.queue
        return f"{{{self.queue}}}"

    def arq_id(self, job_id: str) -> str:
        """The id arq's ``run_job`` sees for ``job_id``, which its keys are built from: on a cluster
        ``<the queue's prefix>:<job id>``, so they share the queue's slot."""
        return f"{self.prefix}:{job_id}" if self.clustered else job_id

    def job_id(self, arq_id: str) -> str:
        """The job id of an arq id (:meth:`arq_id` undone)."""
        return arq_id.removeprefix(f"{self.prefix}:") if self.clustered else arq_id

    def waiting(self, lane: str) -> str:
        return f"{self.prefix}:waiting:{lane}"

    def deferred(self, lane: str) -> str:
        return f"{self.prefix}:deferred:{lane}"

    def running(self, lane: str) -> str:
        return f"{self.prefix}:running:{lane}"

    def tags(self, lane: str) -> str:
        return f"{self.prefix}:tags:{lane}"

    def preempt(self, lane: str) -> str:
        return f"{self.prefix}:preempt:{lane}"

    def fair(self, lane: str) -> str:
        return f"{self.prefix}:fair:{lane}"

    @property
    def preemptions(self) -> str:
        return f"{self.prefix}:preemptions"

    @property
    def jobs(self) -> str:
        """Every job of the queue that is not finished (waiting, deferred or running), so HLEN of it
        is the queue's demand in O(1). The key KEDA scales workers on: the ``redis`` trigger's
        ``listName`` is ``<SLOTQ_QUEUE_NAME>:jobs``, ``slotq:queue:jobs`` by default
        (deploy/kubernetes/keda-scaledobject.yaml; tests/e2e/test_deploy.py checks the two agree).
        Demand rather than waiting jobs, because the HPA sets replicas = ceil(metric / target): a
        metric of waiting jobs alone would scale a busy fleet down whenever the backlog is short."""
        return f"{self.prefix}:jobs"

    @property
    def tenant_waiting(self) -> str:
        return f"{self.prefix}:tenant_waiting"

    @property
    def tenant_running(self) -> str:
        return f"{self.prefix}:tenant_running"

    @property
    def tenant_tokens(self) -> str:
        return f"{self.prefix}:tenant_tokens"

    @property
    def owners(self) -> str:
        return f"{self.prefix}:owners"

    @property
    def progress(self) -> str:
        return f"{self.prefix}:progress"

    @property
    def attempt_outcomes(self) -> str:
        return f"{self.prefix}:attempt_outcomes"

    @property
    def wake(self) -> str:
        return f"{self.prefix}:wake"

    @property
    def claim_seq(self) -> str:
        """The number of the queue's newest claim: every claim's lease ends in a number above the
        last (``<worker token>#<number>``), so a job's fence can tell a newer claim from an older
        one. The number is at least the server's time in microseconds, so it keeps rising after a
        failover that lost the last increments."""
        return f"{self.prefix}:claim_seq"

    @property
    def serving(self) -> str:
        """The workers serving the queue and the model and kind each serves, until when (Redis' clock):
        a worker joins only while every live entry names its own model and kind, so a queue is never
        served by two models (:class:`~slotq.jobs.protocol.scripts.serving.JoinQueue`)."""
        return f"{self.prefix}:serving"

    def claim_mark(self, token: str) -> str:
        """The last claim of the worker ``token`` (CLAIM, PREEMPT, LEND_RESERVE: one at a time per
        worker) and its reply, so that the claim re-sent after its reply was lost is answered with
        the jobs it took, not with more."""
        return f"{self.prefix}:claim_mark:{token}"

    def abort_channel(self, token: str) -> str:
        return f"{self.prefix}:abort:{token}"

    def lane_keys(self, lanes: tuple[str, ...] | None = None) -> list[LaneKeys]:
        """The keys of each of ``lanes`` (default: every lane) that the claim scripts and the reap
        move jobs between, highest priority first (the claim order)."""
        return [LaneKeys(self.waiting(lane), self.deferred(lane), self.running(lane), self.preempt(lane))
                for lane in (self.lanes if lanes is None else lanes)]


@dataclass(frozen=True)
class LaneKeys:
    """One lane's sets and its preemption tokens, as the claim scripts and the reap take them
    (one element of a script's key list: :mod:`slotq.jobs.protocol.scripts.layout`)."""

    waiting: str
    deferred: str
    running: str
    preempt: str


@dataclass(frozen=True)
class PartitionedKeys:
    """The keys of a queue split into partitions (:func:`partition_names`), as a job's arq runner sees them:
    each job's arq id is its own partition's (:func:`partition_of`), so arq's keys of a job share that
    partition's slot on a cluster. With one partition it answers exactly as that partition's :class:`QueueKeys`."""

    partitions: tuple[QueueKeys, ...]

    @property
    def queue(self) -> str:
        """The queue's name (partition 0's)."""
        return self.partitions[0].queue

    def of_job(self, job_id: str) -> QueueKeys:
        """The keys of the partition that holds ``job_id``."""
        return self.partitions[partition_of(job_id, len(self.partitions))]

    def arq_id(self, job_id: str) -> str:
        return self.of_job(job_id).arq_id(job_id)

    def job_id(self, arq_id: str) -> str:
        """The job id of an arq id of any partition (its partition's prefix removed)."""
        for keys in self.partitions:
            if keys.clustered and arq_id.startswith(f"{keys.prefix}:"):
                return keys.job_id(arq_id)
        return arq_id
