"""The engine in a process of its own (slotq.engine.process): the same events as in-process, errors
raised at submit, limits and stats across the boundary, and a child that dies or is orphaned is a
clean signal. A real child process (spawn) on the tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from slotq.engine import (
    EngineConfig,
    EngineDead,
    EngineState,
    EngineStopped,
    Finished,
    FinishReason,
    PromptTooLong,
    TextDelta,
    TokenLogprob,
    TopLogprob,
)
from slotq.engine.process import EngineProcess, decode_event, encode_event
from slotq.engine.reply_parser import ToolCallDelta
from tests.support.engine import DEFAULT_CONFIG, collect, greedy, running_engine


async def start_process(path: Path, **config: object) -> EngineProcess:
    return await EngineProcess.start(EngineConfig(model_path=path, **{**DEFAULT_CONFIG, **config}))


def test_events_cross_the_boundary_unchanged() -> None:
    lp = TokenLogprob(id=5, token="a", token_bytes=[97], logprob=-0.5,
                      top=[TopLogprob(id=5, token="a", token_bytes=[97], logprob=-0.5)])
    delta = TextDelta(request_id="r", choice=1, text="hi", reasoning="hm", token_ids=[5, 6], n_tokens=9,
                      tool_calls=[ToolCallDelta(index=0, id="call_1", name="f", arguments='{"x"')], logprobs=[lp],
                      prompt_tokens=12, cached_prompt_tokens=4)
    plain = TextDelta(request_id="r", text="x", token_ids=[7], n_tokens=1)
    done = Finished.model_validate({"request_id": "r", "finish_reason": "stop", "stop_sequence": "END",
                                    "usage": {"prompt_tokens": 3, "reasoning_tokens": 2}, "timings": {"ttft_ms": 1.5}})
    for event in (delta, plain, done):
        assert decode_event("r", encode_event(event)) == event
    # every field of a delta but its request id crosses: one added to TextDelta needs its place in the array
    assert len(encode_event(plain)) == len(dataclasses.fields(TextDelta)) - 1


async def test_generates_what_the_engine_generates_in_process(tiny_model_path: Path) -> None:
    requests = [greedy(f"prompt {i}", 40) for i in range(3)]
    async with running_engine(tiny_model_path, slots=4) as engine:
        expected = [await collect(engine.submit(r)) for r in requests]
        prompt_tokens = engine.prompt_tokens(requests[0])
    process = await start_process(tiny_model_path, slots=4)
    try:
        assert process.pid != os.getpid() and process.info.model_name == engine.info.model_name
        assert await process.warm_up() >= 0
        handles = [await process.submit_async(r) for r in requests]
        got = await asyncio.gather(*(collect(h) for h in handles))
        for (text, tokens, finished), (want_text, want_tokens, want_finished) in zip(got, expected, strict=True):
            assert (text, tokens) == (want_text, want_tokens) and len(tokens) == 40
            assert [f.finish_reason for f in finished] == [FinishReason.LENGTH]
            assert finished[0].usage == want_finished[0].usage
        assert process.prompt_tokens(requests[0]) == prompt_tokens
        stats = process.stats()          # sent with each step: it includes every event delivered
        assert stats.generated_tokens >= 3 * 40 + 1 and stats.finished.get("length", 0) >= 3

        with pytest.raises(PromptTooLong) as info:          # the child's error, raised here with its field
            await process.submit_async(greedy("too long", 10_000))
        assert info.value.field == "max_tokens"

        limits = process.set_limits(active_slots=99, n_batch=0)
        assert (limits.active_slots, limits.n_batch) == (4, 1)     # clamped to the configured sizes
        process.set_limits(active_slots=4, n_batch=process.full_limits.n_batch)

        handle = await process.submit_async(greedy("cancel me", 400))
        async for event in handle:
            if isinstance(event, TextDelta):
                handle.cancel()
            else:
                assert event.finish_reason == FinishReason.CANCELLED

        early = greedy("cancel early", 400)
        submitting = asyncio.create_task(process.submit_async(early))
        await asyncio.sleep(0)                  # the submit is on its way: the cancel follows it
        process.cancel(early.id)
        _, tokens, finished = await collect(await submitting)
        assert finished[0].finish_reason == FinishReason.CANCELLED and len(tokens) < 400
    finally:
        await process.close()
    assert process.state == EngineState.CLOSED and process.failure is None
    with pytest.raises(EngineStopped):
        await process.submit_async(greedy("closed", 5))


async def test_a_killed_child_ends_every_request_with_engine_dead(tiny_model_path: Path) -> None:
    process = await start_process(tiny_model_path, slots=2, ctx=4096)
    try:
        watcher = asyncio.create_task(process.wait_failed())
        handles = [aiter(await process.submit_async(greedy(f"doomed {i}", 4000))) for i in range(3)]   # one waits
        assert isinstance(await anext(handles[0]), TextDelta)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        failure = await asyncio.wait_for(watcher, 10)
        assert isinstance(failure, EngineDead) and process.failure is failure
        for handle in handles:
            _, _, finished = await asyncio.wait_for(collect(handle), 10)
            assert len(finished) == 1 and finished[0].error is not None
            assert finished[0].error.code == "engine_dead" and finished[0].error.retryable
        with pytest.raises(EngineDead):
            await process.submit_async(greedy("too late", 5))
    finally:
        await process.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


async def test_the_child_exits_when_its_parent_goes_away(tiny_model_path: Path) -> None:
    """The parent's end of the socket closes (as when the parent is killed): the child, mid-request,
    exits on its own instead of holding the model's memory."""
    process = await start_process(tiny_model_path, slots=2, ctx=4096)
    pid = process.pid
    assert pid is not None
    events = aiter(await process.submit_async(greedy("orphaned", 4000)))
    await anext(events)
    process._writer.transport.abort()       # what the kernel does to a killed parent's socket
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _alive(pid)
    await process.close()
