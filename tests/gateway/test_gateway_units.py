"""The gateway's pure parts, without Redis or a model: request translation (its refusals, shared
with Batch lines, are in test_openai_translation.py), the stream-entry -> SSE renderers (resume,
usage, errors, restart), routing from heartbeats, the bind rule, API keys (tenants, the keys
file, the configurations refused at start), metric labels and the access log's redaction."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from pydantic import ValidationError

from slotq.engine.logprobs import token_text
from slotq.jobs.gateway import auth
from slotq.jobs.gateway.auth import Caller, KeyRing
from slotq.jobs.gateway.chunks import DONE, ChunkRenderer, NativeRenderer, parse_stream_id
from slotq.jobs.gateway.metrics import method_label
from slotq.jobs.gateway.routing import routes_from
from slotq.jobs.gateway.settings import GatewaySettings, key_tenant
from slotq.jobs.gateway.surfaces import redact_target
from slotq.jobs.openai.translate import to_job_request, to_response
from slotq.jobs.openai.wire import ChatCompletionRequest, CompletionRequest
from slotq.jobs.protocol.schemas import ChoiceResult, EntryKind, JobResult, JobStatus, StreamEntry, WorkerInfo
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason, TokenLogprob, ToolCallDelta, TopLogprob, Usage
from slotq.jobs.settings import ClientSettings
from tests.support import REPO_ROOT


# ---------------------------------------------------------------------- translation
def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields)


def test_translation_maps_openai_fields_to_the_job():
    job = to_job_request(chat(max_completion_tokens=7, max_tokens=99, temperature=0.2, top_p=0.5, seed=3, n=2,
                              stop="END", logit_bias={"15": -100}, top_k=5, repeat_last_n=32, ignore_eos=True,
                              priority=4, metadata={"k": "v"}, idempotency_key="key-1",
                              messages=[{"role": "developer", "content": "be brief"},
                                        {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}]))
    assert job.max_tokens == 7 and job.n == 2 and job.stop == ["END"] and job.ignore_eos and job.priority == 4
    assert [(m.role, m.content) for m in job.messages] == [("system", "be brief"), ("user", "ab")]
    s = job.sampling
    assert (s.temperature, s.top_p, s.seed, s.top_k, s.penalty_last_n) == (0.2, 0.5, 3, 5, 32)
    assert s.logit_bias == {15: -100.0}
    assert job.metadata == {"k": "v"} and job.idempotency_key == "key-1"


def test_response_formats_become_json_schemas():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    job = to_job_request(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert job.sampling.json_schema == schema
    assert to_job_request(chat(response_format={"type": "json_object"})).sampling.json_schema == {"type": "object"}
    assert to_job_request(chat(response_format={"type": "text"})).sampling.json_schema is None


def test_completion_prompt_and_header_idempotency_key():
    job = to_job_request(CompletionRequest(model="m", prompt=["once"]), idempotency_key="from-header")
    assert job.prompt == "once" and job.messages is None and job.idempotency_key == "from-header"


# ---------------------------------------------------------------------- rendering
def entry(n: int, kind: EntryKind = EntryKind.CHUNK, **fields) -> StreamEntry:
    return StreamEntry(id=f"100-{n}", kind=kind, attempt=1, **fields)


def data(events: list[str]) -> list[dict | str]:
    out = []
    for event in events:
        payload = next(line[6:] for line in event.splitlines() if line.startswith("data: "))
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


STREAM = [
    entry(1, text="Hel"),
    entry(2, text="lo"),
    entry(3, EntryKind.DONE, finish_reason=FinishReason.LENGTH, final=True,
          usage=Usage(prompt_tokens=5, completion_tokens=2, cached_prompt_tokens=1)),
]


def render(renderer: ChunkRenderer, entries: list[StreamEntry]) -> list[str]:
    events = renderer.opening()
    for e in entries:
        events += renderer.feed(e)
    return events


def test_chat_chunks_with_role_usage_and_done():
    events = render(ChunkRenderer("chat", "j1", "m", 7, n=1, include_usage=True), STREAM)
    chunks = data(events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Hel", "lo"]
    assert chunks[3]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["total_tokens"] == 7
    assert chunks[4]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    assert chunks[-1] == "[DONE]" and events[-1] == DONE
    assert all(c["id"] == "chatcmpl-j1" and c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    # the SSE id of each entry's event is its stream id; opening, usage and [DONE] carry none
    assert [e.startswith("id: ") for e in events] == [False, True, True, True, False, False]


def test_a_chat_chunk_that_carries_nothing_is_not_sent():
    """Tokens whose text is held back (a tool call's wrapper) make entries with no text: a chat
    stream sends no empty-content chunk for them (bench api-shapes saw runs of them between a
    forced call's pieces); a completions stream keeps its chunks (their text offsets)."""
    call = [ToolCallDelta(index=0, id="call_1", name="get_weather", arguments='{"city": ')]
    stream = [entry(1, text="", token_ids=[7, 8]), entry(2, token_ids=[9], tool_calls=call),
              entry(3, text="", token_ids=[10]),
              entry(4, token_ids=[11], tool_calls=[ToolCallDelta(index=0, arguments='"Paris"}')]),
              entry(5, EntryKind.DONE, finish_reason=FinishReason.TOOL_CALLS, final=True, usage=Usage())]
    events = render(ChunkRenderer("chat", "j1", "m", 7, n=1, include_usage=False), stream)
    chunks = data(events)
    assert [c if c == "[DONE]" else list(c["choices"][0]["delta"]) for c in chunks] == [
        ["role", "content"], ["tool_calls"], ["tool_calls"], [], "[DONE]"]
    assert [e.splitlines()[0] for e in events if e.startswith("id: ")] == ["id: 100-2", "id: 100-4", "id: 100-5"]
    resumed = render(ChunkRenderer("chat", "j1", "m", 7, n=1, include_usage=False, after="100-2"), stream)
    assert resumed == events[2:]
    text = data(render(ChunkRenderer("text", "j1", "m", 7, n=1, include_usage=False), stream))
    assert [c["choices"][0]["text"] for c in text[:4]] == ["", "", "", ""]


def token(id: int, piece: bytes, logprob: float, *alternatives: tuple[int, bytes, float]) -> TokenLogprob:
    return TokenLogprob(id=id, token=token_text(piece), token_bytes=list(piece), logprob=logprob,
                        top=[TopLogprob(id=i, token=token_text(p), token_bytes=list(p), logprob=lp)
                             for i, p, lp in alternatives])


# "a€b" in four tokens, the euro sign split after its first byte
EURO = [token(1, b"a", -0.5, (1, b"a", -0.5), (2, b"z", -1.0)), token(2, b"\xe2", -0.25, (3, b"x", -0.2)),
        token(3, b"\x82\xac", -0.125), token(4, b"b", -2.0, (5, b"c", -1.5))]
LOGPROB_STREAM = [entry(1, text="a", token_ids=[1, 2], logprobs=EURO[:2]),
                  entry(2, text="\u20acb", token_ids=[3, 4], logprobs=EURO[2:]),
                  entry(3, EntryKind.DONE, finish_reason=FinishReason.LENGTH, final=True, usage=Usage())]


def test_streamed_logprobs_in_openais_shapes_and_text_offsets_that_survive_a_resume():
    chat = data(render(ChunkRenderer("chat", "j1", "m", 7, n=1, include_usage=False), LOGPROB_STREAM))
    content = [c for chunk in chat[1:3] for c in chunk["choices"][0]["logprobs"]["content"]]
    assert content[0] == {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "z", "logprob": -1.0, "bytes": [122]}]}
    assert [(c["token"], c["bytes"]) for c in content] == [("a", [97]), ("bytes:\\xe2", [0xE2]),
                                                            ("bytes:\\x82\\xac", [0x82, 0xAC]), ("b", [98])]
    assert chat[3]["choices"][0]["logprobs"] is None                  # the finish chunk
    text = data(render(ChunkRenderer("text", "j1", "m", 7, n=1, include_usage=False), LOGPROB_STREAM))
    first, second = (chunk["choices"][0]["logprobs"] for chunk in text[:2])
    assert first == {"tokens": ["a", "bytes:\\xe2"], "token_logprobs": [-0.5, -0.25],
                     "top_logprobs": [{"a": -0.5, "z": -1.0}, {"x": -0.2, "bytes:\\xe2": -0.25}], "text_offset": [0, 1]}
    assert second["text_offset"] == [1, 2] and second["top_logprobs"][0] == {"bytes:\\x82\\xac": -0.125}
    # a client resuming after the first chunk gets the same offsets: the renderer reads from the start
    resumed = data(render(ChunkRenderer("text", "j1", "m", 7, n=1, include_usage=False, after="100-1"),
                          LOGPROB_STREAM))
    assert resumed[0]["choices"][0]["logprobs"] == second


