"""The ``openai`` SDK's Responses API against the gateway on the bundled model (issue 45): a
two-turn tool loop as agents run it, the call streamed and not (:mod:`bench.client_checks`, which
``slotq bench clients`` also runs against llama-server). The first turn is forced
(``tool_choice: required``); the function's output goes back with ``previous_response_id`` alone,
and the model, free again (``auto``), answers in text. Then a background response, its stream left
mid-reply and resumed with ``starting_after``, all through the SDK's own calls."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bench import client_checks as checks
from tests.support.gateway import Stack

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

MODEL = "smol"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Iterator[Stack]:
    with Stack.started(tmp_path_factory.mktemp("responses-model"), real_model_path) as s:
        s.start_worker("responses-model-worker", MODEL, ctx=2048)
        s.start_gateway("responses-model-gateway").wait_ready()
        s.wait_for_models({MODEL})
        yield s


def test_the_openai_sdk_runs_a_responses_tool_loop_streamed_and_not(stack: Stack) -> None:
    server = checks.Server(stack.url, MODEL, MODEL)
    first = checks.responses_tool_call(server, stream=False)
    streamed = checks.responses_tool_call(server, stream=True)
    assert [item.arguments for item in streamed.output if item.type == "function_call"] == \
        [item.arguments for item in first.output if item.type == "function_call"]
    checks.responses_tool_loop(server)


def test_the_openai_sdk_resumes_a_background_response_from_starting_after(stack: Stack) -> None:
    """A background response's stream read through the SDK until its first text delta and left; the
    SDK's ``retrieve(stream=True, starting_after=N)`` then gives the rest, each event once, and the two
    together are what a read from the start gives, ending in the Response the SDK retrieves."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    created = client.responses.create(model=MODEL, input="Write a short poem about the sea.", background=True,
                                      max_output_tokens=64, temperature=0)
    assert created.status == "queued" and created.background is True
    seen = []
    with client.responses.retrieve(created.id, stream=True) as stream:
        for event in stream:
            seen.append(event.model_dump())
            if event.type == "response.output_text.delta":
                break                                    # the client leaves mid-reply: the job goes on
    resumed = [event.model_dump() for event in
               client.responses.retrieve(created.id, stream=True, starting_after=seen[-1]["sequence_number"])]
    whole = [event.model_dump() for event in client.responses.retrieve(created.id, stream=True)]
    assert seen + resumed == whole
    assert [event["sequence_number"] for event in whole] == list(range(len(whole)))
    done = client.responses.retrieve(created.id)
    assert done.status in ("completed", "incomplete") and whole[-1]["type"] == f"response.{done.status}"
    text = "".join(event["delta"] for event in whole if event["type"] == "response.output_text.delta")
    assert text.strip() and done.output_text == text
