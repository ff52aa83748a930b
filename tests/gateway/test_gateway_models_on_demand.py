"""Models on demand through the gateway: real Valkey, one ``slotq worker`` given two tiny models
(SLOTQ_MODELS), a ``slotq gateway``, the official OpenAI SDK. The model not loaded is listed as
``unloaded``, and a request for it is served (the worker switches) instead of a 503."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from openai import OpenAI

from slotq.jobs.worker.served_model import gguf_fingerprint
from tests.support.gateway import Stack
from tests.support.tiny_model import write_tiny_llama

pytestmark = pytest.mark.timeout(180)


def statuses(sdk: OpenAI) -> dict[str, str]:
    return {model.id: (model.model_extra or {})["status"] for model in sdk.models.list()}


def test_a_request_for_an_unloaded_model_is_served_by_a_switch(tmp_path: Path, tiny_model_path: Path) -> None:
    second = write_tiny_llama(tmp_path / "second.gguf", seed=7)
    with Stack.started(tmp_path, tiny_model_path) as stack:
        stack.start_worker("multi", "", model="", models=f"first={tiny_model_path},second={second}",
                           model_idle_s=0.2)
        stack.start_gateway("gateway").wait_ready()
        stack.wait_for_models({"first", "second"})
        sdk = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 30
        while statuses(sdk) != {"first": "loaded", "second": "unloaded"} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert statuses(sdk) == {"first": "loaded", "second": "unloaded"}
        card = sdk.models.retrieve("second").model_extra or {}
        assert (card["queue"], card["workers"], card["kind"]) == ("slotq:queue:second", 0, "generation")

        messages = [{"role": "user", "content": "hello"}]
        reply = sdk.chat.completions.create(model="second", messages=messages, max_tokens=4)   # type: ignore[arg-type]
        assert reply.model == "second" and reply.system_fingerprint == gguf_fingerprint(second)
        assert reply.choices[0].message.content
        back = sdk.chat.completions.create(model="first", messages=messages, max_tokens=4)    # type: ignore[arg-type]
        assert back.model == "first" and back.system_fingerprint == gguf_fingerprint(tiny_model_path)
        deadline = time.monotonic() + 30        # the gateway's routes follow heartbeats (a beat, a cache's ttl)
        while (loaded := sdk.models.retrieve("first").model_extra or {})["status"] != "loaded" \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert loaded["status"] == "loaded" and loaded["load_s"] > 0