def test_a_finished_jobs_logprobs_in_openais_shapes():
    result = JobResult(id="j1", status=JobStatus.SUCCEEDED, choices=[ChoiceResult(
        index=0, text="a\u20acb", finish_reason=FinishReason.LENGTH, usage=Usage(), timings={}, logprobs=EURO)])
    chat = to_response("chat", result, "m", 7).model_dump(mode="json")["choices"][0]["logprobs"]
    assert [c["logprob"] for c in chat["content"]] == [-0.5, -0.25, -0.125, -2.0] and chat["refusal"] is None
    text = to_response("text", result, "m", 7).model_dump(mode="json")["choices"][0]["logprobs"]
    assert text["text_offset"] == [0, 1, 1, 2] and text["tokens"][3] == "b"
    plain = result.model_copy(update={"choices": [result.choices[0].model_copy(update={"logprobs": None})]})
    assert to_response("chat", plain, "m", 7).choices[0].logprobs is None


def test_without_include_usage_there_is_no_usage_key():
    chunks = data(render(ChunkRenderer("text", "j1", "m", 7, n=1, include_usage=False), STREAM))
    assert all("usage" not in c for c in chunks[:-1])
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hel", "lo", ""]


@pytest.mark.parametrize("after", ["100-1", "100-2", "100-3"])
def test_resume_skips_exactly_what_the_client_has(after):
    full = render(ChunkRenderer("chat", "j1", "m", 7, n=1, include_usage=True), STREAM)
    resumed = render(ChunkRenderer("chat", "j1", "m", 7, n=1, include_usage=True, after=after), STREAM)
    cut = next(i for i, e in enumerate(full) if e.startswith(f"id: {after}\n"))
    assert resumed == full[cut + 1:]            # usage and [DONE] are re-sent after the final entry


