"""The Batch API end to end: real Valkey, a real ``slotq worker`` on the tiny model, ``slotq gateway``
processes sharing one files directory, and the official ``openai`` package as the client.

Each test starts its own gateway(s), so that the gateway that drives a batch is the one the test
means (every gateway adopts batches whose lease is free). Worker logs say ``job <id> attempt <n>
started`` once per attempt: counting them shows that a line was generated once.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis as sync_redis
from openai import OpenAI

from slotq.jobs.gateway.records import BatchKeys
from slotq.jobs.protocol.keys import QueueKeys
from tests.support.gateway import GatewayProcess, Stack

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny-batch"
STARTED_RE = re.compile(r"job (bulk:[0-9a-f]+:\d+) attempt (\d+) started")
LEASE_S = 2


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          tiny_model_path: Path) -> Iterator[Stack]:
    """On one Valkey; a test parametrized with ``stack`` "cluster" (indirect) gets one on a Valkey Cluster."""
    cluster = getattr(request, "param", "single") == "cluster"
    with Stack.started(tmp_path_factory.mktemp("batches"), tiny_model_path, cluster=cluster) as s:
        s.start_worker("batch-worker", MODEL, ctx=2048)     # room for a tool-call prompt (byte-level tokens)
        yield s


def start_gateway(stack: Stack, name: str, window: int = 4) -> GatewayProcess:
    gateway = stack.start_gateway(name, gateway_files_dir=stack.cwd / "files", gateway_batch_lease_s=LEASE_S,
                                  gateway_batch_window=window)
    gateway.wait_ready()
    stack.wait_for_models({MODEL}, url=gateway.url)
    return gateway


@pytest.fixture
def gateway(stack: Stack) -> Iterator[GatewayProcess]:
    g = start_gateway(stack, f"gateway-{len(stack.gateways) + 1}")
    try:
        yield g
    finally:
        g.stop()


def sdk(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def batch_line(i: int, max_tokens: int = 4, model: str = MODEL, **body: Any) -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"question {i}"}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


def upload(client: OpenAI, tmp_path: Path, lines: list[Any]) -> str:
    path = tmp_path / "batch-input.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch").id


def create_batch(client: OpenAI, tmp_path: Path, n: int, max_tokens: int = 48) -> Any:
    """A chat batch of ``n`` lines (``req-1`` ... ``req-n``) long enough to be caught running."""
    file_id = upload(client, tmp_path, [batch_line(i, max_tokens=max_tokens) for i in range(1, n + 1)])
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_batch(client: OpenAI, batch_id: str, until: Any, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id}: {batch.status} {batch.request_counts} after {timeout} s")


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def starts(log: Path) -> Counter[tuple[str, int]]:
    return Counter((m[1], int(m[2])) for m in STARTED_RE.finditer(log.read_text(errors="replace")))


# ---------------------------------------------------------------------- the SDK's whole flow
@pytest.mark.parametrize("stack", ["single", "cluster"], indirect=True)
def test_sdk_uploads_creates_polls_and_downloads(stack: Stack, gateway: GatewayProcess, tmp_path: Path) -> None:
    client = sdk(gateway.url)
    lines: list[Any] = [batch_line(i) for i in range(1, 11)]
    lines.insert(2, "this line is not JSON")                          # line 3
    lines.insert(6, batch_line(99, temperature=9))                    # line 7: out of range
    lines.append(batch_line(98, model="another-model"))               # line 13: one batch, one model (OpenAI's)
    file_id = upload(client, tmp_path, lines)
    uploaded = client.files.retrieve(file_id)
    assert uploaded.purpose == "batch" and uploaded.bytes == (tmp_path / "batch-input.jsonl").stat().st_size
    assert client.files.content(file_id).read() == (tmp_path / "batch-input.jsonl").read_bytes()

    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"team": "data"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"team": "data"}
    done = wait_batch(client, batch.id, lambda b: b.status in ("completed", "failed", "cancelled", "expired"))
    assert done.status == "completed", done
    assert done.model == MODEL and done.completed_at and done.in_progress_at and done.finalizing_at
    assert done.request_counts.model_dump() == {"total": 13, "completed": 10, "failed": 3}
    assert any(b.id == batch.id for b in client.batches.list())

    output = jsonl(client.files.content(done.output_file_id).text)
    assert sorted(r["custom_id"] for r in output) == sorted(f"req-{i}" for i in range(1, 11))   # each once
    usage = [r["response"]["body"]["usage"] for r in output]
    assert done.usage is not None and done.usage.input_tokens == sum(u["prompt_tokens"] for u in usage) > 0
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usage) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    for record in output:
        assert record["id"].startswith("batch_req_") and record["error"] is None
        assert record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] >= 1
    errors = {e["line"]: e for e in jsonl(client.files.content(done.error_file_id).text)}
    assert set(errors) == {3, 7, 13}
    assert errors[13]["custom_id"] == "req-98" and "this batch runs model" in json.dumps(errors[13])
    assert "'another-model'" in json.dumps(errors[13]) and "one batch, one model" in json.dumps(errors[13])
    assert errors[3]["custom_id"] is None and errors[3]["error"]["code"] == "invalid_json"
    assert errors[7]["custom_id"] == "req-99" and errors[7]["response"]["status_code"] == 400   # the HTTP answer
    assert errors[7]["response"]["body"]["error"]["param"] == "temperature"
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert file_id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(file_id).deleted                       # the batch is finished: its input may go
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def test_chat_lines_with_tools_get_their_calls(gateway: GatewayProcess, tmp_path: Path) -> None:
    """Tool calls in the Batch API (issue 33): a forced call per line, in OpenAI's response shape;
    a call cut by ``max_tokens`` is a completed line with ``finish_reason: length``, as OpenAI's."""
    parameters = {"type": "object", "additionalProperties": False, "required": ["city"],
                  "properties": {"city": {"enum": ["Paris", "Tokyo"]}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    client = sdk(gateway.url)
    file_id = upload(client, tmp_path, [batch_line(i, max_tokens=120 if i < 3 else 50, tools=tools,
                                                   tool_choice="required") for i in (1, 2, 3)])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, batch.id, lambda b: b.status in ("completed", "failed", "cancelled", "expired"))
    assert done.status == "completed" and done.request_counts.completed == 3, done
    records = {record["custom_id"]: record for record in jsonl(client.files.content(done.output_file_id).text)}
    for custom_id, record in records.items():
        assert record["response"]["status_code"] == 200
        [choice] = record["response"]["body"]["choices"]
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and choice["message"]["content"] is None, choice
        if custom_id == "req-3":
            assert choice["finish_reason"] == "length", choice
            continue
        assert choice["finish_reason"] == "tool_calls", choice
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Tokyo")


def test_bad_requests_name_the_parameter(gateway: GatewayProcess, tmp_path: Path) -> None:
    client = sdk(gateway.url)
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(batch_line(1)) + "\n")
    with pytest.raises(openai.BadRequestError) as exc, open(path, "rb") as f:
        client.files.create(file=f, purpose="assistants")
    assert exc.value.body["param"] == "purpose" and "batch" in exc.value.body["message"]
    with open(path, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(input_file_id=file_id, endpoint="/v1/responses", completion_window="24h")
    assert exc.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError) as exc:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    assert exc.value.body["param"] == "input_file_id"
    with pytest.raises(openai.NotFoundError) as exc:
        client.batches.retrieve("batch_nope")
    assert exc.value.body["param"] == "batch_id"
    path.write_text(json.dumps(batch_line(1, model="no-such-model")) + "\n")
    with open(path, "rb") as f:
        unknown = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(input_file_id=unknown, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_batch(client, batch.id, lambda b: b.status != "validating", timeout=60)
    assert failed.status == "failed" and failed.failed_at
    assert [(e.code, e.param, e.line) for e in failed.errors.data] == [("model_not_found", "body.model", 1)]
    response = httpx.post(f"{gateway.url}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                             "completion_window": "1h"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "completion_window"


# ---------------------------------------------------------------------- a gateway killed mid-batch
@pytest.mark.slow
def test_killed_gateway_batch_resumes_without_regenerating(stack: Stack, tmp_path: Path) -> None:
    n = 200
    first = start_gateway(stack, "gateway-killed", window=2)
    try:
        client = sdk(first.url)
        batch = create_batch(client, tmp_path, n)
        before = wait_batch(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 8)
        first.proc.kill()                                   # SIGKILL: no chance to release the lease
        first.proc.wait(10)
    finally:
        first.stop()
    assert before.status == "in_progress" and before.request_counts.completed < n
    second = start_gateway(stack, "gateway-restarted", window=2)
    try:
        client = sdk(second.url)
        done = wait_batch(client, batch.id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
        assert done.status == "completed", done
        assert done.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
        output = jsonl(client.files.content(done.output_file_id).text)
    finally:
        second.stop()
    assert f"batch {batch.id}: running" in second.log_tail(100_000)       # the new gateway resumed it
    assert f"batch {batch.id}: completed" not in first.log_tail(100_000)  # ... which the killed one had not finished
    custom_ids = [r["custom_id"] for r in output]
    assert sorted(custom_ids) == sorted(f"req-{i}" for i in range(1, n + 1))      # complete, no duplicate line
    identity = output[0]["response"]["request_id"].split(":")[1]
    started = [key for key in starts(stack.workers["batch-worker"].log).elements()
               if key[0].startswith(f"bulk:{identity}:")]
    assert sorted(job_id for job_id, _ in started) == sorted(f"bulk:{identity}:{i}" for i in range(1, n + 1))
    assert {attempt for _, attempt in started} == {1}                               # each line generated once


# ---------------------------------------------------------------------- the completion window runs out
def test_an_expired_batch_lists_every_unfinished_request_as_batch_expired(stack: Stack, tmp_path: Path) -> None:
    """The 24 h window ran out while no gateway drove the batch (its gateway stopped): the next
    gateway to adopt it ends it as ``expired``, keeps the finished outputs, lists every other
    request in the error file as ``batch_expired`` (as OpenAI does), and leaves nothing queued."""
    n = 100
    first = start_gateway(stack, "gateway-before-expiry", window=2)
    try:
        client = sdk(first.url)
        batch = create_batch(client, tmp_path, n)
        wait_batch(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 2)
    finally:
        first.stop()                                         # its lines in flight stay queued
    conn = sync_redis.Redis.from_url(stack.redis.url)
    try:
        conn.hset(BatchKeys().batch(batch.id), "expires_at", json.dumps(int(time.time()) - 1))
        second = start_gateway(stack, "gateway-after-expiry", window=2)
        try:
            client = sdk(second.url)
            done = wait_batch(client, batch.id, lambda b: b.status not in ("validating", "in_progress"), timeout=60)
            assert done.status == "expired" and done.expired_at, done
            output = jsonl(client.files.content(done.output_file_id).text)
            errors = jsonl(client.files.content(done.error_file_id).text)
        finally:
            second.stop()
        counts = done.request_counts
        assert counts.total == n and counts.completed >= 2 and counts.completed + counts.failed == n, counts
        assert len(output) == counts.completed and len(errors) == counts.failed
        assert {e["error"]["code"] for e in errors} == {"batch_expired"} and all(e["response"] is None for e in errors)
        assert sorted(r["custom_id"] for r in output + errors) == sorted(f"req-{i}" for i in range(1, n + 1))
        assert conn.hlen(QueueKeys("slotq:queue", ("interactive", "bulk")).jobs) == 0   # nothing left queued
    finally:
        conn.close()


# ---------------------------------------------------------------------- cancel
def test_cancel_goes_cancelling_then_cancelled(stack: Stack, gateway: GatewayProcess, tmp_path: Path) -> None:
    n = 200
    client = sdk(gateway.url)
    batch = create_batch(client, tmp_path, n)
    file_id = batch.input_file_id
    wait_batch(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 2)
    with pytest.raises(openai.ConflictError):
        client.files.delete(file_id)                                  # a running batch reads it
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait_batch(client, batch.id, lambda b: b.status != "cancelling", timeout=60)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert 2 <= counts.completed < n and counts.completed + counts.failed <= n
    assert len(jsonl(client.files.content(done.output_file_id).text)) == counts.completed
    if counts.failed:
        errors = jsonl(client.files.content(done.error_file_id).text)
        assert {e["response"]["body"]["error"]["code"] for e in errors} == {"cancelled"}
    assert client.batches.cancel(batch.id).status == "cancelled"                    # idempotent
    conn = sync_redis.Redis.from_url(stack.redis.url)
    try:
        assert conn.hlen(QueueKeys("slotq:queue", ("interactive", "bulk")).jobs) == 0   # nothing left queued
    finally:
        conn.close()
