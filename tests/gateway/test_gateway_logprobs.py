"""Logprobs through the queue, end to end: real Valkey, ``slotq worker`` and ``slotq gateway``
processes on the tiny model, the official ``openai`` package as the client, chat and completions,
streamed and not, a Batch API line, and a job whose worker is killed mid-reply (each token's logprob
reaches the client and the result exactly once).
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.support.gateway import Stack
from tests.support.jobs import WorkerProcess
from tests.support.processes import wait_for

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-lp"
MESSAGES = [{"role": "user", "content": "Tell me about queues."}]
GREEDY = {"ignore_eos": True}
# A repeated prompt is served from the prefix cache: only its last token is decoded again, in a batch of
# another shape, which rounds the first row's logits differently (by ~2e-3 on the tiny model).
PREFIX_CACHE_ROUNDING = 1e-2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("logprobs"), tiny_model_path) as s:
        s.start_worker("lp-worker", MODEL)
        s.start_gateway("lp-gateway", gateway_files_dir=s.cwd / "files")
        s.gateways[0].wait_ready()
        s.wait_for_models({MODEL})
        yield s


def sdk(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def check_chat_logprobs(content: list[Any], n_tokens: int, top: int) -> None:
    assert len(content) == n_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == top
        assert [alt.logprob for alt in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs),
                                                                     reverse=True)
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)  # greedy


def test_chat_logprobs_streamed_and_not(stack: Stack) -> None:
    client = sdk(stack.url)
    ask: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True,
                               top_logprobs=3, extra_body=GREEDY)
    reply = client.chat.completions.create(**ask)
    content = reply.choices[0].logprobs.content
    check_chat_logprobs(content, 10, top=3)
    assert b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace").startswith(
        reply.choices[0].message.content)
    streamed = [entry for chunk in client.chat.completions.create(**ask, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    # the same tokens; the logprobs to within the rounding of a prompt served from the prefix cache
    assert [(e.token, [a.token for a in e.top_logprobs]) for e in streamed] == \
        [(e.token, [a.token for a in e.top_logprobs]) for e in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=PREFIX_CACHE_ROUNDING)
               for a, b in zip(streamed, content, strict=True))
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, extra_body=GREEDY)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not(stack: Stack) -> None:
    client = sdk(stack.url)
    ask: dict[str, Any] = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2,
                               extra_body=GREEDY)
    whole = client.completions.create(**ask).choices[0].logprobs
    assert len(whole.tokens) == len(whole.token_logprobs) == len(whole.top_logprobs) == len(whole.text_offset) == 8
    assert whole.text_offset[0] == 0 and whole.text_offset == sorted(whole.text_offset)
    for token, logprob, top in zip(whole.tokens, whole.token_logprobs, whole.top_logprobs, strict=True):
        assert logprob <= 0 and top[token] == logprob and max(top.values()) == logprob      # greedy: the best
        assert len(top) <= 2 + 1
    parts = [c.choices[0].logprobs for c in client.completions.create(**ask, stream=True)
             if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert all(math.isclose(a, b, abs_tol=PREFIX_CACHE_ROUNDING)
               for a, b in zip([x for p in parts for x in p.token_logprobs], whole.token_logprobs, strict=True))
    assert [x for p in parts for x in p.text_offset] == whole.text_offset


def test_a_batch_line_with_logprobs(stack: Stack, tmp_path: Path) -> None:
    client = sdk(stack.url)
    line = {"custom_id": "lp-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                     "logprobs": True, "top_logprobs": 2}}
    path = tmp_path / "input.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with open(path, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed", "expired"), 120,
             "the batch ended")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id, done
    [record] = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    content = record["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(entry["top_logprobs"]) == 2 for entry in content)


@pytest.mark.fault
def test_a_resumed_job_gives_each_tokens_logprob_exactly_once(stack: Stack) -> None:
    """The first worker SIGKILLs itself after 40 new tokens; a second resumes the job. The client's
    one stream and the job's result carry one logprob per token, and they are the uninterrupted
    run's (one-token micro-batches, so the resumed prefill computes what the decode did)."""
    queue, tokens = "slotq:queue:lp-r", 120
    settings: dict[str, Any] = {"queue": queue, "slots": 1, "ubatch": 1, "flash_attention": "off"}
    first = stack.start_worker("lp-r1", "tiny-lp-r", fault_kill_after_new_tokens=40, **settings)
    stack.wait_for_models({"tiny-lp-r"})
    survivors: list[WorkerProcess] = []

    def replace_the_dead_worker() -> None:
        wait_for(lambda: first.proc.poll() is not None, 60, "the first worker killed itself")
        survivors.append(stack.start_worker("lp-r2", "tiny-lp-r", **settings))

    watcher = threading.Thread(target=replace_the_dead_worker)
    watcher.start()
    key = f"lp-resumed-{uuid.uuid4().hex}"
    ask: dict[str, Any] = dict(model="tiny-lp-r", messages=MESSAGES, max_tokens=tokens, temperature=0,
                               logprobs=True, top_logprobs=2, extra_body=GREEDY)
    try:
        client = sdk(stack.url)
        streamed = [entry for chunk in client.chat.completions.create(
                    **ask, stream=True, extra_headers={"Idempotency-Key": key})
                    if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
        watcher.join(60)
        result = wait_result(stack.url, key)
        assert result["attempts"] == 2 and result["worker"] == "lp-r2", result
        reference = client.chat.completions.create(**ask).choices[0].logprobs.content
    finally:
        for worker in survivors:
            stack.workers.pop(worker.name).stop()
        stack.workers.pop(first.name).stop()
    assert len(streamed) == tokens == len(result["choices"][0]["logprobs"])
    assert [e.token for e in streamed] == [e["token"] for e in result["choices"][0]["logprobs"]] == \
        [e.token for e in reference]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-5) for a, b in zip(streamed, reference, strict=True))


def wait_result(url: str, job_id: str) -> dict[str, Any]:
    client = sdk(url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        body = client.get(f"/jobs/{job_id}", cast_to=object)
        assert isinstance(body, dict)
        if body["status"] == "succeeded":
            return dict(body["result"])
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} did not succeed")
