"""Prometheus metrics: engine snapshots become counter increments and gauges."""

from __future__ import annotations

from prometheus_client import REGISTRY

from slotq.engine import EngineStats
from slotq.jobs.protocol.schemas import JobResult, JobStatus
from slotq.jobs.worker import metrics


def _stats(**overrides: float) -> EngineStats:
    base = dict(model="m", slots_total=4, slots_active=4, slots_busy=2, waiting=1, decode_steps=10,
                prompt_tokens_processed=100, prompt_tokens_cached=50, generated_tokens=40, kv_cells_used=256,
                kv_cells_cached=0, kv_cells_total=1024, avg_busy_slots_per_decode=3.5, preemptions=1,
                kv_full_events=1, decode_seconds=1.0, generating_steps=8, generating_seconds=0.5, batch_limit=64,
                prefill_chunk_limit=16, finished={})
    return EngineStats(**(base | overrides))


def value(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_engine_sampler_turns_snapshots_into_increments() -> None:
    sampler = metrics.EngineSampler()
    before = value("slotq_tokens_predicted_total")
    sampler.update(_stats())
    sampler.update(_stats(generated_tokens=70, decode_steps=25))
    assert value("slotq_tokens_predicted_total") - before == 70
    assert value("slotq_kv_cache_usage_ratio") == 0.25
    assert value("slotq_requests_processing") == 2 and value("slotq_requests_deferred") == 1
    sampler.update(_stats(generated_tokens=70, decode_steps=25))        # no change, no increment
    assert value("slotq_tokens_predicted_total") - before == 70


def test_observe_result_counts_status_and_latencies() -> None:
    before = value("slotq_jobs_total", {"status": "succeeded"})
    ttft_before = value("slotq_time_to_first_token_seconds_count")
    metrics.observe_result(JobResult.model_validate({
        "id": "j", "status": JobStatus.SUCCEEDED, "timings": {"ttft_ms": 120.0, "decode_tokens_per_s": 50.0}}))
    assert value("slotq_jobs_total", {"status": "succeeded"}) - before == 1
    assert value("slotq_time_to_first_token_seconds_count") - ttft_before == 1
