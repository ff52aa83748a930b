"""Prometheus metrics of a worker (``SLOTQ_METRICS_PORT``; 0 = off).

Names mirror llama-server's where the meaning is the same (under the ``slotq_`` prefix), plus
what llama-server lacks: queue depth and age, KV usage, TTFT and inter-token latency
histograms, retries, lost attempts (interruptions apart from failures), dead letters,
preemptions, Redis failures by kind (an outage apart from an error no retry outlasts) and the
stream writer's backlog. They are served, with /ready and /live, by :mod:`slotq.jobs.worker.health`; the elastic
worker's own metrics are in :mod:`slotq.jobs.worker.elastic.metrics`. Engine counters are sampled from
``Engine.stats()`` once a second, so the hot path does no metric work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

from slotq.engine import EngineStats
from slotq.engine.config import SpecMode
from slotq.jobs.protocol.connection import is_transient
from slotq.jobs.protocol.redis_queue import LaneCounts
from slotq.jobs.protocol.schemas import JobResult

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)

PROMPT_TOKENS = Counter("slotq_prompt_tokens", "Prompt tokens computed (not served from the prefix cache)")
PROMPT_TOKENS_CACHED = Counter("slotq_prompt_tokens_cached", "Prompt tokens served from the prefix cache")
TOKENS_PREDICTED = Counter("slotq_tokens_predicted", "Generated tokens")
N_DECODE = Counter("slotq_n_decode", "llama_decode calls")
PREEMPTIONS = Counter("slotq_preemptions", "Sequences preempted for lack of KV space")
DECODE_SECONDS = Counter("slotq_decode_seconds", "Wall time of the llama_decode calls (slotq_n_decode_total of them)")
LORA_SWITCHES = Counter("slotq_lora_switches", "Decodes run under another LoRA adapter set than the one before: a set "
                        "keeps the turn while it has work, at most SLOTQ_LORA_TURN_MAX_STEPS steps while another set "
                        "has work (scheduler rule 10)")
LORA_SWITCH_SECONDS = Counter(
    "slotq_lora_switch_decode_seconds", "llama_decode time of those decodes (llama.cpp reserves its graph again after "
    "a switch): against slotq_decode_seconds_total / slotq_n_decode_total, what a switch costs")
REQUESTS_PROCESSING = Gauge("slotq_requests_processing", "Sequences holding a slot")
REQUESTS_DEFERRED = Gauge("slotq_requests_deferred", "Sequences waiting for a slot inside the engine")
BUSY_SLOTS_PER_DECODE = Gauge("slotq_n_busy_slots_per_decode", "Average sequences per llama_decode")
SLOTS_TOTAL = Gauge("slotq_slots_total", "Slots of this worker")
KV_USAGE = Gauge("slotq_kv_cache_usage_ratio",
                 "KV cells held for running sequences / total KV cells (idle prefix caches, dropped when space "
                 "is needed, do not count)")
BATCH_LIMIT = Gauge("slotq_batch_limit_tokens", "Token budget of one llama_decode now (smaller while degraded)")
PREFILL_CHUNK_LIMIT = Gauge("slotq_prefill_chunk_limit_tokens",
                            "Prompt tokens of one sequence per decode step now (smaller while degraded)")
SPEC_DRAFT_TOKENS = Counter(
    "slotq_spec_draft_tokens", "Speculative decoding: draft tokens decoded for verification, after each sequence's "
    "own token in the shared decode step (vLLM: vllm:spec_decode_num_draft_tokens_total)")
SPEC_ACCEPTED_TOKENS = Counter(
    "slotq_spec_accepted_tokens", "Speculative decoding: draft tokens verification kept, each a token generated "
    "without a decode step of its own (vLLM: vllm:spec_decode_num_accepted_tokens_total); acceptance over a window: "
    "rate(slotq_spec_accepted_tokens_total[5m]) / rate(slotq_spec_draft_tokens_total[5m])")
SPEC_ACCEPTANCE = Gauge("slotq_spec_acceptance_ratio",
                        "slotq_spec_accepted_tokens_total / slotq_spec_draft_tokens_total since the worker started, "
                        "the figure `slotq status` shows (NaN before the first draft)")
SPEC_SOURCE = Gauge("slotq_spec_source", "1 for the draft source in force (off, ngram or draft: SLOTQ_SPEC decided), "
                    "0 for the others", ["source"])
KV_CACHED = Gauge("slotq_kv_cache_cached_ratio", "KV cells only idle prefix caches hold / total KV cells")
QUEUE_WAITING = Gauge("slotq_queue_waiting", "Jobs waiting to be claimed", ["lane"])
QUEUE_DEFERRED = Gauge("slotq_queue_deferred", "Jobs waiting out a retry backoff", ["lane"])
QUEUE_RUNNING = Gauge("slotq_queue_running", "Jobs claimed by a worker (whole fleet)", ["lane"])
QUEUE_OLDEST_AGE = Gauge("slotq_queue_oldest_waiting_age_seconds", "Age of the oldest job not yet claimed", ["lane"])
LANE_PREEMPTIONS = Counter(
    "slotq_lane_preemptions", "Jobs this worker handed back (no try spent, resumed from their stream) to give their "
    "slot to a waiting job of a higher lane, by the lane of the job handed back", ["lane"])
LANE_RESERVE_RUNS = Counter(
    "slotq_lane_reserve_runs", "Jobs of a higher lane this worker ran in its reserve (a spare KV stream) beside a "
    "full batch of lower-lane jobs, instead of handing one back, by the lane of the job run", ["lane"])
TENANT_RESERVE_RUNS = Counter(
    "slotq_tenant_reserve_runs", "Jobs of a tenant with nothing running this worker ran in its reserve beside a full "
    "batch of other tenants' jobs of their lane, instead of leaving them to wait for a slot, by lane", ["lane"])
QUEUE_PREEMPTED = Gauge("slotq_queue_preempted", "Jobs of this lane that yielded their slot to a higher lane, whole "
                        "fleet, since the queue began", ["lane"])
PICKUP = Histogram("slotq_queue_pickup_seconds", "Enqueue (or retry due) to claim by this worker", ["lane"],
                   buckets=LATENCY_BUCKETS)
MODEL_LOAD = Histogram("slotq_model_load_seconds", "What loading a model cost this worker: engine start and warm-up "
                       "decode, until it claims (a worker of several models, at each switch)", ["model"],
                       buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300))
JOBS = Counter("slotq_jobs", "Finished job attempts by status", ["status"])
RETRIES = Counter("slotq_retries", "Attempts that failed and were scheduled for retry")
ATTEMPTS_LOST = Counter(
    "slotq_attempts_lost", "Attempts lost with their worker (killed, stalled past the lease), judged when the job "
    "starts again: counted_as=interruption if they had delivered new tokens (no try spent), failure if not",
    ["counted_as"])
for _counted_as in ("interruption", "failure"):
    ATTEMPTS_LOST.labels(counted_as=_counted_as)       # exported at 0 from the start, so rate() sees the first one
DEAD_LETTERS = Counter(
    "slotq_dead_letters", "Jobs dead-lettered by this worker, by reason (the error code: killed_its_worker, "
    "tries_exhausted, interruptions_exhausted, poison_payload, invalid_payload, unsupported_payload_version, "
    "wrong_model, wrong_job_kind, or the code of the retryable error the last try ended with)", ["reason"])
for _reason in ("killed_its_worker", "tries_exhausted", "interruptions_exhausted"):
    DEAD_LETTERS.labels(reason=_reason)                # exported at 0 from the start, so rate() sees the first one
REDIS_FAILURES = Counter(
    "slotq_redis_failures", "Redis commands of this worker that failed, by operation (flush: a stream flush; claim: "
    "CLAIM, PREEMPT or LEND_RESERVE; reap: the reaper's REAP) and kind (transient: an outage, a failover, a "
    "loading server, which a retry outlasts; deterministic: a Lua error, OOM, a bad argument or WRONGTYPE, which "
    "the same command gets again)", ["operation", "kind"])
for _operation in ("flush", "claim", "reap"):
    for _kind in ("transient", "deterministic"):
        REDIS_FAILURES.labels(operation=_operation, kind=_kind)    # exported at 0, so rate() sees the first one
STREAM_BUFFERED_TOKENS = Gauge("slotq_stream_buffered_tokens",
                               "Generated tokens the stream writer holds that Redis has not acknowledged yet")
STREAM_OLDEST_UNFLUSHED = Gauge(
    "slotq_stream_oldest_unflushed_age_seconds", "How long the oldest stream entry Redis has not acknowledged has "
    "waited (0 when none): over SLOTQ_HEALTH_MAX_STALL_S, /ready fails")
TTFT = Histogram("slotq_time_to_first_token_seconds", "Submit to first token, in the engine", buckets=LATENCY_BUCKETS)
INTER_TOKEN = Histogram("slotq_inter_token_latency_seconds", "Mean time between tokens of a job",
                        buckets=TOKEN_BUCKETS)


def observe_result(result: JobResult) -> None:
    JOBS.labels(status=result.status.value).inc()
    timings = result.timings
    if timings is not None and timings.ttft_ms is not None:
        TTFT.observe(timings.ttft_ms / 1000)
    if timings is not None and timings.decode_tokens_per_s:
        INTER_TOKEN.observe(1 / timings.decode_tokens_per_s)


# Counters fed from cumulative EngineStats fields.
_COUNTED = (
    (PROMPT_TOKENS, "prompt_tokens_processed"),
    (PROMPT_TOKENS_CACHED, "prompt_tokens_cached"),
    (TOKENS_PREDICTED, "generated_tokens"),
    (N_DECODE, "decode_steps"),
    (PREEMPTIONS, "preemptions"),
    (DECODE_SECONDS, "decode_seconds"),
    (LORA_SWITCHES, "lora_switches"),
    (LORA_SWITCH_SECONDS, "lora_switch_seconds"),
    (SPEC_DRAFT_TOKENS, "spec_draft_tokens"),
    (SPEC_ACCEPTED_TOKENS, "spec_accepted_tokens"),
)
SPEC_SOURCES = tuple(mode for mode in SpecMode if mode != SpecMode.AUTO)    # what the engine reports (AUTO decided)


class EngineSampler:
    """Turns successive ``EngineStats`` snapshots into counter increments and gauges."""

    def __init__(self) -> None:
        self._last: EngineStats | None = None

    def update(self, stats: EngineStats) -> None:
        for counter, name in _COUNTED:
            before = getattr(self._last, name) if self._last else 0
            counter.inc(max(0, getattr(stats, name) - before))
        self._last = stats
        REQUESTS_PROCESSING.set(stats.slots_busy)
        REQUESTS_DEFERRED.set(stats.waiting)
        BUSY_SLOTS_PER_DECODE.set(stats.avg_busy_slots_per_decode)
        SLOTS_TOTAL.set(stats.slots_total)
        BATCH_LIMIT.set(stats.batch_limit)
        PREFILL_CHUNK_LIMIT.set(stats.prefill_chunk_limit)
        KV_USAGE.set(stats.kv_active_ratio)
        KV_CACHED.set(stats.kv_cells_cached / stats.kv_cells_total if stats.kv_cells_total else 0)
        acceptance = stats.spec_acceptance
        SPEC_ACCEPTANCE.set(acceptance if acceptance is not None else math.nan)
        for source in SPEC_SOURCES:
            SPEC_SOURCE.labels(source=source.value).set(int(stats.spec == source))


def redis_failure(operation: str, error: BaseException) -> None:
    """Count a failed Redis command of ``operation`` (flush, claim, reap) by its kind."""
    kind = "transient" if is_transient(error) else "deterministic"
    REDIS_FAILURES.labels(operation=operation, kind=kind).inc()


def sample_stream_backlog(tokens: int, oldest_s: float) -> None:
    """The stream writer's backlog (:meth:`~slotq.jobs.worker.stream_writer.StreamWriter.backlog`)."""
    STREAM_BUFFERED_TOKENS.set(tokens)
    STREAM_OLDEST_UNFLUSHED.set(oldest_s)


def sample_queue(counts: Sequence[LaneCounts]) -> None:
    """Per-lane queue gauges from :meth:`RedisQueue.counts` (each O(1) in Redis)."""
    for c in counts:
        QUEUE_WAITING.labels(lane=c.lane).set(c.waiting)
        QUEUE_DEFERRED.labels(lane=c.lane).set(c.deferred)
        QUEUE_RUNNING.labels(lane=c.lane).set(c.running)
        QUEUE_PREEMPTED.labels(lane=c.lane).set(c.preempted)
        QUEUE_OLDEST_AGE.labels(lane=c.lane).set(c.oldest_waiting_age_s or 0.0)