def test_n_choices_keep_their_indexes_and_usage_adds_up():
    entries = [entry(1, text="a", choice=0), entry(2, text="b", choice=1),
               entry(3, EntryKind.DONE, choice=1, finish_reason=FinishReason.STOP,
                     usage=Usage(prompt_tokens=4, completion_tokens=3)),
               entry(4, EntryKind.DONE, choice=0, finish_reason=FinishReason.LENGTH, final=True,
                     usage=Usage(prompt_tokens=4, completion_tokens=5, reasoning_tokens=2))]
    chunks = data(render(ChunkRenderer("chat", "j", "m", 1, n=2, include_usage=True), entries))
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]          # two opening role chunks
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks[2:6]] == [
        (0, None), (1, None), (1, "stop"), (0, "length")]
    assert chunks[6]["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
                                  "prompt_tokens_details": {"cached_tokens": 0},
                                  "completion_tokens_details": {"reasoning_tokens": 2}}


@pytest.mark.parametrize(("last", "status", "code"), [
    (entry(2, EntryKind.ERROR, final=True, error=ErrorInfo(code="prompt_too_long", message="m", retryable=False)),
     400, "prompt_too_long"),
    (entry(2, EntryKind.ERROR, final=True, error=ErrorInfo(code="tries_exhausted", message="m", retryable=True)),
     500, "tries_exhausted"),
    (entry(2, EntryKind.DONE, final=True, finish_reason=FinishReason.CANCELLED), 409, "job_cancelled"),
    (entry(2, EntryKind.DONE, final=True, finish_reason=FinishReason.DEADLINE), 504, "deadline_exceeded"),
])
def test_unfinished_jobs_end_the_stream_with_an_error_event(last, status, code):
    renderer = ChunkRenderer("chat", "j", "m", 1, n=1, include_usage=True)
    events = render(renderer, [entry(1, text="x"), last])
    assert renderer.finished
    assert data(events)[-1]["error"]["code"] == code and events[-1].startswith("id: 100-2\n")
    fresh = ChunkRenderer("chat", "j", "m", 1, n=1, include_usage=True)
    assert fresh.first_error(last).status == status           # before any output: an HTTP error instead


