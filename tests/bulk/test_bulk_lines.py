"""The bulk runner's pure parts, without Redis or a model: reading inputs and their identity,
parsing slotq and OpenAI Batch lines, output records, and reading an output file back to resume."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from slotq.jobs.bulk.formats import (
    LineError,
    LineFormat,
    error_record,
    failure_of,
    job_id_in,
    output_record,
    parse_line,
    raw_key,
)
from slotq.jobs.bulk.identity import job_id, parse_job_id
from slotq.jobs.bulk.output import OutputError, OutputFiles, default_errors_path
from slotq.jobs.bulk.source import READ_BYTES, READ_LINES, InputFile
from slotq.jobs.protocol.schemas import ChoiceResult, JobResult, JobStatus
from slotq.jobs.protocol.wire import ErrorInfo, FinishReason, Usage


def chat_line(custom_id: str = "a", **body: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body}).encode()


async def scan(path: Path, queue: str = "q"):
    source = InputFile(path, queue)
    try:
        return await source.scan(raw_key), [n async for n, _ in source.lines()]
    finally:
        source.close()


# ---------------------------------------------------------------------- input and identity
async def test_identity_follows_content_and_queue_not_name_or_compression(tmp_path):
    text = b'{"prompt": "a"}\n\n{"prompt": "b"}\r\n{"id": 7, "prompt": "c"}\n'
    (tmp_path / "a.jsonl").write_bytes(text)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(text))
    (tmp_path / "c.jsonl").write_bytes(text.replace(b'"b"', b'"B"'))
    plain, numbers = await scan(tmp_path / "a.jsonl")
    assert (plain.lines, plain.requests, numbers) == (4, 3, [1, 3, 4])          # blank line 2 counted, skipped
    assert (await scan(tmp_path / "b.jsonl.gz"))[0].identity == plain.identity
    assert (await scan(tmp_path / "a.jsonl", queue="other"))[0].identity != plain.identity
    assert (await scan(tmp_path / "c.jsonl"))[0].identity != plain.identity


async def test_repeated_ids_are_found_with_their_first_line(tmp_path):
    lines = [chat_line("x"), chat_line("y"), b'{"id": "x", "prompt": "p"}', chat_line("x"), b'{"prompt": "no id"}',
             chat_line("y"), b'{"id": 5, "prompt": "p"}']
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    result, _ = await scan(tmp_path / "in.jsonl")
    assert result.first_line_with("x") == 1 and result.first_line_with("y") == 2
    assert result.first_line_with("5") is None and result.first_line_with("zzz") is None


async def test_lines_are_read_in_bounded_batches_and_none_is_lost_between_them(tmp_path):
    """lines() hands the run READ_LINES lines (or READ_BYTES of text) at a time from its own thread:
    every line arrives once, in order, across batch boundaries and past a line longer than a batch."""
    long_line = b'{"prompt": "' + b"x" * READ_BYTES + b'"}'
    lines = [b'{"prompt": "%d"}' % n if n % 7 else b"" for n in range(1, 2 * READ_LINES + 500)]
    lines[READ_LINES + 3] = long_line
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    source = InputFile(tmp_path / "in.jsonl.gz", "q")
    read = [(n, raw) async for n, raw in source.lines()]
    assert read == [(n, raw) for n, raw in enumerate(lines, 1) if raw]


def test_missing_input_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        InputFile(tmp_path / "nope.jsonl", "q")


# ---------------------------------------------------------------------- slotq lines
def test_slotq_line_keys_and_lane():
    line = parse_line(b'{"prompt": "p", "max_tokens": 3}', 12, lane="bulk")
    assert (line.format, line.key, line.own_key, line.request.lane) == (LineFormat.SLOTQ, "12", False, "bulk")
    line = parse_line(b'{"id": 99, "messages": [{"role": "user", "content": "c"}], "lane": "interactive"}', 1,
                      lane="bulk")
    assert (line.key, line.own_key, line.request.lane) == ("99", True, "interactive")


@pytest.mark.parametrize("raw, code, words", [
    (b"{oops", "invalid_json", ["not valid JSON"]),
    (b"\xff\xfe", "invalid_json", ["UTF-8"]),
    (b"[1, 2]", "invalid_line", ["JSON object", "list"]),
    (b'{"prompt": "p", "max_tokens": 0}', "invalid_request", ["max_tokens", "greater than or equal to 1", "got 0"]),
    (b'{"prompt": "p", "sampling": {"temperature": 9}}', "invalid_request", ["sampling.temperature", "got 9"]),
    (b'{"prompt": "p", "idempotency_key": "k"}', "invalid_request", ["idempotency_key"]),
    (b'{"id": [1], "prompt": "p"}', "invalid_request", ["id: must be a string or an integer"]),
    (b'{"prompt": "p", "colour": 1}', "invalid_request", ["colour", "Extra inputs"]),
])
def test_bad_slotq_lines_name_the_problem(raw, code, words):
    with pytest.raises(LineError) as info:
        parse_line(raw, 3, lane="bulk")
    assert info.value.error.code == code
    for word in words:
        assert word in info.value.error.message


# ---------------------------------------------------------------------- OpenAI lines
def test_openai_chat_body_becomes_a_job_request():
    line = parse_line(chat_line("c", max_tokens=10, max_completion_tokens=7, temperature=0.2, top_p=0.9, seed=4,
                                stop="END", logit_bias={"13": -100}, metadata={"k": "v"}, user="u",
                                response_format={"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": {"type": "object"}}},
                                messages=[{"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                       {"type": "text", "text": "there"}]}]),
                      5, lane="bulk")
    r = line.request
    assert (line.format, line.key, line.model, line.endpoint) == (LineFormat.OPENAI, "c", "m", "/v1/chat/completions")
    assert r.max_tokens == 7 and r.stop == ["END"] and r.metadata == {"k": "v"} and r.lane == "bulk"
    assert [(m.role, m.content) for m in r.messages] == [("system", "be brief"), ("user", "hi there")]
    s = r.sampling
    assert (s.temperature, s.top_p, s.seed, s.logit_bias) == (0.2, 0.9, 4, {13: -100.0})
    assert s.json_schema == {"type": "object"}


def test_openai_completion_body_takes_one_prompt():
    raw = json.dumps({"custom_id": "t", "method": "POST", "url": "/v1/completions",
                      "body": {"model": "m", "prompt": ["only one"], "n": 2}}).encode()
    line = parse_line(raw, 1, lane="bulk")
    assert line.request.prompt == "only one" and line.request.n == 2
    with pytest.raises(LineError, match="prompt: give one prompt per request"):
        parse_line(raw.replace(b'["only one"]', b'["a", "b"]'), 1, lane="bulk")


# A line's body is refused as the gateway refuses it: tests/gateway/test_openai_translation.py.
@pytest.mark.parametrize("raw, words", [
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}).encode(), ["method"]),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": {}}).encode(),
     ["/v1/responses", "/v1/chat/completions"]),
    (json.dumps({"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}).encode(), ["custom_id"]),
])
def test_bad_batch_envelopes_name_the_field(raw, words):
    with pytest.raises(LineError) as info:
        parse_line(raw, 2, lane="bulk")
    assert info.value.format == LineFormat.OPENAI and info.value.response is None      # no request: OpenAI's `error`
    for word in words:
        assert word in info.value.error.message, info.value.error.message


# ---------------------------------------------------------------------- records
def _result(jid: str, **fields: object) -> JobResult:
    choice = ChoiceResult(index=0, text="out", finish_reason=FinishReason.STOP,
                          usage=Usage(prompt_tokens=3, completion_tokens=2), timings={"total_ms": 1.0})
    return JobResult(id=jid, status=JobStatus.SUCCEEDED, text="out", finish_reason=FinishReason.STOP,
                     usage=Usage(prompt_tokens=3, completion_tokens=2), choices=[choice]).model_copy(update=fields)


def test_records_carry_the_job_id_a_rerun_reads_back():
    jid = job_id("0123456789abcdef", 4)
    assert parse_job_id(jid) == ("0123456789abcdef", 4) and parse_job_id("bulk:xyz:4") is None
    slotq = parse_line(b'{"id": "k", "prompt": "p"}', 4, lane="bulk")
    openai = parse_line(chat_line("k"), 4, lane="bulk")
    for line in (slotq, openai):
        record = output_record(line, jid, _result(jid))
        assert job_id_in(json.loads(json.dumps(record))) == jid
        assert failure_of(line, _result(jid)) is None
    assert output_record(slotq, jid, _result(jid))["text"] == "out"
    assert output_record(openai, jid, _result(jid))["response"]["body"]["choices"][0]["message"]["content"] == "out"


def test_failures_and_their_records():
    jid = job_id("0123456789abcdef", 9)
    openai = parse_line(chat_line("k"), 9, lane="bulk")
    error = ErrorInfo(code="prompt_too_long", message="too long", retryable=False)
    failed = _result(jid, status=JobStatus.FAILED, error=error)
    assert failure_of(openai, failed) == error
    assert failure_of(openai, _result(jid, status=JobStatus.CANCELLED)).code == "cancelled"
    cut = _result(jid, choices=[_result(jid).choices[0].model_copy(update={"finish_reason": FinishReason.DEADLINE})])
    assert failure_of(openai, cut).code == "deadline_exceeded"
    ran = error_record(9, error, format=LineFormat.OPENAI, key="k", job_id=jid)
    assert ran["line"] == 9 and ran["response"]["status_code"] == 400 and ran["response"]["request_id"] == jid
    never = error_record(9, error, format=LineFormat.SLOTQ, key=None, job_id=None)
    assert never == {"id": None, "line": 9, "job_id": None, "error": error.model_dump()}


# ---------------------------------------------------------------------- reading an output back
async def test_output_read_back_marks_done_lines_and_cuts_a_partial_line(tmp_path):
    text = b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n'
    (tmp_path / "in.jsonl").write_bytes(text)
    input_scan, _ = await scan(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    good = [json.dumps({"id": str(n), "line": n, "job_id": job_id(input_scan.identity, n)}) for n in (3, 1)]
    out.write_text("\n".join(good) + '\n{"id": "2", "line": 2, "job_')      # a crash in the middle of a write
    files = OutputFiles(out)
    assert await files.open(input_scan) == 2
    assert [files.is_done(n) for n in (1, 2, 3)] == [True, False, True]
    assert files.recent_job_ids == [job_id(input_scan.identity, 3), job_id(input_scan.identity, 1)]
    await files.close()
    assert out.read_text() == "\n".join(good) + "\n"
    assert default_errors_path(out) == tmp_path / "out.errors.jsonl"

    other, _ = await scan(tmp_path / "in.jsonl", queue="another-model")
    with pytest.raises(OutputError, match="another input or queue"):
        await OutputFiles(out).open(other)
    (tmp_path / "foreign.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(OutputError, match="not a slotq bulk output record"):
        await OutputFiles(tmp_path / "foreign.jsonl").open(input_scan)
    with pytest.raises(OutputError, match="must differ"):
        OutputFiles(out, out)
