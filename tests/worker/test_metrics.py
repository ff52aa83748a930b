"""Prometheus metrics: engine snapshots become counter increments and gauges."""

from __future__ import annotations

import math

from prometheus_client import REGISTRY

from slotq.jobs.protocol.schemas import JobResult, JobStatus
from slotq.jobs.worker import metrics
from tests.support.engine import engine_stats


def value(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_engine_sampler_turns_snapshots_into_increments() -> None:
    sampler = metrics.EngineSampler()
    before = value("slotq_tokens_predicted_total")
    sampler.update(engine_stats())
    sampler.update(engine_stats(generated_tokens=70, decode_steps=25))
    assert value("slotq_tokens_predicted_total") - before == 70
    assert value("slotq_kv_cache_usage_ratio") == 0.25
    assert value("slotq_requests_processing") == 2 and value("slotq_requests_deferred") == 1
    sampler.update(engine_stats(generated_tokens=70, decode_steps=25))    # no change, no increment
    assert value("slotq_tokens_predicted_total") - before == 70


def test_observe_result_counts_status_and_latencies() -> None:
    before = value("slotq_jobs_total", {"status": "succeeded"})
    ttft_before = value("slotq_time_to_first_token_seconds_count")
    metrics.observe_result(JobResult.model_validate({
        "id": "j", "status": JobStatus.SUCCEEDED, "timings": {"ttft_ms": 120.0, "decode_tokens_per_s": 50.0}}))
    assert value("slotq_jobs_total", {"status": "succeeded"}) - before == 1
    assert value("slotq_time_to_first_token_seconds_count") - ttft_before == 1


def test_engine_sampler_exports_speculative_decoding() -> None:
    sampler = metrics.EngineSampler()
    drafted, accepted = value("slotq_spec_draft_tokens_total"), value("slotq_spec_accepted_tokens_total")
    sampler.update(engine_stats(spec="ngram"))                  # drafting on, no draft sent yet: no ratio
    assert value("slotq_spec_source", {"source": "ngram"}) == 1 and value("slotq_spec_source", {"source": "off"}) == 0
    assert math.isnan(value("slotq_spec_acceptance_ratio"))
    sampler.update(engine_stats(spec="ngram", spec_draft_tokens=40, spec_accepted_tokens=30))
    sampler.update(engine_stats(spec="ngram", spec_draft_tokens=100, spec_accepted_tokens=60))
    assert value("slotq_spec_draft_tokens_total") - drafted == 100
    assert value("slotq_spec_accepted_tokens_total") - accepted == 60
    assert value("slotq_spec_acceptance_ratio") == 0.6


def test_engine_sampler_exports_decode_time_and_lora_switches() -> None:
    """What `slotq bench lora` reads to say where a mixed load's time goes: decode time, and the switches
    between adapter sets with their own decode time."""
    sampler = metrics.EngineSampler()
    names = ("slotq_decode_seconds_total", "slotq_lora_switches_total", "slotq_lora_switch_decode_seconds_total")
    before = [value(name) for name in names]
    sampler.update(engine_stats(decode_seconds=1.0, lora_switches=3, lora_switch_seconds=0.25))
    sampler.update(engine_stats(decode_seconds=2.5, lora_switches=7, lora_switch_seconds=0.75))
    assert [value(name) - b for name, b in zip(names, before, strict=True)] == [2.5, 7, 0.75]