def test_retries_are_comments_and_a_restart_ends_the_stream():
    renderer = ChunkRenderer("chat", "j", "m", 1, n=2, include_usage=False)
    retry = entry(2, EntryKind.ERROR, error=ErrorInfo(code="kv_exhausted", message="m", retryable=True))
    events = render(renderer, [entry(1, text="x"), retry])
    assert events[-1].startswith(": attempt 1 failed (kv_exhausted)") and not renderer.finished
    events = renderer.feed(entry(3, EntryKind.RESTART))
    assert renderer.finished and data(events)[0]["error"]["code"] == "stream_restarted"


def test_native_events_resume_and_end_cleanly_after_the_final_entry():
    full = [e for x in STREAM for e in NativeRenderer("j").feed(x)]
    assert [e.split("\n")[0] for e in full] == ["event: chunk", "event: chunk", "event: done"]
    late = NativeRenderer("j", after="100-3")
    assert [e for x in STREAM for e in late.feed(x)] == [] and late.finished


def test_stream_ids_parse_and_compare():
    assert parse_stream_id("1733000000000-12") == (1733000000000, 12)
    assert parse_stream_id("10-0") > parse_stream_id("9-5")
    for bad in ("", "abc", "1-", "-1", "1-2-3"):
        with pytest.raises(ValueError):
            parse_stream_id(bad)


# ---------------------------------------------------------------------- routing and settings
def worker(id: str, model: str, queue: str, busy: int, total: int = 4) -> WorkerInfo:
    return WorkerInfo(id=id, model=model, queue=queue, slots_total=total, slots_busy=busy, waiting=0,
                      generated_tokens=0, started_at=0, updated_at=0)


def test_routes_group_workers_by_model_and_pick_the_freest_queue():
    routes = routes_from([worker("a1", "llama", "q:llama", 1), worker("a2", "llama", "q:llama", 4),
                          worker("b1", "llama", "q:llama-2", 0), worker("c1", "qwen", "q:qwen", 4)])
    assert routes["llama"].queue == "q:llama-2"            # 4 free slots there, 3 on q:llama (8 - 5)
    tied = routes_from([worker("a1", "llama", "q:b", 0), worker("b1", "llama", "q:a", 0)])
    assert tied["llama"].queue == "q:a"                    # ties by name: every replica agrees
    assert routes["qwen"].queue == "q:qwen" and routes["qwen"].slots_busy == 4


def test_bind_rule_and_comma_lists():
    open_settings = GatewaySettings(_env_file=None)
    assert open_settings.bind_error("127.0.0.1") is None and open_settings.bind_error("localhost") is None
    assert "SLOTQ_API_KEYS" in open_settings.bind_error("0.0.0.0")
    keyed = GatewaySettings(_env_file=None, api_keys="a, b,", cors_origins="https://x.example")
    assert keyed.api_keys == ["a", "b"] and keyed.cors_origins == ["https://x.example"]
    assert keyed.bind_error("0.0.0.0") is None


