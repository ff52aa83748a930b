"""``/v1/embeddings`` end to end with the official ``openai`` SDK: real Valkey, a ``slotq worker
--embeddings`` and a generation worker on the tiny model, and a ``slotq gateway`` process."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

from tests.support.gateway import Stack

pytestmark = pytest.mark.timeout(180)

TEXTS = ["the cat sat on the mat", "hello world", "queues and slots"]


def same_vector(a: object, b: object) -> bool:
    """Unit vectors of the same input: llama.cpp sums in another order for another batch shape, so
    they agree to a cosine of 0.9999, not bit for bit."""
    return float(np.dot(np.asarray(a, np.float64), np.asarray(b, np.float64))) > 0.9999


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("gateway-embeddings"), tiny_model_path) as s:
        s.start_worker("gw-generator", "tiny-gen")
        s.start_worker("gw-embedder", "tiny-embed", queue="slotq:embed", embeddings="true", ctx=128, batch=128)
        s.start_gateway("gateway-1").wait_ready()
        s.wait_for_models({"tiny-gen", "tiny-embed"})
        yield s


@pytest.fixture
def sdk(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_say_which_kind_they_serve(sdk: OpenAI) -> None:
    kinds = {model.id: (model.model_extra or {})["kind"] for model in sdk.models.list()}
    assert kinds == {"tiny-gen": "generation", "tiny-embed": "embedding"}


def test_an_embeddings_worker_with_default_settings_is_refused_by_name(stack: Stack, sdk: OpenAI) -> None:
    """`slotq worker --embeddings`, the natural first try, beside a generation worker on the default queue:
    it exits at once naming the queue, the model and the kind there, and the setting to change; both
    kinds are still served by their own workers."""
    intruder = stack.start_worker("gw-embed-default", "tiny-embed-2", embeddings="true")
    assert intruder.proc.wait(60) == 1
    log = intruder.log_tail()
    stack.workers.pop("gw-embed-default").stop()          # gone: the stack's later waits check its workers live
    assert "queue 'slotq:queue' is served by model 'tiny-gen' (generation jobs, worker gw-generator)" in log
    assert "'tiny-embed-2' (embedding jobs)" in log and "SLOTQ_QUEUE_NAME" in log
    assert {model.id for model in sdk.models.list()} == {"tiny-gen", "tiny-embed"}
    assert sdk.embeddings.create(model="tiny-embed", input=TEXTS[:1]).model == "tiny-embed"
    reply = sdk.chat.completions.create(model="tiny-gen", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.model == "tiny-gen" and (reply.model_extra or {})["slotq"]["worker"] == "gw-generator"


def test_every_input_shape_embeds(sdk: OpenAI) -> None:
    listed = sdk.embeddings.create(model="tiny-embed", input=TEXTS, user="ignored")
    assert [d.index for d in listed.data] == [0, 1, 2] and listed.model == "tiny-embed"
    vectors = np.array([d.embedding for d in listed.data])          # the SDK asked for base64 and decoded it
    assert vectors.shape == (3, 128) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert listed.usage.prompt_tokens == listed.usage.total_tokens > 0

    one = sdk.embeddings.create(model="tiny-embed", input="hello world", encoding_format="float")
    assert same_vector(one.data[0].embedding, vectors[1])
    tokens = [1, 104, 105]           # byte tokens of the tiny vocabulary
    as_array = sdk.embeddings.create(model="tiny-embed", input=tokens, encoding_format="float")
    as_arrays = sdk.embeddings.create(model="tiny-embed", input=[tokens, tokens], encoding_format="float")
    assert len(as_arrays.data) == 2 and same_vector(as_array.data[0].embedding, as_arrays.data[1].embedding)
    assert as_array.usage.prompt_tokens == 3


def test_base64_is_little_endian_float32(sdk: OpenAI, stack: Stack) -> None:
    floats = sdk.embeddings.create(model="tiny-embed", input=TEXTS[:1], encoding_format="float").data[0].embedding
    raw = httpx.post(f"{stack.url}/v1/embeddings", json={"model": "tiny-embed", "input": TEXTS[0],
                                                         "encoding_format": "base64"}, timeout=30)
    assert raw.status_code == 200 and raw.headers["x-slotq-job-id"]
    encoded = raw.json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(encoded), "<f4"), np.array(floats, np.float32))


def test_refusals_name_the_parameter(sdk: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as dims:
        sdk.embeddings.create(model="tiny-embed", input="x", dimensions=64)
    assert dims.value.body["param"] == "dimensions" and "fixed length" in dims.value.body["message"]

    with pytest.raises(openai.BadRequestError) as long_input:
        sdk.embeddings.create(model="tiny-embed", input=["short", "abc " * 100])
    assert long_input.value.body["param"] == "input"
    assert "input 1 is" in long_input.value.body["message"] and "at most 128" in long_input.value.body["message"]
    cut = sdk.embeddings.create(model="tiny-embed", input=["short", "abc " * 100], extra_body={"truncate": True})
    assert len(cut.data) == 2

    with pytest.raises(openai.BadRequestError) as empty:
        sdk.embeddings.create(model="tiny-embed", input=[""])
    assert empty.value.body["param"] == "input" and "input 0 is empty" in empty.value.body["message"]


def test_each_kind_of_model_refuses_the_other_endpoint(sdk: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as on_generator:
        sdk.embeddings.create(model="tiny-gen", input="x")
    assert on_generator.value.body["code"] == "wrong_model_kind" and on_generator.value.body["param"] == "model"
    assert "serves generation jobs, not embedding jobs" in on_generator.value.body["message"]
    with pytest.raises(openai.BadRequestError) as on_embedder:
        sdk.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert on_embedder.value.body["code"] == "wrong_model_kind"
    reply = sdk.chat.completions.create(model="tiny-gen", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].message.content is not None


def test_batch_api_runs_embedding_lines(sdk: OpenAI, tmp_path: Path) -> None:
    from tests.gateway.test_gateway_batches import jsonl, wait_batch

    lines = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "tiny-embed", "input": [f"document {i}", f"summary {i}"]}} for i in range(5)]
    lines.append({"custom_id": "b64", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "tiny-embed", "input": "document 0", "encoding_format": "base64"}})
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with open(path, "rb") as f:
        file_id = sdk.files.create(file=f, purpose="batch").id
    batch = sdk.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    done = wait_batch(sdk, batch.id, lambda b: b.status in ("completed", "failed"))
    assert done.status == "completed" and done.request_counts.completed == 6 and done.request_counts.failed == 0
    records = {r["custom_id"]: r["response"]["body"] for r in jsonl(sdk.files.content(done.output_file_id).text)}
    assert len(records["doc-3"]["data"]) == 2 and len(records["doc-3"]["data"][0]["embedding"]) == 128
    decoded = np.frombuffer(base64.b64decode(records["b64"]["data"][0]["embedding"]), "<f4")
    assert same_vector(decoded, records["doc-0"]["data"][0]["embedding"])
