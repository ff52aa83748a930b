"""``slotq demo --tools``: questions enqueued with two tools and ``tool_choice="required"``, each call
run by a stand-in tool, the results sent back as tool messages, and the answers. On the tiny random
model too: a forced call is grammar-constrained, so even random weights make calls that validate."""

from __future__ import annotations

import io
import json
from collections.abc import Awaitable, Callable

from rich.console import Console

from slotq.jobs.cli.demo import CITY, TOOL_QUESTIONS, run_tool_calls
from slotq.jobs.producer.client import SlotqClient
from slotq.jobs.worker.worker import SlotqWorker


async def test_every_question_gets_a_valid_call_its_result_and_an_answer(
        start_worker: Callable[..., Awaitable[SlotqWorker]], client: SlotqClient) -> None:
    await start_worker(slots=4, ctx=2048)
    turns = await run_tool_calls(client, Console(file=io.StringIO()), max_tokens=8)
    assert [t.question for t in turns] == TOOL_QUESTIONS
    for turn in turns:
        assert turn.call.status == "tool_calls" and turn.calls, turn.call
        for call, result in zip(turn.calls, turn.results, strict=True):
            assert call.function.name in ("get_weather", "get_time")
            arguments = json.loads(call.function.arguments)
            assert set(arguments) == set(CITY["required"]) and isinstance(arguments["city"], str)
            assert arguments["city"] in result                  # the stand-in tool answered about that city
        assert turn.answer is not None and turn.answer.status in ("stop", "length") and turn.answer.tokens > 0