def test_every_gateway_setting_is_documented():
    root = REPO_ROOT
    example = (root / "deploy/slotq.env.example").read_text()
    page = (root / "docs" / "gateway.md").read_text()
    for name in set(GatewaySettings.model_fields) - set(ClientSettings.model_fields):
        var = f"SLOTQ_{name.upper()}"
        assert f"{var}=" in example, f"{var} missing from deploy/slotq.env.example"
        assert var in page, f"{var} missing from docs/gateway.md"


def _touch(path, text: str, ahead_s: float = 5) -> None:
    """Write the file with a new mtime, whatever the clock's resolution."""
    path.write_text(text)
    os.utime(path, (time.time() + ahead_s, time.time() + ahead_s))


async def test_keys_name_tenants_and_the_keys_file_is_reread(tmp_path, monkeypatch):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotation: the new key first\nteamA=sk-new\n")
    ring = KeyRing(GatewaySettings(_env_file=None, api_keys="teamA=sk-old,sk-bare", admin_keys="ops=sk-ops",
                                   api_keys_file=keys_file))
    assert await ring.caller("sk-old") == await ring.caller("sk-new") == Caller("teamA", admin=False)
    bare = await ring.caller("sk-bare")
    assert bare is not None and bare.tenant == key_tenant("sk-bare") and "sk-bare" not in bare.tenant
    assert await ring.caller("sk-ops") == Caller("ops", admin=True) and await ring.caller("sk-nope") is None
    monkeypatch.setattr(auth, "KEYS_FILE_CHECK_S", 0)
    _touch(keys_file, "teamA=sk-newer\n")
    assert await ring.caller("sk-newer") == Caller("teamA", admin=False) and await ring.caller("sk-new") is None
    _touch(keys_file, "teamB=sk-old\n", ahead_s=10)            # a key SLOTQ_API_KEYS gives teamA: not taken
    assert await ring.caller("sk-old") == Caller("teamA", admin=False)
    assert await ring.caller("sk-newer") == Caller("teamA", admin=False)
    keys_file.unlink()                                          # unreadable: the keys read last stay
    assert await ring.caller("sk-newer") == Caller("teamA", admin=False)


async def test_the_keys_file_is_read_off_the_event_loop(tmp_path, monkeypatch):
    """A keys file on a slow volume must not stall every request: while it is read, the loop runs."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("teamA=sk-a\n")
    ring = KeyRing(GatewaySettings(_env_file=None, api_keys_file=keys_file))
    reading, release = threading.Event(), threading.Event()
    read = auth.read_keys_file

    def slow_read(path):
        reading.set()
        release.wait(10)
        return read(path)

    monkeypatch.setattr(auth, "read_keys_file", slow_read)
    monkeypatch.setattr(auth, "KEYS_FILE_CHECK_S", 0)
    _touch(keys_file, "teamA=sk-a2\n")
    lookup = asyncio.ensure_future(ring.caller("sk-a2"))
    assert await asyncio.to_thread(reading.wait, 10)       # the read has begun, and this coroutine still runs
    assert not lookup.done()
    release.set()
    assert await lookup == Caller("teamA", admin=False)


@pytest.mark.parametrize(("settings", "named"), [
    ({"api_keys": "alice=sk-a,bob=sk-a"}, ("SLOTQ_API_KEYS entry 2 (tenant 'bob') has the same key as "
                                          "SLOTQ_API_KEYS entry 1 (tenant 'alice')")),
    ({"api_keys": "alice=sk-a,alice=sk-a"}, "SLOTQ_API_KEYS entry 2 (tenant 'alice') has the same key"),
    ({"api_keys": "alice=sk-a", "admin_keys": "ops=sk-a"}, "SLOTQ_ADMIN_KEYS entry 1 (tenant 'ops') has the same key"),
    ({"api_keys": "sk-a,sk-a"}, "SLOTQ_API_KEYS entry 2"),
    ({"api_keys": "default=sk-a"}, "SLOTQ_API_KEYS entry 1 gives a key to the reserved tenant 'default'"),
    ({"admin_keys": "default=sk-a"}, "SLOTQ_ADMIN_KEYS entry 1 gives a key to the reserved tenant 'default'"),
])
def test_duplicate_keys_and_keys_of_the_default_tenant_refuse_to_start(settings, named):
    with pytest.raises(ValidationError) as caught:
        GatewaySettings(_env_file=None, **settings)
    assert named in str(caught.value) and "sk-a" not in str(caught.value)


def test_duplicates_across_the_keys_file_are_refused_and_the_default_tenant_needs_an_opt_in(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# ops\nbob=sk-a\n")
    with pytest.raises(ValidationError) as caught:
        GatewaySettings(_env_file=None, api_keys="alice=sk-a", api_keys_file=keys_file)
    assert f"{keys_file} entry 1 (tenant 'bob') has the same key as SLOTQ_API_KEYS entry 1" in str(caught.value)
    assert "SLOTQ_GATEWAY_ALLOW_DEFAULT_TENANT_KEYS" in str(pytest.raises(
        ValidationError, GatewaySettings, _env_file=None, api_keys="default=sk-d").value)
    assert GatewaySettings(_env_file=None, api_keys="default=sk-d", gateway_allow_default_tenant_keys=True).has_keys


def test_open_cors_without_keys_refuses_to_start():
    with pytest.raises(ValidationError) as caught:
        GatewaySettings(_env_file=None, cors_origins="*")
    assert "SLOTQ_CORS_ORIGINS=*" in str(caught.value) and "SLOTQ_API_KEYS" in str(caught.value)
    assert GatewaySettings(_env_file=None, cors_origins="*", api_keys="sk-a").cors_origins == ["*"]
    assert GatewaySettings(_env_file=None, cors_origins="https://app.example").cors_origins == ["https://app.example"]


def test_the_private_metrics_port_is_another_port():
    with pytest.raises(ValidationError, match="SLOTQ_GATEWAY_METRICS_PORT=8000 is SLOTQ_GATEWAY_PORT"):
        GatewaySettings(_env_file=None, gateway_metrics_port=8000)
    assert GatewaySettings(_env_file=None, gateway_metrics_port=9401).gateway_metrics_port == 9401


def test_metric_methods_are_standard_or_other():
    assert [method_label(m) for m in ("GET", "PATCH", "get", "FOO", "X" * 12_000)] == [
        "GET", "PATCH", "other", "other", "other"]


def test_the_gateway_process_defines_none_of_the_workers_metric_families():
    """Imported, ``slotq.jobs.worker.metrics`` registers the worker's families, which a gateway
    would export as constant zeros (an idle fleet, to alerts)."""
    code = "import sys, slotq.jobs.gateway.app; print('slotq.jobs.worker.metrics' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("target", "logged"), [
    ("/v1/models", "/v1/models"),
    ("/v1/files?limit=5&order=asc&after=file-1", "/v1/files?limit=5&order=asc&after=file-1"),
    ("/v1/models?api_key=sk-secret", "/v1/models?api_key=***"),
    ("/v1/models?Token=sk-secret&limit=2", "/v1/models?Token=***&limit=2"),
    ("/v1/models?sk-secret", "/v1/models?***"),
    ("/v1/models?x=sk-secret", "/v1/models?***"),
    ("/v1/jobs/j/events?after=1700000000000-3", "/v1/jobs/j/events?after=1700000000000-3"),
    ("/v1/files?after=sk-secret&limit=5;api_key=sk-2&order=sk-3", "/v1/files?after=***&limit=***&order=***"),
])
def test_the_access_log_never_holds_a_query_strings_secrets(target, logged):
    assert redact_target(target) == logged


def test_bad_key_entries_are_refused_without_showing_the_key():
    with pytest.raises(ValidationError) as caught:
        GatewaySettings(_env_file=None, api_keys="sk-good,c2VjcmV0/+x=")
    assert "SLOTQ_API_KEYS: entry 2" in str(caught.value) and "c2VjcmV0" not in str(caught.value)
    assert GatewaySettings(_env_file=None, admin_keys="ops=abc==").has_keys      # a named key may hold '='
